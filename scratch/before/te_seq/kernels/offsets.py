"""The grouped ops' cumulative row ends from their split sizes, with the run-time check, in
plain PyTorch: `Backend.group_offsets`'s default (a backend may launch one kernel instead)."""

from __future__ import annotations

import torch
from torch import Tensor

SPLITS_MESSAGE = "split_sizes must be non-negative and sum to the rows"


def split_offsets(split_sizes: Tensor, device: torch.device) -> Tensor:
    """int32 cumulative row ends [E] on `device` (no host sync for device split sizes)."""
    sizes = split_sizes.to(device=device, non_blocking=True)
    return torch.cumsum(sizes, 0, dtype=torch.int32)


def checked_offsets(splits: Tensor, rows: int, device: torch.device) -> Tensor:
    """Cumulative ends on the data's device; for device split sizes (and for every split under
    torch.compile) a run-time check that they are non-negative and sum to `rows` without a host
    sync: a device-side assert on CUDA, a RuntimeError on CPU. Host split sizes were checked on
    the host already (`ops/basic/_split_sizes.check_split_sizes`)."""
    offs = split_offsets(splits, device)
    if splits.device.type == "cuda" or torch.compiler.is_compiling():
        ok = (splits >= 0).all() & (offs[-1] == rows)
        torch._assert_async(ok, SPLITS_MESSAGE)
    return offs
