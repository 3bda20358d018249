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
persistent clusters walk with a fixed stride, m fastest within a group, or (``dynamic_units``,
varlen ``"k"``) take as they free up, the longest groups' first (``tile_scheduler.py``). For
``"m"`` a unit's group is found from the device prefix sums by a warp-cooperative scan that only
moves forward (each warp caches the group it is in), so the grid depends on M and E alone and the
host never reads split sizes. The CTAs of a 1×2 cluster take neighbouring n-tiles of one m-tile
and share A by TMA multicast (2×1: neighbouring m-tiles share B, and a group's tail of at most
one tile's rows runs over two n-tiles, each CTA loading its own B: ``split_tail``, so 2×1 keeps
128-row granularity on small groups as 1×2 does).

Bounds are enforced by TMA itself through "ragged" views (``ragged._ragged_view``): the store of
a varlen-M tile drops rows past its group, and the loads of a varlen-K tile zero-fill rows past
its group, so partial tiles need no predication and no smem masking.

Roles: warp 0 (of the first warpgroup) issues TMA loads into an ``ab_stage``-deep smem ring; two
MMA warpgroups run WGMMA on a 128 × tile_n tile (64 rows each), then the epilogue converts the fp32
accumulators, stages them in smem and TMA-stores them. (Letting a warpgroup whose 64 rows all lie
past its group skip its MMA was tried: it made random-size experts 5-13% slower on one H200,
2026-11-22, for reasons not established.) With ``pingpong`` (varlen M, no bias, route or
accumulate; tile_n 128 or 192) each MMA warpgroup owns whole tiles, alternating, and one's
epilogue overlaps the other's mainloop (``mainloop._pingpong_tiles``).

This module holds the host-side setup, the launch and the ``kernel`` body; the class takes its
device roles from mixins: ``tile_scheduler`` (which tile a work unit is), ``mainloop`` (the TMA
producer and the WGMMA consumers) and ``store_epilogue`` (the epilogue hooks ``_make_epi`` /
``_store_tile``, which ``glu_epilogue.GluGemmKernel`` overrides, and the smem store ring).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory as memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from .launch import PINGPONG_TILE_WIDTHS
from .mainloop import MainloopMixin
from .ragged import _ragged_view
from .routed import RoutedMixin
from .store_epilogue import StoreEpilogueMixin
from .tile_scheduler import (
    RECORD_READERS,
    RECORD_STAGES,
    RECORD_WORDS,
    TileSchedulerMixin,
    _Dynamic,
    _Schedule,
)


