"""Gated-activation (GLU) epilogues for the CuTe DSL grouped GEMM (sm_90a).

Shape legend: M routed rows, E experts, H hidden, F ffn width; h = FC1's pre-activation [M, 2F]
in the activation op's column layout: ``[gate | up]`` halves (interleave None) or alternating
blocks of ``s`` columns (``glu_interleave_size=s``), see ``reference.split_glu``.

``GluGemmKernel`` is ``GroupedGemmKernel`` (varlen M, same scheduler, producer and mainloop)
with the epilogue hook ``_store_tile`` replaced:

* ``"fc1"``: acc = x_e W1_eᵀ for 256 GEMM columns that hold 128 gate and the 128 matching up
  columns; writes h (its halves at their own columns of h) and a = act(gate)·up(·probs), the
  activation computed from the fp32 accumulators (one rounding: a's; ``act_from_rounded_h``
  computes it from the 16-bit h instead, as the unfused chain does from its saved h).
  ``store_h=False`` writes a only (a forward whose backward never runs: no h to keep), the
  same a bit for bit; c is then any 16-bit matrix (a itself): nothing is stored through it.
  With a bias (``has_bias``) h = x_e W1_eᵀ + b1_e: the bias [E, 2F] (h's columns) is added to
  the fp32 accumulator before h is rounded (``bias_epilogue``).
  With halves, W1 is seen through a hierarchical view ((128, 2, F/128), H, E) (no copy) so GEMM
  column 256t + 128q + i is W1 row q·F + 128t + i. With blocks of s in {32, 64, 128} every
  256-column tile of W1 already holds whole gate/up block pairs, so W1 is read as it is.
* ``"dgrad"``: acc = dA = dY_e W2_e for a tile of 256, 192 or 128 columns j of F; loads gate_j,
  up_j of h and writes dh (dgate = dA·p·up·act'(gate), dup = dA·p·act(gate)),
  a = act(gate)·up·p and adds Σ_j dA·act(gate)·up into an fp32 d(probs) buffer (zeroed by the
  caller) with atomics.

Activations that transform the up half (the clamped SwiGLU's clamp + offset, SiTU's soft cap)
use up(up) for ``up`` above and multiply dup by up'(up); their float parameters are
compile-time constants (``params``, part of the compile config). Maths: ``glu_maths``.

All maths in fp32 on the accumulator, one rounding per output. Stores go through the parent's
ring of (128 x 32) smem buffers and TMA (``store_epilogue``), clipped to the expert by the ragged
views (``ragged``).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from te_seq.kernels.activations import epilogue_activations, param_values

from .bias_epilogue import BiasEpilogueMixin
from .glu_h_loads import HLoadMixin
from .glu_maths import act_and_grad, up_and_grad
from .grouped_gemm import GroupedGemmKernel
from .launch import epilogue_subtiles
from .ragged import _ragged_group, _ragged_view
from .row_values import RowValuesMixin

ACTS = epilogue_activations()  # each has a branch in glu_maths.act_and_grad


class _GluTile(NamedTuple):
    """One tile's GLU epilogue context (trace-time bundle)."""

    m_tile: object
    n_tile: object
    f_dim: object  # F
    row_base: object  # first row of the tile in M
    coords: object  # (row, col) in the tile of each accumulator value, in tRS_acc's order
    r_p: object  # router probs of this thread's rows, one per row slot (``row_values``)
    h_out: tuple  # (smem, gmem) TMA partitions of h's (fc1) or dh's (dgrad) stores
    a_out: tuple  # (TMA atom, smem, gmem) of a's stores
    scales: object = None  # the FP8 kernel's dequantization-scale context (``scaled_glu``)
    slots: object = None  # the values' row slots (``row_values.RowSlots``)


