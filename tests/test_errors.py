"""Every bad input of the public API is an exception whose message names the op and shows
the values.

Input errors run twice: with fusions enabled (a fused op must check its inner ops' inputs as the
unfused chain does) and under `te_seq.fusions_disabled()`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from op_specs import skip_if_missing

import te_seq
from te_seq import ops

# Shape legend: T rows, H hidden, F ffn, G groups.
T, H, F, G = 7, 8, 6, 3
f64 = torch.float64


def x_of(width: int = H, dtype: torch.dtype = f64, rows: int = T) -> torch.Tensor:
    return torch.randn(rows, width, dtype=dtype)


def splits(*sizes) -> torch.Tensor:
    return torch.tensor(sizes)


def gl(g: int = G, k: int = H, n: int = H, **kw) -> torch.nn.Module:
    return ops.GroupedLinear(g, k, n, dtype=f64, **kw)


def mlp(act=None, **kw) -> list[torch.nn.Module]:
    return [gl(n=2 * F, **kw), act or ops.SwiGLU(), gl(k=F, **kw)]


@dataclass
class Bad:
    """A Sequential (built lazily), the call's arguments, and the exception it must raise."""

    id: str
    needs: tuple[str, ...]  # ops that must exist (else skip)
    build: Callable[[], list[torch.nn.Module]]
    args: Callable[[], tuple]
    exc: type[Exception]
    match: str


def _same_twice(split_sizes) -> tuple:
    """x and the same split-sizes object for both GroupedLinears (so the window can fuse)."""
    return x_of(), split_sizes, split_sizes


