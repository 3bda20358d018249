"""FP8 quantization maths: what every recipe means, as quantize -> dequantize in fp32.

The reference defines the numbers; faster backends must reproduce them. Everything here works
on 2-D GEMM operands laid out as [rows, reduction]: a GEMM C = A Bᵀ reads A [M, K] and B [N, K]
and both are quantized along K (their last dimension), so a block never straddles two dot
products' worth of different scales in an unexpected way.

Blocks (`QuantBlock`): a tensor [R, C] is cut into blocks of `rows` x `cols` elements from the
top-left corner (`None`: the whole extent); trailing blocks may be partial. One scale per block:

    amax  = max |t| over the exact block (in fp32; a partial block covers only its elements)
    scale = fp8_max / amax / 2**margin, at most the largest finite fp32
            (so a block of tiny or subnormal values still gets a finite scale)
    scale = 2**floor(log2(scale))                        with power_of_two (exactly)
    scale = 1                                            where amax == 0 (an all-zero block)
    scale = nan                                          where amax is inf or nan
    q     = fp8(clamp(t * scale, -fp8_max, fp8_max))     round to nearest even (torch's cast)
    t'    = fp32(q) * scale_inv,  scale_inv = 1 / scale  (fp32)

Non-finite policy: an inf or a nan anywhere in a block turns the whole block into nan (no host
sync is needed to detect it, and the loss becomes nan where an overflow check sees it); finite
blocks are untouched by their neighbours' overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq.kernels import compiled_maths

FP8_FORMATS = {"E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2}
_FP32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class ScaleRule:
    """How one operand's scales are chosen: the FP8 format, the margin (scale divided by
    2**margin, headroom for values that grow) and whether scales are rounded down to powers of
    two (then dequantization is exact in any float format with fp32's exponent range)."""

    fmt: str = "E4M3"
    margin: int = 0
    power_of_two: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return FP8_FORMATS[self.fmt]

    @property
    def fp8_max(self) -> float:
        return float(torch.finfo(self.dtype).max)


@dataclass(frozen=True)
class QuantBlock:
    """The block shape of one scale: `rows` x `cols` elements (None: the tensor's whole extent).
    Per tensor: (None, None); per row: (1, None); 1x128 tiles: (1, 128); weight blocks
    (128, 128)."""

    rows: int | None
    cols: int | None

    def size(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The block's size for a tensor of `shape` (at least 1, so empty tensors work)."""
        r, c = shape
        return max(1, self.rows or r), max(1, self.cols or c)


@dataclass
class QuantizedTensor:
    """An FP8 tensor: `data` [R, C] in the rule's FP8 dtype, `scale_inv` [ceil(R/br), ceil(C/bc)]
    fp32 (one per block; value = fp32(data) * scale_inv of its block), its `block` and `rule`,
    and optionally `transpose`: the same values quantized along the other dimension (what a
    wgrad, which reduces over rows, needs), quantized from the original, never from this one."""

    data: Tensor
    scale_inv: Tensor
    block: QuantBlock
    rule: ScaleRule
    transpose: QuantizedTensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self) -> Tensor:
        """The represented values in fp32 [R, C]."""
        return _expand(self.scale_inv, self.block.size(tuple(self.data.shape)), self.data.shape) \
            * self.data.float()


def _expand(per_block: Tensor, size: tuple[int, int], shape: torch.Size) -> Tensor:
    """A per-block tensor [Rb, Cb] repeated over each block's elements, cropped to `shape`."""
    br, bc = size
    full = per_block.repeat_interleave(br, 0).repeat_interleave(bc, 1)
    return full[: shape[0], : shape[1]]


def block_amax(t: Tensor, block: QuantBlock) -> Tensor:
    """max |t| over each block [ceil(R/br), ceil(C/bc)] in fp32 (nan propagates)."""
    r, c = t.shape
    br, bc = block.size((r, c))
    rb, cb = -(-r // br), -(-c // bc)
    padded = torch.zeros(rb * br, cb * bc, dtype=torch.float32, device=t.device)
    padded[:r, :c] = t.float().abs()  # zeros never raise a block's amax
    blocks = padded.reshape(rb, br, cb, bc)
    return blocks.amax(dim=(1, 3))


def scales_from_amax(amax: Tensor, rule: ScaleRule) -> Tensor:
    """The scale of each block (see the module docstring), fp32."""
    # A true division: `float / tensor` is computed as reciprocal-then-multiply (two roundings).
    scale = torch.div(torch.full_like(amax, rule.fp8_max), amax) / (2.0**rule.margin)
    scale = scale.clamp(max=_FP32_MAX)
    if rule.power_of_two:  # frexp: exact (log2 could round 2**k·(1-ε) up to k)
        _, exponent = torch.frexp(scale)  # scale = m·2**e, m in [0.5, 1)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def quantize(t: Tensor, block: QuantBlock, rule: ScaleRule) -> QuantizedTensor:
    """Quantize a 2-D tensor [R, C] with one scale per `block` under `rule`."""
    if t.dim() != 2:
        raise ValueError(f"quantize: expected a 2-D tensor, got shape {tuple(t.shape)}")
    if block in (ROWWISE, PER_TENSOR) and t.numel() > 0:
        return _quantize_broadcast(t, block, rule)
    if splits_rows(t, block):
        return row_blocks_from_rows(t, block, _quantize_broadcast(
            t.reshape(-1, block.cols), ROWWISE, rule))
    scale = scales_from_amax(block_amax(t, block), rule)
    size = block.size(tuple(t.shape))
    scaled = t.float() * _expand(scale, size, t.shape)
    data = scaled.clamp(-rule.fp8_max, rule.fp8_max).to(rule.dtype)
    return QuantizedTensor(data, torch.reciprocal(scale), block, rule)


ROWWISE = QuantBlock(1, None)
PER_TENSOR = QuantBlock(None, None)


def quantize_stacked(t: Tensor, block: QuantBlock, rule: ScaleRule) -> QuantizedTensor:
    """Each matrix of t [G, R, C] quantized on its own (`quantize` of each, bit for bit), in a
    few launches instead of G: data [G, R, C], scale_inv [G, Rb, Cb]. Row-wise blocks, and
    blocks whose rows divide R, never straddle two matrices: `quantize` of t as [G·R, C].
    Per-tensor blocks take each matrix's amax. Other blocks quantize matrix by matrix."""
    g, r, c = t.shape
    if block == PER_TENSOR and t.numel() > 0:
        scale = scales_from_amax(t.abs().amax(dim=(1, 2), keepdim=True).float(), rule)
        return QuantizedTensor(scaled_cast(t, scale, rule.fp8_max, rule.dtype), inverse(scale),
                               block, rule)
    if block.rows == 1 or (block.rows is not None and r % block.rows == 0 and g * r > 0):
        q = quantize(t.reshape(g * r, c), block, rule)
        scale_inv = q.scale_inv.reshape(g, -1, q.scale_inv.shape[1])
        return QuantizedTensor(q.data.reshape(g, r, c), scale_inv, block, rule)
    parts = [quantize(m, block, rule) for m in t.unbind(0)]
    return QuantizedTensor(torch.stack([q.data for q in parts]),
                           torch.stack([q.scale_inv for q in parts]), block, rule)


def abs_max(t: Tensor, dim: int | None) -> Tensor:
    """max |t| along `dim` (None: all; kept as a size-1 dim), in fp32; nan propagates. |t| and
    max are exact in t's dtype, so this is `block_amax`'s value without its fp32 copies."""
    if dim is None:
        return t.abs().amax().float().reshape(1, 1)
    return t.abs().amax(dim=dim, keepdim=True).float()


def scaled_cast(t: Tensor, scale: Tensor, fp8_max: float, dtype: torch.dtype) -> Tensor:
    """fp8(clamp(t · scale, ±fp8_max)) in fp32, `scale` broadcast against t: `quantize`'s
    elementwise maths."""
    return (t.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)


def splits_rows(t: Tensor, block: QuantBlock) -> bool:
    """Whether `block` is 1 x bc and cuts each row of t [R, C] into whole blocks (C a multiple
    of bc, t not empty): then t's blocks are the rows of t seen as [R·C/bc, bc], and their
    row-wise quantization is t's (`row_blocks_from_rows`), bit for bit."""
    return block.rows == 1 and block.cols is not None and t.dim() == 2 and t.numel() > 0 \
        and t.shape[1] % block.cols == 0


def row_blocks_from_rows(t: Tensor, block: QuantBlock, rows: QuantizedTensor) -> QuantizedTensor:
    """t [R, C] quantized in 1 x bc blocks, from `rows`: t seen as [R·C/bc, bc] quantized
    row-wise (data [R, C], scale_inv [R, C/bc])."""
    r, c = t.shape
    return QuantizedTensor(rows.data.reshape(r, c), rows.scale_inv.reshape(r, c // block.cols),
                           block, rows.rule)


def _quantize_broadcast(t: Tensor, block: QuantBlock, rule: ScaleRule) -> QuantizedTensor:
    """`quantize` for row-wise and per-tensor blocks with the scales broadcast, never expanded
    to t's shape (bitwise the same values); on CUDA one compiled region (`compiled_maths`): one
    read for the amax, one read and one FP8 write for the data, one host call."""
    parts = compiled_maths.for_data(_broadcast_parts, t)(t, block == ROWWISE, rule)
    return QuantizedTensor(*parts, block, rule)


def _broadcast_parts(t: Tensor, rowwise: bool, rule: ScaleRule) -> tuple[Tensor, Tensor]:
    """(data, scale_inv [R, 1] or [1, 1]) of `_quantize_broadcast`."""
    scale = scales_from_amax(abs_max(t, 1 if rowwise else None), rule)
    return scaled_cast(t, scale, rule.fp8_max, rule.dtype), inverse(scale)


def inverse(scale: Tensor) -> Tensor:
    """1 / scale, IEEE-rounded as `torch.reciprocal` is in eager torch; written as a division
    so a compiled region (`compiled_maths`: IEEE division) rounds it the same way (Triton's
    reciprocal is approximate: 510 of 4096 values an ulp off, H100, 2026-11-25)."""
    return torch.div(torch.ones_like(scale), scale)


def qdq(t: Tensor, block: QuantBlock, rule: ScaleRule) -> Tensor:
    """quantize then dequantize: the fp32 values an FP8 GEMM sees for `t` [R, C]."""
    return quantize(t, block, rule).dequantize()


def qdq_columns_per_group(
    t: Tensor, bounds: list[tuple[int, int]], block: QuantBlock, rule: ScaleRule
) -> Tensor:
    """`t` [M, C] quantized along its rows (dimension 0) within each group's row range, as a
    wgrad operand: each group's slice t[s:e]ᵀ [C, e-s] is quantized with `block` (its blocks
    start at the group's first row), returned dequantized as [M, C] fp32. Rows outside every
    group are zero."""
    if block == QuantBlock(1, None) and bounds:  # one scale per (group, column)
        return _qdq_group_columns(t, bounds, rule)
    out = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
    for start, end in bounds:
        if end > start:
            out[start:end] = qdq(t[start:end].t(), block, rule).t()
    return out


def _qdq_group_columns(t: Tensor, bounds: list[tuple[int, int]], rule: ScaleRule) -> Tensor:
    """`qdq_columns_per_group` for row-wise blocks, all groups at once (`quantize_group_columns`
    on the host `bounds`), bitwise the values of the per-group loop with a constant number of
    kernels instead of ~20 per group."""
    edges = torch.tensor(bounds, dtype=torch.long).to(t.device)  # [G, 2] (start, end)
    data, scale, group, inside = quantize_group_columns(t, edges, rule)
    out = torch.reciprocal(scale)[group] * data.float()
    return torch.where(inside[:, None], out, torch.zeros_like(out))


def quantize_group_columns(
    t: Tensor, edges: Tensor, rule: ScaleRule
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`t` [M, C] quantized along its rows with one scale per (group, column), no host sync:
    (data [M, C] in the rule's FP8 dtype, scale [G, C] fp32, group [M] long, inside [M] bool).
    `edges` [G, 2] long on t's device holds each group's (start, end) row, ends ascending.

    The scale of column c in group g comes from max |t[rows of g, c]|, a segmented max over the
    rows (a block holding an inf or a nan is nan, as `block_amax` + `scales_from_amax` make
    it); the data is `quantize`'s elementwise maths with the row's group scale. A row in no
    group has inside False, its group clamped to G-1 and meaningless data."""
    g, (m, c) = edges.shape[0], t.shape
    rows = torch.arange(m, device=t.device)
    group = torch.searchsorted(edges[:, 1].contiguous(), rows, right=True)  # first end > row
    clamped = group.clamp(max=g - 1)
    inside = (group < g) & (rows >= edges[clamped, 0])  # rows in no group stay zero
    tf = t.float()
    finite = torch.isfinite(tf)
    slot = torch.where(inside, clamped, g)[:, None].expand(m, c)  # outside rows: a spare slot
    amax = tf.new_zeros(g + 1, c).scatter_reduce_(0, slot, torch.where(finite, tf.abs(), 0),
                                                  "amax")
    bad = tf.new_zeros(g + 1, c).scatter_reduce_(0, slot, (~finite).float(), "amax") > 0
    amax = torch.where(bad, torch.full_like(amax, float("nan")), amax)[:g]  # [G, C]
    scale = scales_from_amax(amax, rule)
    data = (tf * scale[clamped]).clamp(-rule.fp8_max, rule.fp8_max).to(rule.dtype)
    return data, scale, clamped, inside
