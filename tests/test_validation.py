"""Early, clear errors instead of silent wrong results: `register_fusion` arguments, the input
of a run, `main_grad` buffers (checked before anything is written), and what a fused op returns
(checked against its window). Every message is matched."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_fusions import ChainFused

import te_seq
from te_seq import ops

D = torch.float64


def _never(window):
    raise AssertionError("a rejected registration must never be built")


# --- register_fusion -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(name=3, phase="forward", pattern=(ops.GELU,)), TypeError,
     r"register_fusion: name must be a str, got int 3"),
    (dict(name="", phase="forward", pattern=(ops.GELU,)), ValueError,
     r"register_fusion: name must be a non-empty string"),
    (dict(name="user_x", phase="both", pattern=(ops.GELU,)), ValueError,
     r"register_fusion\('user_x'\): phase must be one of \('joint', 'forward', 'backward'\), "
     r"got 'both'"),
    (dict(name="user_x", phase=None, pattern=(ops.GELU,)), ValueError,
     r"register_fusion\('user_x'\): phase must be one of .* got None"),
    (dict(name="user_x", phase="forward", pattern=ops.GELU), TypeError,
     r"register_fusion\('user_x'\): pattern must be a tuple of op classes .*got <class"),
    (dict(name="user_x", phase="forward", pattern="GELU"), TypeError,
     r"register_fusion\('user_x'\): pattern must be a tuple of op classes"),
    (dict(name="user_x", phase="forward", pattern=()), ValueError,
     r"register_fusion\('user_x'\): pattern is empty"),
    (dict(name="user_x", phase="forward", pattern=(ops.GELU, "Bias")), TypeError,
     r"register_fusion\('user_x'\): pattern elements must be basic op classes \(subclasses of "
     r"te_seq.ops.BasicOperation\) or tuples of them, got str 'Bias'"),
    (dict(name="user_x", phase="forward", pattern=(torch.nn.ReLU,)), TypeError,
     r"register_fusion\('user_x'\): pattern elements must be basic op classes .*got ReLU"),
    (dict(name="user_x", phase="forward", pattern=(ops.GELU, ops.FusedOperation)), TypeError,
     r"pattern elements must be basic op classes .*got FusedOperation"),
    (dict(name="user_x", phase="forward", pattern=(ops.GELU, ())), ValueError,
     r"register_fusion\('user_x'\): a pattern element is an empty tuple"),
    (dict(name="user_x", phase="forward", pattern=((ops.GELU, ops.Linear),)), TypeError,
     r"pattern elements must be basic op classes .*got Linear"),
    (dict(name="grouped_mlp", phase="joint", pattern=(ops.GELU,)), ValueError,
     r"register_fusion: a fusion named 'grouped_mlp' is already registered"),
])
def test_register_fusion_rejects_bad_arguments_at_once(kwargs, exc, match) -> None:
    before = [r.name for r in te_seq.list_fusions()]
    with pytest.raises(exc, match=match):
        te_seq.register_fusion(**kwargs)  # before any build function is given
    assert [r.name for r in te_seq.list_fusions()] == before


@pytest.mark.parametrize("build", [None, 42, "build"])
def test_register_fusion_needs_a_callable_build(build) -> None:
    decorator = te_seq.register_fusion(name="user_x", phase="forward", pattern=(ops.GELU,))
    with pytest.raises(TypeError, match=r"register_fusion\('user_x'\): build must be a callable "
                                        r"taking the window, got "):
        decorator(build)
    assert "user_x" not in [r.name for r in te_seq.list_fusions()]


def test_register_fusion_accepts_lists_and_tuple_elements() -> None:
    te_seq.register_fusion(name="user_ok", phase="forward",
                           pattern=[ops.BasicLinear, (ops.Bias, ops.Identity)])(_never)
    [record] = [r for r in te_seq.list_fusions() if r.name == "user_ok"]
    assert record.pattern == (ops.BasicLinear, (ops.Bias, ops.Identity))


# --- forward entry -------------------------------------------------------------------------------

class _Pair(torch.nn.Module):
    def forward(self, x):
        return x, x


@pytest.mark.parametrize("fusion", ["fused", "unfused"])
@pytest.mark.parametrize("build, args, match", [
    (lambda: [ops.BasicLinear(4, 4, dtype=D)], (None,),
     r"BasicLinear \(basic op 0\): input must be a torch.Tensor, got NoneType"),
    (lambda: [ops.GroupedLinear(2, 4, 4, dtype=D)], ([[1.0] * 4] * 3, torch.tensor([1, 2])),
     r"GroupedLinear \(basic op 0\): input must be a torch.Tensor, got list"),
    (lambda: [ops.Linear(4, 4, dtype=D), _Pair(), ops.GELU()], (torch.randn(3, 4, dtype=D),),
     r"GELU \(basic op 2\): input must be a torch.Tensor, got tuple"),
])
def test_input_must_be_a_tensor(build, args, match, fusion) -> None:
    seq = te_seq.Sequential(*build())
    guard = te_seq.fusions_disabled() if fusion == "unfused" else contextlib.nullcontext()
    with guard, pytest.raises(TypeError, match=match):
        seq(*args)


def test_standalone_op_input_must_be_a_tensor() -> None:
    with pytest.raises(TypeError, match=r"RMSNorm \(basic op 0\): input must be a torch.Tensor, "
                                        r"got float"):
        ops.RMSNorm(4)(1.5)


# --- main_grad: checked before anything is written -----------------------------------------------

def _with_main_grad(op: torch.nn.Module) -> torch.nn.Module:
    for p in op.parameters():
        if p.dim() > 1:
            p.main_grad = torch.zeros_like(p)
    return op


@pytest.mark.parametrize("param, bad, match", [
    ("weight", lambda p: torch.zeros(p.shape, dtype=D, device="meta"),
     r"BasicLinear.weight: main_grad is on meta, weight on cpu"),
    ("weight", lambda p: torch.zeros(p.shape, dtype=torch.int32),
     r"BasicLinear.weight: main_grad has dtype torch.int32; it must be floating point"),
    ("weight", lambda p: [0.0],
     r"BasicLinear.weight: main_grad must be a torch.Tensor, got list"),
    ("weight", lambda p: torch.zeros(p.shape[::-1], dtype=D),
     r"BasicLinear.weight: main_grad has shape \(3, 4\), expected the weight's shape \(4, 3\)"),
])
def test_bad_main_grad_of_basic_linear(param, bad, match) -> None:
    lin = ops.BasicLinear(3, 4, dtype=D, accumulate_into_main_grad=True)
    lin.weight.main_grad = bad(lin.weight)
    y = te_seq.Sequential(lin)(torch.randn(2, 3, dtype=D))
    with pytest.raises(RuntimeError, match=match):
        y.sum().backward()


@pytest.mark.parametrize("fused", [True, False])
def test_bad_main_grad_in_grouped_mlp_writes_nothing(fused: bool) -> None:
    """FC2's wgrad runs first in backward; FC1's bad buffer must stop it before it writes."""
    fc1 = _with_main_grad(ops.GroupedLinear(2, 4, 8, dtype=D, accumulate_into_main_grad=True))
    fc2 = _with_main_grad(ops.GroupedLinear(2, 4, 4, dtype=D, accumulate_into_main_grad=True))
    fc1.weight1.main_grad = torch.zeros(8, 4, dtype=D, device="meta")
    seq = te_seq.Sequential(fc1, ops.SwiGLU(), fc2)
    splits = torch.tensor([3, 4])
    guard = contextlib.nullcontext() if fused else te_seq.fusions_disabled()
    with guard:
        y = seq(torch.randn(7, 4, dtype=D, requires_grad=True), splits, splits)
        assert [s.name for s in seq.fusion_plan().forward][0] == ("GroupedMLP" if fused
                                                                 else "GroupedLinear")
        with pytest.raises(RuntimeError,
                           match=r"GroupedLinear.weight1: main_grad is on meta, weight on cpu"):
            y.sum().backward()
    for p in (fc1.weight0, fc2.weight0, fc2.weight1):
        assert torch.count_nonzero(p.main_grad) == 0, "a gradient was written before the error"
    assert fc1.weight0.grad is None and fc2.weight0.grad is None


def test_bad_main_grad_in_backward_dw_leaves_the_wgrad_queued() -> None:
    lin = ops.BasicLinear(3, 4, dtype=D, accumulate_into_main_grad=True, delay_wgrad_compute=True)
    lin.weight.main_grad = torch.zeros(4, 3, dtype=D, device="meta")
    seq = te_seq.Sequential(lin)
    x = torch.randn(2, 3, dtype=D)
    seq(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"BasicLinear.weight: main_grad is on meta"):
        seq.backward_dw()
    assert seq.need_backward_dw()
    lin.weight.main_grad = torch.zeros(4, 3, dtype=D)
    seq.backward_dw()
    torch.testing.assert_close(lin.weight.main_grad, torch.ones(2, 4, dtype=D).t() @ x)


# --- a fused op's results are checked against its window -----------------------------------------

class DropsSecondGrads(ChainFused):
    def fuser_backward(self, *args, **kwargs):
        dx, pgrads, egrads = super().fuser_backward(*args, **kwargs)
        return dx, pgrads[:1], egrads


class EmptyGradsForLinear(ChainFused):
    def fuser_backward(self, *args, **kwargs):
        dx, pgrads, egrads = super().fuser_backward(*args, **kwargs)
        return dx, [[], *pgrads[1:]], egrads


class TooManyWeightGrads(ChainFused):
    def fuser_backward(self, *args, **kwargs):
        dx, pgrads, egrads = super().fuser_backward(*args, **kwargs)
        return dx, [[*pgrads[0], None], *pgrads[1:]], egrads


class WrongInputGradShape(ChainFused):
    def fuser_backward(self, *args, **kwargs):
        dx, pgrads, egrads = super().fuser_backward(*args, **kwargs)
        return dx[:, :1], pgrads, egrads


class DropsExtraInputGrad(ChainFused):
    def fuser_backward(self, *args, **kwargs):
        dx, pgrads, egrads = super().fuser_backward(*args, **kwargs)
        return dx, pgrads, [*egrads[:-1], ()]


class DropsExtraOutput(ChainFused):
    def fuser_forward(self, *args, **kwargs):
        y, outs = super().fuser_forward(*args, **kwargs)
        return y, [(), ()]


class TooFewExtraOutputLists(ChainFused):
    def fuser_forward(self, *args, **kwargs):
        y, outs = super().fuser_forward(*args, **kwargs)
        return y, outs[:1]


class ReturnsTuple(ChainFused):
    def fuser_forward(self, *args, **kwargs):
        y, outs = super().fuser_forward(*args, **kwargs)
        return (y,), outs


LINEAR_BIAS = (lambda: [ops.BasicLinear(4, 3, dtype=D), ops.Bias(3, dtype=D)],
               lambda: (torch.randn(5, 4, dtype=D, requires_grad=True),))
LINEAR_MEO = (lambda: [ops.BasicLinear(4, 3, dtype=D), ops.MakeExtraOutput()],
              lambda: (torch.randn(5, 4, dtype=D, requires_grad=True),))
GELU_ADD = (lambda: [ops.GELU(), ops.AddExtraInput()],
            lambda: (torch.randn(5, 4, dtype=D, requires_grad=True),
                     torch.randn(5, 4, dtype=D, requires_grad=True)))


@pytest.mark.parametrize("fused_cls, window, phase, match", [
    (DropsSecondGrads, LINEAR_BIAS, "backward",
     r"DropsSecondGrads \(fused op over basic ops \[0, 1\]\): fuser_backward returned 1 "
     r"parameter-gradient lists, expected 2 \(one per basic op, in forward order\)"),
    (EmptyGradsForLinear, LINEAR_BIAS, "backward",
     r"EmptyGradsForLinear \(fused op over basic ops \[0, 1\]\): fuser_backward returned 0 "
     r"parameter gradient\(s\) for basic op 0, expected 1"),
    (TooManyWeightGrads, LINEAR_BIAS, "joint",
     r"TooManyWeightGrads .*returned 2 parameter gradient\(s\) for basic op 0, expected 1"),
    (WrongInputGradShape, LINEAR_BIAS, "backward",
     r"WrongInputGradShape \(fused op over basic ops \[0, 1\]\): fuser_backward returned a grad "
     r"input of shape \(5, 1\), expected the input's shape \(5, 4\)"),
    (DropsExtraInputGrad, GELU_ADD, "joint",
     r"DropsExtraInputGrad .*returned 0 extra-input gradient\(s\) for basic op 1, expected 1"),
    (DropsExtraOutput, LINEAR_MEO, "forward",
     r"DropsExtraOutput \(fused op over basic ops \[0, 1\]\): fuser_forward returned 0 extra "
     r"output\(s\) for MakeExtraOutput \(basic op 1\), which makes 1"),
    (TooFewExtraOutputLists, LINEAR_MEO, "joint",
     r"TooFewExtraOutputLists .*fuser_forward returned 1 extra-output lists, expected 2"),
    (ReturnsTuple, LINEAR_BIAS, "forward",
     r"ReturnsTuple .*fuser_forward returned a tuple as output, not a Tensor"),
])
def test_fused_op_results_are_checked(fused_cls, window, phase, match) -> None:
    build, args = window
    ops_list = build()
    pattern = tuple(type(op) for op in ops_list)
    te_seq.register_fusion(name="user_checked", phase=phase, pattern=pattern)(fused_cls)
    seq = te_seq.Sequential(*ops_list)
    with pytest.raises(RuntimeError, match=match):
        outs = seq(*args())
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


def test_unneeded_grads_may_be_empty() -> None:
    """An empty list stays legal where no gradient of that kind is needed (frozen weights)."""
    te_seq.register_fusion(name="user_lenient", phase="joint",
                           pattern=(ops.BasicLinear, ops.Bias))(EmptyGradsForLinear)
    lin, bias = ops.BasicLinear(4, 3, dtype=D), ops.Bias(3, dtype=D)
    lin.weight.requires_grad_(False)
    seq = te_seq.Sequential(lin, bias)
    x = torch.randn(5, 4, dtype=D, requires_grad=True)
    seq(x).sum().backward()
    assert [s.name for s in seq.fusion_plan().forward] == ["EmptyGradsForLinear"]
    torch.testing.assert_close(x.grad, torch.ones(5, 3, dtype=D) @ lin.weight)
