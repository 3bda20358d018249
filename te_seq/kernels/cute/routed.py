"""Routed rows in the varlen-M grouped GEMM: A rows gathered by index, C rows scattered by index.

Shape legend: T token rows, M routed rows, K reduction dim, N output dim. ``route`` is int32 [M].

* gather (``route`` gives A's rows): A row r of the GEMM is ``a[route[r]]`` of a token matrix
  a [T, K], so the routed copy [M, K] is never built. TMA cannot gather rows on sm_90, so the
  whole producer warpgroup loads A with cp.async (16 bytes per thread and row chunk; each thread
  caches the source rows of its 8 tile rows once per tile) while its first warp TMA-loads B as
  before. A stage's full barrier then completes on B's transaction bytes plus one arrival of
  each producer thread (``cp.async.mbarrier.arrive.noinc``: it fires when the thread's copies
  have landed). K must be a multiple of the 64-column k-tile (no partial chunk to zero-fill);
  A is not multicast (cluster_n = 1). Rows past the group load token row 0; their results are
  dropped by the ragged store as before.
* scatter (``route`` gives C's rows): C row ``route[r]`` receives the GEMM's row r. TMA cannot
  scatter rows, so after a (128 x 32) subtile is staged in smem the 256 epilogue threads store
  it, 16 bytes per thread and row chunk (2 rows each), skipping rows past the group and
  columns past N (N a multiple of 8). ``route`` must be a permutation for a deterministic
  result (no two rows land on one).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr

_VEC_BITS = 128  # one cp.async / store chunk: 16 bytes


class _ScatterTile(NamedTuple):
    """One tile's scatter context (trace-time bundle)."""

    sC: object  # the smem store ring
    mC: object  # C [M, N] in global memory (plain, not a TMA view)
    dst: object  # rmem Int32 [2]: the C row of each of this thread's 2 subtile rows (-1: none)
    row: object  # this thread's first row in the subtile (the second is row + 64)
    chunk: object  # this thread's 16-byte chunk of a subtile row
    col0: object  # the tile's first column in C


