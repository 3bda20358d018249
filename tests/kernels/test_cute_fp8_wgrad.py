"""GPU: the cute FP8 wgrad kernel ``cute.scaled_grouped_wgrad`` on `quantize_token_major`
operands against the fp32 emulation of the same maths (`scaled_grouped_wgrad_emulated`): an empty
expert, a one-row expert, unaligned token counts (spans padded to WGRAD_PAD), N=256, K=192, a new
bf16 output, fp32 accumulation into an existing buffer and a bf16 output accumulated into.

Bound: both multiply the same FP8 values with the same scales; only the summation order differs
(Hopper FP8 WGMMA accumulates below fp32 precision), so norm-relative 4e-3 (tests/test_fp8_cute_gpu
.py's kernel bound); an empty expert's gradient is exactly zero (or the accumulated buffer)."""

from __future__ import annotations

import torch
from cute_marks import gpu, needs_cute
from cute_marks import offsets as _offs
from cute_marks import rel_err as _rel_err

from te_seq.kernels import cute, fp8_wgrad
from te_seq.kernels import fp8_reference as ref

KERNEL_TOL = 4e-3

pytestmark = [gpu, needs_cute]


def _operands(sizes, n=256, k=192, seed=0):
    torch.manual_seed(seed)
    rows = sum(sizes) + 5  # rows past the last expert: in no group
    dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 3
    offs, rule = _offs(sizes), ref.ScaleRule("E4M3")
    a = fp8_wgrad.quantize_token_major(dy, offs, rule)
    b = fp8_wgrad.quantize_token_major(x, offs, rule)
    return (a.data, b.data, a.scale_inv, b.scale_inv, a.offs)


SIZES = [37, 0, 1, 300, 130]  # E=5: an empty and a one-row expert, unaligned counts


def test_wgrad_new_bf16_output():
    args = _operands(SIZES)
    got = cute.scaled_grouped_wgrad(*args)
    want = fp8_wgrad.scaled_grouped_wgrad_emulated(*args, out=torch.zeros(
        5, 256, 192, device="cuda"))
    assert got.dtype == torch.bfloat16 and got.shape == (5, 256, 192)
    assert (got[1] == 0).all()
    assert _rel_err(got, want) < KERNEL_TOL


def test_wgrad_empty_expert_ignores_its_scales():
    """The epilogue never applies an empty expert's scales (they may hold anything): NaN and
    inf there still give +0.0 bits (a new output) and leave an accumulated buffer as it was;
    the other experts are untouched."""
    a, b, sa, sb, offs = _operands(SIZES, seed=2)
    want = cute.scaled_grouped_wgrad(a, b, sa, sb, offs)
    sa[1], sb[1] = float("nan"), float("inf")
    got = cute.scaled_grouped_wgrad(a, b, sa, sb, offs)
    assert (got[1].view(torch.int16) == 0).all()
    assert torch.equal(got[[0, 2, 3, 4]], want[[0, 2, 3, 4]])
    start = torch.randn(5, 256, 192, device="cuda")
    out = start.clone()
    cute.scaled_grouped_wgrad(a, b, sa, sb, offs, out=out, accumulate=True)
    assert torch.equal(out[1], start[1])
    assert not out.isnan().any()


def test_wgrad_fp32_accumulate_and_bf16_accumulate():
    args = _operands(SIZES, seed=1)
    want = fp8_wgrad.scaled_grouped_wgrad_emulated(*args, out=torch.zeros(
        5, 256, 192, device="cuda"))
    start = torch.randn(5, 256, 192, device="cuda")
    out = start.clone()
    cute.scaled_grouped_wgrad(*args, out=out, accumulate=True)
    assert torch.equal(out[1], start[1])  # the empty expert adds nothing
    assert _rel_err(out - start, want) < KERNEL_TOL
    out16 = start.to(torch.bfloat16)
    cute.scaled_grouped_wgrad(*args, out=out16, accumulate=True)
    assert _rel_err(out16, start + want) < KERNEL_TOL
    out32 = torch.full_like(start, float("nan"))
    cute.scaled_grouped_wgrad(*args, out=out32)  # accumulate=False overwrites
    assert _rel_err(out32, want) < KERNEL_TOL