class GluGemmKernel(HLoadMixin, RowValuesMixin, BiasEpilogueMixin, GroupedGemmKernel):
    """Varlen-M grouped GEMM with a GLU epilogue (``mode`` "fc1" or "dgrad"); see the module.

    ``pingpong``: one warpgroup per tile (fc1: a 128-wide tile of 64 gate and 64 up columns;
    dgrad: 128 or 192 columns), no bias."""

    pingpong_ready = True  # without a bias (checked in __init__)
    # fc1: a from h rounded to 16 bits (what the unfused chain computes from its saved h)
    # instead of from the fp32 accumulators: a rounding and its conversions per gate and up
    # value, 6-9 % of the kernel's time (kernel README, "a from the fp32 accumulators")
    act_from_rounded_h = False
    cooperative_fc1_widths = (256,)  # 128 gate + 128 up columns (FP8 block scales: 128)
    wide_fc1_ok = True  # the FC1 takes 64-column subtiles (``_check_wide_fc1``); FP8: not yet

    def _require_32_column_subtiles(self, op: str) -> None:
        """The GLU and activation epilogues index their subtiles by 32 columns: refuse a
        class-level ``epi_cols`` (the fresh wgrads take 64) of anything else."""
        if self.epi_cols != 32:
            raise ValueError(f"{op}: the GLU and activation epilogues stage 32-column "
                             f"subtiles, got epi_cols={self.epi_cols}")

    def _check_wide_fc1(self, epi_cols, mode, tile_n, pingpong, has_bias, interleave,
                        epi_rows, route) -> None:
        """64-column subtiles (``epi_cols``) only where the FC1 epilogue pairs whole 64-column
        gate and up blocks: the 16-bit FC1 (``wide_fc1_ok``) in ping-pong, 128 wide ([gate |
        up] halves of 64, or 64-column blocks), 128-row subtiles, no bias, rows not gathered."""
        if epi_cols == 32:
            return
        if not (epi_cols == 64 and self.wide_fc1_ok and mode == "fc1" and pingpong
                and tile_n == 128 and not has_bias and interleave in (None, 64)
                and epi_rows == 128 and route is None):
            raise ValueError(
                f"{type(self).__name__}: epi_cols {epi_cols} unsupported (32; 64 for the 16-bit "
                f"fc1 in ping-pong, 128 wide, halves or 64-column blocks, 128-row subtiles, no "
                f"bias, rows not gathered), got mode {mode!r}, tile_n {tile_n}, pingpong "
                f"{pingpong}, bias {has_bias}, interleave {interleave}, epi_rows {epi_rows}, "
                f"route {route}"
            )

    def __init__(
        self,
        mode: str,
        act: str,
        interleave: int | None,
        has_probs: bool,
        cluster_mn: tuple[int, int] = (1, 2),
        store_stages: int | None = None,
        tile_n: int = 256,
        params: tuple[float, ...] = (),
        has_bias: bool = False,
        route: str | None = None,
        pingpong: bool = False,
        h_prefetch: int = 1,
        epi_rows: int = 128,
        half_tiles: bool = False,
        store_h: bool = True,
        epi_cols: int = 32,
    ):
        if mode not in ("fc1", "dgrad"):
            raise ValueError(f"GluGemmKernel: mode must be 'fc1' or 'dgrad', got {mode!r}")
        if act not in ACTS:
            raise ValueError(f"GluGemmKernel: act must be one of {ACTS}, got {act!r}")
        fc1_tile_n = (128, 192) if pingpong else self.cooperative_fc1_widths
        if interleave is not None and (
            interleave % 32 or (mode == "fc1" and (tile_n // 2) % interleave)
        ):
            raise ValueError(f"GluGemmKernel: unsupported interleave {interleave} for {mode}")
        if (mode == "fc1" and tile_n not in fc1_tile_n) or tile_n not in (128, 192, 256):
            raise ValueError(
                f"GluGemmKernel: tile_n {tile_n} unsupported for {mode} (fc1: {fc1_tile_n}; "
                f"pingpong {pingpong})"
            )
        if pingpong and has_bias:
            raise ValueError("GluGemmKernel: ping-pong with an fc1 bias is not supported yet")
        subtiles = epilogue_subtiles(tile_n, epi_rows)
        if h_prefetch not in (1, 2, 4) or (h_prefetch > 1 and (
                mode != "dgrad" or subtiles % h_prefetch)):
            raise ValueError(
                f"GluGemmKernel: h_prefetch {h_prefetch} unsupported (1; 2 or 4 for a dgrad "
                f"whose {subtiles} subtiles per tile it divides), mode {mode!r}, tile_n "
                f"{tile_n}, epi_rows {epi_rows}"
            )
        if epi_rows not in (128, 64) or (epi_rows == 64 and not pingpong):
            raise ValueError(
                f"GluGemmKernel: epi_rows {epi_rows} unsupported (128, or 64 in ping-pong), "
                f"pingpong {pingpong}"
            )
        if not store_h and mode != "fc1":
            raise ValueError("GluGemmKernel: store_h=False is an fc1 option (dgrad writes dh)")
        self._require_32_column_subtiles("GluGemmKernel")
        self._check_wide_fc1(epi_cols, mode, tile_n, pingpong, has_bias, interleave, epi_rows,
                             route)
        self.h_prefetch, self.epi_rows, self.store_h = h_prefetch, epi_rows, store_h
        super().__init__(
            "m", (128, tile_n), cluster_mn, route=route, pingpong=pingpong,
            half_tiles=half_tiles, epi_cols=epi_cols,
        )
        self.mode, self.act, self.interleave, self.has_probs = mode, act, interleave, has_probs
        self.params = param_values(act, params)  # compile-time constants of the maths
        if has_bias and mode != "fc1":
            raise ValueError("GluGemmKernel: a bias is an fc1 option (dgrad has none)")
        self.has_bias = has_bias
        self.bias_halves = interleave is None  # GEMM columns are 128-column gate/up pairs
        self.epi_store_stages = store_stages
        if mode == "dgrad":  # store ring + gate/up buffer pairs that TMA fills with h
            # 2 store buffers keep 4 mainloop stages; 4 leave 3 (smem). One mbarrier per pair.
            self.epi_store_stages = store_stages or 2
            self.epi_extra_buffers, self.extra_barriers = 2 * h_prefetch, h_prefetch

    # ---------------------------------------------------------------- host side (jit)

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # x [M, H] (fc1) or dY [M, H] (dgrad)
        b: cute.Tensor,  # (N, K, E): W1 as (2F, H, E) (fc1) or W2 as (F, H, E) (dgrad)
        c: cute.Tensor,  # h [M, 2F] (fc1) or dh [M, 2F] (dgrad), written
        offs: cute.Tensor,
        num_clusters: Int32,
        act_out: cute.Tensor,  # a [M, F], written
        probs: cute.Tensor,  # [M] (unused without probs)
        dprobs: cute.Tensor,  # fp32 [M], accumulated (dgrad with probs)
        h_in: cute.Tensor,  # h [M, 2F] (dgrad)
        bias: cute.Tensor,  # [E, 2F] in h's columns (fc1 with has_bias; else unused)
        route: cute.Tensor,  # int32 [M]: x's row of each GEMM row (``route="gather"``)
        stream,
    ):
        epi_inputs = (act_out, probs, dprobs, h_in, bias)
        self._launch(a, b, c, offs, num_clusters, stream, self._b_tma_view(b), epi_inputs, route)

    def _b_tma_view(self, b: cute.Tensor) -> cute.Tensor:
        """B as the mainloop reads it: with fc1's [gate | up] halves, the hierarchical view
        ((s, 2, F/s), H, E), s = tile_n / 2 (GEMM column 2st + sq + i -> W1 row q*F + st + i)."""
        if self.mode != "fc1" or self.interleave is not None:
            return b
        f = b.shape[0] // 2
        s0 = b.stride[0]
        half = self.tile_mnk[1] // 2
        layout = cute.make_layout(
            ((half, 2, f // half), b.shape[1], b.shape[2]),
            stride=((s0, f * s0, half * s0), b.stride[1], b.stride[2]),
        )
        return cute.make_tensor(b.iterator, layout)

    def _make_epi(self, c: cute.Tensor, epi_inputs: tuple) -> tuple:
        """The epilogue state ``ep.epi``: (a's TMA atom and view, act_out, probs, dprobs, h's
        load atom and view, [bias], then any inputs after the five (the FP8 kernel's scales))."""
        act_out, probs, dprobs, h_in, bias = epi_inputs[:5]
        tma_o, m_o = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
            _ragged_view(act_out, 0),
            cute.slice_(self.c_smem, (None, None, 0)),
            self.epi_tile,
        )
        tma_h, m_h = None, None
        if self.mode == "dgrad":
            tma_h, m_h = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
                h_in,
                cute.slice_(self.c_smem, (None, None, 0)),
                self.epi_tile,
            )
        # the bias goes to the kernel only when used: bias-free configs keep their parameters
        used_bias = (bias,) if self.has_bias else ()
        return (tma_o, m_o, act_out, probs, dprobs, tma_h, m_h, *used_bias, *epi_inputs[5:])

    # ---------------------------------------------------------------- device side

    # Hooks of the FP8 kernel (``scaled_glu``); plain Python, inlined while tracing.

    def _scale_tile(self, ep, group, coords):
        """The tile's dequantization-scale context (None: 16-bit operands, nothing to scale)."""
        return None

    def _acc_at(self, ep, t: _GluTile, i: int):
        """fp32 accumulator value ``i`` of this thread as the GLU maths reads it."""
        return ep.tRS_acc[i]

    @cute.jit
    def _store_glu(self, ep, t, outs, blocks, count, half: int = 0):
        """TMA-store the (epi_rows x 32) subtiles ``outs`` = (gate-side h, up-side h, a)
        registers at column blocks ``blocks`` = (gate block of h, up block of h, block of a)
        and row half ``half`` of the tile, from ring slot ``count`` on."""
        (s_h, g_h), (tma_a, s_a, g_a) = t.h_out, t.a_out
        m_blk = t.m_tile * self._halves() + half
        items = [
            (outs[0], ep.tma_c, s_h, g_h, (m_blk, blocks[0])),
            (outs[1], ep.tma_c, s_h, g_h, (m_blk, blocks[1])),
            (outs[2], tma_a, s_a, g_a, (m_blk, blocks[2])),
        ]
        self._store_group(ep.tiled_r2s, ep.tRS_sC, ep.warp, items, count)

    @cute.jit
    def _store_a(self, ep, t, r_a, j_blk, count, half: int = 0):
        """TMA-store the (epi_rows x 32) subtile ``r_a`` of a at column block ``j_blk`` and
        row half ``half`` of the tile, in ring slot ``count`` (``store_h=False``)."""
        tma_a, s_a, g_a = t.a_out
        m_blk = t.m_tile * self._halves() + half
        self._store_group(ep.tiled_r2s, ep.tRS_sC, ep.warp,
                          [(r_a, tma_a, s_a, g_a, (m_blk, j_blk))], count)

    @cute.jit
    def _partition(self, tma, m_view, sC, row0, rows):
        """TMA partitions of a ragged (M, cols) view clipped to the group, per subtile."""
        g = cute.zipped_divide(_ragged_group(m_view, 0, row0, rows), self.epi_tile)
        return cute.nvgpu.cpasync.tma_partition(
            tma, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), g
        )

    @cute.jit
    def _store_tile(self, ep, acc, group, m_tile, n_tile, row0, rows, epi_count):
        tm, tn, _ = self.tile_mnk
        tma_o, m_o, act_out, probs, dprobs, tma_h, m_h = ep.epi[:7]
        f_dim = act_out.shape[1]
        # (row, col) in the tile of each accumulator value, in tRS_acc's order
        c_tile = cute.make_identity_tensor((tm, tn))
        tRS_c = ep.tiled_r2s.retile(ep.tiled_mma.get_slice(ep.mma_tidx).partition_C(c_tile))
        rows_here = rows - m_tile * tm  # valid rows of this tile (may exceed tm)
        row_base = row0 + m_tile * tm
        slots = self._row_slots(ep, tRS_c)
        if const_expr(self._halves() > 1):
            self._check_subtiles(ep, tRS_c)
        r_p = None
        r_s = cute.make_rmem_tensor((len(slots.first_index),), Float32)  # d(probs) per row
        r_s.fill(0.0)
        if const_expr(self.has_probs):
            r_p = self._load_row_probs(ep, tRS_c, slots, probs, row_base)
        h_out = self._partition(ep.tma_c, ep.mC, ep.sC, row0, rows)
        a_out = (tma_o, *self._partition(tma_o, m_o, ep.sC, row0, rows))
        scales = self._scale_tile(ep, group, tRS_c)
        t = _GluTile(m_tile, n_tile, f_dim, row_base, tRS_c, r_p, h_out, a_out, scales, slots)
        if const_expr(self.mode == "fc1"):
            bt = None
            if const_expr(self.has_bias):
                bt = self._bias_tile(ep, ep.epi[7], None, group, m_tile, n_tile, row0, f_dim)
            count = self._fc1_epilogue(ep, t, epi_count, bt)
        else:
            count = self._dgrad_epilogue(ep, t, r_s, tma_h, m_h, epi_count)
            if const_expr(self.has_probs):
                self._add_row_sums(ep, r_s, tRS_c, slots, rows_here, row_base, dprobs)
        return count

    @cute.jit
    def _fc1_epilogue(self, ep, t, count0, bt):
        """h subtiles (gate and up of each pair, + the bias where ``bt`` is its context) and the
        activation subtile; returns #stores."""
        n_tile, f_dim = t.n_tile, t.f_dim
        size_rD = cute.size(ep.rD)
        tn, cols = self.tile_mnk[1], self.epi_cols
        ts = tn // 2 if const_expr(self.interleave is None) else self.interleave
        q = ts // cols  # subtiles per gate (or up) block of the tile
        r_up = cute.make_rmem_tensor(ep.rD.shape, Float32)
        r_up_out = cute.make_rmem_tensor(ep.rD.shape, self.c_dtype)
        r_a_out = cute.make_rmem_tensor(ep.rD.shape, self.c_dtype)
        halves = self._halves()
        count = count0
        for i in cutlass.range_constexpr(tn // cols * halves):
            e, half = divmod(i, halves)  # column block, row half
            if const_expr((e // q) % 2 == 0):
                sg, su = i, (e + q) * halves + half  # the gate and up subtiles
                for v in cutlass.range_constexpr(size_rD):
                    ep.rD[v] = self._acc_at(ep, t, self._sub_index(ep, sg, v))
                    r_up[v] = self._acc_at(ep, t, self._sub_index(ep, su, v))
                    if const_expr(bt is not None):
                        ep.rD[v] = ep.rD[v] + self._bias_at(bt, self._sub_index(ep, sg, v))
                        r_up[v] = r_up[v] + self._bias_at(bt, self._sub_index(ep, su, v))
                if const_expr(self.store_h or self.act_from_rounded_h):
                    ep.rD_out.store(ep.rD.load().to(self.c_dtype))
                    r_up_out.store(r_up.load().to(self.c_dtype))
                # activation column block (of ``cols``) and h column blocks of gate and up
                j_blk = n_tile * (tn // 2 // cols) + ((cols * e) // (2 * ts)) * q + e % q
                if const_expr(self.interleave is None):
                    g_blk = j_blk
                    u_blk = f_dim // cols + j_blk
                else:
                    g_blk = n_tile * (tn // cols) + e
                    u_blk = g_blk + q
                # the tile past F (zero-filled) stores nothing: point its stores past the end
                g_blk, u_blk, j_blk = self._drop_unless(
                    j_blk * cols < f_dim, f_dim, g_blk, u_blk, j_blk, cols
                )
                gate, up = ep.rD.load(), r_up.load()
                if const_expr(self.act_from_rounded_h):
                    gate = ep.rD_out.load().to(Float32)
                    up = r_up_out.load().to(Float32)
                fg, _ = act_and_grad(gate, self.act, False, self.params)
                res = fg * up_and_grad(up, self.act, False, self.params)[0]
                if const_expr(self.has_probs):
                    res = res * self._per_value(ep, t.r_p, t.slots, sg)
                r_a_out.store(res.to(self.c_dtype))
                if const_expr(self.store_h):
                    self._store_glu(
                        ep, t, (ep.rD_out, r_up_out, r_a_out), (g_blk, u_blk, j_blk), count, half
                    )
                    count = count + 3
                else:  # a only: h is not wanted (no backward reads it)
                    self._store_a(ep, t, r_a_out, j_blk, count, half)
                    count = count + 1
        return count - count0

    @cute.jit
    def _dgrad_epilogue(self, ep, t, r_s, tma_h, m_h, count0):
        """Per 32-column subtile of dA: dgate, dup and a stores; d(probs) partial sums in r_s.

        The subtile's gate and up columns of h arrive by TMA in two smem buffers (one mbarrier,
        one phase per subtile: 4, 6 or 8 per tile, twice that with 64-row subtiles, an even
        count, so the parity of subtile s is s % 2 on every tile);
        the next subtile's load is issued once every thread has read the current one (issuing
        the first one before the tile's mainloop measured 5-7 % slower: kernel README)."""
        n_tile, f_dim = t.n_tile, t.f_dim
        size_rD = cute.size(ep.rD)
        r_g = cute.make_rmem_tensor(ep.rD.shape, Float32)
        r_u = cute.make_rmem_tensor(ep.rD.shape, Float32)
        r_du_out = cute.make_rmem_tensor(ep.rD.shape, self.c_dtype)
        r_a_out = cute.make_rmem_tensor(ep.rD.shape, self.c_dtype)
        s_l, g_l = self._h_partitions(ep, tma_h, m_h, t.row_base)
        reader = self._h_reader(ep)
        depth, halves = self.h_prefetch, self._halves()
        num_sub = self._dgrad_subtiles()  # subtile s: column block s // halves
        for d in cutlass.range_constexpr(min(depth, num_sub)):
            self._issue_h(ep, tma_h, s_l, g_l, n_tile, f_dim, d)
        count = count0
        for e in cutlass.range_constexpr(num_sub):
            j0, g_col, u_col = self._h_cols(n_tile, f_dim, e // halves)
            col_ok = j0 < f_dim
            g_buf = self.epi_stage + 2 * (e % depth)
            u_buf = g_buf + 1
            cute.arch.mbarrier_wait(self._h_bar(ep, e), self._h_parity(count0, e))
            for v in cutlass.range_constexpr(size_rD):
                ep.rD[v] = self._acc_at(ep, t, self._sub_index(ep, e, v))
            self._read_h(ep, reader, g_buf, col_ok, r_g)
            self._read_h(ep, reader, u_buf, col_ok, r_u)
            self._sync_for_tma()  # the h buffers are free again
            if const_expr(e + depth < num_sub):
                self._issue_h(ep, tma_h, s_l, g_l, n_tile, f_dim, e + depth)
            self._dglu(ep, t, (ep.rD, r_g, r_u, e), r_s, (ep.rD_out, r_du_out, r_a_out))
            g_blk, u_blk, j_blk = self._drop_unless(
                col_ok, f_dim, g_col // 32, u_col // 32, j0 // 32
            )
            outs = (ep.rD_out, r_du_out, r_a_out)
            self._store_glu(ep, t, outs, (g_blk, u_blk, j_blk), count, e % halves)
            count = count + 3
        return count - count0

    @cute.jit
    def _dglu(self, ep, t, ins, r_s, outs):
        """``ins`` = (dA, gate, up half) registers of subtile ``sub``, ``outs`` = (dgate, dup,
        a).
        With u = up(up half), u' = up'(up half) (the identity's: 1): dgate = dA·p·u·act'(gate),
        dup = dA·p·act(gate)·u', a = act(gate)·u·p (rounded once); r_s[row] += dA·act(gate)·u
        (the d(probs) partial sums per row slot, before the p scaling)."""
        r_da, r_g, r_u, sub = ins
        r_dg_out, r_du_out, r_a_out = outs
        gate = r_g.load()
        da = r_da.load()
        fg, dfg = act_and_grad(gate, self.act, True, self.params)
        up, dup = up_and_grad(r_u.load(), self.act, True, self.params)
        fgu = fg * up
        if const_expr(self.has_probs):
            self._add_to_rows(ep, r_s, da * fgu, t.slots, sub)
            p = self._per_value(ep, t.r_p, t.slots, sub)
            da = da * p
            fgu = fgu * p
        r_dg_out.store((da * up * dfg).to(self.c_dtype))
        dfu = da * fg
        if const_expr(dup is not None):
            dfu = dfu * dup
        r_du_out.store(dfu.to(self.c_dtype))
        r_a_out.store(fgu.to(self.c_dtype))

    @cute.jit
    def _drop_unless(self, ok, f_dim, g_blk, u_blk, j_blk, cols: int = 32):
        """Column blocks (of ``cols``) of h (2F wide) and a (F wide), or blocks just past their
        ends (TMA drops those stores) where ``ok`` is False."""
        g, u, j = f_dim // (cols // 2), f_dim // (cols // 2), f_dim // cols
        if ok:
            g, u, j = g_blk, u_blk, j_blk
        return g, u, j