class RoutedMixin:
    """``_producer_gather`` (the cp.async + TMA producer) and the scatter store of
    ``GroupedGemmKernel``; on when the kernel is built with ``route="gather"`` / ``"scatter"``."""

    def _gather_copy(self):
        """cp.async tiled copy of an A tile (tm x tk) by the producer warpgroup: threads along K
        (tk / 8 per row), 8 elements each."""
        atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
            self.a_dtype,
            num_bits_per_copy=_VEC_BITS,
        )
        vec = _VEC_BITS // self.a_dtype.width
        per_row = self.tile_mnk[2] // vec
        threads = cute.make_layout(
            (self.threads_per_warpgroup // per_row, per_row), stride=(per_row, 1)
        )
        return cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, vec)))

    @cute.jit
    def _gather_sources(self, route, coords, row_base, rows_left):
        """The token row of each of this thread's tile rows (0 past the group)."""
        n = cute.size(coords, mode=[1])
        src = cute.make_rmem_tensor(n, Int32)
        for i in cutlass.range_constexpr(n):
            r = coords[(0, i, 0)][0]
            src[i] = Int32(0)
            if r < rows_left:
                src[i] = route[row_base + r]
        return src

    @cute.jit
    def _gather_a_tile(self, thr, mA, src, coords, tAsA, k, stage):
        """cp.async this thread's chunks of k-tile ``k`` of the gathered A tile into ``stage``."""
        vec = _VEC_BITS // self.a_dtype.width
        chunk = (coords[(0, 0, 0)][1] + k * self.tile_mnk[2]) // vec
        for i in cutlass.range_constexpr(cute.size(src)):
            row = cute.zipped_divide(mA[src[i], None], (vec,))  # ((vec), K / vec)
            dst = tAsA[(None, i, 0, stage)]
            cute.copy(thr, row[(None, chunk)], dst)

    @cute.jit
    def _producer_gather(self, mA, route, tma_b, mB, sA, sB, ab_pipe, sched, tidx):
        """The producer warpgroup with gathered A: every thread cp.asyncs its A chunks, warp
        ``load_warp`` also TMA-loads B (``tma_b``: its atoms, as ``_producer``'s) and expects
        its bytes on the stage's full barrier."""
        offs, _, k_dim, _, _, cluster_coord, _ = sched
        tm, tn, tk = self.tile_mnk
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        thr = self._gather_copy().get_slice(tidx)
        tAsA = thr.partition_D(sA)  # ((vec, 1), rows per thread, 1, stage)
        coords = thr.partition_S(cute.make_identity_tensor((tm, tk)))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        cursor = self._first_cursor(sched)
        work, cursor = self._next_work(sched, cursor)
        valid, group, m_tile, n_tile, row0, rows, solo = work
        while valid:
            gB = cute.local_tile(mB[None, None, group], (tn, tk), (n_tile, None))
            b_loads = self._b_loads(tma_b, sB, gB, cluster_coord)
            k_tiles = self._k_tiles(group, rows, offs, k_dim)
            src = self._gather_sources(route, coords, row0 + m_tile * tm, rows - m_tile * tm)
            for k in range(k_tiles):
                if warp == self.load_warp:
                    ab_pipe.producer_acquire(state)
                    bar = ab_pipe.producer_get_barrier(state)
                    self._copy_b(b_loads, solo, k, state.index, bar)
                else:
                    ab_pipe.sync_object_empty.wait(state.index, state.phase)
                self._gather_a_tile(thr, mA, src, coords, tAsA, k, state.index)
                cute.arch.cp_async_mbarrier_arrive_noinc(ab_pipe.producer_get_barrier(state))
                state.advance()
            work, cursor = self._next_work(sched, cursor)
            valid, group, m_tile, n_tile, row0, rows, solo = work
        if warp == self.load_warp:
            ab_pipe.producer_tail(state)

    # ---------------------------------------------------------------- scatter store

    @cute.jit
    def _scatter_tile(self, ep, row_base, rows_left, n_tile):
        """This thread's scatter context for a tile (None unless the kernel scatters)."""
        if const_expr(self.route != "scatter"):
            return None
        route, mC = ep.routes
        vec = _VEC_BITS // self.c_dtype.width
        per_row = self.epi_tile[1] // vec  # 16-byte chunks per subtile row
        row = ep.mma_tidx // per_row
        dst = cute.make_rmem_tensor(2, Int32)
        for j in cutlass.range_constexpr(2):
            r = row + j * (self.num_mma_threads // per_row)
            dst[j] = Int32(-1)
            if r < rows_left:
                dst[j] = route[row_base + r]
        return _ScatterTile(ep.sC, mC, dst, row, ep.mma_tidx % per_row, n_tile * self.tile_mnk[1])

    @cute.jit
    def _scatter_subtile(self, sc: _ScatterTile, slot, e):
        """Store ring slot ``slot`` (subtile ``e`` of the tile) to its C rows: 16 bytes per
        thread and row, rows past the group and columns past N skipped."""
        vec = _VEC_BITS // self.c_dtype.width
        per_row = self.epi_tile[1] // vec
        col = sc.col0 + e * self.epi_tile[1] + sc.chunk * vec
        n_dim = cute.size(sc.mC, mode=[1])
        regs = cute.make_rmem_tensor(vec, self.c_dtype)
        for j in cutlass.range_constexpr(2):
            r = sc.row + j * (self.num_mma_threads // per_row)
            if (sc.dst[j] >= 0) & (col < n_dim):
                row_s = cute.zipped_divide(sc.sC[r, None, slot], (vec,))
                cute.autovec_copy(row_s[(None, sc.chunk)], regs)
                out = cute.zipped_divide(sc.mC[sc.dst[j], None], (vec,))
                cute.autovec_copy(regs, out[(None, col // vec)])
