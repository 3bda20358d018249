"""Non-gated activation epilogues for the CuTe DSL grouped GEMM (sm_90a).

Shape legend: M routed rows, E experts, H hidden, F ffn width; h = FC1's pre-activation [M, F].

``ActGemmKernel`` is ``GluGemmKernel`` (so ``GroupedGemmKernel``: varlen M, same scheduler,
producer, mainloop, store ring, ragged stores, TMA load of h and d(probs) atomics) for an
elementwise activation f (a table entry with ``act_epilogue``; f and f' from
``glu_maths.act_and_grad``). Only the per-subtile maths differ from the GLU epilogues:

* ``"fc1"``: acc = x_e W1_eᵀ for a tile of 256, 192 or 128 columns of F (W1 read as it is);
  per (128 x 32) subtile writes h and a = f(h)(·p), f computed from the bf16-rounded h, as the
  reference does from the saved h.
* ``"dgrad"``: acc = dA = dY_e W2_e for a tile of columns j of F; TMA-loads h's matching
  (128 x 32) block into one extra smem buffer and writes dh = dA·p·f'(h), a = f(h)·p (for FC2's
  wgrad) and adds Σ_j dA·f(h) into the fp32 d(probs) buffer (zeroed by the caller).

Columns past F: the B loads zero-fill them (acc = 0), h's loads zero-fill them and TMA drops
their stores, so F need only be a multiple of 8 (16-byte rows). All maths in fp32, one rounding
per output.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from te_seq.kernels.activations import act_epilogue_activations

from .glu_epilogue import GluGemmKernel
from .glu_maths import act_and_grad
from .grouped_gemm import GroupedGemmKernel

ACTS = act_epilogue_activations()  # each has a branch in glu_maths.act_and_grad


class ActGemmKernel(GluGemmKernel):
    """Varlen-M grouped GEMM with a non-gated activation epilogue (``mode`` "fc1" or "dgrad");
    see the module."""

    pingpong_ready = False  # its epilogues assume two warpgroups on one tile

    def __init__(
        self,
        mode: str,
        act: str,
        has_probs: bool,
        cluster_mn: tuple[int, int] = (1, 2),
        store_stages: int | None = None,
        tile_n: int = 256,
        route: str | None = None,
    ):
        if mode not in ("fc1", "dgrad"):
            raise ValueError(f"ActGemmKernel: mode must be 'fc1' or 'dgrad', got {mode!r}")
        if act not in ACTS:
            raise ValueError(f"ActGemmKernel: act must be one of {ACTS}, got {act!r}")
        if tile_n not in (128, 192, 256):
            raise ValueError(f"ActGemmKernel: tile_n must be 128, 192 or 256, got {tile_n}")
        self._require_32_column_subtiles("ActGemmKernel")
        # GluGemmKernel's own checks are about gate/up pairing: set its attributes directly
        GroupedGemmKernel.__init__(self, "m", (128, tile_n), cluster_mn, route=route)
        self.mode, self.act, self.interleave, self.has_probs = mode, act, None, has_probs
        self.params, self.has_bias = (), False
        self.epi_store_stages = store_stages
        if mode == "dgrad":  # store ring + one buffer that TMA fills with h, 1 mbarrier
            # the GLU dgrad's ring (2 store buffers): with the h buffer the mainloop keeps 4
            # stages (128 x 256 x 64 bf16 tiles)
            self.epi_store_stages = store_stages or 2
            self.epi_extra_buffers, self.extra_barriers = 1, 1

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # x [M, H] (fc1) or dY [M, H] (dgrad)
        b: cute.Tensor,  # (F, H, E): W1 (fc1) or W2 (dgrad)
        c: cute.Tensor,  # h [M, F] (fc1) or dh [M, F] (dgrad), written
        offs: cute.Tensor,
        num_clusters: Int32,
        act_out: cute.Tensor,  # a [M, F], written
        probs: cute.Tensor,  # [M] (unused without probs)
        dprobs: cute.Tensor,  # fp32 [M], accumulated (dgrad with probs)
        h_in: cute.Tensor,  # h [M, F] (dgrad)
        bias: cute.Tensor,  # unused (the GLU kernel's argument list: no FC1 bias here)
        route: cute.Tensor,  # int32 [M]: x's row of each GEMM row (``route="gather"``)
        stream,
    ):
        epi_inputs = (act_out, probs, dprobs, h_in, bias)
        self._launch(a, b, c, offs, num_clusters, stream, b, epi_inputs, route)

    # ---------------------------------------------------------------- device side

    @cute.jit
    def _store_pair(self, ep, t, outs, blk, count):
        """TMA-store the (128 x 32) subtiles ``outs`` = (h or dh registers, a registers) at
        column block ``blk`` of both outputs, from ring slot ``count`` on."""
        (s_h, g_h), (tma_a, s_a, g_a) = t.h_out, t.a_out
        items = [
            (outs[0], ep.tma_c, s_h, g_h, (t.m_tile, blk)),
            (outs[1], tma_a, s_a, g_a, (t.m_tile, blk)),
        ]
        self._store_group(ep.tiled_r2s, ep.tRS_sC, ep.warp, items, count)

    @cute.jit
    def _fc1_epilogue(self, ep, t, count0, bias_tile=None):
        """Per 32-column subtile: h (rounded) and a = f(h)(·p) from the fp32 sums; returns
        #stores (``bias_tile``: the GLU kernel's hook argument, always None here: no bias)."""
        size_rD = cute.size(ep.rD)
        num_sub = self.tile_mnk[1] // 32
        r_a_out = cute.make_rmem_tensor(ep.rD.shape, self.c_dtype)
        count = count0
        for e in cutlass.range_constexpr(num_sub):
            for v in cutlass.range_constexpr(size_rD):
                ep.rD[v] = ep.tRS_acc[self._acc_index(ep, e, v)]
            ep.rD_out.store(ep.rD.load().to(self.c_dtype))
            h = ep.rD.load()  # a from the fp32 sums (``act_from_rounded_h``: from the rounded h)
            if const_expr(self.act_from_rounded_h):
                h = ep.rD_out.load().to(Float32)
            f, _ = act_and_grad(h, self.act, False)
            if const_expr(self.has_probs):
                f = f * self._per_value(ep, t.r_p, t.slots, e)
            r_a_out.store(f.to(self.c_dtype))
            self._store_pair(ep, t, (ep.rD_out, r_a_out), t.n_tile * num_sub + e, count)
            count = count + 2
        return count - count0

    @cute.jit
    def _dgrad_epilogue(self, ep, t, r_s, tma_h, m_h, count0):
        """Per 32-column subtile of dA: dh and a stores; d(probs) partial sums in r_s.

        The subtile's block of h arrives by TMA in one smem buffer (one mbarrier phase per
        subtile: 4, 6 or 8 per tile, an even count, so subtile e waits for parity e % 2 on every
        tile); the next block's load is issued once every thread has read the current one."""
        size_rD = cute.size(ep.rD)
        num_sub = self.tile_mnk[1] // 32
        r_h = cute.make_rmem_tensor(ep.rD.shape, Float32)
        r_a_out = cute.make_rmem_tensor(ep.rD.shape, self.c_dtype)
        s_l, g_l = self._h_partitions(ep, tma_h, m_h, t.row_base)
        reader = self._h_reader(ep)
        self._issue_h(ep, tma_h, s_l, g_l, t.n_tile, t.f_dim, 0)
        count = count0
        for e in cutlass.range_constexpr(num_sub):
            cute.arch.mbarrier_wait(ep.extra_bar, e % 2)
            for v in cutlass.range_constexpr(size_rD):
                ep.rD[v] = ep.tRS_acc[self._acc_index(ep, e, v)]
            self._read_h(ep, reader, self.epi_stage, True, r_h)
            self._sync_for_tma()  # the h buffer is free again
            if const_expr(e + 1 < num_sub):
                self._issue_h(ep, tma_h, s_l, g_l, t.n_tile, t.f_dim, e + 1)
            self._dact(ep, t, (ep.rD, r_h, e), r_s, (ep.rD_out, r_a_out))
            self._store_pair(ep, t, (ep.rD_out, r_a_out), t.n_tile * num_sub + e, count)
            count = count + 2
        return count - count0

    @cute.jit
    def _dact(self, ep, t, ins, r_s, outs):
        """``ins`` = (dA, h, subtile index), ``outs`` = (dh, a): dh = dA·p·f'(h), a = f(h)·p
        (rounded once); r_s[row] += dA·f(h) (the d(probs) partial sums per row slot, before the
        p scaling)."""
        r_da, r_h, sub = ins
        r_dh_out, r_a_out = outs
        da = r_da.load()
        f, df = act_and_grad(r_h.load(), self.act, True)
        if const_expr(self.has_probs):
            self._add_to_rows(ep, r_s, da * f, t.slots, sub)
            p = self._per_value(ep, t.r_p, t.slots, sub)
            da = da * p
            f = f * p
        r_dh_out.store((da * df).to(self.c_dtype))
        r_a_out.store(f.to(self.c_dtype))

    @cute.jit
    def _issue_h(self, ep, tma_h, s_l, g_l, n_tile, f_dim, e: int):
        """TMA-load the (128 x 32) block of h for dgrad subtile ``e`` (rows past M and columns
        past F are zero-filled; rows past the group are loaded but their results dropped)."""
        col_blk = n_tile * (self.tile_mnk[1] // 32) + e
        if ep.warp == self.epi_store_warp:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(
                    ep.extra_bar, self.epi_tile[0] * self.epi_tile[1] * self.c_dtype.width // 8
                )
            cute.copy(
                tma_h, g_l[(None, (0, col_blk))], s_l[(None, self.epi_stage)],
                tma_bar_ptr=ep.extra_bar,
            )
