"""The producer and consumer roles of the grouped GEMM's warp-specialized kernel.

The producer warp TMA-loads A and B tiles into the ``ab_stage``-deep smem ring (multicast across
the cluster); each consumer warpgroup waits for a stage, runs WGMMA on its 64 rows of the
128 × tile_n tile and releases the stage, then hands the fp32 accumulators to the epilogue hook
``_store_tile`` (``store_epilogue``, or a subclass's). Ping-pong (``_pingpong_tiles``): each
consumer warpgroup runs whole tiles, every other one, in turns ordered by named barriers.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, const_expr

from .ragged import _ragged_group
from .store_epilogue import _EpilogueState


class MainloopMixin:
    """``_producer`` and ``_consumer`` (with ``_mainloop``) of ``GroupedGemmKernel``: both walk
    the units of ``TileSchedulerMixin._work``. Uses the kernel's tile, cluster and warpgroup
    attributes and what ``_setup`` derives (``ab_stage``, ``c_layout``, dtypes).
    """

    @cute.jit
    def _tile_tensors(self, mA, mB, group, m_tile, n_tile, row0, rows):
        """The (bM, bK, k) and (bN, bK, k) global tiles of one work unit."""
        tm, tn, tk = self.tile_mnk
        if const_expr(self.varlen == "m"):
            mA_g = cute.domain_offset((row0, 0), mA)
            mB_g = mB[None, None, group]
        elif const_expr(self.ragged_k):
            mA_g = _ragged_group(mA, 1, row0, rows)
            mB_g = _ragged_group(mB, 1, row0, rows)
        else:  # zero-padded spans that start on a k-tile
            mA_g = cute.domain_offset((0, row0), mA)
            mB_g = cute.domain_offset((0, row0), mB)
        gA = cute.local_tile(mA_g, (tm, tk), (m_tile, None))
        gB = cute.local_tile(mB_g, (tn, tk), (n_tile, None))
        return gA, gB

    @cute.jit
    def _k_tiles(self, group, rows, offs, k_dim):
        """K-tile count of a unit. The virtual group past offs[-1] loads nothing (zero rows)."""
        tk = self.tile_mnk[2]
        k_tiles = Int32(0)
        if const_expr(self.varlen == "m"):
            if (group < cute.size(offs)) & (rows > 0):
                k_tiles = (k_dim + tk - 1) // tk
        else:
            k_tiles = (rows + tk - 1) // tk
        return k_tiles

    @cute.jit
    def _b_partition(self, tma_b, sB, gB, cluster_coord):
        """(smem, gmem) TMA partitions of a B tile, multicast across the cluster's m-tiles."""
        return cute.nvgpu.cpasync.tma_partition(
            tma_b,
            cluster_coord[0],
            cute.make_layout(self.cluster_m),
            cute.group_modes(sB, 0, 2),
            cute.group_modes(gB, 0, 2),
        )

    @cute.jit
    def _b_loads(self, tma_b, sB, gB, cluster_coord):
        """The producer's B loads of one unit: (multicast ones, solo ones or None). With
        ``split_tail`` a unit is loaded by one of them as ``solo`` says (``tile_scheduler``):
        the multicast atom and mask, or ``tma_b``'s second, unicast atom for the whole tile."""
        b_mask = None
        if const_expr(self.cluster_m > 1):  # CTAs of one n-tile share B
            cta_layout = cute.make_layout((self.cluster_m, self.cluster_n, 1))
            b_mask = cute.make_layout_image_mask(cta_layout, cluster_coord, mode=0)
        shared = (tma_b[0], *self._b_partition(tma_b[0], sB, gB, cluster_coord), b_mask)
        if const_expr(not self.split_tail):
            return shared, None
        own = cute.nvgpu.cpasync.tma_partition(
            tma_b[1], 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
            cute.group_modes(gB, 0, 2),
        )
        return shared, (tma_b[1], *own, None)

    @cute.jit
    def _copy_b(self, loads, solo, k, stage, bar):
        """Load B's k-tile ``k`` into ``stage`` through the unit's loads (``_b_loads``)."""
        shared, own = loads
        if const_expr(own is None):
            _tma_copy(shared, k, stage, bar)
        else:
            if solo == 1:
                _tma_copy(own, k, stage, bar)
            else:
                _tma_copy(shared, k, stage, bar)

    @cute.jit
    def _producer(self, tma_a, mA, tma_b, mB, sA, sB, ab_pipe, sched):
        """``tma_b``: B's TMA atoms, (multicast, unicast); the second only with
        ``split_tail``."""
        offs, _, k_dim, _, _, cluster_coord, _ = sched
        a_mask = None
        if const_expr(self.cluster_n > 1):  # CTAs of one m-tile share A
            cta_layout = cute.make_layout((self.cluster_m, self.cluster_n, 1))
            a_mask = cute.make_layout_image_mask(cta_layout, cluster_coord, mode=1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        cursor = self._first_cursor(sched)
        work, cursor = self._next_work(sched, cursor)
        valid, group, m_tile, n_tile, row0, rows, solo = work
        while valid:
            gA, gB = self._tile_tensors(mA, mB, group, m_tile, n_tile, row0, rows)
            k_tiles = self._k_tiles(group, rows, offs, k_dim)
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_a,
                cluster_coord[1],
                cute.make_layout(self.cluster_n),
                cute.group_modes(sA, 0, 2),
                cute.group_modes(gA, 0, 2),
            )
            b_loads = self._b_loads(tma_b, sB, gB, cluster_coord)
            for k in range(k_tiles):
                ab_pipe.producer_acquire(state)
                bar = ab_pipe.producer_get_barrier(state)
                _tma_copy((tma_a, tAsA, tAgA, a_mask), k, state.index, bar)
                self._copy_b(b_loads, solo, k, state.index, bar)
                ab_pipe.producer_commit(state)
                state.advance()
            work, cursor = self._next_work(sched, cursor)
            valid, group, m_tile, n_tile, row0, rows, solo = work
        ab_pipe.producer_tail(state)

    @cute.jit
    def _mainloop(
        self, tiled_mma, acc, tCrA, tCrB, ab_pipe, read, release, k_tiles, issued=None,
        first_atom=False,
    ):
        """acc = Σ_k A_k B_kᵀ over ``k_tiles`` stages; one WGMMA batch kept in flight
        (the WGMMAs accumulate: acc is zeroed first). ``issued`` (ping-pong): the named barrier
        to arrive on once the last WGMMAs are issued, before waiting for them. ``first_atom``
        (ping-pong, trace-time): only the tile's first 64-row WGMMA atom runs; the other
        accumulators stay zero (``_pingpong_mainloop``).

        Zeroing acc here rather than overwriting it with the first WGMMA (scale-d off, as
        ``issue_k_tile`` can) is deliberate: the fill ends the previous tile's accumulators'
        live range at its epilogue. Without it ptxas keeps them live into the next tile's
        first WGMMA, and the FP8 row-wise 192-wide ping-pong kernel spills 100 B."""
        acc.fill(0.0)
        for k in range(k_tiles):
            ab_pipe.consumer_wait(read)
            issue_k_tile(tiled_mma, acc, tCrA, tCrB, read.index, False, first_atom)
            read.advance()
            if k > 0:
                cute.nvgpu.warpgroup.wait_group(1)
                ab_pipe.consumer_release(release)
                release.advance()
        if const_expr(issued is not None):
            issued.arrive()
        cute.nvgpu.warpgroup.wait_group(0)
        if k_tiles > 0:
            ab_pipe.consumer_release(release)
            release.advance()
        return read, release

    @cute.jit
    def _consumer(
        self, tma_c, mC, sA, sB, sC, ab_pipe, sched, tidx, tiled_mma, epi, extra_bar, routes,
        scratch,
    ):
        tm, tn, tk = self.tile_mnk
        # the MMA warpgroup (0 or 1) and this thread's index among its tile's MMA threads
        wg = cute.arch.make_warp_uniform(tidx // self.threads_per_warpgroup) - 1
        mma_tidx = tidx - self.threads_per_warpgroup
        if const_expr(self.pingpong):  # each warpgroup runs whole tiles
            mma_tidx = tidx % self.threads_per_warpgroup
            thr_mma = tiled_mma.get_slice(0)
        else:
            wg_layout = cute.make_layout(
                self.num_mma_warpgroups, stride=self.threads_per_warpgroup
            )
            thr_mma = tiled_mma.get_slice(wg_layout(mma_tidx // self.threads_per_warpgroup))
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((tm, tn)), self.acc_dtype)

        # Epilogue: registers -> smem (stmatrix for 16-bit) -> TMA store, per (tm x 32) subtile.
        tiled_r2s = stmatrix_tiled_copy(self.c_layout, self.c_dtype, self.acc_dtype, tiled_mma)
        thr_r2s = tiled_r2s.get_slice(mma_tidx)
        tRS_sC = thr_r2s.partition_D(sC)
        tRS_acc = tiled_r2s.retile(acc)
        rD_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
        rD = cute.make_rmem_tensor(rD_shape, self.acc_dtype)
        rD_out = cute.make_rmem_tensor(rD_shape, self.c_dtype)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if const_expr(self.pingpong):  # the second warpgroup's warps 8-11 act as warps 4-7
            warp = warp - 4 * wg
            if const_expr(scratch is not None):  # each warpgroup's tiles use their own block
                words = self.epi_scratch_words
                scratch = cute.make_tensor(scratch.iterator + wg * words, cute.make_layout(words))

        ep = _EpilogueState(
            tma_c,
            mC,
            sC,
            tiled_r2s,
            tRS_acc,
            tRS_sC,
            rD,
            rD_out,
            warp,
            tiled_mma,
            mma_tidx,
            epi,
            extra_bar,
            routes,
            scratch,
        )
        if const_expr(self.pingpong):
            self._pingpong_tiles(ep, acc, tCrA, tCrB, ab_pipe, sched, wg)
        else:
            self._cooperative_tiles(ep, acc, tCrA, tCrB, ab_pipe, sched)
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # smem stays valid until TMA read it

    @cute.jit
    def _cooperative_tiles(self, ep, acc, tCrA, tCrB, ab_pipe, sched):
        """Both MMA warpgroups on every unit of this cluster, in the cursor's order."""
        offs, _, k_dim, _, _, _, _ = sched
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        epi_count = Int32(0)
        tiled_mma = ep.tiled_mma
        cursor = self._first_cursor(sched)
        work, cursor = self._next_work(sched, cursor)
        valid, group, m_tile, n_tile, row0, rows, _ = work
        while valid:
            k_tiles = self._k_tiles(group, rows, offs, k_dim)
            self._before_mainloop(ep, group, m_tile, n_tile, row0, epi_count)
            read, release = self._mainloop(
                tiled_mma, acc, tCrA, tCrB, ab_pipe, read, release, k_tiles
            )
            num_epi = self._store_tile(ep, acc, group, m_tile, n_tile, row0, rows, epi_count)
            epi_count = epi_count + num_epi
            work, cursor = self._next_work(sched, cursor)
            valid, group, m_tile, n_tile, row0, rows, _ = work

    @cute.jit
    def _pingpong_tiles(self, ep, acc, tCrA, tCrB, ab_pipe, sched, wg):
        """Ping-pong: MMA warpgroup ``wg`` takes every other unit of this cluster's sequence
        (units wg, wg + 2, ...) and skips its peer's stages in the A/B ring. Named barriers
        order them: the tensor cores run the tiles in unit order (a warpgroup starts its
        mainloop once the peer has issued its last WGMMAs) and the epilogues one at a time,
        each after the peer's (which drained its TMA stores' smem reads: the store ring is
        shared), so one warpgroup's epilogue overlaps the other's mainloop."""
        offs, _, k_dim, _, _, _, _ = sched
        mma_turn, mma_peer = self._turn_barriers(2, wg)
        epi_turn, epi_peer = self._turn_barriers(4, wg)
        if wg == 0:  # the first turns are warpgroup 0's
            mma_turn.arrive()
            epi_turn.arrive()
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        cursor = self._first_cursor(sched)
        if wg == 1:
            read, release, cursor = self._skip_unit(sched, cursor, read, release)
        epi_count = Int32(0)
        work, cursor = self._next_work(sched, cursor)
        valid, group, m_tile, n_tile, row0, rows, _ = work
        while valid:
            k_tiles = self._k_tiles(group, rows, offs, k_dim)
            self._before_mainloop(ep, group, m_tile, n_tile, row0, epi_count)
            mma_turn.arrive_and_wait()
            read, release = self._pingpong_mainloop(
                ep, acc, (tCrA, tCrB), ab_pipe, (read, release), k_tiles, mma_peer,
                rows - m_tile * self.tile_mnk[0],
            )
            epi_turn.arrive_and_wait()
            num_epi = self._store_tile(ep, acc, group, m_tile, n_tile, row0, rows, epi_count)
            epi_count = epi_count + num_epi
            if ep.warp == self.epi_store_warp:  # the peer's epilogue reuses the store ring
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            epi_peer.arrive()
            read, release, cursor = self._skip_unit(sched, cursor, read, release)
            work, cursor = self._next_work(sched, cursor)
            valid, group, m_tile, n_tile, row0, rows, _ = work

    @cute.jit
    def _pingpong_mainloop(self, ep, acc, frags, ab_pipe, states, k_tiles, issued, tile_rows):
        """One ping-pong tile's mainloop. With ``half_tiles`` (varlen M) a tile whose group
        rows end within its first 64 (``tile_rows`` <= 64: an expert's last, partial tile)
        runs only its first 64-row WGMMA atom, half the MMA work; the other 64 rows keep zero
        accumulators, rows past the group that the ragged stores drop."""
        tCrA, tCrB = frags
        read, release = states
        if const_expr(self.half_tiles):
            if tile_rows <= self.tile_mnk[0] // 2:
                read, release = self._mainloop(
                    ep.tiled_mma, acc, tCrA, tCrB, ab_pipe, read, release, k_tiles, issued,
                    first_atom=True,
                )
            else:
                read, release = self._mainloop(
                    ep.tiled_mma, acc, tCrA, tCrB, ab_pipe, read, release, k_tiles, issued
                )
        else:
            read, release = self._mainloop(
                ep.tiled_mma, acc, tCrA, tCrB, ab_pipe, read, release, k_tiles, issued
            )
        return read, release

    def _turn_barriers(self, first_id: int, wg):
        """(own, peer) 256-thread named barriers of a ping-pong turn, ids ``first_id`` + wg:
        a warpgroup waits on its own (its 128 threads plus the peer's 128 arrivals) and
        hands the turn over by arriving on the peer's."""
        own = pipeline.NamedBarrier(barrier_id=first_id + wg, num_threads=256)
        peer = pipeline.NamedBarrier(barrier_id=first_id + 1 - wg, num_threads=256)
        return own, peer

    @cute.jit
    def _skip_unit(self, sched, cursor, read, release):
        """Advance the A/B read and release states past the stages of the cursor's next unit
        (the peer's); returns them and the cursor after it."""
        work, cursor = self._next_work(sched, cursor)
        valid, group, _, _, _, rows, _ = work
        skip = Int32(0)
        if valid:
            skip = self._k_tiles(group, rows, sched.offs, sched.k_dim)
        read.advance(skip)
        release.advance(skip)
        return read, release, cursor


@cute.jit
def _tma_copy(load, k, stage, bar):
    """One TMA load of k-tile ``k`` into smem ``stage``; ``load`` = (atom, smem partition, gmem
    partition, multicast mask or None)."""
    atom, smem, gmem, mask = load
    cute.copy(atom, gmem[(None, k)], smem[(None, stage)], tma_bar_ptr=bar, mcast_mask=mask)


def _first_m(t):
    """The first m-index of an MMA partition (V, MMA_M, ...) as a (V, 1, ...) view: the first
    64-row WGMMA atom's operand or accumulators (a layout composition, no copy)."""
    rest = [1] * (cute.rank(t) - 1)
    return cute.composition(t, cute.make_layout((cute.shape(t, mode=[0]), *rest)))


def stmatrix_tiled_copy(c_layout, c_dtype, acc_dtype, tiled_mma):
    """The epilogue's register -> smem copy of ``tiled_mma``'s accumulators (converted to
    ``c_dtype``): stmatrix for 16-bit outputs, tiled on the MMA's C layout."""
    r2s_atom = sm90_utils.sm90_get_smem_store_op(c_layout, c_dtype, acc_dtype)
    stm_atom = cute.make_copy_atom(
        cute.nvgpu.warp.StMatrix8x8x16bOp(c_layout.is_m_major_c(), 4), c_dtype
    )
    return cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stm_atom, tiled_mma))


@cute.jit
def issue_k_tile(tiled_mma, acc, tCrA, tCrB, stage, zero_init, first_atom=False):
    """Issue (and commit) one k-tile's WGMMAs from smem ``stage`` into acc. With ``zero_init``
    (a trace-time or run-time bool) the first WGMMA overwrites acc (its scale-d predicate off)
    instead of adding to it, so acc needs no zeroing first. ``first_atom`` (trace-time): only
    the first 64-row atom's WGMMAs. The atom is made here, not taken from ``tiled_mma``: a
    field set inside a dynamic loop must not leak out of it."""
    mma_atom = cute.make_mma_atom(tiled_mma.op)
    mma_atom.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, not zero_init)
    cute.nvgpu.warpgroup.fence()
    for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        a, b = tCrA[None, None, kb, stage], tCrB[None, None, kb, stage]
        if const_expr(first_atom):
            cute.gemm(mma_atom, _first_m(acc), _first_m(a), b, _first_m(acc))
        else:
            cute.gemm(mma_atom, acc, a, b, acc)
        mma_atom.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
    cute.nvgpu.warpgroup.commit_group()
