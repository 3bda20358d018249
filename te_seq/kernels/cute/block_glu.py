"""The FP8 block-scaled GLU steps (sm_90a): ``GluGemmKernel`` ("fc1" and "dgrad") on E4M3
operands whose ``Float8BlockScaling`` scales are promoted in the main loop (``block_scaled``),
so the activation (and router probs), and in the dgrad its backward, run in the epilogues as
for 16-bit and row-wise FP8 operands.

Shape legend: M routed rows, E experts, H hidden, F ffn width (a multiple of 128), HB = ⌈H/128⌉;
g(m) the expert of row m. x [M, H] and W1 [E, 2F, H] (seen as (2F, H, E)) are E4M3 and
K-major; x_scale fp32 [M, HB] holds the dequantization scale of each row's 128-wide block of H
(1×128), w1_scale fp32 [E, 2F/128, HB] that of each 128×128 block of W1:

    h[m, n] = Σ_kb x_scale[m, kb] · w1_scale[g(m), n // 128, kb]
                   · Σ_{k in block kb} x[m, k] · w1[g(m), n, k]

in fp32 (the partial sums promoted every 128-element k-tile), rounded once to bf16, then
a = act(gate)·up(·probs) from the bf16 h, as ``reference.glu_forward`` (the 16-bit kernel's
epilogue, ``glu_epilogue``). The dgrad: dA [M, F] = dY W2 from E4M3 dY [M, H] in 1×128
blocks and W2ᵀ [E, F, H] in 128×128 blocks (scales [M, HB] and [E, ⌈F/128⌉, HB]), promoted
the same way and kept in fp32, then dh, a and d(probs) from h as the 16-bit dgrad epilogue.

Tile: 128 × 128, cooperative (both warpgroups, 64 rows each), 64 gate + 64 up columns: a
thread keeps 64 fp32 accumulators and the 64 of the k-tile being promoted (a 256-wide tile
would need 256 registers). With [gate | up] halves tile column 64q + i of n-tile t reads W1
row q·F + 64t + i (``GluGemmKernel._b_tma_view``): the gate half lies in W1's block row
t // 2, the up half in F/128 + t // 2, so each k-tile promotes with two weight scales, chosen
per accumulator value by its column (static). With interleaved blocks of 32 or 64 the tile's
columns are W1 rows 128t .. 128t + 127: one block row, as for the dgrad's 128 columns of F.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32

from .block_scaled import SCALE_BLOCK, BlockScalesMixin, BlockTile
from .glu_epilogue import GluGemmKernel
from .row_values import _static_offsets

TILE_N = 128


class BlockScaledGluGemmKernel(BlockScalesMixin, GluGemmKernel):
    """``GluGemmKernel`` ("fc1" or "dgrad", cooperative 128 x 128 tiles) on E4M3 operands
    with 1×128 / 128×128 block scales promoted in the main loop; see the module."""

    pingpong_ready = False  # the promoted main loop does not hand the tensor cores over
    cooperative_fc1_widths = (TILE_N,)
    block_scale_index = 7  # ep.epi: the GLU kernel's seven entries (no bias), then the scales
    wide_fc1_ok = False  # 32-column subtiles (cooperative tiles)

    def __init__(
        self,
        mode: str,
        act: str,
        interleave: int | None,
        has_probs: bool,
        cluster_mn: tuple[int, int] = (1, 2),
        params: tuple[float, ...] = (),
    ):
        super().__init__(mode, act, interleave, has_probs, cluster_mn, tile_n=TILE_N,
                         params=params)

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
        scale_a: cute.Tensor,  # fp32 [M, HB]
        scale_b: cute.Tensor,  # fp32 [E, NB, HB]: W1's 2F/128 or W2ᵀ's ⌈F/128⌉ block rows
        route: cute.Tensor,  # unused (a dummy)
        stream,
    ):
        epi_inputs = (act_out, probs, dprobs, h_in, bias, scale_a, scale_b)
        self._launch(a, b, c, offs, num_clusters, stream, self._b_tma_view(b), epi_inputs, route)

    # Plain Python (inlined while the kernel is traced).

    def _tile_blocks(self, ep, n_tile) -> tuple:
        """B's block rows of the tile's columns: fc1 with [gate | up] halves (gate half's, up
        half's); one block row otherwise (interleaved fc1, and the dgrad's columns j of F)."""
        if self.mode != "fc1" or self.interleave is not None:
            return (n_tile * TILE_N // SCALE_BLOCK,)
        f_blocks = ep.epi[2].shape[1] // SCALE_BLOCK  # act_out [M, F]
        gate = n_tile * (TILE_N // 2) // SCALE_BLOCK
        return gate, f_blocks + gate

    def _value_blocks(self, bt: BlockTile, count: int) -> list[int]:
        """With halves: 1 for the values in the tile's up half (columns from TILE_N / 2 on,
        static offsets from the thread's base column, which is below 8), else 0."""
        if self.mode != "fc1" or self.interleave is not None:
            return [0] * count
        cols = [col for _, col in _static_offsets(self, bt.coords, count)]
        return [int(col >= TILE_N // 2) for col in cols]