S = splits(3, 0, 4)  # one shared split tensor: lets the GroupedMLP windows fuse
BAD_INPUTS = [
    # --- wrong feature sizes ---------------------------------------------------------------
    Bad("basic_linear_in_features", (), lambda: [ops.BasicLinear(H, F, dtype=f64)],
        lambda: (x_of(5),), ValueError,
        r"BasicLinear: input has last dimension 5 \(shape \(7, 5\)\), but in_features=8"),
    Bad("linear_in_features", (), lambda: [ops.Linear(H, F, dtype=f64)], lambda: (x_of(5),),
        ValueError, r"BasicLinear: input has last dimension 5 .*in_features=8"),
    Bad("bias_size", (), lambda: [ops.Bias(H, dtype=f64)], lambda: (x_of(5),), ValueError,
        r"Bias: input has last dimension 5 .*size=8"),
    Bad("bias_after_linear", (), lambda: [ops.BasicLinear(H, F, dtype=f64), ops.Bias(5, dtype=f64)],
        lambda: (x_of(),), ValueError, r"Bias: input has last dimension 6 .*size=5"),
    Bad("grouped_in_features", (), lambda: [gl()], lambda: (x_of(5), S), ValueError,
        r"GroupedLinear: input has last dimension 5 .*in_features=8"),
    Bad("grouped_mlp_in_features", (), mlp, lambda: (x_of(5), S, S), ValueError,
        r"GroupedLinear: input has last dimension 5 .*in_features=8"),
    Bad("layer_norm_size", ("LayerNorm",), lambda: [ops.LayerNorm(H, dtype=f64)],
        lambda: (x_of(5),), ValueError,
        r"LayerNorm: input has last dimension 5 .*normalized_shape=8"),
    Bad("rms_norm_size", ("RMSNorm",), lambda: [ops.RMSNorm(H, dtype=f64)],
        lambda: (x_of(5),), ValueError,
        r"RMSNorm: input has last dimension 5 .*normalized_shape=8"),
    Bad("scalar_input", (), lambda: [ops.BasicLinear(H, F, dtype=f64)],
        lambda: (torch.tensor(1.0, dtype=f64),), ValueError, r"BasicLinear: input is a scalar"),
    Bad("reshape_numel", ("Reshape",), lambda: [ops.Reshape((5, 5))], lambda: (x_of(),),
        ValueError, r"Reshape: cannot reshape input of shape \(7, 8\) \(56 elements\) to \(5, 5\)"),
    Bad("add_extra_input_shape", ("AddExtraInput",), lambda: [ops.AddExtraInput()],
        lambda: (x_of(), x_of(4)), ValueError,
        r"AddExtraInput: extra of shape \(7, 4\) does not broadcast to the input's shape \(7, 8\)"),
    # --- dtype and device ------------------------------------------------------------------
    Bad("basic_linear_dtype", (), lambda: [ops.BasicLinear(H, F)], lambda: (x_of(),), ValueError,
        r"BasicLinear: input dtype torch.float64 does not match the op's parameter dtype "
        r"torch.float32"),
    Bad("grouped_dtype", (), lambda: [ops.GroupedLinear(G, H, H)], lambda: (x_of(), S),
        ValueError, r"GroupedLinear: input dtype torch.float64 does not match .* torch.float32"),
    Bad("grouped_mlp_dtype", (), lambda: [ops.GroupedLinear(G, H, 2 * F), ops.SwiGLU(),
                                          ops.GroupedLinear(G, F, H)],
        lambda: (x_of(), S, S), ValueError, r"GroupedLinear: input dtype torch.float64"),
    Bad("layer_norm_dtype", ("LayerNorm",), lambda: [ops.LayerNorm(H)], lambda: (x_of(),),
        ValueError, r"LayerNorm: input dtype torch.float64 does not match .* torch.float32"),
    Bad("basic_linear_device", (), lambda: [ops.BasicLinear(H, F, dtype=f64)],
        lambda: (torch.empty(T, H, dtype=f64, device="meta"),), ValueError,
        r"BasicLinear: input is on meta but the op's parameters are on cpu"),
    Bad("activation_integer_input", (), lambda: [ops.GELU()],
        lambda: (torch.ones(T, H, dtype=torch.int64),), ValueError,
        r"GELU: input must be floating point, got torch.int64"),
    # --- extra-input count -----------------------------------------------------------------
    Bad("too_few_extra_inputs", (), lambda: [gl()], lambda: (x_of(),), ValueError,
        r"GroupedLinear \(basic op 0\) expects 1 extra input\(s\) \(split_sizes\), but only 0 "
        r"of the 0"),
    Bad("too_few_extra_inputs_for_last_op", (), lambda: mlp(ops.ScaledSwiGLU()),
        lambda: (x_of(), S, torch.rand(T, dtype=f64)), ValueError,
        r"GroupedLinear \(basic op 2\) expects 1 extra input\(s\) \(split_sizes\), but only 0 "
        r"of the 2"),
    Bad("too_few_extra_inputs_scales", (), lambda: mlp(ops.ScaledSwiGLU()), lambda: (x_of(), S),
        ValueError, r"ScaledSwiGLU \(basic op 1\) expects 1 extra input\(s\) \(scales\)"),
    Bad("too_many_extra_inputs", (), lambda: [gl()], lambda: (x_of(), S, S), ValueError,
        r"Sequential got 2 extra inputs but its ops take 1 \(GroupedLinear\[0\]: 1\)"),
    Bad("extra_inputs_but_no_taker", (), lambda: [ops.GELU()], lambda: (x_of(), S), ValueError,
        r"Sequential got 1 extra inputs but its ops take 0 \(no op takes extra inputs\)"),
    # --- split sizes -----------------------------------------------------------------------
    Bad("splits_wrong_length", (), lambda: [gl()], lambda: (x_of(), splits(3, 4)), ValueError,
        r"GroupedLinear: split_sizes has shape \(2,\) \(2 entries\), expected a 1-D tensor with "
        r"num_groups=3 entries"),
    Bad("splits_2d", (), lambda: [gl()], lambda: (x_of(), splits([3, 0, 4])), ValueError,
        r"GroupedLinear: split_sizes has shape \(1, 3\)"),
    Bad("splits_negative", (), lambda: [gl()], lambda: (x_of(), splits(8, -1, 0)), ValueError,
        r"GroupedLinear: split_sizes has negative entries \[-1\]: \[8, -1, 0\]"),
    Bad("splits_wrong_sum", (), lambda: [gl()], lambda: (x_of(), splits(3, 0, 3)), ValueError,
        r"GroupedLinear: split_sizes sum to 6 but the input has 7 rows "
        r"\(split_sizes=\[3, 0, 3\]\)"),
    Bad("splits_float", (), lambda: [gl()], lambda: (x_of(), torch.tensor([3.0, 0.0, 4.0])),
        ValueError, r"GroupedLinear: split_sizes must be an integer tensor, got torch.float32"),
    Bad("splits_not_a_tensor", (), lambda: [gl()], lambda: (x_of(), [3, 0, 4]), TypeError,
        r"GroupedLinear: split_sizes must be a torch.Tensor, got list"),
    Bad("grouped_mlp_splits_wrong_sum", (), mlp, lambda: _same_twice(splits(3, 0, 3)), ValueError,
        r"GroupedLinear: split_sizes sum to 6 but the input has 7"),
    Bad("grouped_mlp_fc2_splits_wrong_sum", (), mlp, lambda: (x_of(), S, splits(3, 0, 5)),
        ValueError, r"GroupedLinear: split_sizes sum to 8 but the input has 7 rows"),
    Bad("grouped_mlp_splits_not_a_tensor", (), mlp, lambda: _same_twice([3, 0, 4]),
        TypeError, r"GroupedLinear: split_sizes must be a torch.Tensor, got list"),
    # --- scales ----------------------------------------------------------------------------
    Bad("probs_wrong_length", (), lambda: [ops.ScaledSwiGLU()],
        lambda: (x_of(2 * F), torch.rand(5, dtype=f64)), ValueError,
        r"ScaledSwiGLU: scales has 5 entries \(shape \(5,\)\), expected one per row of the "
        r"input: 7"),
    Bad("grouped_mlp_probs_wrong_length", (), lambda: mlp(ops.ScaledSwiGLU()),
        lambda: (x_of(), S, torch.rand(5, dtype=f64), S), ValueError,
        r"ScaledSwiGLU: scales has 5 entries \(shape \(5,\)\), expected one per row of the "
        r"input: 7"),
    Bad("probs_not_floating", (), lambda: [ops.ScaledSwiGLU()],
        lambda: (x_of(2 * F), torch.ones(T, dtype=torch.int64)), ValueError,
        r"ScaledSwiGLU: scales must be floating point, got torch.int64"),
    Bad("scale_bias_scales_wrong_length", (), lambda: [gl(scale_bias=True)],
        lambda: (x_of(), S, torch.rand(4, dtype=f64)), ValueError,
        r"GroupedLinear: scales has 4 entries \(shape \(4,\)\), expected one per row of the "
        r"input: 7"),
    # --- GLU widths ------------------------------------------------------------------------
    Bad("glu_scalar_input", (), lambda: [ops.ScaledSwiGLU()],
        lambda: (torch.tensor(1.0, dtype=f64), torch.ones(1, dtype=f64)), ValueError,
        r"ScaledSwiGLU: input is a scalar; expected \[..., 2F\] \(gate and up\)"),
    Bad("glu_odd_width", (), lambda: [ops.SwiGLU()], lambda: (x_of(7),), ValueError,
        r"SwiGLU: input's last dimension 7 must be a multiple of 2 to hold gate and up"),
    Bad("glu_interleave_width", (), lambda: [ops.GEGLU(glu_interleave_size=4)],
        lambda: (x_of(12),), ValueError,
        r"GEGLU: input's last dimension 12 must be a multiple of 8 \(glu_interleave_size=4\)"),
    Bad("glu_odd_width_after_linear_bias", (),
        lambda: [ops.BasicLinear(H, 7, dtype=f64), ops.Bias(7, dtype=f64), ops.SwiGLU()],
        lambda: (x_of(),), ValueError, r"SwiGLU: input's last dimension 7 must be a multiple of 2"),
]


