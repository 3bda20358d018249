"""The grouped ops' checked group offsets in one launch (CuTe DSL, SIMT, any sm_90 GPU).

``GroupOffsetsKernel``: split sizes [G] (int32 or int64, on the device) -> offs [G] int32, the
cumulative row ends, and ok [1] int32: 1 when every split is non-negative and they sum to
``rows``, else 0 (and offs all zeros: every group empty, so that a GEMM launched on them
before the assert on ok fires touches no row). One warp walks the splits 32 at a time: an
inclusive shuffle scan per chunk plus the running total. It replaces a cumsum, a dtype copy
and five checking kernels, whose launches cost ~0.1 ms of host time per forward
(``ops/basic/_split_sizes.device_offsets``).

Imports cutlass; only ``offsets.py`` imports this module, lazily.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from .compile import CompiledGemm, _compile

WARP = 32
_SPLIT_DTYPES = {torch.int32: cutlass.Int32, torch.int64: cutlass.Int64}


class GroupOffsetsKernel:
    """offs[g] = splits[0] + ... + splits[g] (int32), ok[0] = (all splits >= 0 and
    offs[G - 1] == rows), offs zeroed where not ok; one CTA of one warp."""

    @cute.jit
    def __call__(self, splits: cute.Tensor, offs: cute.Tensor, ok: cute.Tensor, rows: Int32,
                 stream):
        self.kernel(splits, offs, ok, rows).launch(grid=(1, 1, 1), block=(WARP, 1, 1),
                                                   stream=stream)

    @cute.kernel
    def kernel(self, splits: cute.Tensor, offs: cute.Tensor, ok: cute.Tensor, rows: Int32):
        lane = cute.arch.lane_idx()
        groups = splits.shape[0]
        total = Int32(0)
        negative = Int32(0)
        for base in cutlass.range(0, groups, WARP):
            g = base + lane
            size = splits[cutlass.min(g, groups - 1)]  # clamped read: every lane shuffles
            size = cutlass.select_(g < groups, size, size.dtype(0))
            negative = negative | cutlass.select_(size < 0, Int32(1), Int32(0))
            running = self._inclusive_scan(Int32(size), lane) + total
            if g < groups:
                offs[g] = running
            total = cute.arch.shuffle_sync(running, WARP - 1)
        any_negative = cute.arch.vote_any_sync(negative != 0)
        sums_to_rows = cutlass.select_(total == rows, Int32(1), Int32(0))
        valid = cutlass.select_(any_negative, Int32(0), sums_to_rows)  # the same in every lane
        if lane == 0:
            ok[0] = valid
        if valid == 0:  # every group empty: a kernel launched on offs before the assert reads
            for base in cutlass.range(0, groups, WARP):  # no row (each lane its own slots)
                if base + lane < groups:
                    offs[base + lane] = Int32(0)

    @cute.jit
    def _inclusive_scan(self, value: Int32, lane) -> Int32:
        """Σ of ``value`` over lanes 0..lane of the warp (Hillis-Steele, 5 shuffles)."""
        for step in cutlass.range_constexpr(5):
            shift = 1 << step
            below = cute.arch.shuffle_sync_up(value, shift)
            value = value + cutlass.select_(lane >= shift, below, Int32(0))
        return value


def _fake_args(split_dtype: torch.dtype) -> tuple:
    groups = cute.sym_int32()
    splits = make_fake_compact_tensor(_SPLIT_DTYPES[split_dtype], (groups,),
                                      assumed_align=split_dtype.itemsize)
    offs = make_fake_compact_tensor(cutlass.Int32, (groups,), assumed_align=4)
    ok = make_fake_compact_tensor(cutlass.Int32, (1,), assumed_align=4)
    return splits, offs, ok, Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True)


@functools.lru_cache(maxsize=None)
def compile_offsets(split_dtype: torch.dtype) -> CompiledGemm:
    """The offsets kernel for int32 or int64 split sizes, cached in memory and on disk."""
    if split_dtype not in _SPLIT_DTYPES:
        raise ValueError(f"group offsets: split sizes int32 or int64, got {split_dtype}")
    return _compile("offsets", ("group_offsets", str(split_dtype)), GroupOffsetsKernel(),
                    _fake_args(split_dtype))
