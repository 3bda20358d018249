"""The fuser's steady-state fast path (run/fast_path.py): taken on repeated identical calls,
not taken after any change its reused decisions depend on, and exact (float64)."""

from __future__ import annotations

import pytest
import torch

import te_seq
from te_seq import ops
from te_seq.run.fuser import Fuser

E, H, F, ROWS = 4, 8, 6, 40
SIZES = [7, 0, 20, 13]


def make_mlp(dtype=torch.float64, act=None):
    gen = torch.Generator().manual_seed(0)
    mlp = te_seq.Sequential(
        ops.GroupedLinear(E, H, 2 * F, bias=False, dtype=dtype, single_grouped_weight=True),
        act if act is not None else ops.ScaledSwiGLU(),
        ops.GroupedLinear(E, F, H, bias=False, dtype=dtype, single_grouped_weight=True),
    )
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype))
    return mlp


def make_inputs(dtype=torch.float64, rows=ROWS, sizes=SIZES, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, H, generator=gen, dtype=dtype).requires_grad_()
    probs = torch.rand(rows, generator=gen, dtype=dtype).requires_grad_()
    return x, torch.tensor(sizes), probs


def fuser(mlp: te_seq.Sequential) -> Fuser:
    (run,) = mlp._runs
    return run


def fast_calls(mlp) -> int:
    return fuser(mlp).fast_calls


def call(mlp, x, splits, probs, splits2=None):
    return mlp(x, splits, probs, splits if splits2 is None else splits2)


def test_taken_on_repeated_identical_calls():
    mlp = make_mlp()
    x, splits, probs = make_inputs()
    call(mlp, x, splits, probs)
    assert fast_calls(mlp) == 0
    for i in range(3):
        call(mlp, x, splits, probs)
        assert fast_calls(mlp) == i + 1
    assert "GroupedMLP" in str(mlp.fusion_plan())


