"""The FP8 wgrad's operands along the tokens, laid out token-major, and its emulated GEMM.

A grouped linear's weight gradient dW_g = dY_gᵀ X_g reduces over the tokens of group g, so
both operands are quantized along the tokens within each group (one scale per (group, column):
row-wise recipes; per tensor: the forward operand itself) and laid out with the tokens
contiguous, every group's span padded to a multiple of `WGRAD_PAD` tokens (zeros), which is
what a varlen-K FP8 GEMM reads (`te_seq.kernels.cute.scaled_grouped_wgrad`):

    out[g] = diag(a_scale[g]) · (a[:, span g] @ b[:, span g]ᵀ) · diag(b_scale[g])

with a = dY token-major [N, P], b = X token-major [K, P], fp32 accumulation. The numbers are
exactly `fp8_reference.qdq_columns_per_group`'s (row-wise blocks): only the layout differs.
Block scaling (`Float8BlockScaling`: 1×128 blocks along the tokens, restarting at each group's
first token) keeps the layout with one scale per (128-token block, column)
(`quantize_token_major_blocks`, a `BlockTokenMajor`; `cute.block_scaled_grouped_wgrad`):

    out[g] = Σ_{tb in span g} (a_scale[tb] ⊗ b_scale[tb]) ∘ (a[:, tb] @ b[:, tb]ᵀ)

Everything here runs without reading the group offsets on the host (P is a bound known from
the shapes), with a handful of large passes (`quantize_token_major`: a scatter of the rows into
their padded spans, a block amax and a cast, both compiled kernels on CUDA, a transpose of the
FP8 bytes). A single fused pass (quantize and transpose in one kernel, or in the epilogue that
produces the operand) is later work. `scaled_grouped_wgrad_emulated` and
`block_scaled_grouped_wgrad_emulated` are the kernels' maths in fp32 (the torch backend's FP8
wgrads and the tests' oracles).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq.kernels import compiled_maths, torch_backend
from te_seq.kernels.fp8_reference import (
    QuantBlock,
    QuantizedTensor,
    ScaleRule,
    abs_max,
    scaled_cast,
    scales_from_amax,
)

WGRAD_PAD = 128  # tokens: the cute FP8 kernel's k-tile; every group's span is a multiple


@dataclass
class TokenMajor:
    """t [T, C] quantized along its tokens within each group (one scale per (group, column)),
    laid out for a varlen-K FP8 GEMM: data [C, P] (tokens contiguous, row-major) in the
    rule's FP8 dtype, group g's tokens at columns [pstart_g, pstart_g + count_g) in their
    order, zeros elsewhere; offs int32 [G] the padded cumulative span ends (pstart_g =
    offs[g-1], each span = round_up(count_g, WGRAD_PAD), so every span starts on a multiple
    of WGRAD_PAD); scale_inv fp32 [G, C] the dequantization scales."""

    data: Tensor
    scale_inv: Tensor
    offs: Tensor

    def dequantize(self) -> Tensor:
        """The represented values, fp32 [C, P] (padding columns zero)."""
        groups = _column_groups(self.offs, self.data.shape[1])  # [P]
        return self.data.float() * self.scale_inv[groups].t()

    def to_rows(self, row_offs: Tensor, rows: int) -> Tensor:
        """The represented values back in the row layout, fp32 [rows, C] (`row_offs` the
        unpadded group ends this was made from; rows in no group are zero)."""
        dest, _ = _layout(row_offs, rows)
        values = torch.cat([self.dequantize(), self.data.new_zeros(self.data.shape[0], 1,
                                                                  dtype=torch.float32)], 1)
        return values[:, dest].t()


def padded_width(rows: int, groups: int) -> int:
    """P: the token-major width for `rows` tokens in `groups` groups, an upper bound of the
    padded spans known without reading the offsets: round_up(rows, 128) + groups · 128."""
    return _round_up(rows, WGRAD_PAD) + groups * WGRAD_PAD


def _round_up(v, multiple: int):
    return (v + multiple - 1) // multiple * multiple


def _layout(offs: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """(dest [rows] long: each row's token-major column, P for rows in no group; the padded
    span ends int32 [G]), computed on offs' device."""
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    spans = _round_up(counts, WGRAD_PAD)
    padded_ends = torch.cumsum(spans, 0)
    row = torch.arange(rows, device=offs.device)
    group = torch.searchsorted(ends, row, right=True)
    inside = group < ends.shape[0]
    g = group.clamp(max=ends.shape[0] - 1)
    dest = (padded_ends - spans)[g] + row - (ends - counts)[g]
    width = padded_width(rows, ends.shape[0])
    return torch.where(inside, dest, width), padded_ends.to(torch.int32)


