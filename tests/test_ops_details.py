"""Op-specific behaviour the generic op matrix does not cover: norms against PyTorch, dropout
modes, reshape round trips, extra inputs/outputs inside longer chains, in-place semantics, the
built-in linear/activation/residual fusions (fired, equal to unfused, declines explained) and
every error message of these ops.

Reference maths run in float64 so any difference is the op's, not rounding; sizes are small
because every test here is about semantics, not speed.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.nn.functional as F
from op_specs import activation_ops

import te_seq
from te_seq import ops
from te_seq.fusion.matcher import Window

D = torch.float64


def _rand(*shape: int, grad: bool = True, dtype: torch.dtype = D) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _randomize(module: torch.nn.Module) -> None:
    """Non-trivial parameters (norm weights start at one, biases at zero)."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()


def _grads(tensors) -> list[torch.Tensor | None]:
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def _zero_grads(tensors) -> None:
    for t in tensors:
        t.grad = None


# --- norms ---------------------------------------------------------------------------------


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("eps", [1e-5, 0.5])  # a large eps shows it is added inside the sqrt
def test_layer_norm_matches_torch(zero_centered: bool, eps: float) -> None:
    op = ops.LayerNorm(8, eps=eps, zero_centered_gamma=zero_centered, dtype=D)
    _randomize(op)
    x = _rand(3, 5, 8)
    y = te_seq.Sequential(op)(x)
    gamma = op.weight + 1 if zero_centered else op.weight
    x_ref = x.detach().clone().requires_grad_()
    ref = F.layer_norm(x_ref, (8,), gamma, op.bias, eps)
    torch.testing.assert_close(y, ref)
    dy = torch.randn_like(y)
    (got,) = torch.autograd.grad(y, [x], dy, retain_graph=True)
    want = torch.autograd.grad(ref, [x_ref, op.weight, op.bias], dy)
    y.backward(dy)
    torch.testing.assert_close(got, want[0])
    torch.testing.assert_close(op.weight.grad, want[1])
    torch.testing.assert_close(op.bias.grad, want[2])


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("eps", [1e-5, 0.5])
def test_rms_norm_matches_manual(zero_centered: bool, eps: float) -> None:
    op = ops.RMSNorm((8,), eps=eps, zero_centered_gamma=zero_centered, dtype=D)
    _randomize(op)
    x = _rand(4, 8)
    y = te_seq.Sequential(op)(x)
    gamma = op.weight + 1 if zero_centered else op.weight
    x_ref = x.detach().clone().requires_grad_()
    ref = x_ref * torch.rsqrt(x_ref.pow(2).mean(-1, keepdim=True) + eps) * gamma
    torch.testing.assert_close(y, ref)
    dy = torch.randn_like(y)
    y.backward(dy)
    want = torch.autograd.grad(ref, [x_ref, op.weight], dy)
    torch.testing.assert_close(x.grad, want[0])
    torch.testing.assert_close(op.weight.grad, want[1])


def test_norm_parameters_initialise_as_documented() -> None:
    ln, ln0 = ops.LayerNorm(6), ops.LayerNorm(6, zero_centered_gamma=True)
    assert torch.equal(ln.weight, torch.ones(6)) and torch.equal(ln.bias, torch.zeros(6))
    assert torch.equal(ln0.weight, torch.zeros(6))
    rms = ops.RMSNorm(6, zero_centered_gamma=True, dtype=torch.bfloat16)
    assert [n for n, _ in rms.named_parameters()] == ["weight"]
    assert rms.weight.dtype == torch.bfloat16 and torch.equal(rms.weight.float(), torch.zeros(6))
    # zero_centered_gamma with a zero weight is the identity scale: y = x̂ exactly.
    x = torch.randn(3, 6)
    torch.testing.assert_close(te_seq.Sequential(ln0)(x), F.layer_norm(x, (6,)))


@pytest.mark.parametrize("cls", [ops.LayerNorm, ops.RMSNorm])
def test_norm_bf16_computes_in_fp32(cls) -> None:
    op32 = cls(16)
    _randomize(op32)
    op16 = cls(16, dtype=torch.bfloat16)
    op16.load_state_dict({k: v.to(torch.bfloat16) for k, v in op32.state_dict().items()})
    op32.load_state_dict({k: v.float() for k, v in op16.state_dict().items()})
    x = torch.randn(8, 16).to(torch.bfloat16)
    y16 = te_seq.Sequential(op16)(x)
    y32 = te_seq.Sequential(op32)(x.float())
    assert y16.dtype == torch.bfloat16
    # fp32 compute then one rounding: equal to the fp32 result rounded to bf16.
    torch.testing.assert_close(y16, y32.to(torch.bfloat16), atol=0, rtol=0)


