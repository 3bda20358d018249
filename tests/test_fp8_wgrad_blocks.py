"""The block-scaled FP8 wgrad operands along the tokens (`fp8_wgrad.quantize_token_major_blocks`:
`Float8BlockScaling`'s 1×128 blocks restarting at each group's first token, laid out
token-major) against `fp8_reference`'s block quantization of each group's rows, bitwise; and
the block-scaled wgrad's emulation (`block_scaled_grouped_wgrad_emulated`) against a float64
loop over the token blocks."""

from __future__ import annotations

import pytest
import torch

from te_seq.kernels import fp8_reference as ref
from te_seq.kernels import fp8_wgrad

BLOCK_T = ref.QuantBlock(1, 128)  # along the tokens, once a group's rows are transposed
PAD = fp8_wgrad.WGRAD_PAD


def _offs(sizes):
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def _bounds(sizes):
    ends = torch.tensor(sizes).cumsum(0).tolist()
    return [(e - s, e) for s, e in zip(sizes, ends)]


def _blocky(rows, cols, seed, dtype=torch.float32):
    """Random [rows, cols] whose 64-row bands differ in magnitude by up to 2^±8, so a block
    scale from the wrong rows (a group's, a neighbour block's) changes the data."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-8, 9, (-(-rows // 64), cols), generator=gen).float())
    t = torch.randn(rows, cols, generator=gen) * mag.repeat_interleave(64, 0)[:rows]
    return t.to(dtype)


def _check_layout(tm, sizes, rows, cols):
    """Spans padded to multiples of 128, P the bound, scales [P / 128, C], zeros elsewhere."""
    width = fp8_wgrad.padded_width(rows, len(sizes))
    assert tm.data.shape == (cols, width) and tm.data.is_contiguous()
    assert tm.scale_inv.shape == (width // PAD, cols) and tm.scale_inv.dtype == torch.float32
    spans = [-(-n // PAD) * PAD for n in sizes]
    assert tm.offs.dtype == torch.int32
    assert tm.offs.tolist() == torch.tensor(spans).cumsum(0).tolist()
    used = torch.zeros(width, dtype=torch.bool)
    start = 0
    for n, span in zip(sizes, spans):
        used[start:start + n] = True
        start += span
    assert (tm.data.view(torch.uint8)[:, ~used] == 0).all()


def _reference_blocks(t, sizes, rule):
    """Per group: fp8_reference's quantization of its rows transposed [C, n] in 1×128 blocks
    (blocks from the group's first token, the last partial): (data [C, n], scale_inv)."""
    return [ref.quantize(t[s:e].t(), BLOCK_T, rule) for s, e in _bounds(sizes)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "sizes", [[37, 0, 1, 300], [130], [0, 0, 5], [128, 256, 3], [255, 129, 0, 513]], ids=str
)
def test_block_token_major_is_the_per_group_block_quantization_bitwise(dtype, sizes):
    rows, cols = sum(sizes) + 9, 48  # 9 rows past offs[-1]: in no group
    t = _blocky(rows, cols, sum(sizes), dtype)
    rule = ref.ScaleRule("E4M3", margin=1, power_of_two=True)
    tm = fp8_wgrad.quantize_token_major_blocks(t, _offs(sizes), rule)
    assert isinstance(tm, fp8_wgrad.BlockTokenMajor) and tm.data.dtype == torch.float8_e4m3fn
    _check_layout(tm, sizes, rows, cols)
    want = ref.qdq_columns_per_group(t, _bounds(sizes), BLOCK_T, rule)
    assert torch.equal(tm.to_rows(_offs(sizes), rows), want)
    start = 0  # data and scales block by block, as the kernel reads them
    for q, n in zip(_reference_blocks(t, sizes, rule), sizes):
        if n:
            first = start // PAD
            assert torch.equal(tm.data[:, start:start + n].view(torch.uint8),
                               q.data.view(torch.uint8))
            assert torch.equal(tm.scale_inv[first:first + q.scale_inv.shape[1]], q.scale_inv.t())
        start += -(-n // PAD) * PAD
    assert (tm.scale_inv[start // PAD:] == 1).all()  # blocks past the last span


def test_block_token_major_differs_from_the_per_group_scales():
    """The blocks really are 128 tokens: a group of 300 tokens gets three scales per column."""
    sizes = [300]
    t = _blocky(300, 16, 5)
    tm = fp8_wgrad.quantize_token_major_blocks(t, _offs(sizes), ref.ScaleRule())
    per_group = fp8_wgrad.quantize_token_major(t, _offs(sizes), ref.ScaleRule())
    assert (tm.scale_inv[:3] != per_group.scale_inv[0]).any()
    assert not torch.equal(tm.to_rows(_offs(sizes), 300), per_group.to_rows(_offs(sizes), 300))


def test_block_token_major_non_finite_poisons_its_block_only():
    sizes = [20, 200, 7]
    t = _blocky(227, 32, 9).t().contiguous().t()  # column-major
    t[25, 3], t[170, 5] = float("inf"), float("nan")  # group 1: tokens 5 and 150 of its span
    rule = ref.ScaleRule()
    tm = fp8_wgrad.quantize_token_major_blocks(t, _offs(sizes), rule)
    want = ref.qdq_columns_per_group(t, _bounds(sizes), BLOCK_T, rule)
    got = tm.to_rows(_offs(sizes), 227)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert got[20:148, 3].isnan().all() and not got[148:220, 3].isnan().any()
    assert got[148:220, 5].isnan().all() and not got[20:148, 5].isnan().any()
    assert tm.scale_inv.isnan().sum() == 2  # blocks 1 (column 3) and 2 (column 5) of P


def _wgrad_case(sizes, n=24, k=40, seed=3):
    dy, x = _blocky(sum(sizes), n, seed), _blocky(sum(sizes), k, seed + 1)
    rule = ref.ScaleRule(power_of_two=True)
    a = fp8_wgrad.quantize_token_major_blocks(dy, _offs(sizes), rule)
    b = fp8_wgrad.quantize_token_major_blocks(x, _offs(sizes), rule)
    want = torch.zeros(len(sizes), n, k, dtype=torch.float64)
    spans = [-(-c // PAD) * PAD for c in sizes]
    start = 0
    for g, span in enumerate(spans):  # float64, block by block: Σ_tb sa ⊗ sb ∘ (a_tb b_tbᵀ)
        for tb in range(start // PAD, (start + span) // PAD):
            cols = slice(tb * PAD, (tb + 1) * PAD)
            part = a.data[:, cols].double() @ b.data[:, cols].double().t()
            want[g] += part * a.scale_inv[tb].double()[:, None] * b.scale_inv[tb].double()[None]
        start += span
    return a, b, want


def test_block_emulated_wgrad_matches_a_float64_block_loop():
    sizes = [37, 0, 1, 300]
    a, b, want = _wgrad_case(sizes)
    args = (a.data, b.data, a.scale_inv, b.scale_inv, a.offs)
    got = fp8_wgrad.block_scaled_grouped_wgrad_emulated(*args)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.allclose(got.double(), want, rtol=2**-8, atol=1e-6)
    assert (got[1] == 0).all()  # the empty group
    start = torch.randn(want.shape) * want.abs().mean().float()
    out = start.clone()
    atol = 1e-6 * want.abs().max().item()  # fp32 sums of terms up to 2^16 apart in size
    fp8_wgrad.block_scaled_grouped_wgrad_emulated(*args, out=out, accumulate=True)
    assert torch.allclose(out.double(), start.double() + want, rtol=1e-5, atol=atol)
    fp8_wgrad.block_scaled_grouped_wgrad_emulated(*args, out=out)
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=atol)
    # equals the product of the dequantized row layouts (the reference's definition)
    rows = torch.tensor(sizes).cumsum(0)
    dyr, xr = a.to_rows(_offs(sizes), sum(sizes)), b.to_rows(_offs(sizes), sum(sizes))
    for g, (s, e) in enumerate(zip([0, *rows[:-1].tolist()], rows.tolist())):
        assert torch.allclose(want[g], dyr[s:e].double().t() @ xr[s:e].double(), rtol=1e-12,
                              atol=1e-12)
