"""TransformerEngine's activation family in te_seq: table maths with parameters (clamps, soft
caps, up-half transforms), constructor contracts, the grouped-MLP fusion with parameterized
activations, and `activation_recompute_in_mlp` (what is saved, and the same gradients)."""

from __future__ import annotations

import pytest
import torch
from op_specs import randomize_params

import te_seq
from te_seq import ops
from te_seq.kernels.activations import ACTIVATIONS, GluSpec, activation, param_values

D = torch.float64


# --- the table: parameterized entries -----------------------------------------------------------

_PARAMS = {"clamped_qgelu": (0.9, 1.3, 0.5), "situ": (1.5, 2.0)}


def _off_kinks(params: tuple[float, ...]) -> torch.Tensor:
    """Points over [-3, 3] that avoid the clamps' kinks at ±limit (autograd picks a side there)."""
    x = torch.linspace(-3, 3, 301, dtype=D)
    for p in params[:1]:
        x = x[((x.abs() - p).abs() > 1e-3)]
    return x.requires_grad_(True)


@pytest.mark.parametrize("name", sorted(_PARAMS))
def test_parameterized_entries_derivatives_match_autograd(name: str) -> None:
    spec, params = activation(name), _PARAMS[name]
    assert len(spec.params) == len(params)
    x = _off_kinks(params)
    for f, df in ((spec.f, spec.df), (spec.up, spec.dup)):
        (grad,) = torch.autograd.grad(f(x, *params).sum(), x)
        torch.testing.assert_close(df(x.detach(), *params), grad, rtol=1e-10, atol=1e-10)


def test_clamped_gradients_at_the_bounds_follow_transformer_engine() -> None:
    """TE's kernels pass the gate's gradient where gate <= limit and the up's where
    -limit <= up <= limit, the bounds included."""
    spec, limit = activation("clamped_qgelu"), 0.75
    at = torch.tensor([-limit, limit, limit + 0.01, -limit - 0.01], dtype=D)
    assert spec.dup(at, limit, 1.702, 1.0).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert spec.df(at, limit, 1.702, 1.0)[1] > 0 and spec.df(at, limit, 1.702, 1.0)[2] == 0


def test_glu_spec_checks_the_parameter_count() -> None:
    assert GluSpec("clamped_qgelu", 1, (7.0, 1.702, 1.0)).params == (7.0, 1.702, 1.0)
    with pytest.raises(ValueError, match=r"'situ' takes params \('beta1', 'beta2'\), got \(1.0,\)"):
        GluSpec("situ", None, (1.0,))
    spec = ops.ScaledClampedQGeGLU(4, limit=3.0, alpha=2.0, glu_linear_offset=0.0).glu_spec
    assert spec == GluSpec("clamped_qgelu", 4, (3.0, 2.0, 0.0))
    assert ops.SiTUGLU(beta1=2.0).glu_spec.params == (2.0, 25.0)


# --- constructors -----------------------------------------------------------------------------


def test_transformer_engine_signatures() -> None:
    op = ops.ClampedSwiGLU()
    assert (op.limit, op.alpha, op.glu_linear_offset, op.glu_interleave_size) == (
        7.0, 1.702, 1.0, None)
    assert ops.ScaledClampedQGeGLU(32).glu_interleave_size == 32  # positional, as in TE
    assert ops.ScaledSiTUGLU(64, beta1=3.0).beta1 == 3.0
    assert ops.ScaledSwiGLU(32, activation_recompute_in_mlp=True).activation_recompute_in_mlp
    assert not ops.ScaledSReLU().activation_recompute_in_mlp
    assert (ops.SiTUGLU().beta1, ops.SiTUGLU().beta2) == (4.0, 25.0)


@pytest.mark.parametrize("make, error, match", [
    (lambda: ops.ClampedSwiGLU(limit=0.0), ValueError, "ClampedSwiGLU: limit must be positive"),
    (lambda: ops.ClampedSwiGLU(alpha="1"), TypeError, "ClampedSwiGLU: alpha must be"),
    (lambda: ops.SiTUGLU(beta2=-1.0), ValueError, "SiTUGLU: beta2 must be finite and positive"),
    (lambda: ops.ScaledSiTUGLU(beta1=float("inf")), ValueError, "beta1 must be finite"),
    (lambda: ops.ScaledSReLU(activation_recompute_in_mlp=1), TypeError,
     "ScaledSReLU: activation_recompute_in_mlp must be a bool"),
    (lambda: ops.GLU(glu_interleave_size=0), ValueError, "GLU: glu_interleave_size"),
])
def test_bad_arguments_name_the_op(make, error, match) -> None:
    with pytest.raises(error, match=match):
        make()


def test_every_new_activation_is_in_the_table() -> None:
    for cls in (ops.GLU, ops.QGELU, ops.QGEGLU, ops.SReLU, ops.SReGLU, ops.ScaledSReLU,
                ops.ClampedSwiGLU, ops.ScaledClampedQGeGLU, ops.SiTUGLU, ops.ScaledSiTUGLU):
        assert cls.act in ACTIVATIONS, cls.__name__


# --- the grouped MLP with parameterized and row-scaled activations ------------------------------

T, HID, FFN, G = 9, 8, 6, 3


def _mlp(act: torch.nn.Module, gated: bool = True) -> te_seq.Sequential:
    seq = te_seq.Sequential(ops.GroupedLinear(G, HID, FFN * (2 if gated else 1), dtype=D), act,
                            ops.GroupedLinear(G, FFN, HID, dtype=D))
    randomize_params(seq)
    return seq