def _column_groups(padded_offs: Tensor, width: int) -> Tensor:
    """The group of each token-major column [width] (clamped: padding past the last span
    reads the last group's scale, times zero data)."""
    cols = torch.arange(width, device=padded_offs.device, dtype=padded_offs.dtype)
    return torch.searchsorted(padded_offs, cols, right=True).clamp(max=padded_offs.shape[0] - 1)


def _scatter_token_major(data: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """(data [T, C] FP8 laid out token-major [C, P], zeros outside the spans; padded offs)."""
    rows, cols = data.shape
    dest, padded_offs = _layout(offs, rows)
    width = padded_width(rows, offs.shape[0])
    buffer = torch.zeros(width + 1, cols, dtype=torch.uint8, device=data.device)  # +1: junk row
    buffer.index_copy_(0, dest, data.reshape(rows, cols).view(torch.uint8))
    return buffer[:width].t().contiguous().view(data.dtype), padded_offs


def quantize_token_major(t: Tensor, offs: Tensor, rule: ScaleRule) -> TokenMajor:
    """t [T, C] (any float dtype, any strides) quantized along the tokens of each group, one
    scale per (group, column), as a `TokenMajor`. `offs` int32 [G] the cumulative row ends on
    t's device; rows past offs[-1] belong to no group (ignored). Bitwise the values of
    `qdq_columns_per_group(t, bounds, QuantBlock(1, None), rule)`, nan/inf policy included
    (padding tokens are zeros, except inside a span whose scale is nan: its gradient is nan).

    Each padded token reads its source row (or zero) by index, so the segmented amax is a plain
    max over 128-token blocks followed by a max over each span's blocks (a small tensor), and
    the cast writes the token-major layout directly: two passes over t. The cast (gather,
    scale, clamp, FP8, transpose) is one compiled kernel on CUDA (`compiled_maths`); the span
    layout and the block maxima run eagerly: TorchInductor (torch 2.11, CUDA) fails an internal
    assertion on them, and compiled calls cost ~0.25 ms of host time each (H100, 2026-11-24),
    more than the few eager kernels they would replace."""
    source, padded_offs, block_group, block_amax = _span_blocks(t, offs)
    scale, block_scale = _span_scales(block_amax, block_group, offs.shape[0], rule)
    data = compiled_maths.for_data(_cast_token_major, t)(t, source, block_scale, rule.fp8_max,
                                                          rule.dtype)
    return TokenMajor(data, torch.reciprocal(scale), padded_offs)


def _span_blocks(t: Tensor, offs: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The padded spans of t's groups: (source [P] long: the row each padded token reads, T for
    a padding token; padded span ends int32 [G]; the group of each 128-token block [P / 128],
    G past the last span; max |padded token| per block and column, fp32 [P / 128, C])."""
    rows, groups = t.shape[0], offs.shape[0]
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    spans = _round_up(counts, WGRAD_PAD)
    padded_ends = torch.cumsum(spans, 0)
    token = torch.arange(padded_width(rows, groups), device=t.device)
    group = torch.searchsorted(padded_ends, token, right=True)  # G past the last span
    g = group.clamp(max=groups - 1)
    within = token - (padded_ends - spans)[g]
    real = (group < groups) & (within < counts[g])
    source = torch.where(real, (ends - counts)[g] + within, rows)
    block_group = group[::WGRAD_PAD]
    return source, padded_ends.to(torch.int32), block_group, _block_amax(t, source)


def _span_scales(block_amax: Tensor, block_group: Tensor, groups: int,
                 rule: ScaleRule) -> tuple[Tensor, Tensor]:
    """(scale [G, C] from each span's blocks' maxima, the scale of each block [P / 128, C]: 1
    past the last span). A nan block maximum counts as inf: still non-finite, where a max
    over blocks might drop a nan."""
    cols = block_amax.shape[1]
    block_amax = torch.where(block_amax.isnan(), float("inf"), block_amax)
    amax = block_amax.new_zeros(groups + 1, cols).scatter_reduce_(
        0, block_group[:, None].expand(-1, cols), block_amax, "amax")
    scale = scales_from_amax(amax[:groups], rule)
    return scale, torch.cat([scale, scale.new_ones(1, cols)])[block_group]


def _padded_tokens(t: Tensor, source: Tensor) -> Tensor:
    """[P, C]: row source[p] of t, zero where source[p] == T (a padding token)."""
    rows = t.shape[0]
    if rows == 0:
        return t.new_zeros(source.shape[0], t.shape[1])
    picked = t[source.clamp(max=rows - 1)]
    return torch.where((source < rows)[:, None], picked, torch.zeros_like(picked))


def _block_amax(t: Tensor, source: Tensor) -> Tensor:
    """max |padded token| over each 128-token block, fp32 [P / 128, C] (nan propagates)."""
    blocks = _padded_tokens(t, source).view(-1, WGRAD_PAD, t.shape[1])
    return abs_max(blocks, 1)[:, 0]


def _cast_token_major(t: Tensor, source: Tensor, block_scale: Tensor, fp8_max: float,
                      dtype: torch.dtype) -> Tensor:
    """The padded tokens quantized with their block's scale [P / 128, C], token-major [C, P]."""
    blocks = _padded_tokens(t, source).view(-1, WGRAD_PAD, t.shape[1])
    data = scaled_cast(blocks, block_scale[:, None], fp8_max, dtype)
    return data.view(-1, t.shape[1]).t().contiguous()


@dataclass
class BlockTokenMajor(TokenMajor):
    """A `TokenMajor` quantized with one scale per (128-token block, column): t [T, C] under
    `Float8BlockScaling` along the tokens (1×128 blocks that restart at each group's first
    token; a group's last block is partial, zero-padded). data [C, P] and offs as
    `TokenMajor`'s; scale_inv fp32 [P / 128, C], block tb covering columns [128 tb, 128 tb +
    128) of data (blocks past the last span: 1, over zeros). What
    `te_seq.kernels.cute.block_scaled_grouped_wgrad` reads."""

    def dequantize(self) -> Tensor:
        """The represented values, fp32 [C, P] (padding columns zero)."""
        return self.data.float() * self.scale_inv.t().repeat_interleave(WGRAD_PAD, 1)


def quantize_token_major_blocks(t: Tensor, offs: Tensor, rule: ScaleRule) -> BlockTokenMajor:
    """t [T, C] (any float dtype, any strides) quantized along the tokens of each group in
    1×128 blocks, one scale per (block, column), as a `BlockTokenMajor`: `offs` int32 [G] the
    cumulative row ends on t's device (rows past offs[-1] are ignored). Bitwise the values of
    `qdq_columns_per_group(t, bounds, QuantBlock(1, 128), rule)`: every span starts on a block,
    so a block covers the same tokens as the reference's (its padding tokens are zeros, which
    never raise an amax); nan/inf policy included (a padding token in a nan block is nan).
    The same passes as `quantize_token_major`, without the per-span max (the definition: the
    cute backend runs one kernel for it, `fp8_quantize.token_major_blocks`)."""
    source, padded_offs, _, block_amax = _span_blocks(t, offs)
    block_scale = scales_from_amax(block_amax, rule)  # [P / 128, C]
    data = compiled_maths.for_data(_cast_token_major, t)(t, source, block_scale, rule.fp8_max,
                                                          rule.dtype)
    return BlockTokenMajor(data, torch.reciprocal(block_scale), padded_offs)


def token_major_from(q: QuantizedTensor, offs: Tensor) -> TokenMajor:
    """A per-tensor quantized q [T, C] (its data already what the wgrad reads: per-tensor
    scaling does not depend on the layout) laid out as a `TokenMajor`, its one scale expanded
    to [G, C]."""
    if q.block != QuantBlock(None, None):
        raise ValueError(f"token_major_from: needs a per-tensor QuantizedTensor, got {q.block}")
    tm_data, padded_offs = _scatter_token_major(q.data, offs)
    scale_inv = q.scale_inv.reshape(1, 1).expand(offs.shape[0], q.data.shape[1]).contiguous()
    return TokenMajor(tm_data, scale_inv, padded_offs)


def scaled_grouped_wgrad_emulated(
    a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, offs: Tensor,
    out: Tensor | None = None, accumulate: bool = False,
) -> Tensor:
    """`cute.scaled_grouped_wgrad`'s maths on dequantized operands in fp32: a [N, P] and b
    [K, P] FP8 token-major (`TokenMajor.data`), a_scale [G, N] and b_scale [G, K] fp32, offs
    int32 [G] padded span ends (shared). out[g] [N, K] = Σ_{p in span g} a_scale[g, n]·a[n, p]
    · b_scale[g, k]·b[k, p]; written into `out` (bf16 or fp32; `accumulate` adds) or returned
    as a new bf16 tensor. The fp32 grouped GEMM is the torch backend's (it reads the offsets
    on the host)."""
    groups = _column_groups(offs, a.shape[1])  # [P]
    a_rows = (a.float() * a_scale[groups].t()).t()  # [P, N]
    b_rows = (b.float() * b_scale[groups].t()).t()  # [P, K]
    return _fp32_wgrad(a_rows, b_rows, offs, out, accumulate)


def block_scaled_grouped_wgrad_emulated(
    a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, offs: Tensor,
    out: Tensor | None = None, accumulate: bool = False,
) -> Tensor:
    """`cute.block_scaled_grouped_wgrad`'s maths on dequantized operands in fp32: a [N, P] and
    b [K, P] FP8 token-major (`BlockTokenMajor.data`), a_scale [P / 128, N] and b_scale
    [P / 128, K] fp32 per (128-token block, column), offs int32 [G] padded span ends.
    out[g] [N, K] = Σ_{p in span g} a_scale[p // 128, n]·a[n, p] · b_scale[p // 128, k]·b[k, p];
    `out` and `accumulate` as `scaled_grouped_wgrad_emulated`'s."""
    a_rows = (a.float() * a_scale.t().repeat_interleave(WGRAD_PAD, 1)).t()  # [P, N]
    b_rows = (b.float() * b_scale.t().repeat_interleave(WGRAD_PAD, 1)).t()  # [P, K]
    return _fp32_wgrad(a_rows, b_rows, offs, out, accumulate)


def _fp32_wgrad(a_rows: Tensor, b_rows: Tensor, offs: Tensor, out: Tensor | None,
                accumulate: bool) -> Tensor:
    """The torch backend's grouped wgrad of fp32 a_rows [P, N] and b_rows [P, K] over the
    spans `offs`: a new bf16 tensor, or written into `out` (bf16 or fp32; `accumulate` adds,
    one rounding into a bf16 out)."""
    if out is None:
        return torch_backend.grouped_wgrad(a_rows, b_rows, offs).to(torch.bfloat16)
    if out.dtype == torch.float32:
        return torch_backend.grouped_wgrad(a_rows, b_rows, offs, out=out, accumulate=accumulate)
    result = torch_backend.grouped_wgrad(a_rows, b_rows, offs)  # fp32, one rounding into out
    return out.add_(result) if accumulate else out.copy_(result)


__all__ = [
    "WGRAD_PAD",
    "BlockTokenMajor",
    "block_scaled_grouped_wgrad_emulated",
    "quantize_token_major_blocks",
    "TokenMajor",
    "padded_width",
    "quantize_token_major",
    "scaled_grouped_wgrad_emulated",
    "token_major_from",
]
