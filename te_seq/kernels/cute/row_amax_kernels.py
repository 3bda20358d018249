"""Row-wise FP8 quantization that also yields each group's column maxima, in one read of t
(CuTe DSL, SIMT, any sm_90 GPU).

``RowGroupAmaxKernel``: t [T, C] (16-bit, row-major, C a multiple of 16) -> row_data [T, C]
FP8 and row_scale_inv [T] fp32, bitwise ``RowQuantKernel`` (``fp8_reference.quantize`` with
row-wise blocks) for every row of a group, and group_amax [G, C] fp32 raised to max |t| over
each group's rows per column (nan counted as inf, as ``SpanAmaxKernel``'s block maxima), so
that ``SpanCastKernel`` can later cast the token-major form from it without reading t twice.

Grid: one CTA per (padded 128-token block of the span table, row slice): the block's valid rows
are cut into ``slices`` equal slices (1, 2 or 4, a launch argument), so small widths still get
enough threads. Every block lies in one group, so a CTA's rows share one row of group_amax.

A CTA covers whole rows, ``rows_in_flight`` (r) at a time: thread i owns the 8-column
vectors i, i + n, ..., i + (v - 1) n of every row (``vecs`` = v per row, n threads, n = 32
ceil(C / 256 v), up to 256), so

- each row is read once, 16 bytes per load, the v r loads of a thread issued before any is
  used, and kept in registers for the cast;
- a row's max |t| is each thread's partial max, a warp shuffle, then the warps' partials through
  shared memory (one barrier per r rows; the partials alternate between two buffers, so a warp
  never overwrites a buffer another may still read);
- the column maxima stay in registers (8 v fp32 per thread) over all of the CTA's rows, and go
  to global memory once per CTA and column: ``red.global.max.u32`` on the fp32 bits, which
  orders non-negative floats (inf included; nan is turned into inf first) as numbers, so the
  host zero-fills group_amax.

Layouts (compile-time; the host picks, ``quant._group_amax_layout``): v = 4, r = 2 for C up
to 8192 (ptxas, sm_90a: 128 registers a thread, no spills), v = 8, r = 1 up to 16384 (182),
and v = 2, r = 4 for a step's activations up to 4096 columns (few blocks: twice the threads
of 4 x 2, so twice the loads in flight). The loaded values are 16-bit and converted where
used, so v r bounds the registers: 8 x 2 takes 254. Fewer registers fit more CTAs on an SM,
and more rows in flight per thread mean fewer barriers per row: on one H200 the 4 x 2 layout
runs the weights' shapes 1.2-2x faster than 8 x 1, and 2 x 4 a step's x, dh and a up to 1.3x
faster than 4 x 2 (``quant._group_amax_layout`` and ``_row_slices`` have the figures).

Loads are unconditional: a row past the slice's last valid row is clamped to it, a vector past
the row's end to its last one. Those duplicates leave every maximum as it is; only their stores
and atomics are skipped. Rows of t in no group (past the last group's end) are not read or
written: their row-wise data and scale_inv stay as they were.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory as memory
from cutlass import Float32, Int32

from .quant_kernels import _nan_to_inf, scale_from_amax

SPAN_BLOCK = 128  # tokens per padded block of the span table (fp8_wgrad.WGRAD_PAD)
VEC = 8  # 16-bit elements per 16-byte load
MAX_VECS = 8  # vectors per thread and row at most: 64 columns, whose maxima stay in registers
MAX_ROWS_IN_FLIGHT = 4  # rows loaded per thread before any is used, at most
MAX_THREADS = 256  # so C <= MAX_THREADS * MAX_VECS * VEC = 16384
MAX_WARPS = MAX_THREADS // 32
MAX_COLS = MAX_THREADS * MAX_VECS * VEC


def _fmax(a: Float32, b: Float32) -> Float32:
    """Traced inline: max, nan-propagating."""
    return cute.arch.fmax(a, b, nan=True)


class RowGroupAmaxKernel:
    """Row-wise FP8 data and scale_inv of every grouped row of t, and the groups' column
    maxima into group_amax (atomic max; zeroed by the caller), from the span table."""

    def __init__(self, fp8_max: float = 448.0, power_of_two: bool = False, fp8_dtype=None,
                 vecs: int = MAX_VECS, rows_in_flight: int = 1):
        if not (0 < vecs <= MAX_VECS and 0 < rows_in_flight <= MAX_ROWS_IN_FLIGHT):
            raise ValueError(f"RowGroupAmaxKernel: vecs must be 1..{MAX_VECS} and "
                             f"rows_in_flight 1..{MAX_ROWS_IN_FLIGHT}, got {vecs}, "
                             f"{rows_in_flight}")
        self.fp8_max = fp8_max
        self.power_of_two = power_of_two
        self.fp8_dtype = fp8_dtype or cutlass.Float8E4M3FN
        self.vecs, self.rows_in_flight = vecs, rows_in_flight

    @cute.jit
    def __call__(self, t: cute.Tensor, table: cute.Tensor, row_data: cute.Tensor,
                 row_scale_inv: cute.Tensor, group_amax: cute.Tensor, slices: Int32, stream):
        cols_per_warp = 32 * self.vecs * VEC
        threads = (t.shape[1] + cols_per_warp - 1) // cols_per_warp * 32
        self.kernel(t, table, row_data, row_scale_inv, group_amax, slices).launch(
            grid=(table.shape[0], slices, 1), block=(threads, 1, 1),
            max_number_threads=[MAX_THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, t: cute.Tensor, table: cute.Tensor, row_data: cute.Tensor,
               row_scale_inv: cute.Tensor, group_amax: cute.Tensor, slices: Int32):
        block, part, _ = cute.arch.block_idx()
        allocator = memory.SmemAllocator()
        partial = allocator.allocate_tensor(
            Float32, cute.make_layout((2, self.rows_in_flight, MAX_WARPS),
                                      stride=(self.rows_in_flight * MAX_WARPS, MAX_WARPS, 1)),
            16)
        fields = table[block, None].load()
        first_row, valid, group = fields[0], fields[1], fields[2]
        per_slice = SPAN_BLOCK // slices
        lo = part * per_slice
        hi = cutlass.min(valid, lo + per_slice)
        if lo < hi:  # uniform over the CTA; blocks past the last span have no rows
            col_max = cute.make_rmem_tensor((self.vecs * VEC,), Float32)
            col_max.fill(0.0)
            row_max = cute.make_rmem_tensor((self.rows_in_flight,), Float32)
            raw = [cute.make_rmem_tensor((VEC,), t.element_type)
                   for _ in range(self.rows_in_flight * self.vecs)]
            parity = Int32(0)
            for base in cutlass.range(first_row + lo, first_row + hi, self.rows_in_flight):
                last = first_row + hi - 1
                self._load_rows(t, base, last, raw)
                self._fold(raw, col_max, row_max)
                self._store_rows(raw, row_max, partial, parity, base, last, row_data,
                                 row_scale_inv)
                parity = 1 - parity
            self._store_column_maxima(col_max, group, group_amax, t.shape[1] // VEC)

    def _vector_indices(self, vectors):
        """Traced inline: (this thread's vector k for k < VECS, clamped into the row;
        whether it is in the row): vectors tid + k n of n threads."""
        tidx, _, _ = cute.arch.thread_idx()
        threads, _, _ = cute.arch.block_dim()
        return ([cutlass.min(tidx + k * threads, vectors - 1) for k in range(self.vecs)],
                [tidx + k * threads < vectors for k in range(self.vecs)])

    @cute.jit
    def _load_rows(self, t: cute.Tensor, base, last, raw: list):
        """raw[i VECS + k] = vector k of row min(base + i, last), 16 bytes each, as loaded."""
        columns, _ = self._vector_indices(t.shape[1] // VEC)
        for i in cutlass.range_constexpr(self.rows_in_flight):
            src = cute.zipped_divide(t[cutlass.min(base + i, last), None], (VEC,))
            for k in cutlass.range_constexpr(self.vecs):
                raw[i * self.vecs + k].store(src[(None, columns[k])].load())

    @cute.jit
    def _fold(self, raw: list, col_max: cute.Tensor, row_max: cute.Tensor):
        """row_max[i] = max |t| over this thread's vectors of loaded row i (nan as inf);
        col_max[8 k + e] = max(col_max, |element e of vector k|) over the loaded rows
        (nan-propagating: made inf before the atomics)."""
        for i in cutlass.range_constexpr(self.rows_in_flight):
            amax = Float32(0.0)
            for k in cutlass.range_constexpr(self.vecs):
                values = cute.math.abs(raw[i * self.vecs + k].load().to(Float32))
                amax = _fmax(amax, values.reduce(cute.ReductionOp.MAX, Float32(0.0), 0))
                for e in cutlass.range_constexpr(VEC):
                    col_max[k * VEC + e] = _fmax(col_max[k * VEC + e], values[e])
            row_max[i] = _nan_to_inf(amax)

    @cute.jit
    def _store_rows(self, raw: list, row_max: cute.Tensor, partial: cute.Tensor, parity,
                    base, last, row_data: cute.Tensor, row_scale_inv: cute.Tensor):
        """The loaded rows' maxima over the CTA (this thread's ``row_max``, shuffles, then
        the warps' partials in partial[parity]), their scales, and the cast rows (8 bytes per
        vector) and scale_inv (thread 0) of the rows up to ``last``."""
        tidx, _, _ = cute.arch.thread_idx()
        threads, _, _ = cute.arch.block_dim()
        lane, warp = tidx % 32, tidx // 32
        for i in cutlass.range_constexpr(self.rows_in_flight):
            amax = cute.arch.warp_reduction(row_max[i], _fmax)
            if lane == 0:
                partial[parity, i, warp] = amax
        cute.arch.sync_threads()
        columns, inside = self._vector_indices(row_data.shape[1] // VEC)
        for i in cutlass.range_constexpr(self.rows_in_flight):
            amax = partial[parity, i, 0]
            for w in cutlass.range(1, threads // 32):
                amax = _fmax(amax, partial[parity, i, w])
            scale = scale_from_amax(amax, self.fp8_max, self.power_of_two)
            row = base + i
            if row <= last:
                dst = cute.zipped_divide(row_data[row, None], (VEC,))
                for k in cutlass.range_constexpr(self.vecs):
                    if inside[k]:
                        values = raw[i * self.vecs + k].load().to(Float32) * scale
                        dst[(None, columns[k])].store(values.to(self.fp8_dtype))
                if tidx == 0:
                    row_scale_inv[row] = Float32(1.0) / scale

    @cute.jit
    def _store_column_maxima(self, col_max: cute.Tensor, group, group_amax: cute.Tensor,
                             vectors):
        """group_amax[group, column] = max(itself, this thread's maximum of the column) for
        each of its columns in the row, by an unsigned atomic max on the fp32 bits."""
        columns, inside = self._vector_indices(vectors)
        for k in cutlass.range_constexpr(self.vecs):
            if inside[k]:
                for e in cutlass.range_constexpr(VEC):
                    bits = Float32(_nan_to_inf(col_max[k * VEC + e])).bitcast(Int32)
                    offset = group * group_amax.shape[1] + columns[k] * VEC + e
                    cute.arch.red(group_amax.iterator + offset, bits, op="umax", dtype="u32",
                                  sem="relaxed", scope="gpu")
