"""Expert-parallel exchange: rows sorted by global expert go to the rank owning the expert.

Layout: E = ep * L global experts on an expert-parallel group of ep ranks; global expert e lives
on rank e // L as its local expert e % L. Each rank starts with rows x [N, H] sorted by global
expert and `counts` [E] (rows per global expert, on x's device).

Dispatch (`dispatch_plan` + `dispatch_rows`):
  1. counts are exchanged with one `all_to_all_single` ([ep, L] per rank): recv[s, l] = rows
     rank s sends to this rank's local expert l;
  2. the row split sizes come to the host: ONE host sync (a single `.tolist()` of the send and
     receive sizes), the only one of a step; the rows move with one `all_to_all_single`;
  3. the received rows (source-rank major) are sorted by local expert (a stable device sort),
     with `local_splits` [L] on the device for the grouped MLP.
Combine (`combine_rows`) is the exact inverse: unsort, `all_to_all_single` back with the
splits swapped: y [R, H'] -> [N, H'] in x's order. Each is the other's adjoint (a permutation
and its inverse), so dispatch's backward is combine's forward and vice versa.

Capacity mode (`capacity_plan`): a fixed capacity C rows per (source, destination) rank pair
makes every size static: no host sync, CUDA-graph safe. A destination's rows beyond C are
dropped (their combine output and gradient are zero); free slots are zero padding, placed after
the valid rows and counted in the last local expert's split (zero rows add nothing to any
gradient). How many rows were dropped and padded is returned in `CapacityStats` (device
tensors: reading them is the caller's sync), never silent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from te_seq.distributed.collectives import all_gather_rows, group_size
from te_seq.kernels.routing import invert_permutation


def _check_layout(op: str, x: Tensor, counts: Tensor, num_local: int, ep: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"{op}: rows must be 2-D [N, H], got shape {tuple(x.shape)}")
    if counts.dim() != 1 or counts.numel() != num_local * ep or counts.is_floating_point():
        raise ValueError(
            f"{op}: counts must be a 1-D integer tensor of num_experts = {num_local * ep} "
            f"(ep group size {ep} x {num_local} local experts), got {counts.dtype} of shape "
            f"{tuple(counts.shape)}"
        )


def check_same_on_ranks(op: str, name: str, value: int, group: object) -> None:
    """Every rank of `group` holds the same `value` (one tiny all-gather and a host read): a
    disagreement is a ValueError on every rank, before a collective with mismatched sizes could
    hang. Meant to run once per configuration, not per step."""
    mine = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    values = all_gather_rows(mine, group).tolist()
    if any(v != value for v in values):
        raise ValueError(f"{op}: ranks of the group disagree on {name}: {values} (rank order)")


def exchange_counts(counts: Tensor, ep: int, group: object) -> Tensor:
    """[E] rows per global expert sent by this rank -> [ep, L]: rows each source rank sends to
    this rank's local experts (one all_to_all_single on the device, no host sync)."""
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received.reshape(ep, -1)


def local_expert_order(received: Tensor, total: int, fill: Tensor | None = None) -> Tensor:
    """The stable permutation sorting rows received source-major ([ep, L] blocks of sizes
    `received`, `total` rows) by local expert; `fill` (optional, per row) overrides the key."""
    ep, num_local = received.shape
    experts = torch.arange(num_local, device=received.device).repeat(ep)
    key = torch.repeat_interleave(experts, received.reshape(-1), output_size=total)
    if fill is not None:
        key = fill
    return torch.sort(key, stable=True).indices


@dataclass(frozen=True)
class ExchangePlan:
    """One dispatch's layout, reused by combine and both backwards.

    send_splits / recv_splits: host row counts per peer rank (from the one host sync);
    order: the device permutation sorting received rows by local expert, unorder its inverse;
    local_splits [L]: rows per local expert on this rank (device)."""

    group: object
    send_splits: list[int]
    recv_splits: list[int]
    order: Tensor
    unorder: Tensor
    local_splits: Tensor

    def dispatch(self, x: Tensor) -> Tensor:
        return dispatch_rows(x, self)

    def combine(self, y: Tensor) -> Tensor:
        return combine_rows(y, self)


