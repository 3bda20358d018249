"""The main loop of the FP8 block-scaled kernels (``block_scaled.py``, ``block_wgrad.py``).

Each k-tile's WGMMAs accumulate into a fresh fp32 fragment, which is then promoted into the
accumulator with that k-tile's scales: ``acc += part · scale`` per value. Besides applying the
block scales this bounds the partial sums that Hopper's FP8 WGMMA keeps at reduced precision to
one k-tile of products (as DeepGEMM does).

Two fragments alternate: k-tile k + 1's WGMMAs are issued into one before k-tile k's (in the
other) are waited for and promoted, so the tensor cores stay busy while the promotion's
multiply-adds and the scale loads run. The dynamic k loop therefore handles two k-tiles per
iteration with both fragments named statically (registers cannot be indexed by a runtime
value), and the odd or even tail follows the loop.
Per value the arithmetic, and its order over k, is what one fragment waited for per k-tile
gives: the results are bit for bit the same, only the overlap differs.

A kernel using `PromotedMainloopMixin` defines three trace-time hooks: ``_promotion(acc)``
(what is fixed over the tile: scale indices, value slots), ``_k_scales(ctx, k)`` (k-tile k's
scales) and ``_promote(acc, part, ctx, scales)``, and chooses when the scales are loaded
(``early_scales``).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32


class PromotedMainloopMixin:
    """``_mainloop`` of a kernel whose k-tiles are promoted with scales (module docstring)."""

    # k-tile k's scales are loaded before k + 1's WGMMAs are issued (their latency hidden
    # behind the wait) or, False, after the wait: fewer live registers, the latency then hides
    # behind the next k-tile's WGMMAs, already queued
    early_scales = True

    @cute.jit
    def _mainloop(self, tiled_mma, acc, tCrA, tCrB, ab_pipe, read, release, k_tiles):
        """acc = Σ_k promote(A_k B_kᵀ, scales of k-tile k); the k-tiles' fragments alternate
        between two register sets so one k-tile's WGMMAs overlap the previous one's promotion.

        No dynamic branch separates a fragment's WGMMAs from their wait except the loop's own
        back edge: a fragment in flight across the join of a branch would be copied there,
        and ptxas then serializes every WGMMA of the kernel."""
        ctx = self._promotion(acc)
        p0 = cute.make_rmem_tensor(acc.layout, Float32)
        p1 = cute.make_rmem_tensor(acc.layout, Float32)
        acc.fill(0.0)
        if k_tiles > 0:
            read = self._issue_k_tile(tiled_mma, p0, tCrA, tCrB, ab_pipe, read)
            for kk in range((k_tiles - 1) // 2):  # k-tiles 2kk (in p0) and 2kk + 1 (in p1)
                read, release = self._overlapped_step(
                    tiled_mma, acc, p0, p1, ctx, 2 * kk, tCrA, tCrB, ab_pipe, read, release
                )
                read, release = self._overlapped_step(
                    tiled_mma, acc, p1, p0, ctx, 2 * kk + 1, tCrA, tCrB, ab_pipe, read, release
                )
            if (k_tiles - 1) % 2 == 1:  # two k-tiles left: k_tiles - 2 in p0, the last in p1
                read, release = self._overlapped_step(
                    tiled_mma, acc, p0, p1, ctx, k_tiles - 2, tCrA, tCrB, ab_pipe, read, release
                )
                release = self._last_step(acc, p1, ctx, k_tiles - 1, ab_pipe, release)
            else:  # the last k-tile, in p0
                release = self._last_step(acc, p0, ctx, k_tiles - 1, ab_pipe, release)
        return read, release

    # Plain Python (straight-line DSL code, inlined while the kernel is traced).
    def _issue_k_tile(self, tiled_mma, part, tCrA, tCrB, ab_pipe, read):
        """Wait for the k-tile in stage ``read``, issue its WGMMAs into the zeroed ``part`` (one
        commit group); returns the next read state."""
        ab_pipe.consumer_wait(read)
        part.fill(0.0)
        cute.nvgpu.warpgroup.fence()
        for kb in range(cute.size(tCrA, mode=[2])):
            coord = (None, None, kb, read.index)
            cute.gemm(tiled_mma, part, tCrA[coord], tCrB[coord], part)
        cute.nvgpu.warpgroup.commit_group()
        read.advance()
        return read

    def _overlapped_step(self, tiled_mma, acc, done, nxt, ctx, k, tCrA, tCrB, ab_pipe, read,
                         release):
        """k-tile k (in flight in ``done``): load its scales, issue k-tile k + 1 into ``nxt``,
        wait for k's WGMMAs only, release its stage and promote it."""
        early = self._k_scales(ctx, k) if self.early_scales else None
        read = self._issue_k_tile(tiled_mma, nxt, tCrA, tCrB, ab_pipe, read)
        cute.nvgpu.warpgroup.wait_group(1)
        release = self._release(ab_pipe, release)
        self._promote(acc, done, ctx, early or self._k_scales(ctx, k))
        return read, release

    def _last_step(self, acc, done, ctx, k, ab_pipe, release):
        """The last k-tile k (in flight in ``done``): wait for it, release, promote."""
        scales = self._k_scales(ctx, k)
        cute.nvgpu.warpgroup.wait_group(0)
        release = self._release(ab_pipe, release)
        self._promote(acc, done, ctx, scales)
        return release

    @staticmethod
    def _release(ab_pipe, release):
        ab_pipe.consumer_release(release)
        release.advance()
        return release
