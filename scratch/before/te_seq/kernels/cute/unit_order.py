"""``unit_order``: the dynamic wgrads' input, the groups longest first and a zeroed unit
counter (``unit_order_reference`` is its definition in torch).

One launch makes ``SLOTS`` copies (rows of [E + 1]) and caches them on ``offs``: the wgrads of
one step that share ``offs`` (the fused MLP's FC2 and FC1 wgrads) take a row each, so a step
launches it once. A row's counter is consumed by the one kernel it is given to and never
handed out again; while a CUDA graph is captured every call launches afresh, so the graph
remakes its rows (order and counters) on each replay.

Imports no cutlass until the kernel is first compiled (``unit_order_kernel``).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

_KERNEL_MODULE = __name__.rsplit(".", 1)[0] + ".unit_order_kernel"
SLOTS = 4  # rows per launch: the wgrads of one step sharing offs take one each
_ATTR = "_te_seq_unit_order"  # [offs._version, rows [SLOTS, E + 1], rows handed out]


def unit_order_reference(offs: Tensor) -> Tensor:
    """int32 [E + 1]: the groups of ``offs`` (int32 cumulative ends [E]) sorted by rows,
    longest first, ties by index, then 0."""
    ends = offs.long()
    rows = torch.diff(ends, prepend=ends.new_zeros(1))
    order = torch.sort(rows, descending=True, stable=True).indices
    return torch.cat([order, order.new_zeros(1)]).to(torch.int32)


def unit_order(offs: Tensor) -> Tensor:
    """A fresh row equal to ``unit_order_reference(offs)`` (CUDA offs; no host sync,
    CUDA-graph capturable): from the rows cached on ``offs`` while unchanged (its version)
    and not all handed out, else from one new launch."""
    capturing = offs.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    cached = None if capturing else getattr(offs, _ATTR, None)
    if cached is not None and cached[0] == offs._version and cached[2] < SLOTS:
        cached[2] += 1
        return cached[1][cached[2] - 1]
    rows = _launch(offs)
    if not capturing and not torch.compiler.is_compiling():
        setattr(offs, _ATTR, [offs._version, rows, 1])
    return rows[0]


def _launch(offs: Tensor) -> Tensor:
    kernels = sys.modules.get(_KERNEL_MODULE)  # imported (with cutlass) on first use only
    if kernels is None:
        from . import unit_order_kernel as kernels
    rows = torch.empty(SLOTS, offs.shape[0] + 1, dtype=torch.int32, device=offs.device)
    kernels.compile_unit_order().fn(offs, rows)
    return rows
