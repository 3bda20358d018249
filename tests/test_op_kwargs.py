"""Caller-provided buffers: `Sequential.forward(..., op_kwargs={index: {...}})` (run/op_kwargs.py).

BasicLinear accepts `out=` (y written into it and returned) and `grad_input_out=` (its backward
writes dX into it). Values must be exactly those of the call without buffers (float64, reference
backend); the buffer must be the returned storage; fusions over an op given buffers honour or
decline them.
"""

from __future__ import annotations

import pytest
import torch

import te_seq
from te_seq import ops

F64 = torch.float64


def _mlp(seed: int = 0) -> te_seq.Sequential:
    torch.manual_seed(seed)
    return te_seq.Sequential(
        ops.BasicLinear(6, 5, dtype=F64), ops.GELU(), ops.BasicLinear(5, 4, dtype=F64)
    )


def _run(seq, x, grad, **kwargs):
    """(output, dX, weight grads) of one forward + backward; leaves' grads reset first."""
    x = x.detach().requires_grad_()
    for p in seq.parameters():
        p.grad = None
    y = seq(x, **kwargs)
    y.backward(grad)
    return y, x.grad, [p.grad.clone() for p in seq.parameters()]


def test_out_buffers_equal_unbuffered_and_are_returned_storage():
    seq = _mlp()
    x = torch.randn(3, 2, 6, dtype=F64)
    grad = torch.randn(3, 2, 4, dtype=F64)
    y0, dx0, dw0 = _run(seq, x, grad)
    hidden = torch.full((3, 2, 5), float("nan"), dtype=F64)
    out = torch.full((3, 2, 4), float("nan"), dtype=F64)
    y, dx, dw = _run(seq, x, grad, op_kwargs={0: {"out": hidden}, 2: {"out": out}})
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(y, y0) and torch.equal(out, y0)
    assert torch.equal(hidden, x @ seq[0].weight.detach().t())
    assert torch.equal(dx, dx0)
    assert all(torch.equal(a, b) for a, b in zip(dw, dw0))


def test_grad_input_out_holds_dx_and_gradients_are_unchanged():
    seq = _mlp(1)
    x = torch.randn(7, 6, dtype=F64)
    grad = torch.randn(7, 4, dtype=F64)
    y0, dx0, dw0 = _run(seq, x, grad)
    dx_buf = torch.full((7, 6), float("nan"), dtype=F64)
    dh_buf = torch.full((7, 5), float("nan"), dtype=F64)  # dX of the second linear
    y, dx, dw = _run(seq, x, grad, op_kwargs={0: {"grad_input_out": dx_buf},
                                              2: {"grad_input_out": dh_buf}})
    assert torch.equal(y, y0) and torch.equal(dx, dx0) and torch.equal(dx_buf, dx0)
    assert all(torch.equal(a, b) for a, b in zip(dw, dw0))
    assert torch.equal(dh_buf, grad @ seq[2].weight.detach())  # dH = dY W2


def test_view_of_a_larger_buffer_is_written_in_place():
    seq = _mlp(2)
    x = torch.randn(4, 6, dtype=F64)
    arena = torch.zeros(4, 20, dtype=F64)
    out = arena[:, 3:7]  # a strided view: the product is copied in
    y = seq(x, op_kwargs={2: {"out": out}})
    assert torch.equal(arena[:, 3:7], seq(x)) and y.data_ptr() == out.data_ptr()
    assert torch.equal(arena[:, :3], torch.zeros(4, 3, dtype=F64))


def test_standalone_op_and_composite_take_buffers():
    torch.manual_seed(3)
    lin = ops.BasicLinear(6, 5, dtype=F64)
    x = torch.randn(2, 6, dtype=F64)
    out = torch.empty(2, 5, dtype=F64)
    y = lin(x, out=out)
    assert y.data_ptr() == out.data_ptr() and torch.equal(y, x @ lin.weight.detach().t())
    linear = ops.Linear(6, 5, dtype=F64)
    out2 = torch.empty(2, 5, dtype=F64)
    y2 = linear(x, op_kwargs={0: {"out": out2}})
    assert torch.equal(y2, linear(x)) and torch.equal(out2, x @ linear.weight.detach().t())


def test_none_means_not_given():
    seq = _mlp(4)
    x = torch.randn(3, 6, dtype=F64)
    assert torch.equal(seq(x, op_kwargs={0: {"out": None}}), seq(x))


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({0: {"out": torch.empty(3, 4, dtype=F64)}}, ValueError,
         ["BasicLinear", "(3, 5)", "(3, 4)"]),
        ({0: {"out": torch.empty(3, 5, dtype=torch.float32)}}, ValueError,
         ["BasicLinear", "torch.float64", "torch.float32"]),
        ({0: {"out": torch.empty(3, 5, dtype=F64, device="meta")}}, ValueError,
         ["BasicLinear", "device", "meta"]),
        ({0: {"out": torch.empty(3, 5, dtype=F64, requires_grad=True)}}, ValueError,
         ["BasicLinear", "requires_grad"]),
        ({0: {"out": [1.0]}}, TypeError, ["BasicLinear", "out=", "list"]),
        ({0: {"outt": torch.empty(3, 5, dtype=F64)}}, TypeError,
         ["BasicLinear (basic op 0)", "'outt'", "'out'", "'grad_input_out'"]),
        ({1: {"out": torch.empty(3, 5, dtype=F64)}}, TypeError,
         ["GELU (basic op 1)", "no keyword arguments"]),
        ({3: {"out": torch.empty(3, 5, dtype=F64)}}, IndexError, ["basic op 3", "3 basic op"]),
        ({-1: {}}, IndexError, ["basic op -1"]),
        ({"0": {}}, TypeError, ["'0'", "int"]),
        ({0: torch.empty(3, 5)}, TypeError, ["BasicLinear (basic op 0)", "Tensor"]),
        ([1], TypeError, ["op_kwargs", "list"]),
    ],
)
def test_errors_name_the_op_and_the_values(kwargs, error, words):
    seq = _mlp(5)
    x = torch.randn(3, 6, dtype=F64)
    with pytest.raises(error) as info:
        seq(x, op_kwargs=kwargs)
    for word in words:
        assert word in str(info.value)


