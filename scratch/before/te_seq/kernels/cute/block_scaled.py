"""The FP8 block-scaled grouped GEMM (sm_90a, varlen M): ``Float8BlockScaling``'s GEMM.

Shape legend: M routed rows, E experts, K reduction dim, N output columns, KB = ⌈K/128⌉ scale
blocks along K, NB = ⌈N/128⌉. A [M, K] and B = W [E, N, K] seen as (N, K, E) are E4M3 and
K-major; a_scale fp32 [M, KB] holds the dequantization scale of each row's 128-wide K block
(x and dy: 1×128 blocks), b_scale fp32 [E, NB, KB] that of each 128×128 weight block:

    y[m, n] = Σ_kb a_scale[m, kb] · b_scale[g(m), n // 128, kb]
                   · Σ_{k in block kb} a[m, k] · b[g(m), n, k]

in fp32, rounded once to bf16; g(m) the expert of row m (``offs``). The FP8 k-tile is 128
elements (``GroupedGemmKernel._setup``), so each k-tile is exactly one scale block along K.

Promotion (in the main loop, ``promote.PromotedMainloopMixin``): each k-tile's WGMMAs
accumulate into a zeroed fp32 fragment; once they are done, each accumulator value is
promoted, ``acc += tmp · (a_scale[row, kb] · b_scale[g, n_tile, kb])``. The CTA tile is
128 × 128, so one b scale covers a whole (tile, k-tile); each thread holds its accumulator
values in a few rows (two per 64-row WGMMA of the sm90 accumulator layout) and loads those
rows' a scales, plus the one b scale, from global memory per k-tile, before waiting for the
k-tile's operands.

The K tail (K a multiple of 16, not of 128) is zero-filled by TMA, so the last block's scale
multiplies only the valid products. Rows past offs[-1] form the virtual group E: they run no
k-tile and are written as zeros (no scale is read for them). Scale reads past M or NB (rows of
a partial tile that the ragged store drops, n-tiles past N) are clamped to the last entry.

Not done (speed): the scales are read from global memory rather than TMA-loaded with the
operands; the promotion is not overlapped with the same warpgroup's next WGMMAs (measured
slower: ``promote``).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .grouped_gemm import GroupedGemmKernel
from .promote import PromotedMainloopMixin

SCALE_BLOCK = 128  # elements of a scale block along K (and N for the weights)


class BlockTile(NamedTuple):
    """The scale context of the tile a consumer warpgroup is computing (trace-time bundle)."""

    a_scale: object  # fp32 [M, KB]
    b_scale: object  # fp32 [E, NB, KB]
    group: object  # expert of the tile (E: the virtual group past offs[-1])
    first_row: object  # the tile's first row in A
    n_blocks: tuple  # weight block rows of the tile's columns (one, or one per column half)
    coords: object  # (row, col) in the tile of this thread's accumulator values


def row_slots(acc_shape) -> tuple[list[int], list[int]]:
    """(representative value index of each row slot, row slot of each value) for a thread's
    accumulator of shape ((2, 2, V), MMA_M, MMA_N): the sm90 WGMMA accumulator layout, whose
    value mode is (2 adjacent columns, 2 rows 8 apart, V column groups of 8). A value's row
    depends only on its middle index and its MMA_M index, so a thread has 2 · MMA_M rows.
    Flat (column-major) value index i = c + 2 r + 4 v + 4 V mm + 4 V MMA_M nn."""
    value_mode, mma_m, mma_n = acc_shape
    if not isinstance(value_mode, tuple) or tuple(value_mode[:2]) != (2, 2) or len(value_mode) != 3:
        raise ValueError(f"BlockScaledGemmKernel: unexpected accumulator shape {acc_shape}")
    per_mma = 4 * value_mode[2]
    firsts = [2 * r + per_mma * mm for mm in range(mma_m) for r in range(2)]
    slot = [(i // 2) % 2 + 2 * ((i // per_mma) % mma_m) for i in range(per_mma * mma_m * mma_n)]
    return firsts, slot


class BlockScalesMixin(PromotedMainloopMixin):
    """The promotion hooks of a varlen-M kernel with 1×128 (A) and 128×128 (B) block scales
    (module docstring): a_scale [M, KB] and b_scale [E, NB, KB] are the epilogue state's
    entries ``block_scale_index`` and the next. A tile's columns lie in one weight block row
    (``_tile_blocks``), or, for a kernel whose tile holds two column halves from different
    weight rows (the GLU FC1: gate and up), in one per half (``_value_blocks``)."""

    block_scale_index = 0

    def _tile_blocks(self, ep, n_tile) -> tuple:
        """The weight block rows of n-tile ``n_tile``'s columns: one (tile_n = 128)."""
        return (n_tile * self.tile_mnk[1] // SCALE_BLOCK,)

    def _value_blocks(self, bt: BlockTile, count: int) -> list[int]:
        """Which of ``bt.n_blocks`` each of the thread's ``count`` values reads (trace time)."""
        return [0] * count

    # Plain Python (inlined while the kernel is traced): records the tile for ``_mainloop``,
    # which the consumer calls next in the same loop iteration (its arguments carry no tile).
    def _before_mainloop(self, ep, group, m_tile, n_tile, row0, epi_count):
        tm, tn, _ = self.tile_mnk
        tile = cute.make_identity_tensor((tm, tn))
        coords = ep.tiled_mma.get_slice(ep.mma_tidx).partition_C(tile)
        i = self.block_scale_index
        self._block_tile = BlockTile(
            ep.epi[i], ep.epi[i + 1], group, row0 + m_tile * tm, self._tile_blocks(ep, n_tile),
            coords,
        )

    def _scale_rows(self, bt: BlockTile, firsts: list[int]) -> list:
        """This thread's rows of A (one per row slot), clamped to M - 1."""
        last = cute.size(bt.a_scale, mode=[0]) - 1
        return [cutlass.min(bt.first_row + bt.coords[i][0], last) for i in firsts]

    def _promotion(self, acc) -> tuple:
        """(row slot of each value, this thread's rows, the tile's expert, its weight block
        rows, which block row each value reads): what the k-tiles' scale loads and
        promotions share."""
        bt = self._block_tile
        firsts, slot = row_slots(cute.shape(acc))
        rows = self._scale_rows(bt, firsts)
        group = cutlass.min(bt.group, cute.size(bt.b_scale, mode=[0]) - 1)
        last = cute.size(bt.b_scale, mode=[1]) - 1
        blocks = [cutlass.min(nb, last) for nb in bt.n_blocks]
        return slot, rows, group, blocks, self._value_blocks(bt, cute.size(acc))

    def _k_scales(self, ctx, k) -> tuple:
        """(b_scale[expert, block row, k] per block row, a_scale[row, k] per row slot)."""
        _, rows, group, blocks, _ = ctx
        bt = self._block_tile
        return [bt.b_scale[group, nb, k] for nb in blocks], [bt.a_scale[r, k] for r in rows]

    def _promote(self, acc, part, ctx, scales) -> None:
        b_s, a_s = scales
        slot, which = ctx[0], ctx[4]
        row_scales = [[s * b for s in a_s] for b in b_s]
        for i in range(cute.size(acc)):  # trace time: unrolled
            acc[i] = acc[i] + part[i] * row_scales[which[i]][slot[i]]


class BlockScaledGemmKernel(BlockScalesMixin, GroupedGemmKernel):
    """Varlen-M grouped GEMM of E4M3 operands with 1×128 (A) and 128×128 (B) block scales
    promoted into the fp32 accumulators every 128-element k-tile (module docstring)."""

    pingpong_ready = False  # its mainloop does not hand the tensor cores over (``issued``)

    def __init__(self, tile_mn: tuple[int, int] = (128, 128), cluster_mn: tuple[int, int] = (1, 2)):
        if tile_mn != (128, SCALE_BLOCK):
            raise ValueError(
                f"BlockScaledGemmKernel: the tile must be 128 x {SCALE_BLOCK} (one weight scale "
                f"block per tile and k-tile), got {tile_mn}"
            )
        super().__init__("m", tile_mn, cluster_mn)

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # [M, K] E4M3, K-major
        b: cute.Tensor,  # (N, K, E) E4M3, K-major
        c: cute.Tensor,  # [M, N] bf16
        offs: cute.Tensor,  # int32 [E] cumulative row ends
        num_clusters: Int32,
        a_scale: cute.Tensor,  # fp32 [M, KB], row-major
        b_scale: cute.Tensor,  # fp32 [E, NB, KB], row-major
        route: cute.Tensor,  # unused (no routed rows): a dummy, as the other GEMM kernels take
        stream,
    ):
        self._launch(a, b, c, offs, num_clusters, stream, b, (a_scale, b_scale), route)

    def _make_epi(self, c: cute.Tensor, epi_inputs: tuple) -> tuple:
        """(a_scale, b_scale): the main loop reads them through the epilogue state."""
        return epi_inputs


def config_problem(cfg) -> str:
    """Why a ``compile.GemmConfig`` with ``block_scaled`` cannot be compiled ("" when it can):
    varlen M, E4M3 operands, a bf16 output, K-major B, tile_n 128, nothing else."""
    import torch

    fp8 = torch.float8_e4m3fn
    plain = (cfg.varlen, cfg.ab_dtype, cfg.c_dtype, cfg.b_major, cfg.tile_n)
    extras = (cfg.accumulate, cfg.bias_dtype, cfg.bias_scales, cfg.route, cfg.scaled, cfg.a_dtype)
    if plain != ("m", fp8, torch.bfloat16, "k", SCALE_BLOCK) or any(extras):
        return (
            f"block-scaled GEMMs take varlen 'm', E4M3 operands, a bf16 output, K-major B, "
            f"tile_n {SCALE_BLOCK} and no accumulate, bias, route or row-wise scales: {cfg}"
        )
    return ""
