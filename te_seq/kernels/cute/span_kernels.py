"""The token-major FP8 span kernels (CuTe DSL, SIMT, any sm_90 GPU): t [T, C] quantized along
the tokens of each group into ``fp8_wgrad.TokenMajor``'s layout (data [C, P], every group's span
padded to 128 tokens), bitwise ``fp8_wgrad.quantize_token_major``.

Both kernels run one CTA (256 threads) per padded 128-token block x 64-column chunk; a block's
row ``table[b] = (first source row, valid rows, group, 1 on its group's first block)``
(``quant_kernels.SpanTableKernel``). A CTA reads its 128 x 64 tile of t with 16-byte vector
loads: thread ``tid`` loads columns ``8 (tid % 8) .. + 8`` of tile rows ``tid // 8 + 32 i``
(i < 4), four unconditional loads in flight per thread (the row index is clamped into the
block's valid rows, the values past them replaced by zeros).

``SpanAmaxKernel`` writes max |t| per (block, column) into ``block_amax`` [NB, C] (nan as inf)
with plain stores: the 32 threads of a column combine by warp shuffles and a shared-memory
pass. It also writes each group's block range into ``extents`` [G, 2] (first block, end
block): the CTA of a group's first block writes the start, that of its last block the end.
Neither buffer needs zeroing: the cast kernel reads only entries of groups that have blocks.

``SpanCastKernel`` reads its block's table row (one 16-byte load, with the previous block's
group) and then issues, before consuming any, the loads that need nothing else: its group's
extent, the tile's four 16-byte loads (kept raw in registers) and with ``rows`` the rows'
maxima. Inside the same branch it reduces the maxima of its group's blocks per column (4
threads per column, a stride-4 walk over the blocks, 4 loads into distinct registers per
step, then shared memory) into the chunk's 64 scales while the tile is in flight; only then is
the tile converted (a CTA used to wait for its tile, then for the table, the extent and each
block maximum in turn). Each thread then scales and casts its own values (one load pass at a
time, straight from the raw registers) and writes the FP8 bytes transposed into shared memory
(8 KB, XOR-swizzled: ``_staged_byte``); after one barrier, 8 consecutive lanes write one
column's 128 tokens with 16-byte stores, so every store instruction of a warp fills four whole
128-byte lines of the token-major rows (writing 32 tokens of a column per thread, as before
2026-11-30, left half of each 32-byte sector to the next instruction: the kernel ran at ~2.6
TB/s, L2-bound, against ~3.6 now on an H200). Last, once nothing of the tile is live, it
writes scale_inv for every group: its group's (on the group's first block)
and 1 for the groups without tokens that lie before it (after the previous block's group) or, on
the last block, after it. With ``rows`` both kernels also quantize each row of a group row-wise:
the amax kernel takes each row's max over its 64 columns (8 lanes, shuffles) into ``row_amax``
[T] by atomic max (the one buffer that needs zeroing), the cast kernel writes the row-wise data
and scale_inv on the way.

A group of n blocks costs each of its CTAs n reads per column of ``block_amax`` (L2-resident,
1/64 of t's bytes): cheap for a few blocks, much L2 traffic for one group of thousands.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory as memory
from cutlass import Float32, Int32, const_expr

from .quant_kernels import _nan_to_inf, scale_from_amax

SPAN_BLOCK = 128  # tokens per padded block (fp8_wgrad.WGRAD_PAD)
SPAN_COLS = 64  # columns per CTA
THREADS = 256
VEC = 8  # 16-bit elements per 16-byte load
VECS_PER_ROW = SPAN_COLS // VEC  # 8 threads share a tile row
ROWS_PER_PASS = THREADS // VECS_PER_ROW  # 32 tile rows per load pass
PASSES = SPAN_BLOCK // ROWS_PER_PASS  # 4 loads per thread
WARPS = THREADS // 32
STORE_BYTES = 16  # FP8 tokens of one column per 16-byte token-major store
STORES_PER_COLUMN = SPAN_BLOCK // STORE_BYTES  # 8 lanes write a column's 128 bytes
STORE_PASSES = SPAN_COLS * STORES_PER_COLUMN // THREADS  # 2 stores per thread
SCALE_PARTS = THREADS // SPAN_COLS  # threads per column in the scale reduction
WALK_LOADS = 4  # block maxima loads in flight per thread in that reduction


class _SpanTileKernel:
    """What the two span kernels share: the grid (padded blocks x 64-column chunks), each
    thread's tile coordinates and its tile loads. With ``rows`` they also quantize t row-wise
    (``row_amax`` [T], ``row_data`` [T, C], ``row_scale_inv`` [T]: rows in no group are left
    as they are); without, those arguments are dummies."""

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
        """(block, chunk, thread, this thread's first column, its first tile row)."""
        tidx, _, _ = cute.arch.thread_idx()
        block, chunk, _ = cute.arch.block_idx()
        v, row0 = _stage_coords(tidx)
        return block, chunk, tidx, chunk * SPAN_COLS + v * VEC, row0

    @cute.jit
    def _load_tile(self, t: cute.Tensor, first_row, valid, col, row0, tile: list):
        """tile[i][k] = t[first_row + row0 + 32 i, col + k] in fp32 (``tile``: PASSES rmem
        fragments of VEC), 0 past the block's ``valid`` (>= 1) rows or past the last column.
        The loads are unconditional: the row clamped into the valid rows, the column vector
        into the row (C is a multiple of 16, so the last vector is whole)."""
        cols = t.shape[1]
        vector = cutlass.min(col, cols - VEC) // VEC
        for i in cutlass.range_constexpr(PASSES):
            r = row0 + i * ROWS_PER_PASS
            src = cute.zipped_divide(t[first_row + cutlass.min(r, valid - 1), None], (VEC,))
            values = src[(None, vector)].load().to(Float32)
            for k in cutlass.range_constexpr(VEC):
                kept = cutlass.select_(r < valid, values[k], Float32(0.0))
                tile[i][k] = cutlass.select_(col < cols, kept, Float32(0.0))

    @cute.jit
    def _zero_tile(self, tile: list):
        for i in cutlass.range_constexpr(PASSES):
            for k in cutlass.range_constexpr(VEC):
                tile[i][k] = Float32(0.0)

    def _new_tile(self) -> list:
        return [cute.make_rmem_tensor((VEC,), Float32) for _ in range(PASSES)]

    @cute.jit
    def _block_maxima(self, tile: list, tidx, partial: cute.Tensor):
        """partial[warp, c] = max |tile| over the warp's rows of column c (nan as inf): the 4
        lanes of a column within the warp differ in lane bits 3 and 4."""
        lane, warp = tidx % 32, tidx // 32
        for k in cutlass.range_constexpr(VEC):
            amax = cute.math.abs(tile[0][k])
            for i in cutlass.range_constexpr(1, PASSES):
                amax = _fmax(amax, cute.math.abs(tile[i][k]))
            amax = _shuffle_max(_nan_to_inf(amax), (8, 16))
            if lane < VECS_PER_ROW:
                partial[warp, lane * VEC + k] = amax


def _staged_layout():
    """The cast tiles' FP8 bytes, token-major: column c's 128 tokens are 8 chunks of 16 bytes,
    chunk j of column c at chunk (j ^ (c // 8) % 8) of its 128 bytes (``_staged_byte``)."""
    return cute.make_layout(SPAN_COLS * SPAN_BLOCK)


def _stage_coords(tidx):
    """Traced inline (or plain Python on ints): (v, row0) of a thread's tile values: columns
    8 v .. 8 v + 8 of tile rows row0 + 32 i (the loads' layout, ``_coords``)."""
    return tidx % VECS_PER_ROW, tidx // VECS_PER_ROW


def _store_coords(tidx, p):
    """Traced inline (or plain Python on ints): (column c, chunk j) that thread ``tidx``
    writes in store pass p: 8 consecutive lanes per column."""
    return (p * (THREADS // STORES_PER_COLUMN) + tidx // STORES_PER_COLUMN,
            tidx % STORES_PER_COLUMN)


def _staged_chunk(c, j):
    """Traced inline (or plain Python on ints): the staged 16-byte chunk that holds tokens
    16 j .. 16 j + 16 of column c."""
    return c * STORES_PER_COLUMN + (j ^ ((c // VEC) % STORES_PER_COLUMN))


def _staged_byte(c, r):
    """Traced inline (or plain Python on ints): the staged byte of (column c, token r). The
    XOR swizzle keeps shared memory free of bank conflicts both ways: a warp's byte writes
    (lanes = 8 column vectors v x 4 tokens q of one word; store k touches column 8 v + k, chunk
    (r // 16) ^ v) hit 8 distinct words in 8 distinct banks, and each quarter-warp's 16-byte
    reads (one column, chunks 0..7) cover all 32 banks (tests/kernels/test_cute_quant_host.py
    checks both on every access)."""
    return _staged_chunk(c, r // STORE_BYTES) * STORE_BYTES + r % STORE_BYTES


def _fmax(a: Float32, b: Float32) -> Float32:
    """Traced inline: max, nan-propagating."""
    return cute.arch.fmax(a, b, nan=True)


def _shuffle_max(value: Float32, offsets: tuple) -> Float32:
    """Traced inline: max of ``value`` over the lanes that differ from this one in the
    ``offsets`` bits (a butterfly)."""
    for offset in offsets:
        value = _fmax(value, cute.arch.shuffle_sync_bfly(value, offset))
    return value


class SpanAmaxKernel(_SpanTileKernel):
    """max |t| over each block's valid tokens per column into block_amax [NB, C] fp32 (nan as
    inf; blocks without rows are not written) and each group's block range into extents [G, 2]
    int32 (first block, end block). With ``rows``: max |t| of each row of a group into
    row_amax [T] (zeroed by the caller) by atomic max."""

    @cute.jit
    def __call__(self, t: cute.Tensor, table: cute.Tensor, block_amax: cute.Tensor,
                 extents: cute.Tensor, row_amax: cute.Tensor, stream):
        self.kernel(t, table, block_amax, extents, row_amax).launch(
            grid=self._grid(table, t), block=(THREADS, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, t: cute.Tensor, table: cute.Tensor, block_amax: cute.Tensor,
               extents: cute.Tensor, row_amax: cute.Tensor):
        block, chunk, tidx, col, row0 = self._coords()
        first_row, valid = table[block, 0], table[block, 1]
        allocator = memory.SmemAllocator()
        partial = allocator.allocate_tensor(
            Float32, cute.make_layout((WARPS, SPAN_COLS), stride=(SPAN_COLS, 1)), 16)
        if chunk == 0 and tidx == 0:
            self._write_extent(table, extents, block)
        if valid > 0:  # uniform over the CTA
            tile = self._new_tile()
            self._load_tile(t, first_row, valid, col, row0, tile)
            if const_expr(self.rows):
                self._row_maxima(tile, first_row, valid, row0, tidx, row_amax)
            self._block_maxima(tile, tidx, partial)
            cute.arch.sync_threads()
            column = chunk * SPAN_COLS + tidx
            if tidx < SPAN_COLS and column < t.shape[1]:
                amax = partial[0, tidx]
                for w in cutlass.range_constexpr(1, WARPS):
                    amax = _fmax(amax, partial[w, tidx])
                block_amax[block, column] = amax

    @cute.jit
    def _write_extent(self, table: cute.Tensor, extents: cute.Tensor, block):
        """extents[g] = (first block, end block) of this block's group g, from the block that
        starts it and the one that ends it (the next block is of another group, or none)."""
        group, blocks = table[block, 2], table.shape[0]
        if group < extents.shape[0]:
            if table[block, 3] != 0:
                extents[group, 0] = block
            following = table[cutlass.min(block + 1, blocks - 1), 2]
            following = cutlass.select_(block + 1 < blocks, following, Int32(-1))
            if following != group:
                extents[group, 1] = block + 1

    @cute.jit
    def _row_maxima(self, tile: list, first_row, valid, row0, tidx, row_amax: cute.Tensor):
        """The max |t| over this chunk's 64 columns of each valid tile row, atomically into
        row_amax: a row's 8 threads are 8 consecutive lanes (lane bits 0..2)."""
        for i in cutlass.range_constexpr(PASSES):
            amax = cute.math.abs(tile[i][0])
            for k in cutlass.range_constexpr(1, VEC):
                amax = _fmax(amax, cute.math.abs(tile[i][k]))
            amax = _shuffle_max(amax, (1, 2, 4))
            r = row0 + i * ROWS_PER_PASS
            if tidx % VECS_PER_ROW == 0 and r < valid:
                cute.arch.atomic_fmax(row_amax.iterator + (first_row + r), _nan_to_inf(amax),
                                      sign_bit=False)


class SpanCastKernel(_SpanTileKernel):
    """The token-major FP8 data [C, P] and scale_inv [G, C] from t, the block table and
    ``SpanAmaxKernel``'s block maxima and extents; with ``rows`` also row_data [T, C] and
    row_scale_inv [T] from its row maxima. Blocks past the last span are written as zeros."""

    @cute.jit
    def __call__(self, t: cute.Tensor, table: cute.Tensor, block_amax: cute.Tensor,
                 extents: cute.Tensor, data: cute.Tensor, scale_inv: cute.Tensor,
                 row_amax: cute.Tensor, row_data: cute.Tensor, row_scale_inv: cute.Tensor,
                 stream):
        self.kernel(t, table, block_amax, extents, data, scale_inv, row_amax, row_data,
                    row_scale_inv).launch(grid=self._grid(table, t), block=(THREADS, 1, 1),
                                          stream=stream)

    @cute.kernel
    def kernel(self, t: cute.Tensor, table: cute.Tensor, block_amax: cute.Tensor,
               extents: cute.Tensor, data: cute.Tensor, scale_inv: cute.Tensor,
               row_amax: cute.Tensor, row_data: cute.Tensor, row_scale_inv: cute.Tensor):
        block, chunk, tidx, col, row0 = self._coords()
        row = _TableRow(table, block)
        allocator = memory.SmemAllocator()
        staged = allocator.allocate_tensor(self.fp8_dtype, _staged_layout(), 16)
        parts = allocator.allocate_tensor(
            Float32, cute.make_layout((SCALE_PARTS, SPAN_COLS), stride=(SPAN_COLS, 1)), 16)
        scales = allocator.allocate_tensor(Float32, cute.make_layout(SPAN_COLS), 16)
        # Every global load that does not need another's value is issued before any is
        # consumed: the group's extent, the tile (raw, not yet converted) and the rows' maxima
        # are in flight together, and the tile's loads stay in flight while the group's block
        # maxima are read and reduced (the walk sits in the same branch, after the loads, so
        # that the compiler cannot convert the tile before it).
        extent = _load_extent(extents, row.group)
        raw = _new_raw_tile(t)
        row_maxima = cute.make_rmem_tensor((PASSES,), Float32)
        group_amax = Float32(0.0)  # blocks past the last span: scale 1 on zero data
        if row.valid > 0:  # uniform over the CTA; blocks past the last span stay zeros
            self._issue_tile_loads(t, row.first_row, row.valid, col, row0, raw)
            if const_expr(self.rows):
                _issue_row_maxima_loads(row_amax, row.first_row, row.valid, row0, row_maxima)
            group_amax = self._group_amax(block_amax, row.group, extent, extents.shape[0],
                                          chunk, tidx)
        parts[tidx // SPAN_COLS, tidx % SPAN_COLS] = group_amax
        cute.arch.sync_threads()
        if tidx < SPAN_COLS:
            self._chunk_scale(parts, scales, tidx)
        cute.arch.sync_threads()
        # converted only now, one load pass at a time: the raw 16-bit tile holds half the
        # registers over the barriers, and no more than a pass is live in fp32
        tile = _RawTile(raw, row.valid, col, row0, t.shape[1])
        if const_expr(self.rows):
            if row.valid > 0:
                self._store_rows(tile, row.first_row, row.valid, row0, col, chunk, row_maxima,
                                 row_data, row_scale_inv)
        self._cast_and_store(tile, scales, staged, data, block, chunk, tidx)
        if tidx < SPAN_COLS:  # last: nothing of the tile is live any more
            self._write_scale_inv(row, scales[tidx], scale_inv, block, chunk, tidx,
                                  table.shape[0])

    @cute.jit
    def _issue_tile_loads(self, t: cute.Tensor, first_row, valid, col, row0, raw: list):
        """raw[i] = t[first_row + min(row0 + 32 i, valid - 1), col .. col + 8] as loaded (16
        bytes each, ``_load_tile``'s clamped addresses), nothing consumed yet."""
        cols = t.shape[1]
        vector = cutlass.min(col, cols - VEC) // VEC
        for i in cutlass.range_constexpr(PASSES):
            r = row0 + i * ROWS_PER_PASS
            src = cute.zipped_divide(t[first_row + cutlass.min(r, valid - 1), None], (VEC,))
            raw[i].store(src[(None, vector)].load())

    @cute.jit
    def _cast_and_store(self, tile: list, scales: cute.Tensor, staged: cute.Tensor,
                        data: cute.Tensor, block, chunk, tidx):
        """The tile scaled by its columns' ``scales`` (visible to every thread), cast to FP8,
        transposed through shared memory and written token-major: data[column, this block's
        tokens]. Ends with the stores issued."""
        self._stage(tile, scales, tidx, staged)
        cute.arch.sync_threads()
        self._store_token_major(staged, data, block, chunk, tidx)

    @cute.jit
    def _stage(self, tile: list, scales: cute.Tensor, tidx, staged: cute.Tensor):
        """staged byte (c, r) = fp8(tile value at (token r, column c) x scales[c]): the cast,
        then the transpose one byte at a time (``_staged_byte``)."""
        v, row0 = _stage_coords(tidx)
        stager = _ColumnStager(scales, v, self.fp8_dtype, staged)
        for i in cutlass.range_constexpr(PASSES):
            stager.put(tile[i], _staged_byte(v * VEC, row0 + i * ROWS_PER_PASS))

    @cute.jit
    def _group_amax(self, block_amax: cute.Tensor, group, extent, groups, chunk, tidx):
        """The max of block_amax[b, column c] over the group's blocks b = first + p, first + p
        + 4, ... < end for thread (c = tid % 64, p = tid // 64); 0 for a group out of range.
        ``extent``: the group's (first, end) as loaded, valid for a group below ``groups``
        (the extents' rows); called for blocks with tokens only."""
        c, part = tidx % SPAN_COLS, tidx // SPAN_COLS
        column = cutlass.min(chunk * SPAN_COLS + c, block_amax.shape[1] - 1)
        first, end = extent[0], extent[1]
        end = cutlass.select_(group < groups, end, first)  # else an empty walk
        maxima = cute.make_rmem_tensor((WALK_LOADS,), Float32)
        amax = Float32(0.0)
        # WALK_LOADS loads into distinct registers, then their max: all in flight at once (the
        # index clamped into the group's blocks: a block read twice leaves the max as it is)
        for start in cutlass.range(first + part, end, SCALE_PARTS * WALK_LOADS):
            for u in cutlass.range_constexpr(WALK_LOADS):
                maxima[u] = block_amax[cutlass.min(start + u * SCALE_PARTS, end - 1), column]
            for u in cutlass.range_constexpr(WALK_LOADS):
                amax = cute.arch.fmax(amax, maxima[u])
        return amax

    @cute.jit
    def _chunk_scale(self, parts: cute.Tensor, scales: cute.Tensor, c):
        """scales[c] from the group's maximum of column c (the max of its parts)."""
        amax = parts[0, c]
        for p in cutlass.range_constexpr(1, SCALE_PARTS):
            amax = cute.arch.fmax(amax, parts[p, c])
        scales[c] = scale_from_amax(amax, self.fp8_max, self.power_of_two)

    @cute.jit
    def _write_scale_inv(self, row, scale, scale_inv: cute.Tensor, block, chunk, c, blocks):
        """scale_inv of this chunk's column c: the group's (on its first block), 1 for the
        groups without tokens next to it (the table's values were read at the kernel's
        start)."""
        column, groups = chunk * SPAN_COLS + c, scale_inv.shape[0]
        group = row.group
        if column < scale_inv.shape[1]:
            if group < groups and row.starts != 0:
                scale_inv[group, column] = Float32(1.0) / scale
            for g in cutlass.range(row.previous + 1, cutlass.min(group, groups)):
                scale_inv[g, column] = Float32(1.0)  # no tokens: scale 1
            if block == blocks - 1:
                for g in cutlass.range(group + 1, groups):
                    scale_inv[g, column] = Float32(1.0)

    @cute.jit
    def _store_token_major(self, staged: cute.Tensor, data: cute.Tensor, block, chunk, tidx):
        """data[column c, this block's tokens 16 j .. 16 j + 16] = staged chunk (c, j) for
        thread (c = 32 p + tid // 8, j = tid % 8) in the two passes p: 8 consecutive lanes write
        one column's 128 bytes, so every 16-byte store of a warp fills four whole lines."""
        chunks = cute.zipped_divide(staged, (STORE_BYTES,))
        for p in cutlass.range_constexpr(STORE_PASSES):
            c, j = _store_coords(tidx, p)
            column = chunk * SPAN_COLS + c
            if column < data.shape[0]:
                values = chunks[(None, _staged_chunk(c, j))].load()
                dst = cute.zipped_divide(data[column, None], (STORE_BYTES,))
                dst[(None, block * STORES_PER_COLUMN + j)].store(values)

    @cute.jit
    def _store_rows(self, tile: list, first_row, valid, row0, col, chunk, row_maxima: cute.Tensor,
                    row_data: cute.Tensor, row_scale_inv: cute.Tensor):
        """The valid tile rows quantized with their rows' scales (from ``row_maxima[i]``, the
        row amax of tile row row0 + 32 i) into row_data (8 bytes a thread); the first thread of
        each row in the first chunk writes its scale_inv."""
        for i in cutlass.range_constexpr(PASSES):
            r = row0 + i * ROWS_PER_PASS
            if r < valid:
                row = first_row + r
                scale = scale_from_amax(row_maxima[i], self.fp8_max, self.power_of_two)
                if col < row_data.shape[1]:
                    out = cute.zipped_divide(row_data[row, None], (VEC,))
                    out[(None, col // VEC)].store((tile[i].load() * scale).to(self.fp8_dtype))
                if chunk == 0 and col == 0:
                    row_scale_inv[row] = Float32(1.0) / scale


class _ColumnStager:
    """Traced inline: a thread's 8-column fp32 fragments scaled by their columns' ``scales``,
    cast to FP8 and written transposed into ``staged``, one byte per column 128 bytes apart
    (the columns of a vector share the chunk swizzle of ``_staged_byte``)."""

    def __init__(self, scales: cute.Tensor, v, fp8_dtype, staged: cute.Tensor):
        self.column_scales = [scales[v * VEC + k] for k in range(VEC)]
        self.fp8_dtype = fp8_dtype
        self.scaled = cute.make_rmem_tensor((VEC,), Float32)
        self.cast = cute.make_rmem_tensor((VEC,), fp8_dtype)
        self.cast_bytes = cute.recast_tensor(self.cast, cutlass.Uint8)
        self.staged_bytes = cute.recast_tensor(staged, cutlass.Uint8)

    def put(self, values, first):
        """fp8(values[k] x scale of column v 8 + k) into staged byte ``first`` + 128 k."""
        for k in range(VEC):
            self.scaled[k] = values[k] * self.column_scales[k]
        self.cast.store(self.scaled.load().to(self.fp8_dtype))
        for k in range(VEC):
            self.staged_bytes[first + k * SPAN_BLOCK] = self.cast_bytes[k]


class _RawTile:
    """Traced inline: the tile as ``_load_tile`` would hold it, converted from the raw loads
    one pass at a time: ``tile[i]`` is pass i's fp32 fragment (0 past the block's ``valid``
    rows or past the last column)."""

    def __init__(self, raw: list, valid, col, row0, cols):
        self.raw, self.valid, self.col, self.row0, self.cols = raw, valid, col, row0, cols

    def __getitem__(self, i: int):
        values = self.raw[i].load().to(Float32)
        converted = cute.make_rmem_tensor((VEC,), Float32)
        keep_row = self.row0 + i * ROWS_PER_PASS < self.valid
        for k in range(VEC):
            kept = cutlass.select_(keep_row, values[k], Float32(0.0))
            converted[k] = cutlass.select_(self.col < self.cols, kept, Float32(0.0))
        return converted


class _TableRow:
    """Traced inline: a block's row of the span table (first_row, valid, group, starts: one
    16-byte load) and the previous block's group (-1 for block 0), read once at the start."""

    def __init__(self, table: cute.Tensor, block):
        fields = table[block, None].load()
        self.first_row, self.valid, self.group, self.starts = (fields[0], fields[1], fields[2],
                                                               fields[3])
        previous = table[cutlass.max(block - 1, 0), 2]
        self.previous = cutlass.select_(block > 0, previous, Int32(-1))


def _load_extent(extents: cute.Tensor, group):
    """Traced inline: extents[group] = (first block, end block) as loaded (one 8-byte load;
    the group clamped into the buffer, its values then used only for a group in range)."""
    return extents[cutlass.min(group, extents.shape[0] - 1), None].load()


def _new_raw_tile(t: cute.Tensor) -> list:
    """Traced inline: PASSES zeroed rmem fragments of VEC elements of t's type."""
    raw = [cute.make_rmem_tensor((VEC,), t.element_type) for _ in range(PASSES)]
    for fragment in raw:
        fragment.fill(0.0)
    return raw


@cute.jit
def _issue_row_maxima_loads(row_amax: cute.Tensor, first_row, valid, row0,
                            row_maxima: cute.Tensor):
    """row_maxima[i] = row_amax[first_row + min(row0 + 32 i, valid - 1)]: the row amax of each
    of the thread's tile rows (clamped into the valid rows, as the tile's loads are)."""
    for i in cutlass.range_constexpr(PASSES):
        r = row0 + i * ROWS_PER_PASS
        row_maxima[i] = row_amax[first_row + cutlass.min(r, valid - 1)]