# --- dropout, reshape, scale, identity -----------------------------------------------------


def test_dropout_train_masks_and_rescales_with_same_mask_in_backward() -> None:
    p = 0.25
    op = ops.Dropout(p)
    x = (torch.rand(64, 64, dtype=D) + 0.5).requires_grad_()  # never zero: zeros mean dropped
    y = te_seq.Sequential(op)(x)
    kept = y != 0
    assert 0.15 < 1 - kept.float().mean().item() < 0.35
    torch.testing.assert_close(y[kept], x[kept] / (1 - p))
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, kept.to(D) / (1 - p))


def test_dropout_eval_and_p0_are_identity() -> None:
    x = _rand(5, 7)
    seq = te_seq.Sequential(ops.Dropout(0.5)).eval()
    assert torch.equal(seq(x), x)
    seq0 = te_seq.Sequential(ops.Dropout(0.0))  # training mode
    y = seq0(x)
    assert torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_dropout_draws_a_new_mask_per_call() -> None:
    seq = te_seq.Sequential(ops.Dropout(0.5))
    x = torch.ones(32, 32)
    assert not torch.equal(seq(x), seq(x))


def test_reshape_round_trip_and_gradients() -> None:
    x = _rand(2, 3, 8)
    seq = te_seq.Sequential(ops.Reshape((-1, 4)), ops.ConstantScale(3.0), ops.Reshape((6, 8)),
                            ops.Identity())
    y = seq(x)
    assert y.shape == (6, 8)
    torch.testing.assert_close(y, 3 * x.reshape(6, 8))
    dy = torch.randn_like(y)
    y.backward(dy)
    assert x.grad.shape == x.shape
    torch.testing.assert_close(x.grad, 3 * dy.reshape(x.shape))


def test_reshape_can_feed_ops_that_read_the_last_dim() -> None:
    lin = ops.BasicLinear(4, 3, dtype=D)
    x = _rand(5, 8)
    y = te_seq.Sequential(ops.Reshape((5, 2, 4)), lin)(x)
    torch.testing.assert_close(y, x.reshape(5, 2, 4) @ lin.weight.t())


# --- extra inputs and outputs --------------------------------------------------------------


def _residual_block(in_place: bool = False) -> te_seq.Sequential:
    """LayerNorm → MakeExtraOutput → Linear → GELU → Linear → AddExtraInput."""
    seq = te_seq.Sequential(
        ops.LayerNorm(8, dtype=D),
        ops.MakeExtraOutput(in_place=in_place),
        ops.Linear(8, 16, dtype=D),
        ops.GELU(),
        ops.Linear(16, 8, dtype=D),
        ops.AddExtraInput(in_place=in_place),
    )
    _randomize(seq)
    return seq


def _residual_reference(seq: te_seq.Sequential, x, extra):
    ln, _, lin1, act, lin2, _ = seq
    h = F.layer_norm(x, (8,), ln.weight, ln.bias)
    y = F.linear(F.gelu(F.linear(h, lin1.weight, lin1.bias), approximate="tanh"), lin2.weight,
                 lin2.bias)
    return y + extra, h


@pytest.mark.parametrize("fused", [True, False])
def test_extra_inputs_and_outputs_inside_a_chain(fused: bool) -> None:
    seq = _residual_block()
    x, extra = _rand(2, 3, 8), _rand(2, 3, 8)
    leaves = [x, extra, *seq.parameters()]
    if fused:
        y, residual = seq(x, extra)
    else:
        with te_seq.fusions_disabled():
            y, residual = seq(x, extra)
    dy, dr = torch.randn_like(y), torch.randn_like(residual)
    torch.autograd.backward([y, residual], [dy, dr])
    got = _grads(leaves)
    _zero_grads(leaves)
    y_ref, r_ref = _residual_reference(seq, x, extra)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(residual, r_ref)
    torch.autograd.backward([y_ref, r_ref], [dy, dr])
    for g, w in zip(got, _grads(leaves)):
        torch.testing.assert_close(g, w)