@pytest.mark.parametrize("fusion", ["fused", "unfused"])
@pytest.mark.parametrize("bad", [pytest.param(b, id=b.id) for b in BAD_INPUTS])
def test_bad_input(bad: Bad, fusion: str) -> None:
    for name in bad.needs:
        skip_if_missing(name)
    seq = te_seq.Sequential(*bad.build())
    guard = te_seq.fusions_disabled() if fusion == "unfused" else contextlib.nullcontext()
    with guard, pytest.raises(bad.exc, match=bad.match):
        seq(*bad.args())


BAD_CONSTRUCTORS = [
    # --- sizes: positive ints, raised before anything is allocated --------------------------
    ("BasicLinear", lambda: ops.BasicLinear(0, 4), ValueError,
     r"BasicLinear: in_features must be a positive int, got 0"),
    ("BasicLinear", lambda: ops.BasicLinear(4, 2.5), TypeError,
     r"BasicLinear: out_features must be a positive int, got 2.5"),
    ("BasicLinear", lambda: ops.BasicLinear(True, 4), TypeError,
     r"BasicLinear: in_features must be a positive int, got True"),
    ("Linear", lambda: ops.Linear(4, -2), ValueError,
     r"Linear: out_features must be a positive int, got -2"),
    ("Linear", lambda: ops.Linear("4", 2), TypeError,
     r"Linear: in_features must be a positive int, got '4'"),
    ("Bias", lambda: ops.Bias(0), ValueError, r"Bias: size must be a positive int, got 0"),
    ("Bias", lambda: ops.Bias(None), TypeError, r"Bias: size must be a positive int, got None"),
    ("GroupedLinear", lambda: ops.GroupedLinear(0, 8, 8), ValueError,
     r"GroupedLinear: num_groups must be a positive int, got 0"),
    ("GroupedLinear", lambda: ops.GroupedLinear(2.5, 4, 4), TypeError,
     r"GroupedLinear: num_groups must be a positive int, got 2.5"),
    ("GroupedLinear", lambda: ops.GroupedLinear(2, 4, torch.tensor(4)), TypeError,
     r"GroupedLinear: out_features must be a positive int, got tensor\(4\)"),
    ("GroupedLinear", lambda: ops.GroupedLinear(3, 8, 8, bias=False, single_grouped_bias=True),
     ValueError, r"GroupedLinear: single_grouped_bias=True needs bias=True"),
    ("LayerNorm", lambda: ops.LayerNorm(0), ValueError,
     r"LayerNorm: normalized_shape must be positive, got 0"),
    ("LayerNorm", lambda: ops.LayerNorm(8.0), TypeError,
     r"LayerNorm: normalized_shape must be an int or a non-empty tuple of ints, got 8.0"),
    ("RMSNorm", lambda: ops.RMSNorm([8, 0]), ValueError,
     r"RMSNorm: normalized_shape must be positive, got \[8, 0\]"),
    ("SwiGLU", lambda: ops.SwiGLU(glu_interleave_size=0), ValueError,
     r"SwiGLU: glu_interleave_size must be a positive int, got 0"),
    ("ScaledSwiGLU", lambda: ops.ScaledSwiGLU(glu_interleave_size=-2), ValueError,
     r"ScaledSwiGLU: glu_interleave_size must be a positive int, got -2"),
    ("GEGLU", lambda: ops.GEGLU(glu_interleave_size=1.5), TypeError,
     r"GEGLU: glu_interleave_size must be a positive int, got 1.5"),
    # --- flags: bools, not truthy values -----------------------------------------------------
    ("BasicLinear", lambda: ops.BasicLinear(4, 4, delay_wgrad_compute="yes"), TypeError,
     r"BasicLinear: delay_wgrad_compute must be a bool, got 'yes'"),
    ("GroupedLinear", lambda: ops.GroupedLinear(2, 4, 4, bias=1), TypeError,
     r"GroupedLinear: bias must be a bool, got 1"),
    ("GroupedLinear", lambda: ops.GroupedLinear(2, 4, 4, accumulate_into_main_grad=None),
     TypeError, r"GroupedLinear: accumulate_into_main_grad must be a bool, got None"),
    ("GroupedLinear", lambda: ops.GroupedLinear(2, 4, 4, single_grouped_weight=0), TypeError,
     r"GroupedLinear: single_grouped_weight must be a bool, got 0"),
    ("GroupedLinear", lambda: ops.GroupedLinear(2, 4, 4, scale_bias="no"), TypeError,
     r"GroupedLinear: scale_bias must be a bool, got 'no'"),
    ("Linear", lambda: ops.Linear(4, 4, bias="False"), TypeError,
     r"Linear: bias must be a bool, got 'False'"),
    ("LayerNorm", lambda: ops.LayerNorm(8, zero_centered_gamma=1), TypeError,
     r"LayerNorm: zero_centered_gamma must be a bool, got 1"),
    ("AddExtraInput", lambda: ops.AddExtraInput(in_place="no"), TypeError,
     r"AddExtraInput: in_place must be a bool, got 'no'"),
    ("MakeExtraOutput", lambda: ops.MakeExtraOutput(in_place=None), TypeError,
     r"MakeExtraOutput: in_place must be a bool, got None"),
    # --- numbers -----------------------------------------------------------------------------
    ("GELU", lambda: ops.GELU(approximate="fast"), ValueError,
     r"GELU: approximate must be one of \['none', 'tanh'\], got 'fast'"),
    ("RMSNorm", lambda: ops.RMSNorm(8, eps=0.0), ValueError,
     r"RMSNorm: eps must be positive, got 0"),
    ("LayerNorm", lambda: ops.LayerNorm(8, eps="1e-5"), TypeError,
     r"LayerNorm: eps must be positive, got '1e-5'"),
    ("LayerNorm", lambda: ops.LayerNorm(8, eps=float("nan")), ValueError,
     r"LayerNorm: eps must be finite, got nan"),
    ("Dropout", lambda: ops.Dropout(1.5), ValueError,
     r"Dropout: p must be a number in \[0, 1\), got 1.5"),
    ("Dropout", lambda: ops.Dropout(-0.1), ValueError, r"Dropout: p must be .*got -0.1"),
    ("Dropout", lambda: ops.Dropout("0.1"), TypeError,
     r"Dropout: p must be a number in \[0, 1\), got '0.1'"),
    ("Reshape", lambda: ops.Reshape((-1, -1)), ValueError, re.escape("Reshape: shape (-1, -1)")),
    ("Reshape", lambda: ops.Reshape((2, True)), TypeError,
     r"Reshape: shape must be a sequence of ints, got \(2, True\)"),
    ("Reshape", lambda: ops.Reshape("2x3"), TypeError,
     r"Reshape: shape must be a sequence of ints, got '2x3'"),
    ("ConstantScale", lambda: ops.ConstantScale("a"), TypeError,
     r"ConstantScale: scale must be a real number, got 'a'"),
    ("ConstantScale", lambda: ops.ConstantScale(float("inf")), ValueError,
     r"ConstantScale: scale must be finite, got inf"),
    # --- dtype and device ---------------------------------------------------------------------
    ("BasicLinear", lambda: ops.BasicLinear(4, 4, dtype=torch.int64), ValueError,
     r"BasicLinear: dtype must be a floating-point dtype, got torch.int64"),
    ("GroupedLinear", lambda: ops.GroupedLinear(2, 4, 4, dtype="float32"), TypeError,
     r"GroupedLinear: dtype must be a torch.dtype or None, got str 'float32'"),
    ("Bias", lambda: ops.Bias(4, dtype=torch.bool), ValueError,
     r"Bias: dtype must be a floating-point dtype, got torch.bool"),
    ("LayerNorm", lambda: ops.LayerNorm(4, device="gpu"), ValueError,
     r"LayerNorm: device 'gpu' is not a torch device"),
    ("RMSNorm", lambda: ops.RMSNorm(4, device=1.0), TypeError,
     r"RMSNorm: device must be a torch.device, str, int or None, got float 1.0"),
    ("Linear", lambda: ops.Linear(4, 4, dtype=torch.int32), ValueError,
     r"Linear: dtype must be a floating-point dtype, got torch.int32"),
]


