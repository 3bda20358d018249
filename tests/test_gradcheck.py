"""torch.autograd.gradcheck in float64: every op of the spec table, and the fused GroupedMLP.

The analytic gradients come from te_seq's hand-written backwards; gradcheck compares them with
finite differences of te_seq's own forward, so this catches a backward that disagrees with its
forward even where the spec's reference might share a misconception. Parameters are gradcheck
inputs too: the Parameter objects themselves are passed (gradcheck perturbs them in place), and
the function ignores those arguments because the module reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from op_specs import SPECS, OpSpec, build_case, floating, skip_if_missing

import te_seq
from te_seq import ops

ROWS = 5


def _gradcheck_module(seq: te_seq.Sequential, x: torch.Tensor, extras: Sequence,
                      params: Sequence[torch.nn.Parameter], fast: bool = False) -> None:
    x.requires_grad_(True)
    float_pos = [i for i, e in enumerate(extras) if floating(e)]
    for i in float_pos:
        extras[i].requires_grad_(True)
    for p in params:
        p.requires_grad_(True)

    def run(x_in, *tensors):
        call_extras = list(extras)
        for i, t in zip(float_pos, tensors):
            call_extras[i] = t
        return seq(x_in, *call_extras)

    inputs = (x, *[extras[i] for i in float_pos], *params)
    # fast_mode checks random projections of the Jacobian: enough for the MLP's ~150 inputs.
    assert torch.autograd.gradcheck(run, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=fast)


@pytest.mark.parametrize("spec", [pytest.param(s, id=s.name) for s in SPECS])
def test_op_gradcheck(spec: OpSpec) -> None:
    if spec.name.endswith("in_place"):
        pytest.skip("in-place variants write into their inputs; the out-of-place spec "
                    "covers the maths")
    x = torch.randn(ROWS, spec.in_width, dtype=torch.float64)
    case = build_case(spec, torch.float64, x)
    _gradcheck_module(case.seq, case.x, list(case.extras), list(case.params.values()))


# --- the fused GroupedMLP ---------------------------------------------------------------------

G, HID, FFN = 3, 4, 3


def _mlp(act_name: str, bias: bool, scale_bias: bool, interleave: int | None):
    skip_if_missing(act_name)
    kwargs = dict(glu_interleave_size=interleave) if interleave else {}
    act = getattr(ops, act_name)(**kwargs)
    width = 2 * FFN if act.gated else FFN
    fc1 = ops.GroupedLinear(G, HID, width, bias=bias, scale_bias=scale_bias, dtype=torch.float64)
    fc2 = ops.GroupedLinear(G, FFN, HID, bias=bias, scale_bias=scale_bias, dtype=torch.float64)
    with torch.no_grad():
        for p in [*fc1.parameters(), *fc2.parameters()]:
            p.copy_(torch.randn_like(p) * 0.5)
    return te_seq.Sequential(fc1, act, fc2), act


MLP_CASES = [
    ("SwiGLU", False, False, None),
    ("SwiGLU", True, False, None),
    ("ScaledSwiGLU", False, False, None),
    ("ScaledSwiGLU", True, True, None),
    ("ScaledSwiGLU", False, False, 1),
    ("GEGLU", True, False, None),
    ("ReGLU", False, False, None),
    ("GELU", True, True, None),
    ("SiLU", False, False, None),
]


@pytest.mark.parametrize("act_name,bias,scale_bias,interleave", MLP_CASES)
@pytest.mark.parametrize("sizes", [(2, 0, 3), (0, 5, 0)], ids=["one_empty", "two_empty"])
def test_grouped_mlp_gradcheck(act_name, bias, scale_bias, interleave, sizes) -> None:
    seq, act = _mlp(act_name, bias, scale_bias, interleave)
    rows = sum(sizes)
    splits = torch.tensor(sizes)
    scales = [torch.rand(rows, dtype=torch.float64) + 0.5 for _ in range(2)]
    fc_extra = lambda s: (splits, s) if (bias and scale_bias) else (splits,)  # noqa: E731
    act_extra = (torch.rand(rows, dtype=torch.float64) + 0.5,) if act.num_extra_inputs else ()
    extras = [*fc_extra(scales[0]), *act_extra, *fc_extra(scales[1])]
    x = torch.randn(rows, HID, dtype=torch.float64)
    _gradcheck_module(seq, x, extras, list(seq.parameters()), fast=True)
    assert [s.name for s in seq.fusion_plan().forward] == ["GroupedMLP"], seq.fusion_plan()
    assert [s.name for s in seq.fusion_plan().backward] == ["GroupedMLP"], seq.fusion_plan()