def test_make_extra_output_gives_two_tensors_whose_grads_sum() -> None:
    x = _rand(4, 6)
    y, extra = te_seq.Sequential(ops.MakeExtraOutput())(x)
    assert y is not extra and torch.equal(y, extra)
    assert y.grad_fn is not None and extra.grad_fn is not None
    dy, de = torch.randn_like(y), torch.randn_like(extra)
    torch.autograd.backward([y, extra], [dy, de])
    torch.testing.assert_close(x.grad, dy + de)


def test_make_extra_output_unused_branch_counts_as_zero() -> None:
    x = _rand(4, 6)
    seq = te_seq.Sequential(ops.MakeExtraOutput(), ops.ConstantScale(2.0))
    y, _ = seq(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_add_extra_input_broadcast_extra_gets_reduced_grad() -> None:
    x, extra = _rand(2, 3, 5), _rand(5)
    y = te_seq.Sequential(ops.AddExtraInput())(x, extra)
    torch.testing.assert_close(y, x + extra)
    dy = torch.randn_like(y)
    y.backward(dy)
    torch.testing.assert_close(x.grad, dy)
    torch.testing.assert_close(extra.grad, dy.sum((0, 1)))


def test_add_extra_input_promotes_like_torch() -> None:
    x, extra = _rand(3, 4, dtype=torch.bfloat16), _rand(3, 4, dtype=torch.float32)
    y = te_seq.Sequential(ops.AddExtraInput())(x, extra)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and extra.grad.dtype == torch.float32


def test_add_extra_input_in_place_writes_into_extra_without_grad() -> None:
    x, extra = _rand(3, 4), torch.randn(3, 4, dtype=D)
    before = extra.clone()
    y = te_seq.Sequential(ops.AddExtraInput(in_place=True))(x, extra)
    assert y.data_ptr() == extra.data_ptr()
    torch.testing.assert_close(extra, x.detach() + before)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("extra_shape", [(3, 4), (4,)])  # needs grad / broadcast: out of place
def test_add_extra_input_in_place_leaves_extra_alone_when_it_cannot_write(extra_shape) -> None:
    x = _rand(3, 4)
    extra = _rand(*extra_shape, grad=len(extra_shape) == 2)
    before = extra.detach().clone()
    y = te_seq.Sequential(ops.AddExtraInput(in_place=True))(x, extra)
    assert torch.equal(extra.detach(), before)
    torch.testing.assert_close(y, x + before)


@pytest.mark.parametrize("fused", [True, False])
def test_in_place_ops_give_the_same_values_and_grads(fused: bool) -> None:
    x = _rand(2, 8)
    extra = torch.randn(2, 8, dtype=D)
    results = []
    for in_place in (False, True):
        seq = _residual_block(in_place)
        torch.manual_seed(0)
        _randomize(seq)
        x.grad = None
        with te_seq.fusions_disabled() if not fused else contextlib.nullcontext():
            y, residual = seq(x, extra.clone())
        torch.autograd.backward([y, residual], [torch.ones_like(y), torch.ones_like(residual)])
        results.append((y.detach(), residual.detach(), x.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_make_extra_output_in_place_never_writes_autograd_grads() -> None:
    x = _rand(3, 4)
    y, residual = te_seq.Sequential(ops.MakeExtraOutput(in_place=True), ops.ConstantScale(2.0))(x)
    seen = {}
    residual.register_hook(lambda g: seen.setdefault("grad", (g, g.clone())) and None)
    torch.autograd.backward([y, residual], [torch.ones_like(y), torch.ones_like(residual)])
    grad, value_then = seen["grad"]
    assert torch.equal(grad, value_then)
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


# --- fusions -------------------------------------------------------------------------------

ACTIVATIONS = activation_ops()  # every activation op te_seq.ops exports


def _run(seq: te_seq.Sequential, leaves: list[torch.Tensor], inputs: tuple, fused: bool):
    """Output(s) and the grads of `leaves`, with fusions on or all off."""
    _zero_grads(leaves)
    with contextlib.nullcontext() if fused else te_seq.fusions_disabled():
        out = seq(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    torch.manual_seed(7)
    torch.autograd.backward(list(outs), [torch.randn_like(o) for o in outs])
    return [o.detach() for o in outs], _grads(leaves), seq.fusion_plan()


def _assert_fused_equals_unfused(seq, leaves, inputs, clone_extra: bool = False):
    first = tuple(t.clone() if clone_extra and i else t for i, t in enumerate(inputs))
    outs, grads, plan = _run(seq, leaves, first, fused=True)
    second = tuple(t.clone() if clone_extra and i else t for i, t in enumerate(inputs))
    ref_outs, ref_grads, ref_plan = _run(seq, leaves, second, fused=False)
    assert not ref_plan.fused_steps
    for a, b in zip(outs + grads, ref_outs + ref_grads):
        torch.testing.assert_close(a, b)
    return plan


def _steps(steps) -> list[tuple[str, tuple[int, ...]]]:
    return [(s.name, s.basic_op_indices) for s in steps]


@pytest.mark.parametrize("act_cls", ACTIVATIONS, ids=lambda c: c.__name__)
def test_linear_bias_activation_fuses_and_matches_unfused(act_cls) -> None:
    act = act_cls()
    seq = te_seq.Sequential(ops.Identity(), ops.Linear(6, 8, dtype=D), act)
    _randomize(seq)
    x = _rand(3, 6)
    extra = (_rand(3),) if act_cls.row_scales else ()
    plan = _assert_fused_equals_unfused(seq, [x, *extra, *seq.parameters()], (x, *extra))
    assert _steps(plan.forward) == [("Identity", (0,)), ("LinearBiasActivation", (1, 2, 3))]
    assert _steps(plan.backward) == [("ActivationBiasBackward", (2, 3)), ("BasicLinear", (1,)),
                                     ("Identity", (0,))]
    assert plan.misses == []


def test_linear_bias_activation_keeps_interleaved_glu_layout() -> None:
    seq = te_seq.Sequential(ops.Linear(4, 8, dtype=D), ops.SwiGLU(glu_interleave_size=2))
    _randomize(seq)
    x = _rand(5, 4)
    plan = _assert_fused_equals_unfused(seq, [x, *seq.parameters()], (x,))
    assert plan.forward[0].name == "LinearBiasActivation"


@pytest.mark.parametrize("extra_case", ["needs_grad", "broadcast", "in_place"])
def test_linear_bias_add_fuses_and_matches_unfused(extra_case: str) -> None:
    seq = te_seq.Sequential(ops.Linear(6, 5, dtype=D),
                            ops.AddExtraInput(in_place=extra_case == "in_place"))
    _randomize(seq)
    x = _rand(2, 3, 6)
    extra = {"needs_grad": _rand(2, 3, 5), "broadcast": _rand(5),
             "in_place": _rand(2, 3, 5, grad=False)}[extra_case]
    leaves = [x, *seq.parameters()] + ([extra] if extra.requires_grad else [])
    plan = _assert_fused_equals_unfused(seq, leaves, (x, extra), clone_extra=True)
    assert _steps(plan.forward) == [("LinearBiasAdd", (0, 1, 2))]


def test_linear_bias_add_in_place_writes_into_the_residual() -> None:
    seq = te_seq.Sequential(ops.Linear(6, 5, dtype=D), ops.AddExtraInput(in_place=True))
    x, extra = _rand(4, 6), torch.randn(4, 5, dtype=D)
    before = extra.clone()
    y = seq(x, extra)
    assert seq.fusion_plan().forward[0].name == "LinearBiasAdd"
    assert y.data_ptr() == extra.data_ptr()
    torch.testing.assert_close(y, F.linear(x, seq[0].weight, seq[0].bias) + before)


def test_make_extra_output_linear_backward_fuses_and_matches_unfused() -> None:
    seq = te_seq.Sequential(ops.MakeExtraOutput(), ops.BasicLinear(6, 4, dtype=D))
    x = _rand(3, 6)
    plan = _assert_fused_equals_unfused(seq, [x, *seq.parameters()], (x,))
    assert _steps(plan.forward) == [("MakeExtraOutput", (0,)), ("BasicLinear", (1,))]
    assert _steps(plan.backward) == [("MakeExtraOutputLinearBackward", (0, 1))]


def test_make_extra_output_linear_backward_follows_the_gradient_contract() -> None:
    lin = ops.BasicLinear(6, 4, dtype=D, delay_wgrad_compute=True)
    seq = te_seq.Sequential(ops.MakeExtraOutput(), lin)
    x = _rand(3, 6)
    y, r = seq(x)
    dy = torch.randn_like(y)
    torch.autograd.backward([y, r], [dy, torch.zeros_like(r)])
    assert seq.fusion_plan().backward[0].name == "MakeExtraOutputLinearBackward"
    assert lin.weight.grad is None and seq.need_backward_dw()
    seq.backward_dw()
    torch.testing.assert_close(lin.weight.grad, dy.t() @ x.detach())


def test_all_fusions_in_one_block_and_inference() -> None:
    seq = _residual_block()
    x, extra = _rand(2, 8), _rand(2, 8)
    plan = _assert_fused_equals_unfused(seq, [x, extra, *seq.parameters()], (x, extra))
    assert _steps(plan.forward) == [
        ("LayerNorm", (0,)), ("MakeExtraOutput", (1,)),
        ("LinearBiasActivation", (2, 3, 4)), ("LinearBiasAdd", (5, 6, 7)),
    ]
    assert _steps(plan.backward) == [
        ("AddExtraInput", (7,)), ("Bias", (6,)), ("BasicLinear", (5,)),
        ("ActivationBiasBackward", (3, 4)), ("MakeExtraOutputLinearBackward", (1, 2)),
        ("LayerNorm", (0,)),
    ]
    with torch.no_grad():
        y, r = seq(x, extra)
        assert seq.fusion_plan().backward == []
        with te_seq.fusions_disabled():
            y_ref, r_ref = seq(x, extra)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(r, r_ref)


def test_frozen_prefix_runs_no_backward_for_it() -> None:
    """Ops before the first one needing a gradient save nothing and are not run in backward."""
    bias = ops.Bias(4, dtype=D)
    bias.bias.requires_grad_(False)
    lin = ops.BasicLinear(4, 4, dtype=D)
    seq = te_seq.Sequential(bias, ops.GELU(), lin)
    x = torch.randn(3, 4, dtype=D)
    seq(x).sum().backward()
    assert lin.weight.grad is not None


class _LoudGELU(ops.GELU):
    """A user activation that changes the maths: the fusions must not run it as GELU."""

    def op_forward(self, ctx, input_):
        return super().op_forward(ctx, input_) * 2

    def op_backward(self, ctx, grad_output):
        dx, grads = super().op_backward(ctx, grad_output * 2)
        return dx, grads


def test_activation_subclass_with_own_maths_declines_with_reason() -> None:
    seq = te_seq.Sequential(ops.Linear(4, 4, dtype=D), _LoudGELU())
    x = _rand(2, 4)
    y = seq(x)
    torch.testing.assert_close(y, 2 * F.gelu(F.linear(x, seq[0].weight, seq[0].bias),
                                             approximate="tanh"))
    plan = seq.fusion_plan()
    assert not plan.fused_steps
    misses = {(m.fusion, m.basic_op_indices): m.reason for m in plan.misses}
    assert "overrides op_forward, op_backward of GELU" in misses[("linear_bias_activation",
                                                                    (0, 1, 2))]
    assert "_LoudGELU" in misses[("activation_bias_backward", (1, 2))]


def _build(name: str, *window_ops):
    record = next(f for f in te_seq.list_fusions() if f.name == name)
    n = len(window_ops)
    return record.build(Window(window_ops, [()] * n, tuple(range(n))))


@pytest.mark.parametrize("name, window_ops, reason", [
    ("linear_bias_activation", (ops.BasicLinear(4, 6), ops.Bias(5), ops.GELU()),
     "Bias size 5 does not match BasicLinear out_features 6"),
    ("linear_bias_add", (ops.BasicLinear(4, 6), ops.Bias(6, dtype=D), ops.AddExtraInput()),
     r"Bias parameter \(torch.float64, cpu\) differs from BasicLinear weight \(torch.float32"),
    ("linear_bias_activation", (ops.BasicLinear(4, 6), ops.Bias(6),
                                ops.SwiGLU(glu_interleave_size=2)),
     "SwiGLU needs a width that is a multiple of 4, got 6"),
    ("activation_bias_backward", (ops.Bias(5), ops.GEGLU()),
     "GEGLU needs a width that is a multiple of 2, got 5"),
])
def test_fusion_declines_say_why(name, window_ops, reason) -> None:
    result = _build(name, *window_ops)
    assert isinstance(result, te_seq.NoMatch)
    assert re.search(reason, result.reason), result.reason


def test_fusions_are_listed_as_builtin() -> None:
    records = {f.name: f for f in te_seq.list_fusions()}
    expected = {"linear_bias_activation": "forward", "linear_bias_add": "forward",
                "activation_bias_backward": "backward",
                "make_extra_output_linear_backward": "backward"}
    for name, phase in expected.items():
        assert records[name].phase == phase and records[name].builtin and records[name].enabled


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("make, match", [
    (lambda: ops.LayerNorm((4, 0)), r"LayerNorm: normalized_shape must be positive, got \(4, 0\)"),
    (lambda: ops.RMSNorm(0), "RMSNorm: normalized_shape must be positive, got 0"),
    (lambda: ops.LayerNorm(4, eps=0.0), "LayerNorm: eps must be positive, got 0.0"),
    (lambda: ops.Dropout(1.0), r"Dropout: p must be a number in \[0, 1\), got 1.0"),
    (lambda: ops.Dropout(-0.1), r"Dropout: p must be a number in \[0, 1\), got -0.1"),
    (lambda: ops.Reshape((2, -1, -1)), r"Reshape: shape \(2, -1, -1\) may hold sizes >= 0 and "
                                       "at most one -1"),
])
def test_constructor_errors(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("make, match", [
    (lambda: ops.Reshape(("a", 2)), r"Reshape: shape must be a sequence of ints, got \('a', 2\)"),
    (lambda: ops.ConstantScale("2"), "ConstantScale: scale must be a real number, got '2'"),
])
def test_constructor_type_errors(make, match) -> None:
    with pytest.raises(TypeError, match=match):
        make()


@pytest.mark.parametrize("op, inputs, match", [
    (ops.LayerNorm(8), (torch.randn(2, 7),),
     r"LayerNorm: input has last dimension 7 \(shape \(2, 7\)\), but normalized_shape=8"),
    (ops.RMSNorm(8), (torch.randn(2, 7),),
     r"RMSNorm: input has last dimension 7 \(shape \(2, 7\)\), but normalized_shape=8"),
    (ops.RMSNorm(8), (torch.randn(2, 8, dtype=D),),
     "RMSNorm: input dtype torch.float64 does not match the op's parameter dtype torch.float32"),
    (ops.Reshape((5, -1)), (torch.randn(6, 8),),
     r"Reshape: cannot reshape input of shape \(6, 8\) \(48 elements\) to \(5, -1\)"),
    (ops.Reshape((7, 7)), (torch.randn(6, 8),),
     r"Reshape: cannot reshape input of shape \(6, 8\) \(48 elements\) to \(7, 7\)"),
    (ops.Dropout(0.1), (torch.ones(3, dtype=torch.int64),),
     "Dropout: input must be floating point, got torch.int64"),
    (ops.AddExtraInput(), (torch.randn(3, 4), torch.randn(3, 5)),
     r"AddExtraInput: extra of shape \(3, 5\) does not broadcast to the input's shape \(3, 4\)"),
    (ops.AddExtraInput(), (torch.randn(3, 4), torch.randn(2, 3, 4)),
     r"AddExtraInput: extra of shape \(2, 3, 4\) does not broadcast to the input's shape \(3, 4\)"),
    (ops.AddExtraInput(), (torch.randn(3, 4), torch.randn(3, 4, device="meta")),
     "AddExtraInput: extra is on meta, input on cpu"),
])
def test_forward_value_errors(op, inputs, match) -> None:
    with pytest.raises(ValueError, match=match):
        te_seq.Sequential(op)(*inputs)


def test_add_extra_input_errors_inside_fused_window() -> None:
    """The fused op checks its inner AddExtraInput just as the unfused run does."""
    seq = te_seq.Sequential(ops.Linear(4, 3), ops.AddExtraInput())
    with pytest.raises(ValueError, match=r"AddExtraInput: extra of shape \(2, 4\) does not "
                                         r"broadcast to the input's shape \(2, 3\)"):
        seq(torch.randn(2, 4), torch.randn(2, 4))


def test_add_extra_input_needs_a_tensor_and_the_extra_input() -> None:
    seq = te_seq.Sequential(ops.AddExtraInput())
    with pytest.raises(TypeError, match="AddExtraInput: extra must be a torch.Tensor, got float"):
        seq(torch.randn(2), 1.0)
    with pytest.raises(ValueError, match=r"AddExtraInput \(basic op 0\) expects 1 extra input"):
        seq(torch.randn(2))
