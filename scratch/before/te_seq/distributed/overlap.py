"""GEMMs overlapped with the sequence-parallel collectives around them (chunked, async handles).

- `all_gather_matmul`: y = all_gather(x) @ w_t. The all-gather runs asynchronously while this
  rank multiplies its own rows (which it already has); the other ranks' rows follow.
- `matmul_reduce_scatter`: y = reduce_scatter(x @ w_t). The rows are cut into one block per
  destination rank; block d's product is reduced onto rank d asynchronously while block d+1 is
  multiplied. Every rank issues the reductions in the same order (d = 0, 1, ...), as a
  communicator requires.

Same values as the unoverlapped collective + GEMM (the same products; the reduction order over
ranks is the backend's in both).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from te_seq.distributed.collectives import all_gather_rows, group_rank, group_size


def all_gather_matmul(x: Tensor, w_t: Tensor, group: object) -> tuple[Tensor, Tensor]:
    """x [T, K] on each of n ranks, w_t [K, N] -> (x_all [n*T, K], y = x_all @ w_t [n*T, N])."""
    n, rank, rows = group_size(group), group_rank(group), x.shape[0]
    x_all, work = all_gather_rows(x, group, async_op=True)
    y = x.new_empty((n * rows, w_t.shape[1]))
    own = slice(rank * rows, (rank + 1) * rows)
    torch.matmul(x, w_t, out=y[own])  # while the other ranks' rows travel
    work.wait()
    for block in (slice(0, own.start), slice(own.stop, n * rows)):
        if block.stop > block.start:
            torch.matmul(x_all[block], w_t, out=y[block])
    return x_all, y


def matmul_reduce_scatter(x: Tensor, w_t: Tensor, group: object, op: str) -> Tensor:
    """x [T, K], w_t [K, N] -> (sum over ranks of x @ w_t)[rank's T/n rows] [T/n, N]; T must be
    divisible by the group size (ValueError naming `op`)."""
    n, rank = group_size(group), group_rank(group)
    if x.shape[0] % n:
        raise ValueError(f"{op}: reduce-scatter along dim 0 needs a row count divisible by the "
                         f"group size {n}, got {x.shape[0]} rows")
    works, own = [], None
    for dest, rows in enumerate(x.chunk(n)):
        part = rows @ w_t  # the next block's GEMM overlaps this block's reduction
        dst = dest if group is None else dist.get_global_rank(group, dest)
        works.append(dist.reduce(part, dst=dst, group=group, async_op=True))
        if dest == rank:
            own = part
    for work in works:
        work.wait()
    return own