def _run(seq, x, extras, fused: bool):
    x = x.clone().requires_grad_(True)
    extras = [e.clone().requires_grad_(True) if e.is_floating_point() else e for e in extras]
    for p in seq.parameters():
        p.grad = None
    with te_seq.fusions_disabled() if not fused else torch.enable_grad():
        y = seq(x, *extras)
    y.backward(torch.randn(y.shape, dtype=D, generator=torch.Generator().manual_seed(3)))
    leaves = [x, *[e for e in extras if e.is_floating_point()], *seq.parameters()]
    return [y.detach()] + [t.grad for t in leaves], seq.fusion_plan()


@pytest.mark.parametrize("make, gated", [
    (lambda: ops.ClampedSwiGLU(limit=0.5, alpha=1.3, glu_interleave_size=1), True),
    (lambda: ops.ScaledClampedQGeGLU(2, limit=0.5, glu_linear_offset=0.25), True),
    (lambda: ops.ScaledSiTUGLU(beta1=0.8, beta2=1.1), True),
    (lambda: ops.ScaledSReLU(), False),
], ids=["ClampedSwiGLU", "ScaledClampedQGeGLU", "ScaledSiTUGLU", "ScaledSReLU"])
def test_grouped_mlp_runs_the_activations_parameters(make, gated) -> None:
    act = make()
    seq = _mlp(act, gated)
    x = torch.randn(T, HID, dtype=D) * 2
    splits = torch.tensor([4, 0, T - 4])
    extras = [splits] + ([torch.rand(T, dtype=D) + 0.5] if act.row_scales else []) + [splits]
    fused, plan = _run(seq, x, extras, fused=True)
    assert plan.forward[0].name == "GroupedMLP", plan
    unfused, plan_off = _run(seq, x, extras, fused=False)
    assert not plan_off.fused_steps
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_cute_epilogue_takes_parameterized_activations() -> None:
    """The parameterized entries pass the epilogue's activation check (on CPU tensors the next
    check declines); an entry without an epilogue is still declined by name."""
    from te_seq.kernels import cute

    x, w = torch.randn(16, 64, dtype=torch.bfloat16), torch.randn(2, 64, 256, dtype=torch.bfloat16)
    for act in ("clamped_qgelu", "situ"):
        ok, why = cute.glu_fc1_forward.supports(x, w, act, None)
        assert not ok and "needs CUDA tensors" in why, why
    ok, why = cute.glu_fc1_forward.supports(x, w, "gelu_erf", None)
    assert not ok and "act 'gelu_erf' has no fused epilogue" in why


def test_param_values_fill_in_the_defaults_and_check_the_count() -> None:
    assert param_values("clamped_qgelu") == (7.0, 1.702, 1.0)
    assert param_values("situ") == (4.0, 25.0)
    assert param_values("situ", (1, 2.5)) == (1.0, 2.5)
    assert param_values("silu") == ()
    with pytest.raises(ValueError, match=r"'situ' takes params \('beta1', 'beta2'\), got \(1.0,\)"):
        param_values("situ", (1.0,))


# --- activation_recompute_in_mlp ----------------------------------------------------------------


def _saved_bytes(fn) -> int:
    """Bytes of distinct storages autograd saves while `fn` runs."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


_SCALED = [
    lambda r: ops.ScaledSwiGLU(activation_recompute_in_mlp=r),
    lambda r: ops.ScaledClampedQGeGLU(activation_recompute_in_mlp=r, limit=0.6),
    lambda r: ops.ScaledSiTUGLU(2, activation_recompute_in_mlp=r),
    lambda r: ops.ScaledSReLU(activation_recompute_in_mlp=r),
]


def _pair(make, recompute: bool, fc_kwargs: dict) -> te_seq.Sequential:
    act = make(recompute)
    torch.manual_seed(0)
    seq = te_seq.Sequential(act, ops.GroupedLinear(G, FFN, HID, dtype=D, **fc_kwargs))
    randomize_params(seq)
    return seq


@pytest.mark.parametrize("make", _SCALED, ids=["ScaledSwiGLU", "ScaledClampedQGeGLU",
                                                "ScaledSiTUGLU", "ScaledSReLU"])
@pytest.mark.parametrize("fc_kwargs", [dict(bias=False), dict(bias=True, scale_bias=True)],
                         ids=["no_bias", "scale_bias"])
def test_recompute_keeps_the_activation_out_of_memory(make, fc_kwargs) -> None:
    width = FFN * (2 if make(False).gated else 1)
    x = torch.randn(T, width, dtype=D) * 2
    scales, splits = torch.rand(T, dtype=D) + 0.5, torch.tensor([3, 0, T - 3])
    fc_extras = [splits] + ([torch.rand(T, dtype=D)] if fc_kwargs.get("scale_bias") else [])
    results = {}
    for recompute in (False, True):
        seq = _pair(make, recompute, fc_kwargs)

        def step(seq=seq):
            return _run(seq, x, [scales, *fc_extras], fused=True)

        results[recompute] = _saved_bytes(step)
    (kept, (grads_kept, plan_kept)), (lean, (grads_lean, plan)) = results[False], results[True]
    assert [s.name for s in plan.forward] == ["ActivationRecompute"], plan
    assert [s.name for s in plan_kept.forward] == [type(make(False)).__name__, "GroupedLinear"]
    assert kept - lean == T * FFN * 8  # exactly the activation's output [T, F] in float64
    for a, b in zip(grads_lean, grads_kept):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_recompute_false_says_why_it_does_not_fuse() -> None:
    seq = _pair(_SCALED[0], False, dict(bias=False))
    x, s, splits = torch.randn(T, 2 * FFN, dtype=D), torch.rand(T, dtype=D), torch.tensor([T, 0, 0])
    seq(x, s, splits)
    (miss,) = seq.fusion_plan().misses
    assert miss.fusion == "activation_recompute"
    assert "ScaledSwiGLU: activation_recompute_in_mlp is False" in miss.reason
