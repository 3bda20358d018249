"""Ragged TMA views: clip a tile to its group by TMA bounds, without predication.

Used by the grouped GEMM (``grouped_gemm``) for the rows of a varlen-M C store and of varlen-K
A/B loads, and by the GLU epilogues (``glu_epilogue``) for their extra stores and loads.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32

# Ragged views (the trick of Triton's ragged TMA): replace the ragged mode of extent L by
# _BIG_INT and append two modes of extent _MAX_INT with strides (2**34 - s, s). Selecting the
# coordinates (_BIG_INT, start + len) of the extra modes and offsetting the ragged mode to
# _BIG_INT - len gives addresses base + (start + r) * s (mod 2**64) for row r, and rows r >= len
# fall past _BIG_INT, where TMA zero-fills loads and drops stores. The base pointer is never
# shifted, so it is safe for loads too.
_BIG_INT = 2**30
_MAX_INT = 2**31 - 1
_WRAP = 2**34  # _BIG_INT * _WRAP == 2**64


def _ragged_view(t: cute.Tensor, mode: int) -> cute.Tensor:
    """A rank-2 tensor viewed with ``mode`` ragged (rank 4), for TMA atoms."""
    s = t.stride[mode]
    shape = list(t.shape)
    shape[mode] = _BIG_INT
    stride = list(t.stride)
    layout = cute.make_layout((*shape, _MAX_INT, _MAX_INT), stride=(*stride, _WRAP - s, s))
    return cute.make_tensor(t.iterator, layout)


def _ragged_group(t: cute.Tensor, mode: int, start: Int32, length: Int32) -> cute.Tensor:
    """Rows [start, start + length) of a ragged TMA coordinate tensor, as a rank-2 tensor."""
    sel = t[(None, None, _BIG_INT, start + length)]
    off = [0, 0]
    off[mode] = _BIG_INT - length
    return cute.domain_offset(tuple(off), sel)
