"""Expert parallelism for ExpertDispatch / ExpertCombine: the exchange around the local block.

With an expert-parallel group of n ranks, E = n·L global experts and rank r holds global
experts r·L .. r·L + L - 1 as its local experts 0 .. L - 1. ExpertDispatch first sorts its
rows by global expert exactly as without expert parallelism (routed rows [N, H], counts [E]),
then moves them to the ranks owning their experts (te_seq.distributed.expert_exchange): the
rows [R, H] it returns are this rank's share, sorted by local expert, with `split_sizes` [L]
and the exchanged probabilities [R]. ExpertCombine undoes the exchange (R rows back to the N
rows in global-expert order) and then un-permutes them per token as without it.

The exchange plan (a Python object: host split sizes or the capacity slots) reaches the
combine through the routing channel: the published `routing` tensor carries it as an
attribute. Its maths is a permutation and its inverse, so each op's backward is the other
exchange direction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from te_seq.core import checks
from te_seq.distributed import group_size, resolve_group
from te_seq.distributed.expert_exchange import (
    CapacityPlan,
    CapacityStats,
    ExchangePlan,
    capacity_plan,
    check_same_on_ranks,
    dispatch_plan,
)

_PLAN_ATTR = "_te_seq_expert_exchange"


@dataclass
class ExpertParallel:
    """An ExpertDispatch's expert-parallel configuration: `size` ranks, `num_local` experts
    each, `capacity` rows per rank pair (None: exact mode); `agreed` once the ranks were
    checked to agree on the configuration (one tiny all-gather, the first forward only).
    A deep copy shares the group (process groups cannot be copied)."""

    group: dist.ProcessGroup
    size: int
    num_local: int
    capacity: int | None
    agreed: bool = False

    def __deepcopy__(self, memo: dict) -> ExpertParallel:
        return ExpertParallel(self.group, self.size, self.num_local, self.capacity, self.agreed)


def expert_parallel(op: object, num_experts: int, ep_group: object,
                    capacity: object) -> ExpertParallel | None:
    """The op's configuration (None: no expert parallelism, i.e. no group or a group of one
    rank). num_experts must be divisible by the group size (ValueError naming both)."""
    name = checks.op_name(op)
    capacity = checks.optional_positive_int(op, "capacity", capacity)
    if ep_group is None:
        if capacity is not None:
            raise ValueError(f"{name}: capacity={capacity} needs an ep_group (capacity mode is "
                             "the expert-parallel exchange's)")
        return None
    size = checked_group_size(op, ep_group)
    if num_experts % size:
        raise ValueError(f"{name}: num_experts={num_experts} is not divisible by the ep_group "
                         f"size {size}: each rank must hold num_experts / size local experts")
    if size == 1:
        return None
    return ExpertParallel(ep_group, size, num_experts // size, capacity)


def checked_group_size(op: object, ep_group: object) -> int:
    """The size of `ep_group`, a ProcessGroup of an initialized torch.distributed."""
    name = checks.op_name(op)
    if not isinstance(ep_group, dist.ProcessGroup):
        raise TypeError(f"{name}: ep_group must be a torch.distributed.ProcessGroup or None, got "
                        f"{type(ep_group).__name__}")
    resolve_group(name, ep_group)
    return group_size(ep_group)


def check_ranks_agree(op: object, ep: ExpertParallel, num_experts: int) -> None:
    """Once per configuration: every rank has the same num_experts and capacity (a mismatch
    would make the all-to-alls disagree on sizes and hang), a ValueError on every rank."""
    if ep.agreed:
        return
    name = checks.op_name(op)
    check_same_on_ranks(name, "num_experts", num_experts, ep.group)
    check_same_on_ranks(name, "capacity (-1: exact mode)",
                        -1 if ep.capacity is None else ep.capacity, ep.group)
    ep.agreed = True


def exchange_forward(ep: ExpertParallel, rows: Tensor, counts: Tensor, row_probs: Tensor):
    """Rows [N, H] and probs [N] sorted by global expert with counts [E] -> (rows [R, H],
    probs [R], split_sizes [L], plan): this rank's share, sorted by local expert."""
    if ep.capacity is None:
        plan = dispatch_plan(rows, counts, ep.num_local, ep.group)  # the one host sync
    else:
        plan = capacity_plan(rows, counts, ep.num_local, ep.capacity, ep.group)
    return plan.dispatch(rows), plan.dispatch(row_probs), plan.local_splits, plan


def capacity_stats(plan: ExchangePlan | CapacityPlan) -> CapacityStats | None:
    return plan.stats if isinstance(plan, CapacityPlan) else None


def attach_plan(routing_map: Tensor, plan: ExchangePlan | CapacityPlan) -> Tensor:
    """The routing map carrying the exchange plan to the paired ExpertCombine."""
    setattr(routing_map, _PLAN_ATTR, plan)
    return routing_map


def plan_of(routing_map: Tensor) -> ExchangePlan | CapacityPlan | None:
    return getattr(routing_map, _PLAN_ATTR, None)


def local_row_count(plan: ExchangePlan | CapacityPlan) -> int:
    """R: the rows this rank's experts received (exact: from the host splits; capacity:
    ep · capacity, padding included)."""
    if isinstance(plan, CapacityPlan):
        return plan.order.numel()
    return sum(plan.recv_splits)


def check_combine_group(op: object, ep_group: object, plan: object) -> None:
    """An ExpertCombine's own ep_group (optional) must be its dispatch's."""
    name = checks.op_name(op)
    if plan is None and ep_group is not None and group_size(ep_group) > 1:
        raise ValueError(f"{name}: ep_group is given, but the routing map comes from an "
                         "ExpertDispatch without expert parallelism (give it the ep_group)")
    if plan is not None and ep_group is not None and ep_group is not plan.group:
        raise ValueError(f"{name}: ep_group is not the process group of the ExpertDispatch "
                         "that made the routing map")
