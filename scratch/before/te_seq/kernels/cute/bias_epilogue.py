"""Per-expert biases in the grouped GEMM epilogues (sm_90a).

Shape legend: M routed rows, E experts, N GEMM output columns. The bias is [E, N] (bf16, fp16
or fp32; for FC1, N = 2F in h's column layout); with per-row scales s [M] (fp32) the epilogue
adds s_t · b_e instead of b_e (a scaled bias, GroupedLinear's ``scale_bias``).

The epilogue adds the bias value of each accumulator to the fp32 accumulator before the one
rounding to the output type. Every thread reads the bias of its own accumulator columns once
per tile, as the subtiles of the tile come through the epilogue (the same column twice: its
two rows of an 8-row block, the second an L1 hit); loads past N (or past M for the scales) are
clamped to the last element, and TMA drops those stores anyway. Rows past the last expert (the
virtual group E, whose output is zeros) get no bias.

``BiasEpilogueMixin`` holds the lookup (``_bias_at``); ``BiasGemmKernel`` is the plain varlen-M
``GroupedGemmKernel`` with the bias (FC2's forward y = a W2ᵀ + b2), and ``glu_epilogue`` uses
the mixin for FC1's h = x W1ᵀ + b1. Kernels compiled without a bias run none of this code.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .grouped_gemm import GroupedGemmKernel
from .ragged import _ragged_group


class BiasTile(NamedTuple):
    """One tile's bias context (trace-time bundle)."""

    bias: object  # [E, N] tensor
    scales: object  # [M] fp32 tensor, or None without per-row scales
    coords: object  # (row, col) in the tile of each accumulator value, in tRS_acc's order
    group: object  # the tile's expert
    n_tile: object
    row_base: object  # first row of the tile in M
    f_dim: object  # F (GLU halves layout only; else unused)


class BiasEpilogueMixin:
    """The bias lookup shared by the plain and GLU epilogues. ``bias_halves``: the GEMM's
    columns are FC1's [gate | up] halves seen as 128-column pairs (``glu_epilogue``): tile
    column 128q + i of n-tile t is h column q·F + 128t + i."""

    pingpong_ready = False  # the bias columns of a tile assume 128-column gate/up halves

    bias_halves = False

    # Plain Python (inlined while the kernel is traced): no dynamic control flow below.

    def _bias_tile(self, ep, bias, scales, group, m_tile, n_tile, row0, f_dim) -> BiasTile:
        """The bias context of one tile (coordinates of this thread's accumulator values)."""
        c_tile = cute.make_identity_tensor(self.tile_mnk[:2])
        coords = ep.tiled_r2s.retile(ep.tiled_mma.get_slice(ep.mma_tidx).partition_C(c_tile))
        row_base = row0 + m_tile * self.tile_mnk[0]
        return BiasTile(bias, scales, coords, group, n_tile, row_base, f_dim)

    def _bias_at(self, bt: BiasTile, i: int):
        """The fp32 bias (· row scale) of accumulator value ``i`` of this thread."""
        r, c = bt.coords[i]
        if const_expr(self.bias_halves):
            col = (c // 128) * bt.f_dim + bt.n_tile * 128 + c % 128
        else:
            col = bt.n_tile * self.tile_mnk[1] + c
        last_col = cute.size(bt.bias, mode=[1]) - 1
        num_experts = cute.size(bt.bias, mode=[0])
        # rows past offs[-1] form a virtual group E, written as zeros: no bias there
        group = cutlass.min(bt.group, num_experts - 1)
        val = bt.bias[group, cutlass.min(col, last_col)].to(Float32)
        val = cutlass.select_(bt.group < num_experts, val, Float32(0.0))
        if const_expr(bt.scales is not None):
            last_row = cute.size(bt.scales) - 1
            val = val * bt.scales[cutlass.min(bt.row_base + r, last_row)].to(Float32)
        return val


class BiasGemmKernel(BiasEpilogueMixin, GroupedGemmKernel):
    """Varlen-M grouped GEMM with a per-expert bias (and optional per-row bias scales) added in
    the store epilogue: ``C[rows of e] = A[rows of e] @ B[e] + (s_t ·) bias[e]``."""

    def __init__(
        self,
        tile_mn: tuple[int, int] = (128, 256),
        cluster_mn: tuple[int, int] = (1, 2),
        has_scales: bool = False,
        route: str | None = None,
    ):
        super().__init__("m", tile_mn, cluster_mn, route=route)
        self.has_scales = has_scales

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # [M, K]
        b: cute.Tensor,  # (N, K, E)
        c: cute.Tensor,  # [M, N], written
        offs: cute.Tensor,
        num_clusters: Int32,
        bias: cute.Tensor,  # [E, N]
        scales: cute.Tensor,  # fp32 [M] (unused without scales)
        route: cute.Tensor,  # int32 [M] (``route``: routed.py; else unused)
        stream,
    ):
        self._launch(a, b, c, offs, num_clusters, stream, b, (bias, scales), route)

    def _make_epi(self, c: cute.Tensor, epi_inputs: tuple) -> tuple:
        bias, scales = epi_inputs
        return (bias, scales) if self.has_scales else (bias,)

    @cute.jit
    def _store_tile(self, ep, acc, group, m_tile, n_tile, row0, rows, epi_count):
        tm, tn, _ = self.tile_mnk
        scales = ep.epi[1] if const_expr(self.has_scales) else None
        bt = self._bias_tile(ep, ep.epi[0], scales, group, m_tile, n_tile, row0, None)
        gC = cute.local_tile(_ragged_group(ep.mC, 0, row0, rows), (tm, tn), (m_tile, n_tile))
        sc = self._scatter_tile(ep, row0 + m_tile * tm, rows - m_tile * tm, n_tile)
        return self._epilogue(ep, gC, epi_count, None, bt, scatter=sc)
