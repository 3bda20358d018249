"""Split sizes of the grouped ops: their checks and their cumulative ends on the data's device.

Shape legend: T tokens (routed rows), G groups.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_seq import kernels
from te_seq.core import checks
from te_seq.kernels import offsets as offsets_maths


def group_index(offs: Tensor, rows: int) -> Tensor:
    """Group of every row [T] from the cumulative ends `offs` [G]; no host sync."""
    positions = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, positions, right=True)


def check_split_sizes(op: object, splits: object, num_groups: int, input_: Tensor) -> None:
    """Host split sizes are checked here (ValueError); device ones by a device-side assert.

    Under torch.compile the values are never read here (that would make a data-dependent guard):
    every split is checked by the assert in `device_offsets` when the compiled graph runs."""
    name = checks.op_name(op)
    checks.check_tensor(op, "split_sizes", splits)
    if splits.is_floating_point() or splits.is_complex() or splits.dtype == torch.bool:
        raise ValueError(f"{name}: split_sizes must be an integer tensor, got {splits.dtype}")
    if splits.dim() != 1 or splits.numel() != num_groups:
        raise ValueError(
            f"{name}: split_sizes has shape {tuple(splits.shape)} ({splits.numel()} entries), "
            f"expected a 1-D tensor with num_groups={num_groups} entries"
        )
    if splits.device.type != "cpu" and splits.device != input_.device:
        raise ValueError(f"{name}: split_sizes is on {splits.device}, input on {input_.device}")
    if splits.device.type == "cpu" and not torch.compiler.is_compiling():
        check_host_split_values(name, splits, rows_of(input_))


def check_host_split_values(name: str, splits: Tensor, rows: int) -> None:
    values = splits.tolist()
    negative = [v for v in values if v < 0]
    if negative:
        raise ValueError(f"{name}: split_sizes has negative entries {negative}: {values}")
    if sum(values) != rows:
        raise ValueError(
            f"{name}: split_sizes sum to {sum(values)} but the input has {rows} rows "
            f"(split_sizes={values})"
        )


def rows_of(input_: Tensor) -> int:
    """The input's rows: the product of its leading dimensions."""
    return int(input_.shape[:-1].numel())


def device_offsets(splits: Tensor, rows: int, device: torch.device,
                   backend: kernels.Backend | None = None) -> Tensor:
    """Cumulative ends on the data's device; for device split sizes (and for every split under
    torch.compile) a run-time check that they are non-negative and sum to `rows` without a host
    sync: a device-side assert on CUDA, a RuntimeError on CPU. `backend` (the plan step's) may
    run it as one kernel (`Backend.group_offsets`); without one, torch ops."""
    if backend is None:
        return offsets_maths.checked_offsets(splits, rows, device)
    return backend.group_offsets(splits, rows, device)
