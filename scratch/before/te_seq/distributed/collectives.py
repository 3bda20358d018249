"""All-gather, reduce-scatter and all-reduce along the first (token) dimension.

Each function is one `torch.distributed` collective on a process group (None: the default
group), out of place: the input is never written (it may be a tensor autograd saved, or the
user's). Every rank must call with the same shapes except along dim 0 where stated; a
collective cannot check what the other ranks pass without a second collective, so a mismatch
is the backend's error (gloo raises, NCCL may hang: set a timeout on the group).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

# torch 2.13 renamed the tensor collectives (the old names warn); older torch has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


def resolve_group(op: str, group: object) -> object:
    """`group` checked usable: torch.distributed initialized, and a ProcessGroup or None (the
    default group). Raises naming `op` otherwise."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{op}: torch.distributed is not initialized (call "
            "torch.distributed.init_process_group first)"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{op}: process group must be a torch.distributed.ProcessGroup or None, got "
            f"{type(group).__name__}"
        )
    return group


def group_size(group: object) -> int:
    return dist.get_world_size(group)


def group_rank(group: object) -> int:
    return dist.get_rank(group)


def all_gather_rows(x: Tensor, group: object, async_op: bool = False):
    """y = cat([x_0, ..., x_{n-1}], dim 0): x [T, ...] on each of n ranks -> y [n*T, ...], in
    rank order. With `async_op`, returns (y, work); y is valid after `work.wait()`."""
    x = x.contiguous()
    n = group_size(group)
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    work = _all_gather_single(out, x, group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_rows(x: Tensor, group: object, op: str = "reduce_scatter_rows",
                        async_op: bool = False):
    """y = (sum over ranks of x)[r*T/n:(r+1)*T/n] on rank r: x [T, ...] -> y [T/n, ...].

    T must be divisible by the group size n (ValueError naming `op` and the values). With
    `async_op`, returns (y, work)."""
    n = group_size(group)
    if x.dim() == 0 or x.shape[0] % n != 0:
        rows = "a 0-d tensor" if x.dim() == 0 else f"{x.shape[0]} rows"
        raise ValueError(
            f"{op}: reduce-scatter along dim 0 needs a row count divisible by the group size "
            f"{n}, got {rows} (shape {tuple(x.shape)})"
        )
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    work = _reduce_scatter_single(out, x, group=group, async_op=async_op)
    return (out, work) if async_op else out


def all_reduce_sum(x: Tensor, group: object, in_place: bool = False) -> Tensor:
    """y = sum over ranks of x, same shape on every rank. Out of place unless `in_place` (for a
    fresh tensor the caller owns, e.g. a GEMM's output)."""
    out = x if in_place and x.is_contiguous() else x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out
