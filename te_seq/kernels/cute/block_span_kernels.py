"""The block-scaled token-major FP8 span kernel (CuTe DSL, SIMT, any sm_90 GPU): t [T, C]
quantized along the tokens of each group in 1x128 blocks, one scale per (128-token block,
column), into ``fp8_wgrad.BlockTokenMajor``'s layout (data [C, P], every group's span padded
to 128 tokens, scale_inv [P / 128, C]), bitwise ``fp8_wgrad.quantize_token_major_blocks``.

Every span starts on a 128-token block, so a padded block is exactly one scale block: its
scale needs the maxima of its own tile only. ``SpanBlockCastKernel`` is therefore one pass,
one CTA (256 threads) per padded block x 64-column chunk over the span table
(``quant_kernels.SpanTableKernel``): the tile load of ``span_kernels`` (8-element vectors:
16 bytes of bf16/fp16, two 16-byte loads of fp32; rows past the block's valid ones and
columns past C read as zeros), the per-(block, column)
maxima of ``SpanAmaxKernel`` (shuffles, then one shared-memory pass over the 8 warps; nan
as inf), the transpose through shared memory and the 16-byte token-major stores of
``SpanCastKernel``, each column scaled by its block's own scale. It writes every element of
data and of scale_inv (blocks past the last span: zeros and 1, as the definition's all-zero
padding blocks), so neither needs a fill, and needs no block-maxima buffer or second launch.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory as memory
from cutlass import Float32

from .quant_kernels import scale_from_amax
from .span_kernels import SPAN_COLS, THREADS, WARPS, SpanCastKernel, _fmax, _staged_layout


class SpanBlockCastKernel(SpanCastKernel):
    """The token-major FP8 data [C, P] and its scale_inv [P / 128, C] (one per block and
    column) from t [T, C] and the span table [P / 128, 4]."""

    @cute.jit
    def __call__(self, t: cute.Tensor, table: cute.Tensor, data: cute.Tensor,
                 scale_inv: cute.Tensor, stream):
        self.kernel(t, table, data, scale_inv).launch(
            grid=self._grid(table, t), block=(THREADS, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, t: cute.Tensor, table: cute.Tensor, data: cute.Tensor,
               scale_inv: cute.Tensor):
        block, chunk, tidx, col, row0 = self._coords()
        first_row, valid = table[block, 0], table[block, 1]
        allocator = memory.SmemAllocator()
        staged = allocator.allocate_tensor(self.fp8_dtype, _staged_layout(), 16)
        partial = allocator.allocate_tensor(
            Float32, cute.make_layout((WARPS, SPAN_COLS), stride=(SPAN_COLS, 1)), 16)
        scales = allocator.allocate_tensor(Float32, cute.make_layout(SPAN_COLS), 16)
        tile = self._new_tile()
        self._zero_tile(tile)
        if valid > 0:  # uniform over the CTA; blocks past the last span stay zeros (scale 1)
            self._load_tile(t, first_row, valid, col, row0, tile)
        self._block_maxima(tile, tidx, partial)
        cute.arch.sync_threads()
        if tidx < SPAN_COLS:
            self._block_scale(partial, scales, scale_inv, block, chunk, tidx)
        cute.arch.sync_threads()
        self._cast_and_store(tile, scales, staged, data, block, chunk, tidx)

    @cute.jit
    def _block_scale(self, partial: cute.Tensor, scales: cute.Tensor, scale_inv: cute.Tensor,
                     block, chunk, c):
        """scales[c] from the block's max |t| of this chunk's column c (the max of the warps'
        partial maxima; inf for a nan: scale nan), scale_inv[block, column] its reciprocal."""
        amax = partial[0, c]
        for w in cutlass.range_constexpr(1, WARPS):
            amax = _fmax(amax, partial[w, c])
        scale = scale_from_amax(amax, self.fp8_max, self.power_of_two)
        scales[c] = scale
        column = chunk * SPAN_COLS + c
        if column < scale_inv.shape[1]:
            scale_inv[block, column] = Float32(1.0) / scale
