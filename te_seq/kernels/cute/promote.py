"""The main loop of the FP8 block-scaled kernels (``block_scaled.py``, ``block_wgrad.py``).

Each k-tile's WGMMAs write a fresh fp32 fragment (the first overwrites it), which is waited
for and then promoted into the accumulator with that k-tile's scales: ``acc += part · scale``
per value.
Besides applying the block scales this bounds the partial sums that Hopper's FP8 WGMMA keeps at
reduced precision to one k-tile of products (as DeepGEMM does). The two consumer warpgroups of
a CTA interleave, so one's promotion runs while the other's WGMMAs do.

Measured (one H100, 2026-11-25, ``bench_grouped_gemm.py --fp8``): two fragments alternating
per warpgroup, so that k-tile k + 1's WGMMAs run during k-tile k's promotion, compiled without
serialization or spills in the forward but ran *slower*: A's FC1 forward 914 -> 794 TFLOP/s,
its FC1 wgrad 457 -> 369, Q's 692 -> 634 and 265 -> 201. So each warpgroup waits for its
k-tile before promoting, as here.

A kernel using `PromotedMainloopMixin` defines three trace-time hooks: ``_promotion(acc)``
(what is fixed over the tile: scale indices, value slots), ``_k_scales(ctx, k)`` (k-tile k's
scales, loaded before the k-tile is waited for) and ``_promote(acc, part, ctx, scales)``.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32

from .mainloop import issue_k_tile


class PromotedMainloopMixin:
    """``_mainloop`` of a kernel whose k-tiles are promoted with scales (module docstring)."""

    @cute.jit
    def _mainloop(self, tiled_mma, acc, tCrA, tCrB, ab_pipe, read, release, k_tiles):
        """acc = Σ_k promote(A_k B_kᵀ, scales of k-tile k): per k-tile the WGMMAs overwrite
        an fp32 fragment, are waited for, and the fragment is promoted into acc."""
        ctx = self._promotion(acc)
        part = cute.make_rmem_tensor(acc.layout, Float32)
        acc.fill(0.0)
        for k in range(k_tiles):
            # issued before the wait: their latency hides behind the pipeline and the MMAs
            scales = self._k_scales(ctx, k)
            ab_pipe.consumer_wait(read)
            issue_k_tile(tiled_mma, part, tCrA, tCrB, read.index, zero_init=True)
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipe.consumer_release(release)
            read.advance()
            release.advance()
            self._promote(acc, part, ctx, scales)
        return read, release
