"""The dynamic wgrad schedule's input in one launch (CuTe DSL, SIMT, any sm_90 GPU).

``UnitOrderKernel``: offs [E] (int32 cumulative group ends) -> rows [S, E + 1] int32, each row
the same: row[r] is the group of rank r when the groups are sorted by rows, longest first,
ties by index (a stable descending sort), and row[E] = 0 (the unit counter a wgrad kernel
draws from). One CTA: each thread ranks its groups against all E (E·E comparisons of
L1-resident sizes).

Imports cutlass; only ``unit_order.py`` imports this module, lazily.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from .compile import CompiledGemm, _compile

THREADS = 256


class UnitOrderKernel:
    """rows[s, rank(g)] = g (rows descending, ties by index) and rows[s, E] = 0; one CTA."""

    @cute.jit
    def __call__(self, offs: cute.Tensor, rows: cute.Tensor, stream):
        self.kernel(offs, rows).launch(grid=(1, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, offs: cute.Tensor, rows: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        groups = offs.shape[0]
        copies = rows.shape[0]
        for g in cutlass.range(tidx, groups, THREADS):
            size = self._rows(offs, g)
            rank = Int32(0)
            for j in cutlass.range(groups):
                other = self._rows(offs, j)
                before = (other > size) | ((other == size) & (j < g))
                rank = rank + cutlass.select_(before, Int32(1), Int32(0))
            for s in cutlass.range(copies):
                rows[s, rank] = g
        if tidx < copies:
            rows[tidx, groups] = Int32(0)

    @cute.jit
    def _rows(self, offs: cute.Tensor, g) -> Int32:
        start = Int32(0)
        if g > 0:
            start = offs[g - 1]
        return offs[g] - start


@functools.lru_cache(maxsize=1)
def compile_unit_order() -> CompiledGemm:
    """The unit-order kernel, compiled once (cached in memory and on disk)."""
    groups = cute.sym_int32()
    offs = make_fake_compact_tensor(cutlass.Int32, (groups,), assumed_align=4)
    rows = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int32(), cute.sym_int32()),
                                    stride_order=(1, 0), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return _compile("unit_order", ("unit_order",), UnitOrderKernel(), (offs, rows, stream))
