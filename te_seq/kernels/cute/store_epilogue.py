"""The store epilogue of the grouped GEMM: accumulators -> smem ring -> TMA store.

Per (tm x epi_cols) subtile (32 columns, or 64: ``GroupedGemmKernel.epi_cols``) the consumer
warpgroups convert the fp32 accumulators to the output type, stage them in a ring of smem
buffers and one warp TMA-stores them; with ``accumulate`` (varlen K into an existing C) the old
C subtiles are TMA-loaded into ``old_c_blocks`` (2 or 3) extra smem blocks (subtile g of the
CTA's running count in block g % blocks, one mbarrier each; in ping-pong each warpgroup has its
own blocks and count) and added first: a tile's first loads (one per block) are issued before
its mainloop, each later one as soon as its block is free, so the epilogue waits for none it
could have had earlier.
The ring helpers (``_store_group``, ``_ring_reserve``, ``_ring_flush``) are shared with the GLU
epilogues (``glu_epilogue``), which override the hooks ``_make_epi`` and ``_store_tile``.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .ragged import _ragged_group


class _EpilogueState(NamedTuple):
    """Loop-invariant epilogue pieces of a consumer warpgroup (trace-time bundle)."""

    tma_c: object
    mC: object
    sC: object
    tiled_r2s: object
    tRS_acc: object
    tRS_sC: object
    rD: object
    rD_out: object
    warp: object
    tiled_mma: object
    mma_tidx: object
    epi: tuple
    extra_bar: object  # pointer to the subclass's extra mbarriers (smem)
    routes: tuple  # scatter: (route [M], C [M, N]) (routed.py); else unused
    scratch: object  # the subclass's fp32 smem scratch (``epi_scratch_words``); else None


class StoreEpilogueMixin:
    """The epilogue hooks of ``GroupedGemmKernel`` and the store ring. Uses the kernel's
    ``epi_tile``, ``epi_stage``, ``epi_batch``, ``epi_store_warp``, ``epi_barrier``,
    ``c_smem``, ``c_dtype``, ``tile_mnk``, ``varlen`` and ``accumulate``.
    """

    def _make_epi(self, c: cute.Tensor, epi_inputs: tuple) -> tuple:
        """Host-side (jit) epilogue state passed to the kernel: extra TMA atoms, tensors. Here:
        with ``accumulate``, the TMA load atom (and coordinates) of the old C."""
        if not self.accumulate:
            return ()
        return cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            c,
            cute.slice_(self.c_smem, (None, None, 0)),
            self.epi_tile,
        )

    @cute.jit
    def _store_tile(self, ep, acc, group, m_tile, n_tile, row0, rows, epi_count):
        """Epilogue hook: write one tile's accumulators (added to the old C with ``accumulate``);
        returns the number of smem stores used."""
        tm, tn, _ = self.tile_mnk
        if const_expr(self.varlen == "m"):
            mC_g = _ragged_group(ep.mC, 0, row0, rows)
        else:
            mC_g = ep.mC[None, None, group]
        gC = cute.local_tile(mC_g, (tm, tn), (m_tile, n_tile))
        old = None
        if const_expr(self.accumulate):
            old = self._old_tile(ep, group, m_tile, n_tile)
        sc = self._scatter_tile(ep, row0 + m_tile * tm, rows - m_tile * tm, n_tile)
        return self._epilogue(ep, gC, epi_count, old, scatter=sc)

    @cute.jit
    def _old_tile(self, ep, group, m_tile, n_tile):
        """(TMA load atom, gmem tile) of the old C of a tile (``accumulate``, varlen K)."""
        tm, tn, _ = self.tile_mnk
        tma_old, m_old = ep.epi
        return tma_old, cute.local_tile(m_old[None, None, group], (tm, tn), (m_tile, n_tile))

    @cute.jit
    def _before_mainloop(self, ep, group, m_tile, n_tile, row0, epi_count):
        """Hook before a tile's mainloop. With ``accumulate``: start loading the tile's first
        ``old_c_blocks`` old C subtiles (their smem blocks are free: the last tile's epilogue
        is done)."""
        if const_expr(self.accumulate):
            loads = self._old_c_loads(ep, self._old_tile(ep, group, m_tile, n_tile))
            for e in cutlass.range_constexpr(
                    min(self.old_c_blocks, self.tile_mnk[1] // self.epi_cols)):
                self._load_old_c(ep, loads, e, epi_count)

    @cute.jit
    def _epilogue(self, ep, gC, epi_count, old, bias_tile=None, scatter=None, scale_tile=None):
        """Store the accumulators of one tile: per (tm x epi_cols) subtile, (add the old C
        subtile, which TMA loads into the extra smem block,) (add the bias: ``bias_epilogue``,
        ``bias_tile`` its context,) (multiply by the row and column scales: ``scale_epilogue``,
        ``scale_tile`` its context,) convert to the output type, copy to a ring of smem buffers
        and TMA-store (``scatter``: the threads store the rows, ``routed``), ``epi_batch``
        subtiles per pair of barriers; returns the number of subtiles."""
        gC_epi = cute.zipped_divide(gC, self.epi_tile)
        bSG_sC, bSG_gC = cute.nvgpu.cpasync.tma_partition(
            ep.tma_c, 0, cute.make_layout(1), cute.group_modes(ep.sC, 0, 2), gC_epi
        )
        num_epi = cute.size(gC_epi, mode=[1])
        epi_layout = cute.make_layout(gC_epi.shape[1], stride=(gC_epi.shape[1][1], 1))
        size_rD = cute.size(ep.rD)
        loads = None
        batch = self._batch(num_epi)
        if const_expr(old is not None):
            loads = self._old_c_loads(ep, old)
            batch = 1
        outs = [ep.rD_out]
        outs += [cute.make_rmem_tensor(ep.rD.shape, self.c_dtype) for _ in range(batch - 1)]
        for b in cutlass.range_constexpr(num_epi // batch):
            items = []
            for i in cutlass.range_constexpr(batch):
                e = b * batch + i
                for v in cutlass.range_constexpr(size_rD):
                    ep.rD[v] = ep.tRS_acc[self._acc_index(ep, e, v)]
                if const_expr(bias_tile is not None):
                    for v in cutlass.range_constexpr(size_rD):
                        ep.rD[v] = ep.rD[v] + self._bias_at(bias_tile, self._acc_index(ep, e, v))
                if const_expr(scale_tile is not None):  # dequantization scales (scale_epilogue)
                    for v in cutlass.range_constexpr(size_rD):
                        ep.rD[v] = self._scaled_at(scale_tile, self._acc_index(ep, e, v), ep.rD[v])
                if const_expr(old is not None):
                    self._add_old_c(ep, loads, e, num_epi, epi_count)
                outs[i].store(ep.rD.load().to(self.c_dtype))
                items.append((outs[i], ep.tma_c, bSG_sC, bSG_gC, epi_layout.get_hier_coord(e)))
            self._store_group(
                ep.tiled_r2s, ep.tRS_sC, ep.warp, items, epi_count + b * batch, scatter
            )
        return num_epi

    @cute.jit
    def _old_c_loads(self, ep, old):
        """TMA partitions of the old C tile per (tm x 32) subtile, the tile coordinates of
        this thread's accumulator values (in ``tRS_acc``'s order) and the subtile layout."""
        tma_old, g_old = old
        g_epi = cute.zipped_divide(g_old, self.epi_tile)
        s_l, g_l = cute.nvgpu.cpasync.tma_partition(
            tma_old, 0, cute.make_layout(1), cute.group_modes(ep.sC, 0, 2), g_epi
        )
        c_tile = cute.make_identity_tensor(self.tile_mnk[:2])
        coords = ep.tiled_r2s.retile(ep.tiled_mma.get_slice(ep.mma_tidx).partition_C(c_tile))
        epi_layout = cute.make_layout(g_epi.shape[1], stride=(g_epi.shape[1][1], 1))
        return tma_old, s_l, g_l, coords, epi_layout

    @cute.jit
    def _load_old_c(self, ep, loads, e: int, epi_count):
        """Start the TMA load of subtile ``e`` of the old C into extra smem block g % blocks,
        g = ``epi_count`` + e (the CTA's running subtile count); that block's mbarrier completes
        one phase per load. Values past C's bounds are zero-filled."""
        tma_old, s_l, g_l, _, epi_layout = loads
        buf = self._old_c_block(epi_count + e)
        if ep.warp == self.epi_store_warp:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(
                    ep.extra_bar + buf,
                    self.epi_tile[0] * self.epi_tile[1] * self.c_dtype.width // 8,
                )
            cute.copy(
                tma_old,
                g_l[(None, epi_layout.get_hier_coord(e))],
                s_l[(None, self.epi_stage + buf)],
                tma_bar_ptr=ep.extra_bar + buf,
            )

    @cute.jit
    def _add_old_c(self, ep, loads, e: int, num_epi: int, epi_count):
        """rD += subtile ``e`` of the old C (block g % blocks, its load phase g // blocks); then
        the block is free and the load of subtile e + blocks starts."""
        coords = loads[3]
        size_rD = cute.size(ep.rD)
        g = epi_count + e
        buf = self._old_c_block(g)
        cute.arch.mbarrier_wait(ep.extra_bar + buf, (g // self.old_c_blocks) % 2)
        for v in cutlass.range_constexpr(size_rD):
            r, cc = coords[self._acc_index(ep, e, v)]
            ep.rD[v] = ep.rD[v] + ep.sC[r, cc - self.epi_cols * e, self.epi_stage + buf].to(
                Float32)
        self._sync_for_tma()  # the block is free for its next load
        if const_expr(e + self.old_c_blocks < num_epi):
            self._load_old_c(ep, loads, e + self.old_c_blocks, epi_count)

    def _old_c_block(self, g):
        """The old-C smem block (and mbarrier) of subtile ``g`` of the running count: g %
        ``old_c_blocks``, in ping-pong within this warpgroup's own set (its count is its own)."""
        block = g % self.old_c_blocks
        if self.pingpong:
            wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4 - 1  # warpgroup 0 loads
            block = block + wg * self.old_c_blocks
        return block

    def _acc_index(self, ep, e: int, v: int) -> int:
        """Flat index in ``tRS_acc`` (and in coordinate views retiled the same way) of value
        ``v`` (in ``rD``'s order) of epilogue subtile ``e`` (trace time).

        rD is (copy values, m-atoms, 16-column chunks of the subtile) and tRS_acc ((copy values,
        16-column chunks of the tile), m-atoms, 1). With one 64-row m-atom per thread
        (cooperative: each warpgroup owns 64 rows) subtile e is the run e · size(rD) + v; with
        two (ping-pong: a warpgroup owns all 128 rows) the m-atom mode is outermost in tRS_acc,
        so a subtile takes its chunks from both halves."""
        size_rD = cute.size(ep.rD)
        atoms_m = cute.size(ep.rD, mode=[1])
        if atoms_m == 1:
            return e * size_rD + v
        values, chunks = cute.size(ep.rD, mode=[0]), cute.size(ep.rD, mode=[2])
        tile_chunks = cute.size(ep.tRS_acc) // (values * atoms_m)
        value, rest = v % values, v // values
        m, chunk = rest % atoms_m, rest // atoms_m
        return value + values * (e * chunks + chunk) + values * tile_chunks * m

    def _batch(self, count: int) -> int:
        """Subtiles staged per pair of barriers (trace time): ``epi_batch`` if set, else all but
        one slot of the ring (the TMA store of the last may still be reading it); divides
        ``count``."""
        batch = min(self.epi_batch or max(1, self.epi_stage - 1), self.epi_stage)
        while count % batch:
            batch -= 1
        return batch

    @cute.jit
    def _store_group(self, tiled_r2s, tRS_sC, warp, items: list, count, scatter=None):
        """Stage and TMA-store subtiles in ring slots ``count``, ``count + 1``, ..., ``_batch``
        of them per pair of barriers. ``items``: (registers in the output type, TMA atom, smem
        partition, gmem partition, gmem coordinate). ``scatter``: the routed store's context
        (``routed._ScatterTile``) instead of TMA."""
        batch = self._batch(len(items))
        for b in cutlass.range_constexpr(len(items) // batch):
            self._ring_reserve(warp, batch)
            stores = []
            for i in cutlass.range_constexpr(batch):
                r_out, tma, s_part, g_part, coord = items[b * batch + i]
                slot = (count + b * batch + i) % self.epi_stage
                cute.copy(tiled_r2s, r_out, tRS_sC[(None, None, None, slot)])
                stores.append((tma, s_part, g_part, slot, coord))
            if const_expr(scatter is None):
                self._ring_flush(warp, stores)
            else:
                self.epi_barrier.arrive_and_wait()  # the staged subtiles are visible
                for i in cutlass.range_constexpr(len(stores)):
                    self._scatter_subtile(scatter, stores[i][3], stores[i][4][1])

    @cute.jit
    def _ring_reserve(self, warp, n: int):
        """Before staging ``n`` subtiles in the next ring slots: wait until the TMA stores that
        last used those slots have read them (at most ``epi_stage - n`` stores still reading),
        then sync the epilogue threads."""
        if warp == self.epi_store_warp:
            cute.arch.cp_async_bulk_wait_group(self.epi_stage - n, read=True)
        self.epi_barrier.arrive_and_wait()

    @cute.jit
    def _sync_for_tma(self):
        """Sync the epilogue threads before TMA touches smem they used (stores a slot they
        wrote, refills a block they read): each first fences the async proxy, since the
        barrier orders only their generic accesses. Without the fence the ping-pong
        accumulate read stale old C in about half the calls on an H200 (kernel README,
        section 19)."""
        cute.arch.fence_proxy("async.shared", space="cta")
        self.epi_barrier.arrive_and_wait()

    @cute.jit
    def _ring_flush(self, warp, stores: list):
        """Make the staged subtiles visible to TMA and store them, one bulk group each.
        ``stores``: (TMA atom, smem partition, gmem partition, ring slot, gmem coordinate)."""
        self._sync_for_tma()
        if warp == self.epi_store_warp:
            for i in cutlass.range_constexpr(len(stores)):
                tma, s_part, g_part, slot, coord = stores[i]
                cute.copy(tma, s_part[(None, slot)], g_part[(None, coord)])
                cute.arch.cp_async_bulk_commit_group()
