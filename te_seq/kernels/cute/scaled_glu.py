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

import cutlass.cute as cute
from cutlass import Int32

from .glu_epilogue import GluGemmKernel, _GluTile
from .scale_epilogue import ScaleScratchMixin, ScaleTile


class ScaledGluGemmKernel(ScaleScratchMixin, GluGemmKernel):
    """``GluGemmKernel`` ("fc1" or "dgrad", no bias, no route) on E4M3 operands whose fp32
    accumulators are dequantized by row and column scales first; see the module."""

    scale_epi_index = 7  # ep.epi: the GLU kernel's seven entries (no bias), then the scales
    wide_fc1_ok = False  # its FC1 stages 32-column subtiles (64: not run on a GPU yet)

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
