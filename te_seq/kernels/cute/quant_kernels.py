"""FP8 quantization kernels (CuTe DSL, SIMT, any sm_90 GPU): the FP8 GEMMs' operands in a few
memory passes and one launch each, bitwise `fp8_reference`'s numbers.

Imports cutlass; only ``quant.py``'s functionals import this module, lazily (through
``compile_quant.compile_quant``).

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
first block also writes ``scale_inv`` [G, C]. With ``rows`` the same two passes also quantize
every row of a group row-wise (row maxima by a warp shuffle and an atomic max per 64-column
chunk; the row-wise data and scale_inv written on the way), so an operand needed in both forms
is read twice, not four times.

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
    warps of 16 tokens each), each thread's coordinates and its loads. With ``rows`` they also
    quantize t row-wise on the way (``row_amax`` [T], ``row_data`` [T, C], ``row_scale_inv``
    [T]: rows in no group are left as they are); without, those arguments are dummies."""

    def __init__(self, fp8_max: float = 448.0, power_of_two: bool = False, rows: bool = False,
                 fp8_dtype=None):
        self.fp8_max = fp8_max
        self.power_of_two = power_of_two
        self.rows = rows
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

    @cute.jit
    def _load_pair(self, t: cute.Tensor, row, col, pair: cute.Tensor):
        """t[row, col:col + 2] into the fp32 fragment ``pair``, zeros for a lane past the last
        column (its load is clamped: every lane of the warp takes part in the row shuffles)."""
        cols = t.shape[1]
        src = cute.zipped_divide(t[row, None], (2,))
        values = src[(None, cutlass.min(col, cols - 2) // 2)].load().to(Float32)
        for k in cutlass.range_constexpr(2):
            pair[k] = cutlass.select_(col < cols, values[k], Float32(0.0))


class SpanAmaxKernel(_SpanKernel):
    """max |t| over each group's tokens per column, into span_amax [G + 1, C] fp32 (zeroed by
    the caller) by atomic max; nan counts as inf. With ``rows``: max |t| of each row of a group
    into row_amax [T] (zeroed by the caller) too."""

    @cute.jit
    def __call__(self, t: cute.Tensor, table: cute.Tensor, span_amax: cute.Tensor,
                 row_amax: cute.Tensor, stream):
        self.kernel(t, table, span_amax, row_amax).launch(
            grid=self._grid(table, t), block=(256, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, t: cute.Tensor, table: cute.Tensor, span_amax: cute.Tensor,
               row_amax: cute.Tensor):
        block, col, token0 = self._coords()
        first_row, valid, group = table[block, 0], table[block, 1], table[block, 2]
        if token0 < valid:  # uniform over the warp
            amax = [Float32(0.0), Float32(0.0)]
            pair = cute.make_rmem_tensor((2,), Float32)
            for i in cutlass.range_constexpr(TOKENS_PER_WARP):
                if token0 + i < valid:
                    self._load_pair(t, first_row + token0 + i, col, pair)
                    for k in cutlass.range_constexpr(2):
                        amax[k] = cute.arch.fmax(amax[k], cute.math.abs(pair[k]), nan=True)
                    if const_expr(self.rows):
                        self._row_max(pair, row_amax, first_row + token0 + i)
            if col < t.shape[1]:
                base = group * t.shape[1] + col
                for k in cutlass.range_constexpr(2):
                    cute.arch.atomic_fmax(span_amax.iterator + (base + k), _nan_to_inf(amax[k]),
                                          sign_bit=False)

    @cute.jit
    def _row_max(self, pair: cute.Tensor, row_amax: cute.Tensor, row):
        """The warp's max |t| over its 64 columns of ``row``, atomically into row_amax[row]."""
        m = cute.arch.fmax(cute.math.abs(pair[0]), cute.math.abs(pair[1]), nan=True)
        m = cute.arch.warp_reduction(m, lambda a, b: cute.arch.fmax(a, b, nan=True))
        tidx, _, _ = cute.arch.thread_idx()
        if tidx % 32 == 0:
            cute.arch.atomic_fmax(row_amax.iterator + row, _nan_to_inf(m), sign_bit=False)


class SpanCastKernel(_SpanKernel):
    """The token-major FP8 data [C, P] and scale_inv [G, C] from t, the block table and the
    span maxima of ``SpanAmaxKernel``; with ``rows`` also row_data [T, C] and row_scale_inv [T]
    from its row maxima."""

    @cute.jit
    def __call__(self, t: cute.Tensor, table: cute.Tensor, span_amax: cute.Tensor,
                 data: cute.Tensor, scale_inv: cute.Tensor, row_amax: cute.Tensor,
                 row_data: cute.Tensor, row_scale_inv: cute.Tensor, stream):
        self.kernel(t, table, span_amax, data, scale_inv, row_amax, row_data,
                    row_scale_inv).launch(grid=self._grid(table, t), block=(256, 1, 1),
                                          stream=stream)

    @cute.kernel
    def kernel(self, t: cute.Tensor, table: cute.Tensor, span_amax: cute.Tensor,
               data: cute.Tensor, scale_inv: cute.Tensor, row_amax: cute.Tensor,
               row_data: cute.Tensor, row_scale_inv: cute.Tensor):
        block, col, token0 = self._coords()
        first_row, valid, group = table[block, 0], table[block, 1], table[block, 2]
        cols = t.shape[1]
        clamped = cutlass.min(col, cols - 2)  # lanes past the last column compute, never store
        scales = [scale_from_amax(span_amax[group, clamped + k], self.fp8_max,
                                  self.power_of_two) for k in range(2)]
        tokens = [cute.make_rmem_tensor((TOKENS_PER_WARP,), Float32) for _ in range(2)]
        pair = cute.make_rmem_tensor((2,), Float32)
        for i in cutlass.range_constexpr(TOKENS_PER_WARP):
            for k in cutlass.range_constexpr(2):
                tokens[k][i] = Float32(0.0)
            if token0 + i < valid:
                self._load_pair(t, first_row + token0 + i, col, pair)
                for k in cutlass.range_constexpr(2):
                    tokens[k][i] = pair[k]
                if const_expr(self.rows):
                    self._store_row(pair, first_row + token0 + i, col, row_amax, row_data,
                                    row_scale_inv)
        if col < cols:
            chunk = (block * SPAN_BLOCK + token0) // TOKENS_PER_WARP
            for k in cutlass.range_constexpr(2):
                out = cute.zipped_divide(data[col + k, None], (TOKENS_PER_WARP,))
                out[(None, chunk)].store((tokens[k].load() * scales[k]).to(self.fp8_dtype))
            if table[block, 3] != 0 and token0 == 0:
                for k in cutlass.range_constexpr(2):
                    scale_inv[group, col + k] = Float32(1.0) / scales[k]

    @cute.jit
    def _store_row(self, pair: cute.Tensor, row, col, row_amax: cute.Tensor,
                   row_data: cute.Tensor, row_scale_inv: cute.Tensor):
        """``pair`` (t[row, col:col + 2]) quantized with its row's scale into row_data; the
        first lane of the first column chunk writes the row's scale_inv."""
        scale = scale_from_amax(row_amax[row], self.fp8_max, self.power_of_two)
        if col < row_data.shape[1]:
            out = cute.zipped_divide(row_data[row, None], (2,))
            out[(None, col // 2)].store((pair.load() * scale).to(self.fp8_dtype))
        if col == 0:
            row_scale_inv[row] = Float32(1.0) / scale


class SpanTableKernel:
    """The span kernels' block table from the group ends: table [NB, 4] int32 (per padded
    128-token block: first row, valid rows, group, 1 on its group's first block; blocks past
    the last span: group G, no rows) and the padded span ends [G]. One thread per block walks
    the G group ends (G is small: experts), so the table costs one launch per step."""

    @cute.jit
    def __call__(self, offs: cute.Tensor, table: cute.Tensor, padded_offs: cute.Tensor, stream):
        blocks = table.shape[0]
        self.kernel(offs, table, padded_offs).launch(
            grid=((blocks + 127) // 128, 1, 1), block=(128, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, offs: cute.Tensor, table: cute.Tensor, padded_offs: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        block = bidx * 128 + tidx
        groups = offs.shape[0]
        start = block * SPAN_BLOCK
        prev, pstart = Int32(0), Int32(0)
        group, first_row, valid, first = groups, Int32(0), Int32(0), Int32(0)
        for g in cutlass.range(groups):
            end = offs[g]
            count = end - prev
            span = (count + SPAN_BLOCK - 1) // SPAN_BLOCK * SPAN_BLOCK
            if group == groups and start < pstart + span:  # this block is in group g's span
                within = start - pstart
                group, first_row = g, prev + within
                valid = cutlass.min(count - within, SPAN_BLOCK)
                first = cutlass.select_(within == 0, Int32(1), Int32(0))
            pstart, prev = pstart + span, end
            if block == 0:
                padded_offs[g] = pstart
        if block < table.shape[0]:
            table[block, 0] = first_row
            table[block, 1] = valid
            table[block, 2] = group
            table[block, 3] = first
