"""FP8 quantization kernels (CuTe DSL, SIMT, any sm_90 GPU): the FP8 GEMMs' operands in a few
memory passes and one launch each, bitwise `fp8_reference`'s numbers: the row-wise kernel, the
span table and the scale rule the span kernels (``span_kernels``) share.

Imports cutlass; only ``quant.py``'s functionals import this module, lazily (through
``compile_quant.compile_quant``).

``RowQuantKernel``: t [R, C] (16-bit) -> data [R, C] FP8 and scale_inv [R] fp32, one scale per
row (``fp8_reference.quantize`` with row-wise blocks). One warp per row. Rows of up to 4096
columns are loaded once into registers (``lane_vecs`` 16-byte vectors per lane, 4, 8 or 16, all
issued before the first is used; lanes past the row's end load its last vector again, which
changes no maximum, and store nothing); the amax is a warp shuffle, the cast reads the
registers. Wider rows take two passes: one for the amax, a second (mostly from L2) for the cast.

``SpanTableKernel``: the block table of the token-major span kernels (``span_kernels``:
``SpanAmaxKernel`` and ``SpanCastKernel``, t [T, C] quantized along the tokens of each group
into the layout of ``fp8_wgrad.TokenMajor``, data [C, P] with every group's span padded to 128
tokens): per padded 128-token block ``table[b] = (first source row, valid rows, group, 1 on its
group's first block)``, group G for the blocks past the last span.

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

    def __init__(self, fp8_max: float, power_of_two: bool, fp8_dtype=None, lane_vecs: int = 0):
        self.fp8_max = fp8_max
        self.power_of_two = power_of_two
        self.fp8_dtype = fp8_dtype or cutlass.Float8E4M3FN
        self.lane_vecs = lane_vecs  # > 0: C <= 32 * lane_vecs * ROW_VEC, the row in registers
        # 16 vectors a lane take ~160 registers: 4-warp CTAs, so that 3 fit on an SM, not 1
        self.rows_per_cta = ROWS_PER_CTA // 2 if lane_vecs >= 16 else ROWS_PER_CTA

    @cute.jit
    def __call__(self, t: cute.Tensor, data: cute.Tensor, scale_inv: cute.Tensor, stream):
        rows = t.shape[0]
        grid = (rows + self.rows_per_cta - 1) // self.rows_per_cta
        self.kernel(t, data, scale_inv).launch(
            grid=(grid, 1, 1), block=(32 * self.rows_per_cta, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, t: cute.Tensor, data: cute.Tensor, scale_inv: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * self.rows_per_cta + tidx // 32
        if row < t.shape[0]:
            src = cute.zipped_divide(t[row, None], (ROW_VEC,))
            dst = cute.zipped_divide(data[row, None], (ROW_VEC,))
            vectors = t.shape[1] // ROW_VEC
            if const_expr(self.lane_vecs > 0):
                scale = self._cast_from_registers(src, dst, lane, vectors)
            else:
                scale = self._cast_in_two_passes(src, dst, lane, vectors)
            if lane == 0:
                scale_inv[row] = Float32(1.0) / scale

    def _row_scale(self, amax: Float32) -> Float32:
        """Traced inline: the scale of a row from its lane's partial amax (warp shuffle)."""
        amax = cute.arch.warp_reduction(
            _nan_to_inf(amax), lambda a, b: cute.arch.fmax(a, b, nan=True)
        )
        return scale_from_amax(amax, self.fp8_max, self.power_of_two)

    @cute.jit
    def _cast_in_two_passes(self, src, dst, lane, vectors) -> Float32:
        """Any width: the amax pass, then the cast pass re-reading the row."""
        amax = Float32(0.0)
        for j in cutlass.range(lane, vectors, 32):
            amax = cute.arch.fmax(amax, _vec_abs_max(src[(None, j)].load()), nan=True)
        scale = self._row_scale(amax)
        for j in cutlass.range(lane, vectors, 32):
            values = src[(None, j)].load().to(Float32) * scale
            dst[(None, j)].store(values.to(self.fp8_dtype))
        return scale

    @cute.jit
    def _cast_from_registers(self, src, dst, lane, vectors) -> Float32:
        """vectors <= 32 lane_vecs: lane l loads vectors l + 32 k (clamped into the row), all
        before the first is used, then casts them from registers."""
        raw = [cute.make_rmem_tensor((ROW_VEC,), src.element_type)
               for _ in range(self.lane_vecs)]
        for k in cutlass.range_constexpr(self.lane_vecs):
            raw[k].store(src[(None, cutlass.min(lane + 32 * k, vectors - 1))].load())
        amax = Float32(0.0)
        for k in cutlass.range_constexpr(self.lane_vecs):
            amax = cute.arch.fmax(amax, _vec_abs_max(raw[k].load()), nan=True)
        scale = self._row_scale(amax)
        for k in cutlass.range_constexpr(self.lane_vecs):
            if lane + 32 * k < vectors:
                values = raw[k].load().to(Float32) * scale
                dst[(None, lane + 32 * k)].store(values.to(self.fp8_dtype))
        return scale


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
