"""The FP8 block-scaled weight-gradient GEMM (sm_90a, varlen K): ``Float8BlockScaling``'s wgrad.

Shape legend: E experts, N output rows (dY's columns), K output columns (X's columns), P the
padded token width, PB = P / 128 token blocks. A = dY token-major (N, P) and B = X token-major
(K, P) are E4M3 and K-major (tokens contiguous); expert e's tokens are the span
[offs[e-1], offs[e]) of P, which starts on a 128-token block and is zero-padded to whole blocks
(``te_seq.kernels.fp8_wgrad.quantize_token_major_blocks``). a_scale fp32 [PB, N] and b_scale
fp32 [PB, K] hold the dequantization scale of each (128-token block, column):

    C[e][n, k] = Σ_{tb in span e} a_scale[tb, n] · b_scale[tb, k]
                   · Σ_{t in block tb} fp32(a[n, t]) · fp32(b[k, t])

in fp32, written to C (E, N, K) as bf16 or fp32, or (``accumulate``) added to the old C (the
store epilogue's old-C loads, as the row-wise FP8 wgrad does). The FP8 k-tile is 128 tokens
(``GroupedGemmKernel._setup``), so k-tile j of expert e's span is token block
offs[e-1] / 128 + j, and the promotion after each k-tile is an outer product of two scale
vectors: ``acc[r, c] += tmp[r, c] · a_scale[tb, n0 + r] · b_scale[tb, k0 + c]`` (n0, k0 the
tile's first output row and column; tmp the k-tile's WGMMA result in a zeroed fp32 fragment,
so Hopper's reduced-precision FP8 accumulation also stays bounded to 128 products).

Each thread reads, per k-tile, the a scales of its accumulator rows (two per 64-row WGMMA of
the sm90 accumulator layout) and the b scales of its columns (two adjacent columns per group of
8: tile_n / 4 of them) from global memory, which values share a row or a column being read off
the accumulator's coordinate layout at trace time (``value_offsets``, ``slots``), before
waiting for the k-tile's operands (``promote.PromotedMainloopMixin``), so the loads' latency
hides behind the pipeline wait and the MMAs; the lanes of a warp read 4 distinct b scales per
load (L1 broadcasts). Reads past N, K or PB (a partial
last tile, whose values the TMA store drops) are clamped to the last entry. An empty span runs
no k-tile: its C is written as zeros, or left as it was with ``accumulate``, whatever its
scales hold (none is read).

Not done (speed): the scales are read from global memory per k-tile rather than TMA-loaded
into smem with the operands (tm + tn floats per stage would do); tile_n is 128 (acc, tmp and
tn / 4 scales fit the registers); two fragments per warpgroup to overlap the promotion with the
next k-tile's WGMMAs measured slower (``promote``).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .block_scaled import SCALE_BLOCK
from .grouped_gemm import GroupedGemmKernel
from .promote import PromotedMainloopMixin


class WgradTile(NamedTuple):
    """The scale context of the tile a consumer warpgroup is computing (trace-time bundle)."""

    a_scale: object  # fp32 [PB, N]
    b_scale: object  # fp32 [PB, K]
    first_block: object  # the span's first token block (offs[e-1] / 128)
    first_row: object  # the tile's first output row n0 (N)
    first_col: object  # the tile's first output column k0 (K)
    coords: object  # (row, col) in the tile of this thread's accumulator values


def value_offsets(coords, count: int) -> list[tuple[int, int]]:
    """The static (row, col) offset in the tile of each of a thread's ``count`` accumulator
    values (``coords``: the tile's identity tensor partitioned like the accumulator; its
    layout maps a flat value index to the offset, the thread's own base is dynamic). Trace
    time; a non-constant offset is a ValueError (a layout this kernel does not know)."""
    offsets = [tuple(coords.layout(i)) for i in range(count)]
    if not all(len(o) == 2 and all(isinstance(x, int) for x in o) for o in offsets):
        raise ValueError(f"BlockWgradKernel: accumulator offsets are not static: {offsets[:4]}")
    return offsets


def slots(offsets: list[tuple[int, int]], mode: int) -> tuple[list[int], list[int]]:
    """(first value index of each slot, slot of each value): the values grouped by their
    offset along ``mode`` (0: the row, 1: the column), so one scale load serves each slot.
    In the sm90 WGMMA accumulator layout a thread has 2 rows per 64-row MMA and 2 adjacent
    columns per group of 8 (tile_n / 4 at tile_n 128)."""
    keys: list[int] = []
    for o in offsets:
        if o[mode] not in keys:
            keys.append(o[mode])
    firsts = [next(i for i, o in enumerate(offsets) if o[mode] == key) for key in keys]
    return firsts, [keys.index(o[mode]) for o in offsets]


class BlockWgradKernel(PromotedMainloopMixin, GroupedGemmKernel):
    """Varlen-K grouped GEMM of token-major E4M3 operands with (128-token block, column) scales
    promoted into the fp32 accumulators every k-tile (module docstring)."""

    ragged_k = False  # zero-padded spans that start on a k-tile (the token-major layout)
    pingpong_ready = False  # its mainloop does not hand the tensor cores over (``issued``)

    def __init__(self, cluster_mn: tuple[int, int] = (1, 2), accumulate: bool = False):
        super().__init__("k", (128, SCALE_BLOCK), cluster_mn, accumulate)

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # (N, P) E4M3, tokens contiguous
        b: cute.Tensor,  # (K, P) E4M3, tokens contiguous
        c: cute.Tensor,  # (N, K, E) bf16 or fp32 (the [E, N, K] output, permuted)
        offs: cute.Tensor,  # int32 [E] padded span ends in P
        num_clusters: Int32,
        a_scale: cute.Tensor,  # fp32 [PB, N], row-major
        b_scale: cute.Tensor,  # fp32 [PB, K], row-major
        route: cute.Tensor,  # unused (no routed rows): a dummy, as the other GEMM kernels take
        stream,
    ):
        self._launch(a, b, c, offs, num_clusters, stream, b, (a_scale, b_scale), route)

    def _make_epi(self, c: cute.Tensor, epi_inputs: tuple) -> tuple:
        """(a_scale, b_scale) for the main loop and, with ``accumulate``, the old C's TMA atom
        and tensor."""
        old = super()._make_epi(c, epi_inputs)
        return (*epi_inputs, *old) if self.accumulate else epi_inputs

    @cute.jit
    def _old_tile(self, ep, group, m_tile, n_tile):
        tm, tn, _ = self.tile_mnk
        tma_old, m_old = ep.epi[2], ep.epi[3]
        return tma_old, cute.local_tile(m_old[None, None, group], (tm, tn), (m_tile, n_tile))

    # Plain Python (inlined while the kernel is traced): starts the old-C loads (``accumulate``)
    # and records the tile for ``_mainloop``, which the consumer calls next in the same loop
    # iteration (its arguments carry no tile).
    def _before_mainloop(self, ep, group, m_tile, n_tile, row0, epi_count):
        super()._before_mainloop(ep, group, m_tile, n_tile, row0, epi_count)
        tm, tn, _ = self.tile_mnk
        tile = cute.make_identity_tensor((tm, tn))
        coords = ep.tiled_mma.get_slice(ep.mma_tidx).partition_C(tile)
        self._wgrad_tile = WgradTile(
            ep.epi[0], ep.epi[1], row0 // SCALE_BLOCK, m_tile * tm, n_tile * tn, coords
        )

    def _scale_indices(self, first, coords, firsts: list[int], mode: int, scales) -> list:
        """Per slot, the column of ``scales`` (clamped to the last) that this thread's
        accumulator row (mode 0: a_scale [PB, N]) or column (mode 1: b_scale [PB, K]) reads:
        ``first`` (the tile's first row or column) plus the value's coordinate in the tile."""
        last = cute.size(scales, mode=[1]) - 1
        return [cutlass.min(first + coords[i][mode], last) for i in firsts]

    def _promotion(self, acc) -> tuple:
        """(row slot and column slot of each value, this thread's a-scale and b-scale
        columns, the last token block of each scale): shared by the k-tiles."""
        wt = self._wgrad_tile
        offsets = value_offsets(wt.coords, cute.size(acc))
        row_firsts, row_slot = slots(offsets, 0)
        col_firsts, col_slot = slots(offsets, 1)
        rows = self._scale_indices(wt.first_row, wt.coords, row_firsts, 0, wt.a_scale)
        cols = self._scale_indices(wt.first_col, wt.coords, col_firsts, 1, wt.b_scale)
        last_a = cute.size(wt.a_scale, mode=[0]) - 1
        last_b = cute.size(wt.b_scale, mode=[0]) - 1
        return row_slot, col_slot, rows, cols, last_a, last_b

    def _k_scales(self, ctx, k) -> tuple[list, list]:
        """(a scales of this thread's rows, b scales of its columns) of the span's k-th token
        block (clamped to the last block)."""
        _, _, rows, cols, last_a, last_b = ctx
        wt = self._wgrad_tile
        block = wt.first_block + k
        a_block, b_block = cutlass.min(block, last_a), cutlass.min(block, last_b)
        return [wt.a_scale[a_block, r] for r in rows], [wt.b_scale[b_block, c] for c in cols]

    def _promote(self, acc, part, ctx, scales) -> None:
        row_slot, col_slot = ctx[0], ctx[1]
        a_s, b_s = scales
        for i in range(cute.size(acc)):  # trace time: unrolled
            acc[i] = acc[i] + part[i] * (a_s[row_slot[i]] * b_s[col_slot[i]])


def config_problem(cfg) -> str:
    """Why a ``compile.GemmConfig`` with ``block_wgrad`` cannot be compiled ("" when it can):
    varlen K, E4M3 operands, a bf16 or fp32 output, K-major B, tile_n 128, ``accumulate``
    allowed, nothing else."""
    import torch

    fp8 = torch.float8_e4m3fn
    plain = (cfg.varlen, cfg.ab_dtype, cfg.b_major, cfg.tile_n)
    extras = (cfg.bias_dtype, cfg.bias_scales, cfg.route, cfg.scaled, cfg.a_dtype, cfg.pingpong,
              cfg.block_scaled)
    if (plain != ("k", fp8, "k", SCALE_BLOCK) or any(extras)
            or cfg.c_dtype not in (torch.bfloat16, torch.float32)):
        return (
            f"block-scaled wgrad GEMMs take varlen 'k', E4M3 operands, a bf16 or fp32 output, "
            f"K-major B, tile_n {SCALE_BLOCK} and no bias, route, row-wise scales or ping-pong: "
            f"{cfg}"
        )
    return ""