def dispatch_plan(x: Tensor, counts: Tensor, num_local_experts: int,
                  group: object) -> ExchangePlan:
    """The exchange layout of rows x [N, H] sorted by global expert with `counts` [E]."""
    ep = group_size(group)
    _check_layout("expert dispatch", x, counts, num_local_experts, ep)
    received = exchange_counts(counts, ep, group)  # [ep, L]
    per_peer = torch.stack([counts.reshape(ep, -1).sum(1), received.sum(1)])
    send, recv = per_peer.tolist()  # the step's one host sync
    if sum(send) != x.shape[0]:
        raise ValueError(f"expert dispatch: counts sum to {sum(send)} but x has {x.shape[0]} "
                         "rows")
    order = local_expert_order(received, sum(recv))
    return ExchangePlan(group, send, recv, order, invert_permutation(order), received.sum(0))


def dispatch_rows(x: Tensor, plan: ExchangePlan) -> Tensor:
    """x [N, H] -> rows of this rank's local experts [R, H], sorted by local expert."""
    received = x.new_empty((sum(plan.recv_splits), *x.shape[1:]))
    dist.all_to_all_single(received, x.contiguous(), plan.recv_splits, plan.send_splits,
                           group=plan.group)
    return received[plan.order]


def combine_rows(y: Tensor, plan: ExchangePlan) -> Tensor:
    """The inverse of dispatch_rows: y [R, H'] sorted by local expert -> [N, H'] in x's order."""
    unsorted = y.index_select(0, plan.unorder)
    out = y.new_empty((sum(plan.send_splits), *y.shape[1:]))
    dist.all_to_all_single(out, unsorted.contiguous(), plan.send_splits, plan.recv_splits,
                           group=plan.group)
    return out


# --- capacity mode: static sizes, no host sync ------------------------------------------------


@dataclass(frozen=True)
class CapacityStats:
    """What capacity mode did this step, as device tensors (reading them syncs; te_seq never
    does): `dropped` rows this rank sent that did not fit (their output and gradient are zero),
    `padded` zero rows this rank received to fill its capacity."""

    dropped: Tensor
    padded: Tensor


@dataclass(frozen=True)
class CapacityPlan:
    """A capacity-mode exchange: `capacity` rows per (source, destination) rank pair.

    slots [N]: each row's send slot (destination * capacity + position), ep * capacity for a
    dropped row; sources [ep * capacity]: the row each send slot holds, N for a free one, and
    free [ep * capacity] those slots; order [ep * capacity]: the sort of received slots by
    local expert, padding last, unorder its inverse; local_splits [L]: rows per local expert,
    the padding counted in the last (they sum to ep * capacity: static). Rows move by
    gathers, never by indexed stores."""

    group: object
    capacity: int
    slots: Tensor
    sources: Tensor
    free: Tensor
    order: Tensor
    unorder: Tensor
    local_splits: Tensor
    stats: CapacityStats

    def dispatch(self, x: Tensor) -> Tensor:
        send = _gather_rows(x, self.sources, self.free)  # free slots: zero padding
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        return received[self.order]

    def combine(self, y: Tensor) -> Tensor:
        unsorted = y.index_select(0, self.unorder)
        back = unsorted.new_empty((unsorted.shape[0] + 1, *unsorted.shape[1:]))
        back[-1].zero_()  # the row dropped rows read (their slot is ep * capacity)
        dist.all_to_all_single(back[:-1], unsorted, group=self.group)
        return back.index_select(0, self.slots)


def _gather_rows(t: Tensor, index: Tensor, empty: Tensor) -> Tensor:
    """out[i] = t[index[i]], zero where empty[i] (whose index may lie past t's rows): one
    gather and one masked fill, no indexed store and no padded copy of t."""
    if t.shape[0] == 0:  # a rank with no rows sends only padding
        return t.new_zeros((index.shape[0], *t.shape[1:]))
    rows = t.index_select(0, index.clamp(max=t.shape[0] - 1))
    return rows.masked_fill_(empty.view(-1, *([1] * (t.dim() - 1))), 0)


