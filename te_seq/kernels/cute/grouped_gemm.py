"""Persistent, warp-specialized Hopper (sm_90a) grouped GEMM in the CuTe DSL.

Shape legend: M routed rows (tokens), E groups (experts), K reduction dim, N output dim.
Group boundaries come as ``offs`` (int32 cumulative row ends, on the device).

Two problems share one kernel class, chosen by ``varlen``:

* ``"m"`` (forward / dgrad): ``C[rows of e] = A[rows of e] @ B[e]`` with A [M, K] (K-major),
  B seen as (N, K, E) in either major, C [M, N].
* ``"k"`` (wgrad): ``C[e] = A[:, rows of e] @ B[:, rows of e]ᵀ`` with A seen as (N_out, M)
  (M-major: the transpose of grad_out [M, N_out]), B seen as (K_in, M) (the transpose of
  x [M, K_in]), C seen as (N_out, K_in, E).

Work is cut into cluster units (``cluster_m`` m-tiles × ``cluster_n`` n-tiles of one group) that
persistent clusters walk with a fixed stride, m fastest within a group. For ``"m"`` a unit's group
is found from the device prefix sums by a warp-cooperative scan that only moves forward (each warp
caches the group it is in), so the grid depends on M and E alone and the host never reads split
sizes. The CTAs of a 1×2 cluster take neighbouring n-tiles of one m-tile and share A by TMA
multicast (2×1: neighbouring m-tiles share B). 1×2 keeps 128-row granularity on small groups:
on one H200 (2026-11-22) it beat 2×1 by 5–20% on the varlen-M shapes of DESIGN.md.

Bounds are enforced by TMA itself through "ragged" views (see ``_ragged_view``): the store of a
varlen-M tile drops rows past its group, and the loads of a varlen-K tile zero-fill rows past its
group, so partial tiles need no predication and no smem masking.

Roles: warp 0 (of the first warpgroup) issues TMA loads into an ``ab_stage``-deep smem ring; two
MMA warpgroups run WGMMA on a 128 × tile_n tile (64 rows each), then the epilogue converts the fp32
accumulators, stages them in smem and TMA-stores them. (Letting a warpgroup whose 64 rows all lie
past its group skip its MMA was tried: it made random-size experts 5-13% slower on one H200,
2026-11-22, for reasons not established.)
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.memory as memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

# Ragged views (the trick of Triton's ragged TMA): replace the ragged mode of extent L by
# _BIG_INT and append two modes of extent _MAX_INT with strides (2**34 - s, s). Selecting the
# coordinates (_BIG_INT, start + len) of the extra modes and offsetting the ragged mode to
# _BIG_INT - len gives addresses base + (start + r) * s (mod 2**64) for row r, and rows r >= len
# fall past _BIG_INT, where TMA zero-fills loads and drops stores. The base pointer is never
# shifted, so it is safe for loads too.
_BIG_INT = 2**30
_MAX_INT = 2**31 - 1
_WRAP = 2**34  # _BIG_INT * _WRAP == 2**64


def _ragged_view(t: cute.Tensor, mode: int) -> cute.Tensor:
    """A rank-2 tensor viewed with ``mode`` ragged (rank 4), for TMA atoms."""
    s = t.stride[mode]
    shape = list(t.shape)
    shape[mode] = _BIG_INT
    stride = list(t.stride)
    layout = cute.make_layout((*shape, _MAX_INT, _MAX_INT), stride=(*stride, _WRAP - s, s))
    return cute.make_tensor(t.iterator, layout)


def _ragged_group(t: cute.Tensor, mode: int, start: Int32, length: Int32) -> cute.Tensor:
    """Rows [start, start + length) of a ragged TMA coordinate tensor, as a rank-2 tensor."""
    sel = t[(None, None, _BIG_INT, start + length)]
    off = [0, 0]
    off[mode] = _BIG_INT - length
    return cute.domain_offset(tuple(off), sel)


class _Schedule(NamedTuple):
    """What the producer and the consumers need to walk the same work units (trace-time)."""

    offs: object  # int32 [E] cumulative group ends (device)
    num_rows: object  # M
    k_dim: object  # K (varlen M)
    n_tiles: object  # cluster n-units per group
    m_units_k: object  # cluster m-units per group (varlen K)
    cluster_coord: object  # this CTA's (m, n, 1) coordinate in its cluster


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


class GroupedGemmKernel:
    """CuTe DSL kernel: a persistent grouped GEMM over varlen M (``"m"``) or varlen K (``"k"``)."""

    num_mma_warpgroups = 2
    threads_per_warpgroup = 128
    load_warp = 0
    load_registers = 40
    mma_registers = 232
    # Epilogue hook knobs (subclasses): store-ring depth (None: 4 for 16-bit C, else 2), extra
    # (128 x 32) smem buffers after the ring, and extra mbarriers after the mainloop's.
    epi_store_stages: int | None = None
    # Subtiles staged per pair of barriers (None: the ring less one). One per pair measured the
    # same as batches of 2-3 on one H200 (Q GEMMs and GLU steps, 2026-11-22, within 3%).
    epi_batch: int | None = 1
    epi_extra_buffers = 0
    extra_barriers = 0

    def __init__(
        self,
        varlen: str,
        tile_mn: tuple[int, int] = (128, 256),
        cluster_mn: tuple[int, int] = (1, 2),
        accumulate: bool = False,
        store_stages: int | None = None,
    ):
        if varlen not in ("m", "k"):
            raise ValueError(f"GroupedGemmKernel: varlen must be 'm' or 'k', got {varlen!r}")
        if tile_mn[0] != 128 or tile_mn[1] not in (64, 128, 192, 256):
            raise ValueError(f"GroupedGemmKernel: unsupported tile {tile_mn}")
        if cluster_mn not in ((1, 1), (2, 1), (1, 2)):
            raise ValueError(
                f"GroupedGemmKernel: cluster must be 1x1, 2x1 or 1x2, got {cluster_mn}"
            )
        self.varlen = varlen
        self.accumulate = accumulate and varlen == "k"
        if store_stages is not None:
            self.epi_store_stages = store_stages
        if self.accumulate:  # one smem block that TMA fills with the old C subtile, 1 mbarrier
            self.epi_extra_buffers, self.extra_barriers = 1, 1
        self.cluster_m, self.cluster_n = cluster_mn
        self.cluster_size = self.cluster_m * self.cluster_n
        self.tile_mnk = (tile_mn[0], tile_mn[1], 64)
        self.threads = (1 + self.num_mma_warpgroups) * self.threads_per_warpgroup
        self.num_mma_threads = self.num_mma_warpgroups * self.threads_per_warpgroup
        self.epi_store_warp = 4  # first warp of the first MMA warpgroup
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)

    # ---------------------------------------------------------------- host-side (jit) setup

    def _setup(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor) -> None:
        self.a_dtype, self.b_dtype, self.c_dtype = a.element_type, b.element_type, c.element_type
        self.acc_dtype = Float32
        self.a_layout = LayoutEnum.from_tensor(a)
        self.b_layout = LayoutEnum.from_tensor(b)
        self.c_layout = LayoutEnum.from_tensor(c)
        tm, tn, tk = self.tile_mnk
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.a_dtype,
            self.b_dtype,
            self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            (self.num_mma_warpgroups, 1, 1),
            tiler_mn=(64, tn),
        )
        self.epi_tile = (tm, 32)
        self.epi_stage = self.epi_store_stages or (4 if self.c_dtype.width == 16 else 2)
        epi_buffers = self.epi_stage + self.epi_extra_buffers
        ab_bytes = (tm * tk * self.a_dtype.width + tn * tk * self.b_dtype.width) // 8
        epi_bytes = tm * 32 * self.c_dtype.width // 8 * epi_buffers
        smem = memory.get_smem_capacity_in_bytes("sm_90")
        self.ab_stage = (smem - 2048 - epi_bytes) // ab_bytes
        self.a_smem = sm90_utils.make_smem_layout_a(
            self.a_layout, self.tile_mnk, self.a_dtype, self.ab_stage
        )
        self.b_smem = sm90_utils.make_smem_layout_b(
            self.b_layout, self.tile_mnk, self.b_dtype, self.ab_stage
        )
        self.c_smem = sm90_utils.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.epi_tile, epi_buffers
        )

    def _tma_load(self, t: cute.Tensor, smem_staged, tile: tuple[int, int], mcast: int):
        op = (
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            if mcast == 1
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
        )
        smem = cute.slice_(smem_staged, (None, None, 0))
        return cute.nvgpu.cpasync.make_tiled_tma_atom(op, t, smem, tile, num_multicast=mcast)

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,
        b: cute.Tensor,
        c: cute.Tensor,
        offs: cute.Tensor,
        num_clusters: Int32,
        stream,
    ):
        self._launch(a, b, c, offs, num_clusters, stream, b, ())

    # ---------------------------------------------------------------- epilogue hooks
    # Subclasses (``glu_epilogue.GluGemmKernel``) override these to fuse work into the epilogue;
    # the scheduler, producer and mainloop are shared.

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
    def _launch(self, a, b, c, offs, num_clusters, stream, b_tma_view, epi_inputs):
        """Set up, build the TMA atoms (B through ``b_tma_view``, a view of ``b``) and launch."""
        self._setup(a, b, c)
        tm, tn, tk = self.tile_mnk
        a_tma_src, b_tma_src, c_tma_src = a, b_tma_view, c
        if const_expr(self.varlen == "m"):
            c_tma_src = _ragged_view(c, 0)
        else:
            a_tma_src = _ragged_view(a, 1)
            b_tma_src = _ragged_view(b, 1)
        tma_a, mA = self._tma_load(a_tma_src, self.a_smem, (tm, tk), self.cluster_n)
        tma_b, mB = self._tma_load(b_tma_src, self.b_smem, (tn, tk), self.cluster_m)
        tma_c, mC = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
            c_tma_src,
            cute.slice_(self.c_smem, (None, None, 0)),
            self.epi_tile,
        )
        epi = self._make_epi(c, epi_inputs)

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[
                cutlass.Int64, self.ab_stage * 2 + self.extra_barriers
            ]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem)], 1024
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem)], 1024
            ]
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(self.c_smem)], 1024
            ]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_a,
            mA,
            tma_b,
            mB,
            tma_c,
            mC,
            offs,
            a.shape[0],
            a.shape[1],
            self.tiled_mma,
            self.a_smem,
            self.b_smem,
            self.c_smem,
            epi,
        ).launch(
            grid=(self.cluster_m, self.cluster_n, num_clusters),
            block=(self.threads, 1, 1),
            cluster=(self.cluster_m, self.cluster_n, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---------------------------------------------------------------- tile scheduling

    @cute.jit
    def _scan_groups(self, offs: cute.Tensor, num_rows: Int32, n_tiles: Int32, unit: Int32, st):
        """Move the cached group forward until it holds ``unit`` (varlen M).

        ``st`` = (group, first unit, end unit, next group to scan, its first unit, row start,
        row count). Group E (one past the last) is virtual: rows past ``offs[-1]``, written as
        zeros.
        Each round loads 32 groups' sizes, one per lane, and finds the first whose units end past
        ``unit`` by an inclusive warp scan and a ballot.
        """
        group, first, end, nxt, nxt_first, row0, rows = st
        num_groups = cute.size(offs) + 1
        block_m = self.tile_mnk[0] * self.cluster_m
        lane = cute.arch.lane_idx()
        while (unit >= end) & (nxt < num_groups):
            g = nxt + lane
            g_begin = Int32(0)
            g_end = Int32(0)
            if g < num_groups:
                if g > 0:
                    g_begin = offs[g - 1]
                if g < num_groups - 1:
                    g_end = offs[g]
                else:
                    g_end = num_rows
            count = (g_end - g_begin + block_m - 1) // block_m * n_tiles
            incl = count
            for i in cutlass.range_constexpr(5):
                up = cute.arch.shuffle_sync_up(incl, 1 << i)
                if lane >= (1 << i):
                    incl = incl + up
            j = cute.arch.popc(cute.arch.vote_ballot_sync(nxt_first + incl <= unit))
            if j < 32:
                group = nxt + j
                end = nxt_first + cute.arch.shuffle_sync(incl, j)
                first = end - cute.arch.shuffle_sync(count, j)
                row0 = cute.arch.shuffle_sync(g_begin, j)
                rows = cute.arch.shuffle_sync(g_end, j) - row0
                nxt = group + 1
                nxt_first = end
            else:
                nxt = nxt + 32
                nxt_first = nxt_first + cute.arch.shuffle_sync(incl, 31)
        return group, first, end, nxt, nxt_first, row0, rows

    @cute.jit
    def _work(self, offs, num_rows, n_tiles, m_units_k, unit, st):
        """Decode ``unit``: (valid, group, m-unit, n-unit, row start, rows, new scan state)."""
        if const_expr(self.varlen == "m"):
            st = self._scan_groups(offs, num_rows, n_tiles, unit, st)
            group, first, end, _, _, row0, rows = st
            valid = unit < end
            block_m = self.tile_mnk[0] * self.cluster_m
            m_units = (rows + block_m - 1) // block_m
            local = unit - first
            m_units = cutlass.max(m_units, 1)
            return valid, group, local % m_units, local // m_units, row0, rows, st
        else:
            per_group = m_units_k * n_tiles
            group = unit // per_group
            local = unit - group * per_group
            valid = group < cute.size(offs)
            row0 = Int32(0)
            row1 = Int32(0)
            if valid:
                row1 = offs[group]
                if group > 0:
                    row0 = offs[group - 1]
            return valid, group, local % m_units_k, local // m_units_k, row0, row1 - row0, st

    # ---------------------------------------------------------------- device kernel

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_c: cute.CopyAtom,
        mC: cute.Tensor,
        offs: cute.Tensor,
        num_rows: Int32,
        k_dim: Int32,
        tiled_mma: cute.TiledMma,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        c_smem: cute.ComposedLayout,
        epi,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_c)
        tm, tn, tk = self.tile_mnk
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cta_layout = cute.make_layout((self.cluster_m, self.cluster_n, 1))
        cluster_coord = cta_layout.get_flat_coord(cta_rank)

        storage = memory.SmemAllocator().allocate(self.shared_storage)
        a_bytes = cute.size_in_bytes(self.a_dtype, cute.slice_(a_smem, (None, None, 0)))
        b_bytes = cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem, (None, None, 0)))
        # Each consumer warp releases a stage to every CTA that wrote into it (B is multicast).
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread,
                (self.cluster_m + self.cluster_n - 1) * self.num_mma_warpgroups * 4,
            ),
            tx_count=a_bytes + b_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, self.cluster_n, 1)),
            defer_sync=True,
        )
        extra_bar = storage.ab_barriers.data_ptr() + self.ab_stage * 2
        if const_expr(self.extra_barriers > 0):
            if warp == 0:
                with cute.arch.elect_one():
                    for i in cutlass.range_constexpr(self.extra_barriers):
                        cute.arch.mbarrier_init(extra_bar + i, 1)
                cute.arch.mbarrier_init_fence()
        pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, self.cluster_n), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sC = storage.sC.get_tensor(c_smem.outer, swizzle=c_smem.inner)

        n_dim = cute.size(mB, mode=[0])  # mode 0 may be hierarchical (an interleaving view)
        if const_expr(self.varlen == "m"):
            m_units_k = Int32(1)
        else:
            m_units_k = (mA.shape[0] + tm * self.cluster_m - 1) // (tm * self.cluster_m)
        n_tiles = (n_dim + tn * self.cluster_n - 1) // (tn * self.cluster_n)  # cluster n-units

        sched = _Schedule(offs, num_rows, k_dim, n_tiles, m_units_k, cluster_coord)
        pipeline_init_wait(cluster_shape_mn=(self.cluster_m, self.cluster_n))
        wg = cute.arch.make_warp_uniform(tidx // self.threads_per_warpgroup)
        if wg == 0:
            cute.arch.setmaxregister_decrease(self.load_registers)
            if warp == self.load_warp:
                self._producer(tma_a, mA, tma_b, mB, sA, sB, ab_pipe, sched)
        else:
            cute.arch.setmaxregister_increase(self.mma_registers)
            self._consumer(tma_c, mC, sA, sB, sC, ab_pipe, sched, tidx, tiled_mma, epi, extra_bar)

    @cute.jit
    def _tile_tensors(self, mA, mB, group, m_tile, n_tile, row0, rows):
        """The (bM, bK, k) and (bN, bK, k) global tiles of one work unit."""
        tm, tn, tk = self.tile_mnk
        if const_expr(self.varlen == "m"):
            mA_g = cute.domain_offset((row0, 0), mA)
            mB_g = mB[None, None, group]
        else:
            mA_g = _ragged_group(mA, 1, row0, rows)
            mB_g = _ragged_group(mB, 1, row0, rows)
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
    def _producer(self, tma_a, mA, tma_b, mB, sA, sB, ab_pipe, sched):
        offs, num_rows, k_dim, n_tiles, m_units_k, cluster_coord = sched
        a_mask, b_mask = None, None
        cta_layout = cute.make_layout((self.cluster_m, self.cluster_n, 1))
        if const_expr(self.cluster_n > 1):  # CTAs of one m-tile share A
            a_mask = cute.make_layout_image_mask(cta_layout, cluster_coord, mode=1)
        if const_expr(self.cluster_m > 1):  # CTAs of one n-tile share B
            b_mask = cute.make_layout_image_mask(cta_layout, cluster_coord, mode=0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        cluster_id = cute.arch.block_idx()[2]
        stride = cute.arch.grid_dim()[2]
        st = (Int32(0), Int32(0), Int32(0), Int32(0), Int32(0), Int32(0), Int32(0))
        unit = cluster_id
        valid, group, m_unit, n_unit, row0, rows, st = self._work(
            offs, num_rows, n_tiles, m_units_k, unit, st
        )
        while valid:
            m_tile = m_unit * self.cluster_m + cluster_coord[0]
            n_tile = n_unit * self.cluster_n + cluster_coord[1]
            gA, gB = self._tile_tensors(mA, mB, group, m_tile, n_tile, row0, rows)
            k_tiles = self._k_tiles(group, rows, offs, k_dim)
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_a,
                cluster_coord[1],
                cute.make_layout(self.cluster_n),
                cute.group_modes(sA, 0, 2),
                cute.group_modes(gA, 0, 2),
            )
            tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                tma_b,
                cluster_coord[0],
                cute.make_layout(self.cluster_m),
                cute.group_modes(sB, 0, 2),
                cute.group_modes(gB, 0, 2),
            )
            for k in range(k_tiles):
                ab_pipe.producer_acquire(state)
                bar = ab_pipe.producer_get_barrier(state)
                cute.copy(
                    tma_a,
                    tAgA[(None, k)],
                    tAsA[(None, state.index)],
                    tma_bar_ptr=bar,
                    mcast_mask=a_mask,
                )
                cute.copy(
                    tma_b,
                    tBgB[(None, k)],
                    tBsB[(None, state.index)],
                    tma_bar_ptr=bar,
                    mcast_mask=b_mask,
                )
                ab_pipe.producer_commit(state)
                state.advance()
            unit = unit + stride
            valid, group, m_unit, n_unit, row0, rows, st = self._work(
                offs, num_rows, n_tiles, m_units_k, unit, st
            )
        ab_pipe.producer_tail(state)

    @cute.jit
    def _mainloop(self, tiled_mma, acc, tCrA, tCrB, ab_pipe, read, release, k_tiles):
        """acc = Σ_k A_k B_kᵀ over ``k_tiles`` stages; one WGMMA batch kept in flight
        (``tiled_mma`` accumulates: acc is zeroed first)."""
        acc.fill(0.0)
        num_k_blocks = cute.size(tCrA, mode=[2])
        for k in range(k_tiles):
            ab_pipe.consumer_wait(read)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range_constexpr(num_k_blocks):
                coord = (None, None, kb, read.index)
                cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
            cute.nvgpu.warpgroup.commit_group()
            read.advance()
            if k > 0:
                cute.nvgpu.warpgroup.wait_group(1)
                ab_pipe.consumer_release(release)
                release.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        if k_tiles > 0:
            ab_pipe.consumer_release(release)
            release.advance()
        return read, release

    @cute.jit
    def _consumer(self, tma_c, mC, sA, sB, sC, ab_pipe, sched, tidx, tiled_mma, epi, extra_bar):
        offs, num_rows, k_dim, n_tiles, m_units_k, cluster_coord = sched
        tm, tn, tk = self.tile_mnk
        mma_tidx = tidx - self.threads_per_warpgroup
        wg_layout = cute.make_layout(self.num_mma_warpgroups, stride=self.threads_per_warpgroup)
        thr_mma = tiled_mma.get_slice(wg_layout(mma_tidx // self.threads_per_warpgroup))
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((tm, tn)), self.acc_dtype)
        # once, outside the tile loop: the epilogue partitions with ``tiled_mma`` too, and a value
        # set inside a (dynamic) branch of the loop would not be visible there
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)

        # Epilogue: registers -> smem (stmatrix for 16-bit) -> TMA store, per (tm x 32) subtile.
        r2s_atom = sm90_utils.sm90_get_smem_store_op(self.c_layout, self.c_dtype, self.acc_dtype)
        stm_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4), self.c_dtype
        )
        tiled_r2s = cute.make_tiled_copy_S(
            r2s_atom, cute.make_tiled_copy_C_atom(stm_atom, tiled_mma)
        )
        thr_r2s = tiled_r2s.get_slice(mma_tidx)
        tRS_sC = thr_r2s.partition_D(sC)
        tRS_acc = tiled_r2s.retile(acc)
        rD_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
        rD = cute.make_rmem_tensor(rD_shape, self.acc_dtype)
        rD_out = cute.make_rmem_tensor(rD_shape, self.c_dtype)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        cluster_id = cute.arch.block_idx()[2]
        stride = cute.arch.grid_dim()[2]
        st = (Int32(0), Int32(0), Int32(0), Int32(0), Int32(0), Int32(0), Int32(0))
        unit = cluster_id
        epi_count = Int32(0)
        valid, group, m_unit, n_unit, row0, rows, st = self._work(
            offs, num_rows, n_tiles, m_units_k, unit, st
        )
        while valid:
            m_tile = m_unit * self.cluster_m + cluster_coord[0]
            n_tile = n_unit * self.cluster_n + cluster_coord[1]
            k_tiles = self._k_tiles(group, rows, offs, k_dim)
            read, release = self._mainloop(
                tiled_mma, acc, tCrA, tCrB, ab_pipe, read, release, k_tiles
            )
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
            )
            num_epi = self._store_tile(ep, acc, group, m_tile, n_tile, row0, rows, epi_count)
            epi_count = epi_count + num_epi
            unit = unit + stride
            valid, group, m_unit, n_unit, row0, rows, st = self._work(
                offs, num_rows, n_tiles, m_units_k, unit, st
            )
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # smem stays valid until TMA read it

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
            tma_old, m_old = ep.epi
            old = (tma_old, cute.local_tile(m_old[None, None, group], (tm, tn), (m_tile, n_tile)))
        return self._epilogue(ep, gC, epi_count, old)

    @cute.jit
    def _epilogue(self, ep, gC, epi_count, old):
        """Store the accumulators of one tile: per (tm x 32) subtile, (add the old C subtile,
        which TMA loads into the extra smem block,) convert to the output type, copy to a ring of
        smem buffers and TMA-store, ``epi_batch`` subtiles per pair of barriers; returns the
        number of subtiles."""
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
            loads = self._old_c_loads(ep, old, epi_layout)
            self._load_old_c(ep, loads, 0)
            batch = 1
        outs = [ep.rD_out]
        outs += [cute.make_rmem_tensor(ep.rD.shape, self.c_dtype) for _ in range(batch - 1)]
        for b in cutlass.range_constexpr(num_epi // batch):
            items = []
            for i in cutlass.range_constexpr(batch):
                e = b * batch + i
                for v in cutlass.range_constexpr(size_rD):
                    ep.rD[v] = ep.tRS_acc[e * size_rD + v]
                if const_expr(old is not None):
                    self._add_old_c(ep, loads, e, num_epi)
                outs[i].store(ep.rD.load().to(self.c_dtype))
                items.append((outs[i], ep.tma_c, bSG_sC, bSG_gC, epi_layout.get_hier_coord(e)))
            self._store_group(ep.tiled_r2s, ep.tRS_sC, ep.warp, items, epi_count + b * batch)
        return num_epi

    @cute.jit
    def _old_c_loads(self, ep, old, epi_layout):
        """TMA partitions of the old C tile per (tm x 32) subtile, and the tile coordinates of
        this thread's accumulator values (in ``tRS_acc``'s order)."""
        tma_old, g_old = old
        s_l, g_l = cute.nvgpu.cpasync.tma_partition(
            tma_old,
            0,
            cute.make_layout(1),
            cute.group_modes(ep.sC, 0, 2),
            cute.zipped_divide(g_old, self.epi_tile),
        )
        c_tile = cute.make_identity_tensor(self.tile_mnk[:2])
        coords = ep.tiled_r2s.retile(ep.tiled_mma.get_slice(ep.mma_tidx).partition_C(c_tile))
        return tma_old, s_l, g_l, coords, epi_layout

    @cute.jit
    def _load_old_c(self, ep, loads, e: int):
        """Start the TMA load of subtile ``e`` of the old C into the extra smem block (one
        mbarrier phase per subtile; tiles have an even number of subtiles, so subtile e always
        waits for parity e % 2). Values past C's bounds are zero-filled."""
        tma_old, s_l, g_l, _, epi_layout = loads
        if ep.warp == self.epi_store_warp:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(
                    ep.extra_bar, self.epi_tile[0] * self.epi_tile[1] * self.c_dtype.width // 8
                )
            cute.copy(
                tma_old,
                g_l[(None, epi_layout.get_hier_coord(e))],
                s_l[(None, self.epi_stage)],
                tma_bar_ptr=ep.extra_bar,
            )

    @cute.jit
    def _add_old_c(self, ep, loads, e: int, num_epi: int):
        """rD += subtile ``e`` of the old C; then the block is free and the next load starts."""
        coords = loads[3]
        size_rD = cute.size(ep.rD)
        cute.arch.mbarrier_wait(ep.extra_bar, e % 2)
        for v in cutlass.range_constexpr(size_rD):
            r, cc = coords[e * size_rD + v]
            ep.rD[v] = ep.rD[v] + ep.sC[r, cc - 32 * e, self.epi_stage].to(Float32)
        self.epi_barrier.arrive_and_wait()
        if const_expr(e + 1 < num_epi):
            self._load_old_c(ep, loads, e + 1)

    def _batch(self, count: int) -> int:
        """Subtiles staged per pair of barriers (trace time): ``epi_batch`` if set, else all but
        one slot of the ring (the TMA store of the last may still be reading it); divides
        ``count``."""
        batch = min(self.epi_batch or max(1, self.epi_stage - 1), self.epi_stage)
        while count % batch:
            batch -= 1
        return batch

    @cute.jit
    def _store_group(self, tiled_r2s, tRS_sC, warp, items: list, count):
        """Stage and TMA-store subtiles in ring slots ``count``, ``count + 1``, ..., ``_batch``
        of them per pair of barriers. ``items``: (registers in the output type, TMA atom, smem
        partition, gmem partition, gmem coordinate)."""
        batch = self._batch(len(items))
        for b in cutlass.range_constexpr(len(items) // batch):
            self._ring_reserve(warp, batch)
            stores = []
            for i in cutlass.range_constexpr(batch):
                r_out, tma, s_part, g_part, coord = items[b * batch + i]
                slot = (count + b * batch + i) % self.epi_stage
                cute.copy(tiled_r2s, r_out, tRS_sC[(None, None, None, slot)])
                stores.append((tma, s_part, g_part, slot, coord))
            self._ring_flush(warp, stores)

    @cute.jit
    def _ring_reserve(self, warp, n: int):
        """Before staging ``n`` subtiles in the next ring slots: wait until the TMA stores that
        last used those slots have read them (at most ``epi_stage - n`` stores still reading),
        then sync the epilogue threads."""
        if warp == self.epi_store_warp:
            cute.arch.cp_async_bulk_wait_group(self.epi_stage - n, read=True)
        self.epi_barrier.arrive_and_wait()

    @cute.jit
    def _ring_flush(self, warp, stores: list):
        """Make the staged subtiles visible to TMA and store them, one bulk group each.
        ``stores``: (TMA atom, smem partition, gmem partition, ring slot, gmem coordinate)."""
        cute.arch.fence_proxy("async.shared", space="cta")
        self.epi_barrier.arrive_and_wait()
        if warp == self.epi_store_warp:
            for i in cutlass.range_constexpr(len(stores)):
                tma, s_part, g_part, slot, coord = stores[i]
                cute.copy(tma, s_part[(None, slot)], g_part[(None, coord)])
                cute.arch.cp_async_bulk_commit_group()