def _grads(mlp, x, splits, probs, dy):
    for t in (x, probs, *mlp.parameters()):
        t.grad = None
    y = call(mlp, x, splits, probs)
    y.backward(dy)
    return [y.detach(), x.grad, probs.grad, *(p.grad for p in mlp.parameters())]


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_fast_path_results_identical(backend):
    """The first (full path) and later (fast path) calls give bit-identical results, equal to a
    fresh Sequential's, and equal to the unfused maths."""
    mlp, fresh = make_mlp(), make_mlp()
    x, splits, probs = make_inputs()
    dy = torch.randn(ROWS, H, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with te_seq.backend(backend):
        full = _grads(mlp, x, splits, probs, dy)
        fast = _grads(mlp, x, splits, probs, dy)
        assert fast_calls(mlp) == 1
        other = _grads(fresh, x, splits, probs, dy)
    for a, b, c in zip(full, fast, other):
        assert torch.equal(a, b) and torch.equal(a, c)
    w1, w2 = mlp[0].weight.detach(), mlp[2].weight.detach()
    outs, start = [], 0
    for e, n in enumerate(SIZES):
        h = x.detach()[start : start + n] @ w1[e].T
        a = torch.nn.functional.silu(h[:, :F]) * h[:, F:] * probs.detach()[start : start + n, None]
        outs.append(a @ w2[e].T)
        start += n
    torch.testing.assert_close(full[0], torch.cat(outs), rtol=1e-12, atol=1e-12)


def _missed(mlp, before_calls, *args):
    """Run the call; True when it took the full path."""
    before = fast_calls(mlp)
    call(mlp, *args)
    return fast_calls(mlp) == before


def _warm(mlp, x, splits, probs):
    call(mlp, x, splits, probs)
    call(mlp, x, splits, probs)
    assert fast_calls(mlp) >= 1


def test_not_taken_after_shape_dtype_or_requires_grad_change():
    mlp = make_mlp()
    x, splits, probs = make_inputs()
    _warm(mlp, x, splits, probs)
    x2, splits2, probs2 = make_inputs(rows=ROWS + 3, sizes=[7, 3, 20, 13], seed=2)
    assert _missed(mlp, None, x2, splits2, probs2)
    assert not _missed(mlp, None, x2, splits2, probs2)  # the new signature is remembered
    assert _missed(mlp, None, x2.detach(), splits2, probs2)  # input requires_grad
    assert _missed(mlp, None, x2, splits2, probs2.detach())  # an extra input's requires_grad
    assert _missed(mlp, None, x2, splits2.int(), probs2)  # split sizes' dtype
    mlp.float()
    x3, splits3, probs3 = make_inputs(torch.float32)
    assert _missed(mlp, None, x3, splits3, probs3)
    assert "GroupedMLP" in str(mlp.fusion_plan())


def test_not_taken_without_grad_backend_or_autocast_change():
    mlp = make_mlp(torch.float32)
    x, splits, probs = make_inputs(torch.float32)
    _warm(mlp, x, splits, probs)
    with torch.no_grad():
        assert _missed(mlp, None, x, splits, probs)
    with te_seq.backend("reference"):
        assert _missed(mlp, None, x, splits, probs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _missed(mlp, None, x, splits, probs)
        y = call(mlp, x, splits, probs)
    assert y.dtype == torch.bfloat16  # autocast's policy applied on the fast path too
    assert _missed(mlp, None, x, splits, probs)


def test_weight_replacement_and_requires_grad_change():
    mlp = make_mlp()
    x, splits, probs = make_inputs()
    _warm(mlp, x, splits, probs)
    new = torch.nn.Parameter(torch.randn_like(mlp[2].weight))
    mlp[2].weight = new
    assert _missed(mlp, None, x, splits, probs)
    y = call(mlp, x, splits, probs)
    y.sum().backward()
    assert new.grad is not None and torch.count_nonzero(new.grad) > 0
    mlp[0].weight.requires_grad_(False)  # in place: no attribute write
    mlp[0].weight.grad = None
    assert _missed(mlp, None, x, splits, probs)
    call(mlp, x, splits, probs).sum().backward()
    assert mlp[0].weight.grad is None
    with torch.no_grad():  # a dtype change through .data keeps the Parameter object
        mlp[2].weight.data = mlp[2].weight.data.float()
    with pytest.raises(ValueError, match="dtype"):
        call(mlp, x, splits, probs)


def test_op_attribute_change_is_seen():
    mlp = make_mlp(act=ops.SwiGLU())
    x, splits, _ = make_inputs()
    mlp(x, splits, splits)
    mlp(x, splits, splits)
    assert fast_calls(mlp) == 1
    mlp[1].glu_interleave_size = 2  # changes the maths: the plan and the checks see it
    before = fast_calls(mlp)
    y = mlp(x, splits, splits)
    assert fast_calls(mlp) == before
    mlp[1].glu_interleave_size = None
    assert not torch.equal(y, mlp(x, splits, splits))
    mlp.eval()
    before = fast_calls(mlp)
    mlp(x, splits, splits)
    assert fast_calls(mlp) == before


def test_host_split_values_checked_every_call():
    mlp = make_mlp()
    x, splits, probs = make_inputs()
    _warm(mlp, x, splits, probs)
    splits[1] += 1  # in place: the same tensor, now summing to ROWS + 1
    with pytest.raises(ValueError, match="sum to"):
        call(mlp, x, splits, probs)
    other = torch.tensor([8, 0, 20, 12])  # another tensor, the same signature: valid values
    y = call(mlp, x, other, probs)
    assert torch.isfinite(y).all()


def test_distinct_equal_host_splits_then_values_differ():
    """Two distinct host split tensors fuse while their values are equal; once one changes in
    place the call runs unfused (and is checked), on the fast path or not."""
    mlp = make_mlp()
    x, splits, probs = make_inputs()
    splits2 = splits.clone()
    call(mlp, x, splits, probs, splits2)
    call(mlp, x, splits, probs, splits2)
    assert fast_calls(mlp) == 1 and "GroupedMLP" in str(mlp.fusion_plan())
    splits2.copy_(torch.tensor([8, 0, 20, 12]))
    before = fast_calls(mlp)
    y = call(mlp, x, splits, probs, splits2)
    assert fast_calls(mlp) == before
    assert "GroupedMLP" not in str(mlp.fusion_plan().forward)
    assert y.shape == (ROWS, H)


def test_split_device_change_not_taken():
    mlp = make_mlp()
    x, splits, probs = make_inputs()
    _warm(mlp, x, splits, probs)
    meta_splits = torch.empty(E, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="split_sizes is on meta"):
        call(mlp, x, meta_splits, probs)


class _CountingSwiGLU(ops.ScaledSwiGLU):
    """A user's subclass with a check of its own: checked in full on every call."""

    checked = 0

    def pre_forward_checks(self, input_, extra_inputs):
        type(self).checked += 1
        super().pre_forward_checks(input_, extra_inputs)


def test_user_checks_run_every_call():
    mlp = make_mlp(act=_CountingSwiGLU())
    x, splits, probs = make_inputs()
    for _ in range(3):
        call(mlp, x, splits, probs)
    assert fast_calls(mlp) == 2
    assert _CountingSwiGLU.checked == 3


def test_structure_change_makes_new_runs():
    mlp = make_mlp()
    x, splits, probs = make_inputs()
    _warm(mlp, x, splits, probs)
    mlp[1] = ops.ScaledSwiGLU()
    y = call(mlp, x, splits, probs)
    assert fast_calls(mlp) == 0  # a new Fuser
    assert y.shape == (ROWS, H)


# --- what the flat signature must still see (run/fast_path.py's list) ----------------------

def test_not_taken_under_another_fp8_recipe():
    """The recipe is part of the signature: entering te_seq.autocast leaves the fast path, and
    its calls follow the recipe (a later call without it leaves it again)."""
    from te_seq import recipe

    mlp = make_mlp(torch.float32)
    x, splits, probs = make_inputs(torch.float32)
    _warm(mlp, x, splits, probs)
    with te_seq.autocast(recipe=recipe.Float8CurrentScaling()):
        assert _missed(mlp, None, x, splits, probs)
        assert not _missed(mlp, None, x, splits, probs)
        assert mlp.fusion_plan().forward[0].recipe is not None
    assert _missed(mlp, None, x, splits, probs)
    assert mlp.fusion_plan().forward[0].recipe is None


def test_not_taken_after_a_fusion_registry_change():
    """Disabling a fusion (a registry write, no op attribute) leaves the fast path: the next
    call runs unfused, and fuses again once it is enabled."""
    mlp = make_mlp()
    x, splits, probs = make_inputs()
    _warm(mlp, x, splits, probs)
    with te_seq.fusions_disabled("grouped_mlp"):
        assert _missed(mlp, None, x, splits, probs)
        assert "GroupedMLP" not in str(mlp.fusion_plan().forward)
    assert _missed(mlp, None, x, splits, probs)
    assert "GroupedMLP" in str(mlp.fusion_plan().forward)


def test_facts_of_an_input_given_twice_are_read_at_its_first_slot():
    """The split sizes fill two slots (one object): the second slot records only that it is
    the same object, so a change of the object's facts (its dtype, through .data) must still
    be seen, and a distinct tensor in the second slot is another signature."""
    mlp = make_mlp()
    x, splits, probs = make_inputs()
    _warm(mlp, x, splits, probs)
    splits.data = splits.data.to(torch.int32)  # the same object, another dtype
    assert _missed(mlp, None, x, splits, probs)
    assert not _missed(mlp, None, x, splits, probs)
    assert _missed(mlp, None, x, splits, probs, splits.clone())  # equal values, two objects
    assert "GroupedMLP" in str(mlp.fusion_plan().forward)


def test_signature_labels_sameness_and_rejects_other_inputs():
    from te_seq.run.fast_path import call_signature

    mlp = make_mlp()
    x, splits, probs = make_inputs()
    ops_ = mlp.basic_ops()
    same = call_signature(ops_, x, [(splits,), (probs,), (splits,)], None)
    equal = call_signature(ops_, x, [(splits,), (probs,), (splits.clone(),)], None)
    other = call_signature(ops_, x, [(splits,), (probs,), (splits + 1,)], None)
    assert same == call_signature(ops_, x, [(splits,), (probs,), (splits,)], None)
    assert len({same, equal, other}) == 3  # identity, equal host values, different values
    swapped_probs = call_signature(ops_, x, [(splits,), (probs.clone(),), (splits,)], None)
    assert swapped_probs == same  # a float tensor's identity is no decision input
    assert call_signature(ops_, x, [(splits,), ([0.5],), (splits,)], None) is None


# --- the lone-run Sequential call (run/sequential.py) ---------------------------------------

def test_lone_run_plan_follows_calls_with_and_without_op_kwargs():
    """A Sequential of one run takes its short call path, except with op_kwargs; the plan it
    shows is always the last call's."""
    seq = te_seq.Sequential(ops.BasicLinear(6, 5, dtype=torch.float64), ops.GELU())
    x = torch.randn(3, 6, dtype=torch.float64)
    seq(x)
    assert seq._lone_fuser is seq._runs[0]
    plain = seq.fusion_plan()
    out = torch.empty(3, 5, dtype=torch.float64)
    seq(x, op_kwargs={0: {"out": out}})
    with_kwargs = seq.fusion_plan()
    seq(x)
    assert seq.fusion_plan() is not with_kwargs
    assert str(seq.fusion_plan()) == str(plain)


def test_lone_run_not_taken_with_extra_outputs_or_plain_modules():
    """Extra outputs to the caller and plain modules take the general loop: the extra output
    is still returned, the module still runs."""
    x = torch.randn(4, 6, dtype=torch.float64)
    seq = te_seq.Sequential(ops.MakeExtraOutput(), ops.BasicLinear(6, 5, dtype=torch.float64))
    y, extra = seq(x)
    assert seq._lone_fuser is None and torch.equal(extra, x)
    mixed = te_seq.Sequential(ops.BasicLinear(6, 6, dtype=torch.float64), torch.nn.Tanh())
    y = mixed(x)
    assert mixed._lone_fuser is None and bool((y.abs() <= 1).all())


def test_lone_run_input_type_error_unchanged():
    seq = te_seq.Sequential(ops.BasicLinear(6, 5, dtype=torch.float64))
    seq(torch.randn(2, 6, dtype=torch.float64))
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        seq([1.0] * 6)


def test_glu_spec_shared_and_follows_the_layout():
    act = ops.SwiGLU()
    assert act.glu_spec is act.glu_spec
    act.glu_interleave_size = 32
    assert act.glu_spec.glu_interleave_size == 32 and act.glu_spec.act == act.act


def test_not_taken_after_a_weight_layout_change():
    """Parameter strides are in the signature (prepared launches read the weight's layout):
    new strides through .data, same shape and values, leave the fast path; results equal to
    float64 rounding (BLAS may sum a transposed operand in another order: on an AVX2 machine
    with MKL the result moved by one ulp, 3.6e-15 at 170, 2026-11-28)."""
    mlp = make_mlp()
    x, splits, probs = make_inputs()
    _warm(mlp, x, splits, probs)
    y = call(mlp, x, splits, probs)
    weight = mlp[0].weight
    with torch.no_grad():
        weight.data = weight.data.transpose(1, 2).contiguous().transpose(1, 2)
    assert _missed(mlp, None, x, splits, probs)
    assert not _missed(mlp, None, x, splits, probs)
    torch.testing.assert_close(call(mlp, x, splits, probs), y, rtol=1e-13, atol=0)


def test_each_full_path_call_starts_a_new_steady_dict(monkeypatch):
    """The contexts of a signature's calls share one `steady` dict; a full-path call (another
    signature) gets a new one, so nothing prepared for one signature serves another."""
    import te_seq.run.fuser as fuser_module

    seen = []
    make = fuser_module.new_contexts

    def recording(*args, **kwargs):
        ctxs = make(*args, **kwargs)
        seen.append(ctxs[0].steady)
        return ctxs

    monkeypatch.setattr(fuser_module, "new_contexts", recording)
    mlp = make_mlp()
    x, splits, probs = make_inputs()
    x2, splits2, probs2 = make_inputs(rows=ROWS + 3, sizes=[7, 3, 20, 13], seed=2)
    call(mlp, x, splits, probs)
    call(mlp, x2, splits2, probs2)
    assert len(seen) == 2 and seen[0] is not seen[1]
    assert all(isinstance(s, dict) for s in seen)
    assert fuser(mlp)._fast.templates[0]["steady"] is seen[1]