@pytest.mark.parametrize("op_name,make,exc,match", [
    pytest.param(*c, id=f"{c[0]}-{i}") for i, c in enumerate(BAD_CONSTRUCTORS)])
def test_bad_constructor(op_name: str, make, exc, match: str) -> None:
    skip_if_missing(op_name)
    with pytest.raises(exc, match=match):
        make()


def test_grouped_mlp_checks_like_the_unfused_chain() -> None:
    """Sanity: the fused window really fused (so the 'fused' error cases test the fused op)."""
    seq = te_seq.Sequential(*mlp())
    seq(x_of(), S, S)
    assert [s.name for s in seq.fusion_plan().forward] == ["GroupedMLP"]


@pytest.mark.parametrize("make, exc", [
    (lambda: ops.GroupedLinear(2.5, 4, 4), TypeError),
    (lambda: ops.GroupedLinear(2, 4, 4, dtype=torch.int8), ValueError),
    (lambda: ops.BasicLinear(4, 4, device="nowhere"), ValueError),
    (lambda: ops.LayerNorm(4, eps=-1.0), ValueError),
    (lambda: ops.Linear(4, 4, bias=None), TypeError),
])
def test_constructor_checks_come_before_any_allocation(make, exc, monkeypatch) -> None:
    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated before the arguments were checked")

    monkeypatch.setattr(torch, "empty", no_allocation)
    with pytest.raises(exc):
        make()
