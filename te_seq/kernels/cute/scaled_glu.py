"""FP8 (E4M3) GLU epilogue GEMMs (sm_90a): ``GluGemmKernel`` with E4M3 operands and row-wise
dequantization scales applied to the fp32 accumulators before the GLU maths.

Shape legend: M routed rows, E experts, H hidden, F ffn width, N the GEMM's columns (2F for
"fc1", F for "dgrad"); g(m) the expert of row m. A [M, H] and B (N, H, E) are both K-major
(FP8 WGMMA reads only K-major smem operands): "fc1" B = W1 [E, 2F, H] seen as (2F, H, E),
"dgrad" B = W2ᵀ [E, F, H] seen as (F, H, E). scale_a fp32 [M] and scale_b fp32 [E, N] (N in
W1's row order for "fc1") are the *dequantization* scales (te_seq's ``scale_inv``):

    acc'[m, n] = scale_a[m] · scale_b[g(m), n] · Σ_k fp32(a[m, k]) · fp32(b[g(m), n, k])

and everything after that is the 16-bit kernel's epilogue (``glu_epilogue``): h rounded to bf16
and a computed from the rounded h (fc1); dh, a and the d(probs) atomics from the unrounded dA
(dgrad). Outputs bf16.

The scales of a tile reach the epilogue as in ``scale_epilogue``: copied into an smem scratch
by cp.async before the tile's mainloop (``ScaleScratchMixin``), waited for before the epilogue.
With fc1's [gate | up] halves of w = tile_n / 2 columns (128 cooperative, 64 or 96 in ping-pong),
tile column wq + i of n-tile t reads W1 row q·F + wt + i (``GluGemmKernel._b_tma_view``), so the
column scale copied for it is scale_b[g, q·F + wt + i];
with interleaved blocks the tile's columns are W1's rows in order. Rows past offs[-1] (the
virtual group E) have zero accumulators and get acc' = 0 whatever their scales hold (no
NaN · 0), so fc1 writes zeros there and dgrad's dh is zero there, as the 16-bit kernel's.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .glu_epilogue import GluGemmKernel, _GluTile
from .quant_kernels import _nan_to_inf
from .row_values import _static_offsets
from .scale_epilogue import ScaleScratchMixin, ScaleTile
from .span_kernels import _fmax, _shuffle_max


class ScaledGluGemmKernel(ScaleScratchMixin, GluGemmKernel):
    """``GluGemmKernel`` ("fc1" or "dgrad", no bias, no route) on E4M3 operands whose fp32
    accumulators are dequantized by row and column scales first; see the module."""

    scale_epi_index = 7  # ep.epi: the GLU kernel's seven entries (no bias), then the scales

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
        pingpong: bool = False,
        epi_rows: int = 128,
        half_tiles: bool = False,
        store_h: bool = True,
        h_prefetch: int = 1,
    ):
        super().__init__(mode, act, interleave, has_probs, cluster_mn, store_stages, tile_n, params,
                         pingpong=pingpong, h_prefetch=h_prefetch, epi_rows=epi_rows,
                         half_tiles=half_tiles, store_h=store_h)

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # x [M, H] (fc1) or dY [M, H] (dgrad), E4M3
        b: cute.Tensor,  # (N, H, E) E4M3, K-major: W1 as (2F, H, E) or W2ᵀ as (F, H, E)
        c: cute.Tensor,  # h [M, 2F] (fc1) or dh [M, 2F] (dgrad) bf16, written
        offs: cute.Tensor,
        num_clusters: Int32,
        act_out: cute.Tensor,  # a [M, F] bf16, written
        probs: cute.Tensor,  # [M] (unused without probs)
        dprobs: cute.Tensor,  # fp32 [M], accumulated (dgrad with probs)
        h_in: cute.Tensor,  # h [M, 2F] bf16 (dgrad)
        bias: cute.Tensor,  # unused (a dummy: the 16-bit kernel's argument list)
        scale_a: cute.Tensor,  # fp32 [M]
        scale_b: cute.Tensor,  # fp32 [E, N]
        route: cute.Tensor,  # unused (a dummy)
        stream,
    ):
        epi_inputs = (act_out, probs, dprobs, h_in, bias, scale_a, scale_b)
        self._launch(a, b, c, offs, num_clusters, stream, self._b_tma_view(b), epi_inputs, route)

    # Plain Python (inlined while the kernel is traced): no dynamic control flow below.

    def _scale_col(self, n_tile, t, scale_b):
        """W1's row of fc1 tile column ``t`` with [gate | up] halves of w = tile_n / 2 columns
        (q·F + w·n_tile + i for t = w·q + i); the GEMM's own column otherwise."""
        if self.mode == "fc1" and self.interleave is None:
            f_dim, half = cute.size(scale_b, mode=[1]) // 2, self.tile_mnk[1] // 2
            return (t // half) * f_dim + n_tile * half + t % half
        return n_tile * self.tile_mnk[1] + t

    def _scale_tile(self, ep, group, coords) -> ScaleTile:
        """Wait for the tile's scales; the tile is live unless it is the virtual group E."""
        self._wait_scales()
        num_experts = cute.size(ep.epi[self.scale_epi_index + 1], mode=[0])
        return ScaleTile(ep.scratch, coords, group < num_experts)

    def _acc_at(self, ep, t: _GluTile, i: int):
        """Accumulator value ``i`` times its row's and column's dequantization scales."""
        return self._scaled_at(t.scales, i, ep.tRS_acc[i])


class ColumnMaximaGluKernel(ScaledGluGemmKernel):
    """The FP8 GLU dgrad (``ScaledGluGemmKernel`` mode "dgrad") that also raises
    amax_dh [E, 2F] and amax_a [E, F] (fp32, zero-filled by the caller) to max |v| over each
    expert's rows per column of the dh and a it writes (the bf16 values stored; nan counted as
    inf), so that their token-major FP8 forms need no maxima pass over memory
    (``fp8_quantize.token_major_from_amax``, bitwise the pass's result).

    Per 32-column subtile each thread takes, per distinct column it holds, the max over its
    rows of the tile that lie in the expert (the rows past the expert's end are not its
    values); the lanes that share columns (lane bits 2-4 in a WGMMA accumulator) combine by
    shuffles, and lanes 0-3 of each warp raise the column's entry with an atomic max on the
    fp32 bits (non-negative floats order as their bits). Rows of the virtual group E (past
    the last expert) and subtiles past F add nothing."""

    amax_epi_index = ScaledGluGemmKernel.scale_epi_index + 2  # after the scales

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.mode != "dgrad":
            raise ValueError("ColumnMaximaGluKernel: column maxima are a dgrad option, got "
                             f"mode {self.mode!r}")

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # dY [M, H], E4M3
        b: cute.Tensor,  # W2ᵀ as (F, H, E), E4M3, K-major
        c: cute.Tensor,  # dh [M, 2F] bf16, written
        offs: cute.Tensor,
        num_clusters: Int32,
        act_out: cute.Tensor,  # a [M, F] bf16, written
        probs: cute.Tensor,
        dprobs: cute.Tensor,
        h_in: cute.Tensor,  # h [M, 2F] bf16
        bias: cute.Tensor,  # unused (a dummy)
        scale_a: cute.Tensor,  # fp32 [M]
        scale_b: cute.Tensor,  # fp32 [E, F]
        amax_dh: cute.Tensor,  # fp32 [E, 2F], raised
        amax_a: cute.Tensor,  # fp32 [E, F], raised
        route: cute.Tensor,  # unused (a dummy)
        stream,
    ):
        epi_inputs = (act_out, probs, dprobs, h_in, bias, scale_a, scale_b, amax_dh, amax_a)
        self._launch(a, b, c, offs, num_clusters, stream, self._b_tma_view(b), epi_inputs, route)

    def _subtile_columns(self, ep, t: _GluTile, e: int) -> list:
        """Trace time: subtile ``e``'s values of this thread grouped by column, as (the flat
        index of the column's first value, [value indices v of rD on that column])."""
        offsets = _static_offsets(self, t.coords, cute.size(ep.tRS_acc))
        columns: dict[int, list] = {}
        for v in range(cute.size(ep.rD)):
            flat = self._sub_index(ep, e, v)
            columns.setdefault(offsets[flat][1], []).append((flat, v))
        return [(members[0][0], [v for _, v in members]) for members in columns.values()]

    @cute.jit
    def _column_maxima(self, ep, t, outs, cols, col_ok, e: int):
        """The subtile's (dgate, dup, a) maxima per column into amax_dh and amax_a."""
        amax_dh, amax_a = ep.epi[self.amax_epi_index], ep.epi[self.amax_epi_index + 1]
        lane = cute.arch.lane_idx()
        first_col = 32 * (e // self._halves())  # the subtile's first column in the tile
        live = col_ok & (t.group < cute.size(amax_a, mode=[0]))
        targets = ((outs[0], cols[0], amax_dh), (outs[1], cols[1], amax_dh),
                   (outs[2], cols[2], amax_a))
        columns = self._subtile_columns(ep, t, e)
        for out, col0, dst in targets:
            values = out.load().to(Float32)
            for first, members in columns:
                c = t.coords[first][1] - first_col  # this thread's column of the subtile
                in_f = cols[2] + c < t.f_dim
                amax = Float32(0.0)
                for v in members:
                    inside = t.coords[self._sub_index(ep, e, v)][0] < t.valid_rows
                    magnitude = cute.math.abs(values[v])
                    amax = _fmax(amax, cutlass.select_(inside, magnitude, Float32(0.0)))
                amax = _shuffle_max(amax, (4, 8, 16))  # the lanes holding the same columns
                if live & in_f & (lane < 4):
                    entry = t.group * dst.shape[1] + col0 + c
                    cute.arch.atomic_fmax(dst.iterator + entry, _nan_to_inf(amax),
                                          sign_bit=False)
