"""``group_offsets``: the grouped ops' cumulative row ends and their check in one launch.

Imports no cutlass until the kernel is first compiled (``offsets_kernel``).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from .launch import available

_SPLIT_DTYPES = (torch.int32, torch.int64)
_KERNEL_MODULE = __name__.rsplit(".", 1)[0] + ".offsets_kernel"


def offsets_problem(splits: Tensor) -> str:
    """Why ``group_offsets`` cannot take ``splits`` ("" when it can): a contiguous 1-D int32 or
    int64 CUDA tensor, not inside torch.compile (compiled code runs the torch ops, which
    inductor fuses), the CuTe DSL installed."""
    if splits.device.type != "cuda" or splits.dim() != 1 or splits.dtype not in _SPLIT_DTYPES:
        return (f"needs 1-D int32/int64 CUDA split sizes, got {splits.dtype} "
                f"{tuple(splits.shape)} on {splits.device}")
    if torch.compiler.is_compiling():
        return "inside torch.compile"
    ok, why = available()
    return "" if ok else why


def group_offsets(splits: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """(offs int32 [G], ok int32 [1]) from split sizes [G] on the GPU: offs[g] = Σ_{j≤g}
    splits[j]; ok[0] = 1 when every split is >= 0 and they sum to ``rows``, else 0 and offs
    all zeros (every group empty: a kernel launched on them before the caller's assert on ok
    reads and writes no row). One launch, no host sync, CUDA-graph capturable
    (``offsets_problem`` says where it runs)."""
    kernels = sys.modules.get(_KERNEL_MODULE)  # imported (with cutlass) on first use only;
    if kernels is None:  # read from sys.modules after that: an import statement costs ~1 µs
        from . import offsets_kernel as kernels
    splits = splits.contiguous()
    groups, device = splits.shape[0], splits.device
    offs = torch.empty(groups, dtype=torch.int32, device=device)
    ok = torch.empty(1, dtype=torch.int32, device=device)
    if groups == 0:
        ok.fill_(int(rows == 0))
        return offs, ok
    kernels.compile_offsets(splits.dtype).fn(splits, offs, ok, rows)
    return offs, ok