def _slot_sources(slots: Tensor, num_slots: int) -> Tensor:
    """The row each of `num_slots` send slots holds (N for a free slot), from each row's slot
    (num_slots for a dropped row: those all land in one extra slot, cut off)."""
    rows = slots.shape[0]
    sources = torch.full((num_slots + 1,), rows, dtype=slots.dtype, device=slots.device)
    sources[slots] = torch.arange(rows, dtype=slots.dtype, device=slots.device)
    return sources[:num_slots]


def _send_slots(counts: Tensor, ep: int, capacity: int, rows: int) -> Tensor:
    """Each row's send slot: its destination's block, its position there; overflow -> ep*C."""
    device = counts.device
    num_experts = counts.numel()
    expert = torch.repeat_interleave(torch.arange(num_experts, device=device), counts,
                                     output_size=rows)
    dest = expert // (num_experts // ep)
    per_dest = counts.reshape(ep, -1).sum(1)
    dest_start = per_dest.cumsum(0) - per_dest
    position = torch.arange(rows, device=device) - dest_start[dest]
    overflow = torch.full_like(position, ep * capacity)
    return torch.where(position < capacity, dest * capacity + position, overflow)


def capacity_plan(x: Tensor, counts: Tensor, num_local_experts: int, capacity: int,
                  group: object) -> CapacityPlan:
    """The capacity-mode layout of rows x [N, H] sorted by global expert with `counts` [E]:
    every size static, no host sync. Each destination keeps the first `capacity` of the rows
    sent to it (in global-expert order)."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"expert dispatch: capacity must be a positive int, got {capacity!r}")
    ep = group_size(group)
    _check_layout("expert dispatch", x, counts, num_local_experts, ep)
    per_expert = counts.reshape(ep, num_local_experts)
    earlier = per_expert.cumsum(1) - per_expert  # rows of the same destination's earlier experts
    kept = (capacity - earlier).clamp(min=0).minimum(per_expert)  # [ep, L] rows that fit
    received = exchange_counts(kept.reshape(-1), ep, group)  # [ep, L] valid rows per source
    position = torch.arange(capacity, device=counts.device).expand(ep, capacity).contiguous()
    key = torch.searchsorted(received.cumsum(1), position, right=True)  # local expert, L: pad
    order = torch.sort(key.reshape(-1), stable=True).indices
    valid = received.sum()
    local_splits = received.sum(0)
    local_splits[-1] += ep * capacity - valid
    stats = CapacityStats(dropped=counts.sum() - kept.sum(), padded=ep * capacity - valid)
    slots = _send_slots(counts, ep, capacity, x.shape[0])
    sources = _slot_sources(slots, ep * capacity)
    return CapacityPlan(group, capacity, slots, sources, sources == x.shape[0], order,
                        invert_permutation(order), local_splits, stats)


# --- autograd: each exchange's backward is the other one ---------------------------------


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, plan) -> Tensor:
        ctx.plan = plan
        return plan.dispatch(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.plan.combine(grad.contiguous()), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, plan) -> Tensor:
        ctx.plan = plan
        return plan.combine(y)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.plan.dispatch(grad.contiguous()), None


def expert_dispatch(x: Tensor, counts: Tensor, num_local_experts: int, group: object = None,
                    capacity: int | None = None):
    """Rows x [N, H] sorted by global expert, `counts` [E] -> (rows [R, H] of this rank's local
    experts sorted by local expert, plan); `plan.local_splits` [L] (device) are the grouped
    MLP's split sizes and `plan` is what `expert_combine` takes. capacity None: exact sizes (one
    host sync); an int: capacity mode (no sync; `plan.stats` reports dropped and padded rows).
    Differentiable in x (the backward is the combine exchange)."""
    if capacity is None:
        plan = dispatch_plan(x, counts, num_local_experts, group)
    else:
        plan = capacity_plan(x, counts, num_local_experts, capacity, group)
    return _Dispatch.apply(x, plan), plan


def expert_combine(y: Tensor, plan) -> Tensor:
    """The inverse of `expert_dispatch`: y [R, H'] sorted by local expert -> [N, H'] in the
    dispatched rows' order (zero for rows capacity mode dropped). Differentiable in y."""
    return _Combine.apply(y, plan)