def test_buffers_that_would_corrupt_the_maths_are_refused():
    torch.manual_seed(6)
    lin = ops.BasicLinear(5, 5, dtype=F64)
    x = torch.randn(4, 5, dtype=F64)
    with pytest.raises(ValueError, match="BasicLinear: out= shares memory with the op's input"):
        lin(x, out=x)
    with pytest.raises(ValueError, match="grad_input_out= was given but the op's input needs no"):
        lin(x, grad_input_out=torch.empty_like(x))
    xg = x.clone().requires_grad_()
    with pytest.raises(ValueError, match="grad_input_out= must have shape"):
        lin(xg, grad_input_out=torch.empty(4, 6, dtype=F64))


def test_a_fusion_that_does_not_honour_a_buffer_declines_and_the_plan_says_why():
    torch.manual_seed(7)
    seq = te_seq.Sequential(ops.BasicLinear(6, 5, dtype=F64), ops.Bias(5, dtype=F64), ops.GELU())
    x = torch.randn(3, 6, dtype=F64, requires_grad=True)
    y0 = seq(x)
    assert "LinearBiasActivation" in [s.name for s in seq.fusion_plan().forward]
    out = torch.empty(3, 5, dtype=F64)
    y = seq(x, op_kwargs={0: {"out": out}})
    plan = seq.fusion_plan()
    assert [s.name for s in plan.forward] == ["BasicLinear", "Bias", "GELU"]
    (miss,) = [m for m in plan.misses if m.fusion == "linear_bias_activation"]
    assert "basic op 0 got out" in miss.reason and "LinearBiasActivation" in miss.reason
    assert torch.equal(y, y0)
    assert torch.equal(out, x.detach() @ seq[0].weight.detach().t())
    seq(x)  # without buffers the plan fuses again (the names given are part of the plan key)
    assert "LinearBiasActivation" in [s.name for s in seq.fusion_plan().forward]


def test_a_fusion_that_honours_a_buffer_still_runs():
    torch.manual_seed(8)
    seq = te_seq.Sequential(ops.MakeExtraOutput(), ops.BasicLinear(6, 5, dtype=F64))
    x = torch.randn(3, 6, dtype=F64)
    g_y, g_r = torch.randn(3, 5, dtype=F64), torch.randn(3, 6, dtype=F64)

    def run(**kwargs):
        xl = x.clone().requires_grad_()
        y, r = seq(xl, **kwargs)
        torch.autograd.backward([y, r], [g_y, g_r])
        return y, xl.grad, seq.fusion_plan()

    y0, dx0, _ = run()
    out = torch.empty(3, 5, dtype=F64)
    y, dx, plan = run(op_kwargs={1: {"out": out}})  # out acts in the unfused forward only
    assert "MakeExtraOutputLinearBackward" in [s.name for s in plan.backward]
    assert torch.equal(y, y0) and torch.equal(dx, dx0) and y.data_ptr() == out.data_ptr()
    dx_buf = torch.empty(3, 6, dtype=F64)
    y, dx, plan = run(op_kwargs={1: {"grad_input_out": dx_buf}})
    assert "MakeExtraOutputLinearBackward" not in [s.name for s in plan.backward]
    assert any("grad_input_out" in m.reason for m in plan.misses)
    # unfused, dR + dY W is a sum after the GEMM, fused one addmm: they round differently
    torch.testing.assert_close(dx, dx0, rtol=1e-14, atol=1e-14)
    assert torch.equal(dx_buf, g_y @ seq[1].weight.detach())  # this op's dX only, not dR


def test_torch_compile_runs_a_call_with_buffers_eagerly():
    torch._dynamo.reset()
    seq = _mlp(9)
    x = torch.randn(3, 6, dtype=F64)

    def step(inp, buf):
        return seq(inp, op_kwargs={2: {"out": buf}}) * 2

    out = torch.empty(3, 4, dtype=F64)
    compiled = torch.compile(step, backend="aot_eager")
    y = compiled(x, out)
    assert torch.equal(y, seq(x) * 2) and torch.equal(out, seq(x))


@pytest.mark.gpu
def test_gpu_bf16_out_buffer_matches():
    torch.manual_seed(10)
    lin = ops.BasicLinear(64, 32, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(16, 32, device="cuda", dtype=torch.bfloat16)
    y0 = lin(x)
    (dx0,) = torch.autograd.grad(y0, x, grad)
    out, dx_buf = torch.empty_like(y0), torch.empty_like(x).detach()
    y = lin(x, out=out, grad_input_out=dx_buf)
    (dx,) = torch.autograd.grad(y, x, grad)
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(y, y0) and torch.equal(dx, dx0) and torch.equal(dx_buf, dx0)
