"""Regular tests for what the differential fuzz campaign (tests/test_fuzz.py) found.

Each test is the smallest chain that showed the failure, checked against the unfused chain and
plain PyTorch in float64.

Found and fixed here:
- LinearBiasAdd with `in_place=True` and a residual wider than the input (fp64 beside fp32):
  `addmm_` into the residual raised a dtype RuntimeError where the unfused chain promotes.
- The residual given as the Sequential's own input (in place) and a Linear whose weights are
  reassigned or loaded with assign=True: see tests/test_in_place_aliasing.py and
  tests/test_weight_surgery.py (the fuzz finds both when their fixes are reverted).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from fuzz_chains import (
    DoubledGroupedLinear,
    DoubledResidual,
    DoubledSwiGLU,
    HalfBias,
    LeakyReLU,
    TwiceExtraAdd,
)

import te_seq
from te_seq import ops

D = torch.float64
FUSED = pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])


def _fusions(fused: bool):
    return contextlib.nullcontext() if fused else te_seq.fusions_disabled()


@FUSED
def test_linear_bias_add_in_place_with_a_wider_residual_promotes(fused: bool) -> None:
    lin = ops.Linear(4, 4, dtype=torch.float32)
    seq = te_seq.Sequential(lin, ops.AddExtraInput(in_place=True))
    x = torch.randn(3, 4)
    residual = torch.randn(3, 4, dtype=D)
    before = residual.clone()
    with _fusions(fused):
        y = seq(x, residual)
    assert y.dtype == D
    torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias).double() + before)


# --- known failures of another change (the matcher's subclass rule; frozen grouped MLP) --------

def _overriding_subclass_chains():
    """name -> a builder of (Sequential, extra inputs, plain-PyTorch reference or None) with a
    subclass overriding the maths a built-in fusion would replace, inside that window."""

    def linear_bias_activation():
        lin, bias = ops.BasicLinear(4, 4, dtype=D), HalfBias(4, dtype=D)
        with torch.no_grad():
            bias.bias.normal_()
        seq = te_seq.Sequential(lin, bias, ops.GELU())
        return seq, (), lambda x: F.gelu(F.linear(x, lin.weight) + bias.bias / 2,
                                         approximate="tanh")

    def linear_bias_add():
        lin = ops.Linear(4, 4, dtype=D)
        residual = torch.randn(3, 4, dtype=D)
        seq = te_seq.Sequential(lin, TwiceExtraAdd())
        return seq, (residual,), lambda x: F.linear(x, lin.weight, lin.bias) + 2 * residual

    def grouped_mlp():
        fc1 = DoubledGroupedLinear(2, 4, 8, bias=False, dtype=D)
        fc2 = ops.GroupedLinear(2, 4, 4, bias=False, dtype=D)
        splits = torch.tensor([1, 2])
        seq = te_seq.Sequential(fc1, ops.SwiGLU(), fc2)

        def reference(x):
            rows = x.split([1, 2])
            h = [2 * F.linear(r, getattr(fc1, f"weight{g}")) for g, r in enumerate(rows)]
            a = [F.silu(t[:, :4]) * t[:, 4:] for t in h]
            return torch.cat([F.linear(t, getattr(fc2, f"weight{g}")) for g, t in enumerate(a)])

        return seq, (splits, splits), reference

    def make_extra_output_linear_backward():
        lin = ops.BasicLinear(4, 4, dtype=D)
        seq = te_seq.Sequential(DoubledResidual(), lin)
        return seq, (), None  # compared with the unfused chain only (two outputs)

    def activation_bias_backward():
        bias = HalfBias(4, dtype=D)
        seq = te_seq.Sequential(bias, ops.ReLU())
        return seq, (), lambda x: torch.relu(x + bias.bias / 2)

    def activation_bias_backward_activation():
        bias = ops.Bias(4, dtype=D)
        seq = te_seq.Sequential(bias, LeakyReLU())
        return seq, (), lambda x: F.leaky_relu(x + bias.bias, 0.1)

    def grouped_mlp_activation():
        fc1 = ops.GroupedLinear(2, 4, 8, bias=False, dtype=D)
        fc2 = ops.GroupedLinear(2, 4, 4, bias=False, dtype=D)
        splits = torch.tensor([2, 1])
        seq = te_seq.Sequential(fc1, DoubledSwiGLU(), fc2)
        return seq, (splits, splits), None

    return {
        "linear_bias_activation-HalfBias": linear_bias_activation,
        "linear_bias_add-TwiceExtraAdd": linear_bias_add,
        "grouped_mlp-DoubledGroupedLinear": grouped_mlp,
        "make_extra_output_linear_backward-DoubledResidual": make_extra_output_linear_backward,
        "activation_bias_backward-HalfBias": activation_bias_backward,
        # Activations that override their maths are already declined by the fusions:
        "activation_bias_backward-LeakyReLU": activation_bias_backward_activation,
        "grouped_mlp-DoubledSwiGLU": grouped_mlp_activation,
    }


_SUBCLASS_CASES = [pytest.param(name, id=name) for name in _overriding_subclass_chains()]


def _run(seq, x, extras, fused: bool):
    x = x.detach().clone().requires_grad_()
    for p in seq.parameters():
        p.grad = None
    with _fusions(fused):
        out = seq(x, *extras)
    outs = out if isinstance(out, tuple) else (out,)
    torch.manual_seed(5)
    torch.autograd.backward(list(outs), [torch.randn_like(o) for o in outs])
    return [o.detach() for o in outs], [x.grad, *[p.grad for p in seq.parameters()]]


@pytest.mark.parametrize("name", _SUBCLASS_CASES)
def test_fused_window_keeps_an_overriding_subclass_maths(name: str) -> None:
    seq, extras, reference = _overriding_subclass_chains()[name]()
    x = torch.randn(3, 4, dtype=D)
    fused_outs, fused_grads = _run(seq, x, extras, fused=True)
    unfused_outs, unfused_grads = _run(seq, x, extras, fused=False)
    if reference is not None:
        torch.testing.assert_close(unfused_outs[0], reference(x))
    for a, b in zip(fused_outs + fused_grads, unfused_outs + unfused_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("frozen", ["fc1", "all"])
def test_grouped_mlp_with_frozen_fc1_and_an_input_without_grad(frozen: str) -> None:
    fc1 = ops.GroupedLinear(2, 4, 8, bias=False, dtype=D)
    fc2 = ops.GroupedLinear(2, 4, 4, bias=False, dtype=D)
    for p in (*fc1.parameters(), *(fc2.parameters() if frozen == "all" else ())):
        p.requires_grad_(False)
    seq = te_seq.Sequential(fc1, ops.ScaledSwiGLU(), fc2)
    splits = torch.tensor([2, 1])
    x = torch.randn(3, 4, dtype=D)  # needs no grad
    probs = torch.rand(3, dtype=D, requires_grad=True)
    results = []
    for fused in (True, False):
        probs.grad = None
        for p in fc2.parameters():
            p.grad = None
        with _fusions(fused):
            y = seq(x, splits, probs, splits)
        y.sum().backward()
        results.append([y.detach(), probs.grad, *[p.grad for p in fc2.parameters()]])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
