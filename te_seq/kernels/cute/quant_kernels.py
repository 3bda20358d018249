"""FP8 quantization kernels (CuTe DSL, SIMT, any sm_90 GPU): the FP8 GEMMs' operands in a few
memory passes and one launch each, bitwise `fp8_reference`'s numbers.

Imports cutlass; only ``quant.py``'s functionals import this module, lazily (through
``compile.compile_quant``).

``RowQuantKernel``: t [R, C] (16-bit) -> data [R, C] FP8 and scale_inv [R] fp32, one scale per
row (``fp8_reference.quantize`` with row-wise blocks). One warp per row: a pass for the row's
amax (a warp shuffle reduces it), a second pass (L2-resident) for the cast.

``SpanAmaxKernel`` and ``SpanCastKernel``: t [T, C] quantized along the tokens of each group into
the token-major layout of ``fp8_wgrad.TokenMajor`` (data [C, P], every group's span padded to
128 tokens). Both run over the padded 128-token blocks x 64-column chunks; a block's row
``table[b] = (first source row, valid rows, group, first block of its group)``. The first
kernel takes max |t| per (block, column) and combines it into ``span_amax`` [G + 1, C] by
atomic max (row G: blocks past the last span); the second computes each column's scale from it,
casts the block's tokens (zeros past the valid rows) and writes them token-major; a group's
first block also writes ``scale_inv`` [G, C].

Scales (``scale_from_amax``) are `fp8_reference.scales_from_amax` with margin 0: fp8_max / amax
by IEEE division, clamped to the largest finite fp32, optionally rounded down to a power of two,
1 where amax is 0, nan where it is inf or nan (a nan amax is taken as inf, so max never drops
it). The cast is `cvt.rn.satfinite`: round to nearest even, finite values past ±fp8_max to
±fp8_max, which is the reference's clamp-then-cast.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

FP32_MAX = 3.4028234663852886e38
ROWS_PER_CTA = 8  # RowQuantKernel: one warp per row
ROW_VEC = 8  # elements per vector load (16 bytes of 16-bit data)
SPAN_BLOCK = 128  # tokens per padded block (fp8_wgrad.WGRAD_PAD)
SPAN_COLS = 64  # columns per CTA of the span kernels: 32 lanes x 2
TOKENS_PER_WARP = SPAN_BLOCK // 8  # 8 warps per CTA


@cute.jit
def _nan_to_inf(a: Float32) -> Float32:
    """A nan maximum becomes inf: still non-finite, and max/atomic max keep it."""
    return cutlass.select_(a != a, Float32(float("inf")), a)


@cute.jit
def scale_from_amax(amax: Float32, fp8_max: float, power_of_two: bool) -> Float32:
    """`fp8_reference.scales_from_amax` (margin 0) of one nonnegative or nan amax."""
    scale = Float32(fp8_max) / amax
    scale = cute.arch.fmin(scale, Float32(FP32_MAX))
    if const_expr(power_of_two):  # normal scales (>= fp8_max / FP32_MAX): the exponent alone
        scale = (scale.bitcast(Int32) & Int32(0x7F800000)).bitcast(Float32)
    scale = cutlass.select_(amax == Float32(0.0), Float32(1.0), scale)
    finite = amax < Float32(float("inf"))  # False for inf and nan
    return cutlass.select_(finite, scale, Float32(float("nan")))


@cute.jit
def _vec_abs_max(v) -> Float32:
    """max |v| over a TensorSSA in fp32, nan-propagating."""
    return cute.math.abs(v.to(Float32)).reduce(cute.ReductionOp.MAX, Float32(0.0), 0)


class RowQuantKernel:
    """Row-wise FP8 quantization of a row-major [R, C] 16-bit tensor (C a multiple of 8)."""

    def __init__(self, fp8_max: float, power_of_two: bool, fp8_dtype=None):
        self.fp8_max = fp8_max
        self.power_of_two = power_of_two
        self.fp8_dtype = fp8_dtype or cutlass.Float8E4M3FN

    @cute.jit
    def __call__(self, t: cute.Tensor, data: cute.Tensor, scale_inv: cute.Tensor, stream):
        rows = t.shape[0]
        grid = (rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA
        self.kernel(t, data, scale_inv).launch(
            grid=(grid, 1, 1), block=(32 * ROWS_PER_CTA, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, t: cute.Tensor, data: cute.Tensor, scale_inv: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * ROWS_PER_CTA + tidx // 32
        if row < t.shape[0]:
            src = cute.zipped_divide(t[row, None], (ROW_VEC,))
            dst = cute.zipped_divide(data[row, None], (ROW_VEC,))
            vectors = t.shape[1] // ROW_VEC
            amax = Float32(0.0)
            for j in cutlass.range(lane, vectors, 32):
                amax = cute.arch.fmax(amax, _vec_abs_max(src[(None, j)].load()), nan=True)
            amax = cute.arch.warp_reduction(
                _nan_to_inf(amax), lambda a, b: cute.arch.fmax(a, b, nan=True)
            )
            scale = scale_from_amax(amax, self.fp8_max, self.power_of_two)
            for j in cutlass.range(lane, vectors, 32):
                values = src[(None, j)].load().to(Float32) * scale
                dst[(None, j)].store(values.to(self.fp8_dtype))
            if lane == 0:
                scale_inv[row] = Float32(1.0) / scale


class _SpanKernel:
    """What the two span kernels share: the launch grid (padded blocks x 64-column chunks, 8
    warps of 16 tokens each) and each thread's coordinates."""

    def __init__(self, fp8_max: float = 448.0, power_of_two: bool = False, fp8_dtype=None):
        self.fp8_max = fp8_max
        self.power_of_two = power_of_two
        self.fp8_dtype = fp8_dtype or cutlass.Float8E4M3FN

    def _grid(self, table: cute.Tensor, t: cute.Tensor):
        cols = t.shape[1]
        return (table.shape[0], (cols + SPAN_COLS - 1) // SPAN_COLS, 1)

    @cute.jit
    def _coords(self):
        """(block, first column of this lane's pair, this warp's first token in the block)."""
        tidx, _, _ = cute.arch.thread_idx()
        block, chunk, _ = cute.arch.block_idx()
        col = chunk * SPAN_COLS + 2 * (tidx % 32)
        return block, col, (tidx // 32) * TOKENS_PER_WARP


class SpanAmaxKernel(_SpanKernel):
    """max |t| over each group's tokens per column, into span_amax [G + 1, C] fp32 (zeroed by
    the caller) by atomic max; nan counts as inf."""

    @cute.jit
    def __call__(self, t: cute.Tensor, table: cute.Tensor, span_amax: cute.Tensor, stream):
        self.kernel(t, table, span_amax).launch(
            grid=self._grid(table, t), block=(256, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, t: cute.Tensor, table: cute.Tensor, span_amax: cute.Tensor):
        block, col, token0 = self._coords()
        first_row, valid, group = table[block, 0], table[block, 1], table[block, 2]
        if col < t.shape[1] and token0 < valid:
            amax = [Float32(0.0), Float32(0.0)]
            for i in cutlass.range_constexpr(TOKENS_PER_WARP):
                if token0 + i < valid:
                    pair = cute.zipped_divide(t[first_row + token0 + i, None], (2,))
                    values = pair[(None, col // 2)].load().to(Float32)
                    for k in cutlass.range_constexpr(2):
                        amax[k] = cute.arch.fmax(amax[k], cute.math.abs(values[k]), nan=True)
            base = group * t.shape[1] + col
            for k in cutlass.range_constexpr(2):
                cute.arch.atomic_fmax(span_amax.iterator + (base + k), _nan_to_inf(amax[k]),
                                      sign_bit=False)


class SpanCastKernel(_SpanKernel):
    """The token-major FP8 data [C, P] and scale_inv [G, C] from t, the block table and the
    span maxima of ``SpanAmaxKernel``."""

    @cute.jit
    def __call__(self, t: cute.Tensor, table: cute.Tensor, span_amax: cute.Tensor,
                 data: cute.Tensor, scale_inv: cute.Tensor, stream):
        self.kernel(t, table, span_amax, data, scale_inv).launch(
            grid=self._grid(table, t), block=(256, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, t: cute.Tensor, table: cute.Tensor, span_amax: cute.Tensor,
               data: cute.Tensor, scale_inv: cute.Tensor):
        block, col, token0 = self._coords()
        first_row, valid, group = table[block, 0], table[block, 1], table[block, 2]
        cols = t.shape[1]
        if col < cols:
            scales = [scale_from_amax(span_amax[group, col + k], self.fp8_max, self.power_of_two)
                      for k in range(2)]
            tokens = [cute.make_rmem_tensor((TOKENS_PER_WARP,), Float32) for _ in range(2)]
            for i in cutlass.range_constexpr(TOKENS_PER_WARP):
                for k in cutlass.range_constexpr(2):
                    tokens[k][i] = Float32(0.0)
                if token0 + i < valid:
                    pair = cute.zipped_divide(t[first_row + token0 + i, None], (2,))
                    values = pair[(None, col // 2)].load().to(Float32)
                    for k in cutlass.range_constexpr(2):
                        tokens[k][i] = values[k]
            chunk = (block * SPAN_BLOCK + token0) // TOKENS_PER_WARP
            for k in cutlass.range_constexpr(2):
                out = cute.zipped_divide(data[col + k, None], (TOKENS_PER_WARP,))
                out[(None, chunk)].store((tokens[k].load() * scales[k]).to(self.fp8_dtype))
            if table[block, 3] != 0 and token0 == 0:
                for k in cutlass.range_constexpr(2):
                    scale_inv[group, col + k] = Float32(1.0) / scales[k]
