"""The FP8 grouped GEMM (sm_90a): E4M3 operands, fp32 accumulation, row-wise dequantization
scales applied in the store epilogue.

Shape legend: M routed rows, E experts, K reduction dim, N output columns. A [M, K] and
B = W [E, N, K] seen as (N, K, E) are both K-major (FP8 WGMMA reads only K-major smem
operands); scale_a fp32 [M], scale_b fp32 [E, N] are the *dequantization* scales (te_seq's
``scale_inv``); the output is

    y[m, n] = scale_a[m] · scale_b[g(m), n] · Σ_k fp32(a[m, k]) · fp32(b[g(m), n, k])

rounded once to the output type (bf16), g(m) the expert of row m. The mainloop is the plain
kernel's with a 128-element k-tile (128-byte smem rows, as the 16-bit kernels' 64 elements;
``GroupedGemmKernel._setup``); the K tail (K a multiple of 16, not of 128) is zero-filled by the
TMA loads of both operands.

The epilogue multiplies each fp32 accumulator by its row's and column's scales (read per value
from global memory, L1-cached; loads past M or N are clamped to the last element, and TMA drops
those stores anyway) before the rounding. Rows past offs[-1] form the virtual group E: their
accumulators are zero and they are written as zeros whatever the scales hold (no NaN · 0).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .grouped_gemm import GroupedGemmKernel
from .ragged import _ragged_group


class ScaleTile(NamedTuple):
    """One tile's scale context (trace-time bundle)."""

    scale_a: object  # fp32 [M]
    scale_b: object  # fp32 [E, N]
    coords: object  # (row, col) in the tile of each accumulator value, in tRS_acc's order
    group: object  # the tile's expert (E: the virtual group past offs[-1])
    col_base: object  # first column of the tile in N
    row_base: object  # first row of the tile in M


class ScaledGemmKernel(GroupedGemmKernel):
    """Varlen-M grouped GEMM whose epilogue applies per-row (A) and per-expert, per-column (B)
    scales to the fp32 accumulators: ``C[rows of e] = diag(sa) (A[rows of e] @ B[e]) diag(sb[e])``.
    """

    def __init__(self, tile_mn: tuple[int, int] = (128, 256), cluster_mn: tuple[int, int] = (1, 2)):
        super().__init__("m", tile_mn, cluster_mn)

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # [M, K] E4M3, K-major
        b: cute.Tensor,  # (N, K, E) E4M3, K-major
        c: cute.Tensor,  # [M, N] bf16, written
        offs: cute.Tensor,  # int32 [E] cumulative row ends
        num_clusters: Int32,
        scale_a: cute.Tensor,  # fp32 [M]
        scale_b: cute.Tensor,  # fp32 [E, N]
        route: cute.Tensor,  # unused (no routed rows): a dummy, as the other GEMM kernels take
        stream,
    ):
        self._launch(a, b, c, offs, num_clusters, stream, b, (scale_a, scale_b), route)

    def _make_epi(self, c: cute.Tensor, epi_inputs: tuple) -> tuple:
        return epi_inputs

    @cute.jit
    def _store_tile(self, ep, acc, group, m_tile, n_tile, row0, rows, epi_count):
        tm, tn, _ = self.tile_mnk
        c_tile = cute.make_identity_tensor((tm, tn))
        coords = ep.tiled_r2s.retile(ep.tiled_mma.get_slice(ep.mma_tidx).partition_C(c_tile))
        st = ScaleTile(ep.epi[0], ep.epi[1], coords, group, n_tile * tn, row0 + m_tile * tm)
        gC = cute.local_tile(_ragged_group(ep.mC, 0, row0, rows), (tm, tn), (m_tile, n_tile))
        return self._epilogue(ep, gC, epi_count, None, scale_tile=st)

    # Plain Python (inlined while the kernel is traced): no dynamic control flow below.

    def _scaled_at(self, st: ScaleTile, i: int, value):
        """``value`` (accumulator value ``i`` of this thread) times its row's and column's
        scales; 0 in the virtual group past offs[-1]."""
        r, c = st.coords[i]
        num_experts = cute.size(st.scale_b, mode=[0])
        last_col = cute.size(st.scale_b, mode=[1]) - 1
        last_row = cute.size(st.scale_a) - 1
        group = cutlass.min(st.group, num_experts - 1)
        sb = st.scale_b[group, cutlass.min(st.col_base + c, last_col)]
        sa = st.scale_a[cutlass.min(st.row_base + r, last_row)]
        return cutlass.select_(st.group < num_experts, value * (sa * sb), Float32(0.0))
