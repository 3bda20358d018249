"""The token-major FP8 cast in one read of t (CuTe DSL, SIMT, any sm_90 GPU): t [T, C]
quantized along the tokens of each group into ``fp8_wgrad.TokenMajor``'s layout (data [C, P],
every group's span padded to 128 tokens, scale_inv [G, C]), bitwise
``span_kernels``' pair and ``fp8_wgrad.quantize_token_major``.

``StripCastKernel`` runs one CTA (256 threads) per (group, 64-column chunk): the CTA holds
its group's strip of t, up to ``STRIP_TOKENS`` tokens x 64 columns, in registers (the span
kernels' load layout, 16 passes of 32 rows instead of 4: sixteen 16-byte loads in flight per
thread), takes the column maxima from them (shuffles, one shared-memory pass over the 8
warps), and casts the same registers: the transpose through shared memory (the span kernels'
swizzle, one 8 KB block per 128 tokens) and the 16-byte token-major stores. So t is read once
and no maxima buffer or second launch is needed, where the span pair reads t twice
(``SpanAmaxKernel``, then ``SpanCastKernel``) or needs the maxima from a row-wise pass
(``row_amax_kernels``).

A group of more than ``STRIP_TOKENS`` tokens is walked twice in windows of that many: once
for its maxima, once to cast (its second read mostly from L2); still exact, and one CTA per
chunk does the whole group, so the host takes this kernel only where the groups hold up to
``STRIP_TOKENS`` tokens on average (``quant.strips_fit``). Rows past the group's end read as
its last row (no maximum changes) and cast as zeros, as the span kernels' padding.

The grid holds G more CTA rows, which write the zeros past the last group's padded span
(blocks of 128 tokens, a stride of G blocks each): every element of data and scale_inv is
written (groups without tokens: scale_inv 1), so neither needs a fill.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory as memory
from cutlass import Float32, Int32

from .quant_kernels import _nan_to_inf, scale_from_amax
from .span_kernels import (
    ROWS_PER_PASS,
    SPAN_BLOCK,
    SPAN_COLS,
    STORE_BYTES,
    STORE_PASSES,
    STORES_PER_COLUMN,
    THREADS,
    VEC,
    WARPS,
    _ColumnStager,
    _fmax,
    _shuffle_max,
    _stage_coords,
    _staged_byte,
    _staged_chunk,
    _store_coords,
)

STRIP_TOKENS = 512  # tokens a CTA holds in registers
STRIP_PASSES = STRIP_TOKENS // ROWS_PER_PASS  # 16 loads per thread
STRIP_BLOCKS = STRIP_TOKENS // SPAN_BLOCK  # 4 staged 128-token blocks
BLOCK_BYTES = SPAN_COLS * SPAN_BLOCK  # staged FP8 bytes of one 128-token block
PASSES_PER_BLOCK = SPAN_BLOCK // ROWS_PER_PASS
# CTAs an SM holds at least: caps the registers at 128 a thread (the strip's raw values are 64
# of them), where the compiler alone took 189 and one CTA an SM
MIN_CTAS_PER_SM = 2


class StripCastKernel:
    """The token-major FP8 data [C, P] and scale_inv [G, C] of t [T, C] from the group ends
    offs [G] and the padded span ends padded_offs [G] (``quant_kernels.SpanTableKernel``'s)."""

    def __init__(self, fp8_max: float = 448.0, power_of_two: bool = False, fp8_dtype=None):
        self.fp8_max = fp8_max
        self.power_of_two = power_of_two
        self.fp8_dtype = fp8_dtype or cutlass.Float8E4M3FN

    @cute.jit
    def __call__(self, t: cute.Tensor, offs: cute.Tensor, padded_offs: cute.Tensor,
                 data: cute.Tensor, scale_inv: cute.Tensor, stream):
        chunks = (t.shape[1] + SPAN_COLS - 1) // SPAN_COLS
        self.kernel(t, offs, padded_offs, data, scale_inv).launch(
            grid=(2 * offs.shape[0], chunks, 1), block=(THREADS, 1, 1), stream=stream,
            max_number_threads=[THREADS, 1, 1], min_blocks_per_mp=MIN_CTAS_PER_SM,
            preferred_smem_carveout=-1,  # the driver's default (else the DSL asks the device)
        )

    @cute.kernel
    def kernel(self, t: cute.Tensor, offs: cute.Tensor, padded_offs: cute.Tensor,
               data: cute.Tensor, scale_inv: cute.Tensor):
        unit, chunk, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        groups = offs.shape[0]
        allocator = memory.SmemAllocator()
        staged = allocator.allocate_tensor(
            self.fp8_dtype, cute.make_layout(BLOCK_BYTES * STRIP_BLOCKS), 16)
        partial = allocator.allocate_tensor(
            Float32, cute.make_layout((WARPS, SPAN_COLS), stride=(SPAN_COLS, 1)), 16)
        scales = allocator.allocate_tensor(Float32, cute.make_layout(SPAN_COLS), 16)
        if unit < groups:  # uniform over the CTA
            self._group(t, offs, padded_offs, data, scale_inv, unit, chunk, tidx, staged,
                        partial, scales)
        else:
            self._zero_tail(data, padded_offs, unit - groups, groups, chunk, tidx)

    @cute.jit
    def _group(self, t: cute.Tensor, offs: cute.Tensor, padded_offs: cute.Tensor,
               data: cute.Tensor, scale_inv: cute.Tensor, g, chunk, tidx, staged: cute.Tensor,
               partial: cute.Tensor, scales: cute.Tensor):
        """Group g's chunk: its column maxima, scales, the cast strip and its scale_inv."""
        start = cutlass.select_(g > 0, offs[cutlass.max(g - 1, 0)], Int32(0))
        count = cutlass.max(offs[g] - start, 0)
        pstart = cutlass.select_(g > 0, padded_offs[cutlass.max(g - 1, 0)], Int32(0))
        v, row0 = _stage_coords(tidx)
        col = chunk * SPAN_COLS + v * VEC
        vector = cutlass.min(col, t.shape[1] - VEC) // VEC
        windows = (count + STRIP_TOKENS - 1) // STRIP_TOKENS
        raw = [cute.make_rmem_tensor((VEC,), t.element_type) for _ in range(STRIP_PASSES)]
        col_max = cute.make_rmem_tensor((VEC,), Float32)
        col_max.fill(0.0)
        for w in cutlass.range(windows):
            first = start + w * STRIP_TOKENS
            self._load_window(t, first, cutlass.min(count - w * STRIP_TOKENS, STRIP_TOKENS),
                              vector, row0, raw)
            self._fold(raw, col_max)
        self._column_maxima(col_max, tidx, partial)
        cute.arch.sync_threads()
        if tidx < SPAN_COLS:
            amax = partial[0, tidx]
            for w in cutlass.range_constexpr(1, WARPS):
                amax = _fmax(amax, partial[w, tidx])
            scales[tidx] = scale_from_amax(amax, self.fp8_max, self.power_of_two)
        cute.arch.sync_threads()
        for w in cutlass.range(windows):
            valid = cutlass.min(count - w * STRIP_TOKENS, STRIP_TOKENS)
            if windows > 1:  # uniform: the window again (the first one's registers are gone)
                self._load_window(t, start + w * STRIP_TOKENS, valid, vector, row0, raw)
            self._stage(raw, valid, col, t.shape[1], tidx, scales, staged)
            cute.arch.sync_threads()
            self._store_window(staged, data, (pstart + w * STRIP_TOKENS) // SPAN_BLOCK, valid,
                               chunk, tidx)
            cute.arch.sync_threads()
        column = chunk * SPAN_COLS + tidx
        if tidx < SPAN_COLS and column < scale_inv.shape[1]:
            scale_inv[g, column] = Float32(1.0) / scales[tidx]

    @cute.jit
    def _load_window(self, t: cute.Tensor, first, valid, vector, row0, raw: list):
        """raw[i] = t[first + min(row0 + 32 i, valid - 1), 8 vector .. + 8] as loaded, all
        sixteen issued before any is used (``valid`` >= 1)."""
        for i in cutlass.range_constexpr(STRIP_PASSES):
            r = cutlass.min(row0 + i * ROWS_PER_PASS, valid - 1)
            src = cute.zipped_divide(t[first + r, None], (VEC,))
            raw[i].store(src[(None, vector)].load())

    @cute.jit
    def _fold(self, raw: list, col_max: cute.Tensor):
        """col_max[k] = max(col_max[k], |raw[i][k]|) over the passes (nan-propagating)."""
        for i in cutlass.range_constexpr(STRIP_PASSES):
            values = cute.math.abs(raw[i].load().to(Float32))
            for k in cutlass.range_constexpr(VEC):
                col_max[k] = _fmax(col_max[k], values[k])

    @cute.jit
    def _column_maxima(self, col_max: cute.Tensor, tidx, partial: cute.Tensor):
        """partial[warp, c] = max of col_max over the warp's threads of column c (nan as inf):
        the 4 lanes of a column vector differ in lane bits 3 and 4."""
        lane, warp = tidx % 32, tidx // 32
        for k in cutlass.range_constexpr(VEC):
            amax = _shuffle_max(_nan_to_inf(col_max[k]), (8, 16))
            if lane < SPAN_COLS // VEC:
                partial[warp, lane * VEC + k] = amax

    @cute.jit
    def _stage(self, raw: list, valid, col, cols, tidx, scales: cute.Tensor,
               staged: cute.Tensor):
        """Staged byte (c, r) of block r // 128 = fp8(t value at (window token r, column c) x
        scales[c]), 0 past the ``valid`` tokens or the last column, transposed one byte at a
        time (``span_kernels._staged_byte`` within each block)."""
        v, row0 = _stage_coords(tidx)
        stager = _ColumnStager(scales, v, self.fp8_dtype, staged)
        kept = cute.make_rmem_tensor((VEC,), Float32)
        for i in cutlass.range_constexpr(STRIP_PASSES):
            r = row0 + i * ROWS_PER_PASS
            keep = (r < valid) & (col < cols)
            values = raw[i].load().to(Float32)
            for k in cutlass.range_constexpr(VEC):
                kept[k] = cutlass.select_(keep, values[k], Float32(0.0))
            block, within = i // PASSES_PER_BLOCK, r % SPAN_BLOCK
            stager.put(kept, block * BLOCK_BYTES + _staged_byte(v * VEC, within))

    @cute.jit
    def _store_window(self, staged: cute.Tensor, data: cute.Tensor, block0, valid, chunk,
                      tidx):
        """data[column c, tokens of padded block block0 + b] = staged block b, for the blocks
        of the window's padded span (b 128 < valid): 8 consecutive lanes write one column's
        128 bytes, as ``SpanCastKernel._store_token_major``."""
        chunks = cute.zipped_divide(staged, (STORE_BYTES,))
        for b in cutlass.range_constexpr(STRIP_BLOCKS):
            if b * SPAN_BLOCK < valid:
                for p in cutlass.range_constexpr(STORE_PASSES):
                    c, j = _store_coords(tidx, p)
                    column = chunk * SPAN_COLS + c
                    if column < data.shape[0]:
                        values = chunks[(None, b * (BLOCK_BYTES // STORE_BYTES)
                                         + _staged_chunk(c, j))].load()
                        dst = cute.zipped_divide(data[column, None], (STORE_BYTES,))
                        dst[(None, (block0 + b) * STORES_PER_COLUMN + j)].store(values)

    @cute.jit
    def _zero_tail(self, data: cute.Tensor, padded_offs: cute.Tensor, k, groups, chunk, tidx):
        """Zeros in this chunk's columns of the padded blocks past the last group's span:
        blocks first + k, first + k + G, ... (first: the last padded span end / 128)."""
        first = padded_offs[groups - 1] // SPAN_BLOCK
        zero = cute.make_rmem_tensor((STORE_BYTES,), Float32)
        zero.fill(0.0)
        zeros = cute.make_rmem_tensor((STORE_BYTES,), self.fp8_dtype)
        zeros.store(zero.load().to(self.fp8_dtype))
        for p in cutlass.range_constexpr(STORE_PASSES):
            c, j = _store_coords(tidx, p)
            column = chunk * SPAN_COLS + c
            if column < data.shape[0]:
                dst = cute.zipped_divide(data[column, None], (STORE_BYTES,))
                for block in cutlass.range(first + k, data.shape[1] // SPAN_BLOCK, groups):
                    dst[(None, block * STORES_PER_COLUMN + j)].store(zeros.load())