class GroupedGemmKernel(TileSchedulerMixin, MainloopMixin, StoreEpilogueMixin, RoutedMixin):
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
    old_c_blocks = 2  # with accumulate: old C subtiles in flight (``_setup`` may take 3)
    # Give up one slot of a 4-slot store ring where that fits one more A/B stage (the plain
    # kernel: ``compile_gemm``); subclasses keep their rings.
    trade_store_slot = False
    # rows of an epilogue subtile (None: the tile's 128); the GLU kernel's ping-pong option 64
    epi_rows: int | None = None
    # columns of an epilogue subtile (a store-ring slot, one TMA store): 32, or (the
    # ``epi_cols`` argument) 64, which the fresh wgrads take over short groups
    # (``launch.wgrad_epi_cols``; the plain and FP8 row-wise ping-pong varlen-M GEMMs take it
    # with ``TE_SEQ_MM_EPI_COLS=64``, measured no faster); the accumulating wgrads and the
    # GLU and activation kernels refuse anything but 32
    epi_cols = 32
    # Varlen K: clip each group's loads by ragged TMA views (True), or take every group's span as
    # whole k-tiles of zero-padded operands (False: the FP8 wgrad, whose operands are K-major,
    # and ragged views need a 16-byte stride along the ragged mode).
    ragged_k = True
    # fp32 words of smem scratch the epilogue hooks use (``_epi_scratch``), after the buffers
    epi_scratch_words = 0
    # whether this kernel's epilogue runs with one warpgroup per tile (``pingpong``); epilogue
    # classes built for two warpgroups on one tile set it False
    pingpong_ready = True
    half_tiles = False  # set per kernel by __init__ (subclasses that skip it keep full tiles)

    def __init__(
        self,
        varlen: str,
        tile_mn: tuple[int, int] = (128, 256),
        cluster_mn: tuple[int, int] = (1, 2),
        accumulate: bool = False,
        store_stages: int | None = None,
        route: str | None = None,
        pingpong: bool = False,
        trade_store_slot: bool = False,
        dynamic_units: bool = False,
        half_tiles: bool = False,
        epi_cols: int | None = None,
    ):
        if varlen not in ("m", "k"):
            raise ValueError(f"GroupedGemmKernel: varlen must be 'm' or 'k', got {varlen!r}")
        if route not in (None, "gather", "scatter") or (route and varlen != "m"):
            raise ValueError(f"GroupedGemmKernel: route {route!r} unsupported (varlen {varlen!r})")
        if route == "gather" and cluster_mn[1] != 1:
            raise ValueError(
                f"GroupedGemmKernel: gathered A is not multicast: cluster {cluster_mn}"
            )
        self.route = route
        if dynamic_units and varlen != "k":
            raise ValueError(
                f"GroupedGemmKernel: dynamic units are for varlen 'k' (the wgrads), got {varlen!r}"
            )
        # units handed out longest group first as clusters free up (tile_scheduler.py); the
        # launch's int32 side input (``route``) is then the order-and-counter tensor [E + 1]
        self.dynamic_units = dynamic_units
        if route == "gather":  # the cp.async producer keeps 8 row addresses per thread
            self.load_registers, self.mma_registers = 56, 224
        if tile_mn[0] != 128 or tile_mn[1] not in (64, 128, 192, 256):
            raise ValueError(f"GroupedGemmKernel: unsupported tile {tile_mn}")
        if cluster_mn not in ((1, 1), (2, 1), (1, 2)):
            raise ValueError(
                f"GroupedGemmKernel: cluster must be 1x1, 2x1 or 1x2, got {cluster_mn}"
            )
        self.varlen = varlen
        self.accumulate = accumulate and varlen == "k"
        self._set_epi_cols(epi_cols)
        self.pingpong = pingpong
        if pingpong:
            self._check_pingpong(tile_mn)
        if half_tiles and not (pingpong and varlen == "m"):
            raise ValueError(
                f"GroupedGemmKernel: half tiles are for varlen 'm' in ping-pong, got varlen "
                f"{varlen!r}, pingpong {pingpong}"
            )
        # an expert's last tile with <= 64 rows runs one 64-row WGMMA atom (_pingpong_mainloop)
        self.half_tiles = half_tiles
        if store_stages is not None:
            self.epi_store_stages = store_stages
        self.trade_store_slot = trade_store_slot
        if self.accumulate:  # smem blocks that TMA fills with old C subtiles, 1 mbarrier each
            self.epi_extra_buffers = self.extra_barriers = self._old_c_smem_blocks()
        self.cluster_m, self.cluster_n = cluster_mn
        self.cluster_size = self.cluster_m * self.cluster_n
        # a 2x1 unit's last m-tile alone runs over two n-tiles (tile_scheduler.py)
        self.split_tail = varlen == "m" and cluster_mn == (2, 1)
        self.tile_mnk = (tile_mn[0], tile_mn[1], 64)
        self.threads = (1 + self.num_mma_warpgroups) * self.threads_per_warpgroup
        # the threads of one tile's MMA and epilogue: both warpgroups, or one in ping-pong
        self.num_mma_threads = self.threads_per_warpgroup * (1 if pingpong else 2)
        # first warp of the first MMA warpgroup; in ping-pong each warpgroup's first warp, which
        # the epilogue sees as warp 4 (``_EpilogueState.warp``)
        self.epi_store_warp = 4
        # one barrier for the epilogue threads of a tile (ping-pong epilogues never overlap)
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_mma_threads)

    def _check_pingpong(self, tile_mn: tuple[int, int]) -> None:
        """Ping-pong consumers (``mainloop._pingpong_tiles``) are built for the plain kernel,
        varlen M or K, with or without the old-C accumulate (each warpgroup its own old-C
        blocks), without routed rows; a warpgroup's whole 128 x tile_n accumulator must fit
        its registers."""
        if not self.pingpong_ready:
            raise ValueError(f"{type(self).__name__}: ping-pong consumers are not supported yet")
        if self.route:
            raise ValueError(
                f"GroupedGemmKernel: ping-pong runs without routed rows, got varlen "
                f"{self.varlen!r}, route {self.route!r}"
            )
        if tile_mn[1] not in PINGPONG_TILE_WIDTHS:
            raise ValueError(
                f"GroupedGemmKernel: ping-pong tile width must be one of {PINGPONG_TILE_WIDTHS} "
                f"(a warpgroup holds 128 x tile_n fp32 accumulators), got {tile_mn[1]}"
            )

    # ---------------------------------------------------------------- host-side (jit) setup

    def _setup(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor) -> None:
        self.a_dtype, self.b_dtype, self.c_dtype = a.element_type, b.element_type, c.element_type
        self.acc_dtype = Float32
        self.a_layout = LayoutEnum.from_tensor(a)
        self.b_layout = LayoutEnum.from_tensor(b)
        self.c_layout = LayoutEnum.from_tensor(c)
        # k-tile: 128-byte smem rows (the 128B swizzle), 64 elements of 16-bit, 128 of FP8
        self.tile_mnk = (*self.tile_mnk[:2], 1024 // self.a_dtype.width)
        tm, tn, tk = self.tile_mnk
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.a_dtype,
            self.b_dtype,
            self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            (1 if self.pingpong else self.num_mma_warpgroups, 1, 1),
            tiler_mn=(64, tn),
        )
        self.epi_tile = (self.epi_rows or tm, self.epi_cols)
        if self.accumulate:
            self.old_c_blocks = self._old_c_blocks()
            self.epi_extra_buffers = self.extra_barriers = self._old_c_smem_blocks()
        self.epi_stage = self._store_ring()
        self.ab_stage = self._ab_stages(self.epi_stage)
        self.a_smem = sm90_utils.make_smem_layout_a(
            self.a_layout, self.tile_mnk, self.a_dtype, self.ab_stage
        )
        self.b_smem = sm90_utils.make_smem_layout_b(
            self.b_layout, self.tile_mnk, self.b_dtype, self.ab_stage
        )
        self.c_smem = sm90_utils.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.epi_tile, self.epi_stage + self.epi_extra_buffers
        )

    def _set_epi_cols(self, epi_cols: int | None) -> None:
        """Take ``epi_cols`` (None: the class's): subtiles are 32 or 64 columns; accumulating
        into C loads old C in 32-column blocks, so it refuses anything but 32."""
        if epi_cols is not None:
            self.epi_cols = epi_cols
        if self.epi_cols not in (32, 64) or (self.accumulate and self.epi_cols != 32):
            raise ValueError(f"GroupedGemmKernel: epilogue subtiles are 32 or 64 columns, "
                             f"accumulating into C stages 32-column subtiles, got "
                             f"epi_cols={self.epi_cols}, accumulate={self.accumulate}")

    def _store_ring(self) -> int:
        """Slots of the epilogue's smem store ring: ``epi_store_stages``, else
        ``_default_ring``; one fewer where that fits one more A/B stage and the kernel trades
        (``trade_store_slot``)."""
        ring = self._default_ring()
        gains = self._ab_stages(ring - 1) > self._ab_stages(ring)
        return ring - 1 if self.trade_store_slot and ring >= 4 and gains else ring

    def _default_ring(self) -> int:
        """The store ring's slots before any trade: ``epi_store_stages``, else the bytes of 4
        32-column subtiles for 16-bit outputs and 2 for wider ones, at least 2 slots (64
        columns: 2 slots, 16-bit or wider)."""
        slots32 = 4 if self.c_dtype.width == 16 else 2
        return self.epi_store_stages or max(2, slots32 * 32 // self.epi_cols)

    def _old_c_smem_blocks(self) -> int:
        """Smem blocks (and mbarriers) of the old C: ``old_c_blocks`` per epilogue, one set
        per warpgroup in ping-pong (each loads its next tile's old C before its mainloop,
        while the peer's epilogue may still read its own set)."""
        return self.old_c_blocks * (self.num_mma_warpgroups if self.pingpong else 1)

    def _old_c_blocks(self) -> int:
        """Old C subtiles in flight for ``accumulate``: 2 per warpgroup in ping-pong; else 3
        where the third smem block costs no A/B stage (the 256-wide 16-bit wgrad into fp32:
        3 stages either way), else 2. Measured on one H200 (2026-11-29, fp32 ``main_grad``,
        `bench_grouped_gemm.py --main-grad`, cooperative): 3 blocks ran Q's and Z's FC1
        accumulate 7 % faster, their FC2 2-4 %, B level; 4 (one stage fewer) lost up to 16 %
        on B."""
        if self.pingpong:
            return 2
        ring = self._default_ring()
        keeps_stages = self._ab_stages(ring, extra_buffers=3) == self._ab_stages(ring, 2)
        return 3 if keeps_stages else 2

    def _ab_stages(self, store_ring: int, extra_buffers: int | None = None) -> int:
        """A/B pipeline stages that fit in smem beside a store ring of ``store_ring`` (tm x
        ``epi_cols``) subtiles and the class's extra epilogue buffers (or ``extra_buffers``)
        and scratch. A 128 x 192 bf16 tile fits 4 beside a 4-slot ring and 5 beside a 3-slot
        one (``trade_store_slot``)."""
        tm, tn, tk = self.tile_mnk
        ab_bytes = (tm * tk * self.a_dtype.width + tn * tk * self.b_dtype.width) // 8
        extra = self.epi_extra_buffers if extra_buffers is None else extra_buffers
        epi_bytes = tm * self.epi_cols * self.c_dtype.width // 8 * (store_ring + extra)
        smem = memory.get_smem_capacity_in_bytes("sm_90")
        # barriers and the padding to sA's 1024-byte alignment take < 1 KB; the scratch after
        reserve = max(2048, 1024 + 4 * self._scratch_words())
        return (smem - reserve - epi_bytes) // ab_bytes

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
        # int32: gathered A rows or scattered C rows [M]; the dynamic schedule's order and
        # counter [E + 1] (``dynamic_units``); unused otherwise
        route: cute.Tensor,
        stream,
    ):
        self._launch(a, b, c, offs, num_clusters, stream, b, (), route)

    @cute.jit
    def _launch(self, a, b, c, offs, num_clusters, stream, b_tma_view, epi_inputs, route):
        """Set up, build the TMA atoms (B through ``b_tma_view``, a view of ``b``) and launch.
        ``route`` (int32 [M]) gives A's rows (``route="gather"``: a is the [T, K] token matrix)
        or C's rows (``"scatter"``); with ``dynamic_units`` it is the groups' longest-first
        order and the unit counter [E + 1]; other kernels ignore it."""
        self._setup(a, b, c)
        tm, tn, tk = self.tile_mnk
        a_tma_src, b_tma_src, c_tma_src = a, b_tma_view, c
        if const_expr(self.varlen == "m"):
            c_tma_src = _ragged_view(c, 0)
        elif const_expr(self.ragged_k):
            a_tma_src = _ragged_view(a, 1)
            b_tma_src = _ragged_view(b, 1)
        num_rows = a.shape[0]
        routes = ()
        if const_expr(self.route == "gather"):
            tma_a, mA = None, a  # cp.async reads the token rows
            num_rows = route.shape[0]
            routes = (route,)
        else:
            tma_a, mA = self._tma_load(a_tma_src, self.a_smem, (tm, tk), self.cluster_n)
        if const_expr(self.route == "scatter"):
            routes = (route, c)
        if const_expr(self.dynamic_units):
            routes = (route,)  # the order-and-counter tensor
        tma_b, mB = self._tma_load(b_tma_src, self.b_smem, (tn, tk), self.cluster_m)
        tma_b = (tma_b,)
        if const_expr(self.split_tail):  # the tail units' B, one whole tile per CTA
            tma_b = (*tma_b, self._tma_load(b_tma_src, self.b_smem, (tn, tk), 1)[0])
        tma_c, mC = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
            c_tma_src,
            cute.slice_(self.c_smem, (None, None, 0)),
            self.epi_tile,
        )
        epi = self._make_epi(c, epi_inputs)

        # the dynamic schedule's full and empty mbarriers, then its records (tile_scheduler.py)
        sched_barriers = 2 * RECORD_STAGES if self.dynamic_units else 0
        record_words = RECORD_WORDS * RECORD_STAGES if self.dynamic_units else 4

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[
                cutlass.Int64, self.ab_stage * 2 + self.extra_barriers + sched_barriers
            ]
            records: cute.struct.Align[cute.struct.MemRange[Int32, record_words], 16]
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
            num_rows,
            a.shape[1],
            self.tiled_mma,
            self.a_smem,
            self.b_smem,
            self.c_smem,
            epi,
            routes,
        ).launch(
            grid=(self.cluster_m, self.cluster_n, num_clusters),
            block=(self.threads, 1, 1),
            cluster=(self.cluster_m, self.cluster_n, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    def _scratch_words(self) -> int:
        """fp32 words of epilogue scratch in smem: ``epi_scratch_words`` per tile in flight,
        so one block per MMA warpgroup in ping-pong (``_consumer`` hands each its own)."""
        return self.epi_scratch_words * (2 if self.pingpong else 1)

    def _epi_scratch(self, allocator):
        """The epilogue's fp32 smem scratch (``_scratch_words``; None without one)."""
        if self.epi_scratch_words == 0:
            return None
        return allocator.allocate_tensor(Float32, cute.make_layout(self._scratch_words()), 16)

    @cute.jit
    def _init_extra_barriers(self, storage, warp, routes):
        """The subclass's extra mbarriers (one arrival each) and the dynamic schedule's,
        initialised by warp 0 before the cluster's barrier-init sync: (a pointer to the first
        extra one, the `_Dynamic` or None)."""
        extra_bar = storage.ab_barriers.data_ptr() + self.ab_stage * 2
        if const_expr(self.extra_barriers > 0):
            if warp == 0:
                with cute.arch.elect_one():
                    for i in cutlass.range_constexpr(self.extra_barriers):
                        cute.arch.mbarrier_init(extra_bar + i, 1)
                cute.arch.mbarrier_init_fence()
        dynamic = self._init_dynamic(storage, extra_bar + self.extra_barriers, warp, routes)
        return extra_bar, dynamic

    @cute.jit
    def _load_warpgroup(self, tma_a, mA, tma_b, mB, sA, sB, ab_pipe, sched, routes, tidx):
        """The first warpgroup's roles: the producer (warp ``load_warp``, or every thread with
        gathered rows) and, with dynamic units, the scheduler (the next warp, in the cluster's
        first CTA)."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if const_expr(self.route == "gather"):
            self._producer_gather(mA, routes[0], tma_b, mB, sA, sB, ab_pipe, sched, tidx)
        elif warp == self.load_warp:
            self._producer(tma_a, mA, tma_b, mB, sA, sB, ab_pipe, sched)
        if const_expr(self.dynamic_units):
            cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            if (warp == self.load_warp + 1) & (cta_rank == 0):
                self._schedule_units(sched)

    @cute.jit
    def _init_dynamic(self, storage, barriers, warp, routes):
        """The dynamic schedule's smem (``_Dynamic``; None for the static one): its full
        mbarriers (one arrival and the record's bytes) and empty ones (every reader warp of
        the cluster), initialised by warp 0 before the cluster's barrier-init sync."""
        if const_expr(not self.dynamic_units):
            return None
        if warp == 0:
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(RECORD_STAGES):
                    cute.arch.mbarrier_init(barriers + i, 1)
                    cute.arch.mbarrier_init(
                        barriers + RECORD_STAGES + i, RECORD_READERS * self.cluster_size
                    )
            cute.arch.mbarrier_init_fence()
        records = storage.records.get_tensor(cute.make_layout((RECORD_WORDS, RECORD_STAGES)))
        return _Dynamic(routes[0], records, barriers, barriers + RECORD_STAGES)

    # ---------------------------------------------------------------- device kernel

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: tuple,  # B's TMA atoms: multicast, and unicast with split_tail
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
        routes,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            if const_expr(self.route != "gather"):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            for atom in tma_b:
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_c)
        tm, tn, tk = self.tile_mnk
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cta_layout = cute.make_layout((self.cluster_m, self.cluster_n, 1))
        cluster_coord = cta_layout.get_flat_coord(cta_rank)

        allocator = memory.SmemAllocator()
        storage = allocator.allocate(self.shared_storage)
        scratch = self._epi_scratch(allocator)
        a_bytes = cute.size_in_bytes(self.a_dtype, cute.slice_(a_smem, (None, None, 0)))
        b_bytes = cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem, (None, None, 0)))
        # A gathered by cp.async: a stage is full after B's TMA bytes and one arrival of each
        # producer thread (routed.py); otherwise after the TMA bytes of A and B.
        producers = 1
        if const_expr(self.route == "gather"):
            producers, a_bytes = 1 + self.threads_per_warpgroup, 0
        # Each consumer warp releases a stage to every CTA that wrote into it (B is multicast).
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producers),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread,
                (self.cluster_m + self.cluster_n - 1) * self.num_mma_threads // 32,
            ),
            tx_count=a_bytes + b_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, self.cluster_n, 1)),
            defer_sync=True,
        )
        extra_bar, dynamic = self._init_extra_barriers(storage, warp, routes)
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

        sched = _Schedule(offs, num_rows, k_dim, n_tiles, m_units_k, cluster_coord, dynamic)
        pipeline_init_wait(cluster_shape_mn=(self.cluster_m, self.cluster_n))
        wg = cute.arch.make_warp_uniform(tidx // self.threads_per_warpgroup)
        if wg == 0:
            cute.arch.setmaxregister_decrease(self.load_registers)
            self._load_warpgroup(tma_a, mA, tma_b, mB, sA, sB, ab_pipe, sched, routes, tidx)
        else:
            cute.arch.setmaxregister_increase(self.mma_registers)
            self._consumer(
                tma_c, mC, sA, sB, sC, ab_pipe, sched, tidx, tiled_mma, epi, extra_bar, routes,
                scratch,
            )
