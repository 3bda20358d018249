"""Collectives on `torch.distributed` process groups, as plain functions of tensors.

This layer knows nothing of ops or contexts: the communication ops (`ops/basic/all_gather.py`
...), the tensor-parallel linear (`ops/basic/_tensor_parallel.py`) and the expert-parallel
exchange (`expert_exchange.py`) call these functions in their forward and backward. Everything
moves along the first (token) dimension.
"""

from te_seq.distributed.collectives import (
    all_gather_rows,
    all_reduce_sum,
    group_rank,
    group_size,
    reduce_scatter_rows,
    resolve_group,
)

__all__ = [
    "all_gather_rows",
    "all_reduce_sum",
    "group_rank",
    "group_size",
    "reduce_scatter_rows",
    "resolve_group",
]
