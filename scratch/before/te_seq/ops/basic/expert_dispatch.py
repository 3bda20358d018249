"""ExpertDispatch: token rows sorted by expert for the grouped expert MLP (MoE dispatch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq.core import checks
from te_seq.core.operation import BasicOperation
from te_seq.kernels import routing
from te_seq.ops.basic import _expert_parallel as ep_exchange

# Shape legend: T tokens, k experts per token (top-k), N = T·k routed rows, E experts, H hidden.


@dataclass(frozen=True)
class DispatchSaved:
    """What backward needs besides the saved routing map: the input's shape."""

    input_shape: torch.Size
    exchange: object = None  # the expert-parallel exchange plan (None: no expert parallelism)


def check_routing_inputs(op: object, input_: Tensor, indices: object, probs: object,
                         num_experts: int) -> None:
    """Top-k expert indices [..., k] (integer) and probabilities [..., k] (floating) for an
    input [..., H] on its device; host indices are checked to lie in [0, E) (on the device that
    check is the device-side bounds check of the count, which never syncs)."""
    name = checks.op_name(op)
    checks.check_floating(op, input_)
    if input_.dim() == 0:
        raise ValueError(f"{name}: input is a scalar; expected token rows [..., H]")
    indices = checks.check_tensor(op, "topk_indices", indices)
    probs = checks.check_tensor(op, "topk_probs", probs)
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise ValueError(f"{name}: topk_indices must be an integer tensor, got {indices.dtype}")
    lead = tuple(input_.shape[:-1])
    if indices.dim() != len(lead) + 1 or tuple(indices.shape[:-1]) != lead or not indices.shape[-1]:
        raise ValueError(
            f"{name}: topk_indices has shape {tuple(indices.shape)}, expected "
            f"{lead + ('k',)} with k >= 1 for input of shape {tuple(input_.shape)}"
        )
    if probs.shape != indices.shape or not probs.is_floating_point():
        raise ValueError(
            f"{name}: topk_probs must be floating point with topk_indices' shape "
            f"{tuple(indices.shape)}, got {probs.dtype} {tuple(probs.shape)}"
        )
    for what, t in (("topk_indices", indices), ("topk_probs", probs)):
        if t.device != input_.device:
            raise ValueError(f"{name}: {what} is on {t.device}, input on {input_.device}")
    if indices.device.type == "cpu" and indices.numel() and not torch.compiler.is_compiling():
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= num_experts:
            raise ValueError(
                f"{name}: topk_indices must lie in [0, num_experts={num_experts}), got values "
                f"in [{low}, {high}]"
            )


class ExpertDispatch(BasicOperation):
    """Routed rows sorted by expert: rows[r] = x[t_r] for the slots (t, j) in expert order.

    x [..., H] (T tokens); extra inputs `topk_indices` [..., k] (integer, in [0, E)) and
    `topk_probs` [..., k]. The N = T·k slots (t, j) are sorted by expert index, stably: ties
    keep token order, then choice order. Output: rows [N, H]. Extra outputs:
    `split_sizes` int64 [E] (rows per expert, counted on the device without a host sync),
    `probs` [N] (topk_probs in row order, for ScaledSwiGLU / RowScale / scale_bias) and
    `routing` int64 [..., k] (routing[t, j]: the row of slot (t, j), for ExpertCombine).
    They are published on the channels "split_sizes", "probs" and "routing", to which
    GroupedLinear, ScaledSwiGLU, RowScale and ExpertCombine subscribe by default, so
    `Sequential(ExpertDispatch(E), GroupedLinear(E, H, 2F), ScaledSwiGLU(),
    GroupedLinear(E, F, H), ExpertCombine())` is a whole MoE expert block called as
    `block(x, topk_indices, topk_probs)`. An output no later op takes goes to the caller.

    Equivalent to `order = argsort(idx.flatten(), stable=True); rows = x[order // k]`.
    Backward: dx_t = Σ_j d rows[routing[t, j]]; d topk_probs[t, j] = d probs[routing[t, j]].
    Out-of-range indices: ValueError for host tensors; on CUDA a device-side assert.

    Expert parallelism (`ep_group`: a process group of n > 1 ranks; None: none): num_experts
    is the global count E, this rank holds L = E / n local experts (global experts r·L ..
    r·L + L - 1 on rank r). After the sort above the rows go to the ranks owning their
    experts (te_seq.distributed.expert_exchange): the output is this rank's share [R, H],
    sorted by local expert, `split_sizes` is [L] and `probs` [R] are the exchanged
    probabilities, so the GroupedLinear(L, ...) ops after it fuse as without it. The routing
    map carries the exchange to the ExpertCombine. `capacity` (rows per rank pair) selects the
    sync-free capacity mode; the last forward's dropped / padded row counts are in
    `capacity_stats` (device tensors). See docs/distributed.md.
    """

    num_extra_inputs = 2
    extra_input_names = ("topk_indices", "topk_probs")
    num_extra_outputs = 3
    extra_output_names = ("split_sizes", "probs", "routing")
    default_output_channels = {"split_sizes": "split_sizes", "probs": "probs",
                               "routing": "routing"}

    def __init__(self, num_experts: int, *, ep_group: object = None,
                 capacity: int | None = None) -> None:
        super().__init__()
        self.num_experts = checks.positive_int(self, "num_experts", num_experts)
        self.expert_parallel = ep_exchange.expert_parallel(self, self.num_experts, ep_group,
                                                           capacity)
        self.capacity_stats = None  # capacity mode: the last forward's CapacityStats

    @property
    def ep_group(self) -> object:
        """The expert-parallel process group (None: no expert parallelism)."""
        return None if self.expert_parallel is None else self.expert_parallel.group

    def extra_repr(self) -> str:
        ep = self.expert_parallel
        if ep is None:
            return f"num_experts={self.num_experts}"
        return (f"num_experts={self.num_experts}, ep_size={ep.size}, "
                f"num_local_experts={ep.num_local}, capacity={ep.capacity}")

    def plan_facts(self) -> tuple:
        ep = self.expert_parallel
        return (self.num_experts,) if ep is None else (self.num_experts, ep.size, ep.capacity)

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        check_routing_inputs(self, input_, *extra_inputs, self.num_experts)

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        ctx = basic_op_ctxs[0]
        indices, probs = basic_op_extra_inputs[0]
        k = indices.shape[-1]
        expert_of_slot = indices.reshape(-1)  # [N]
        order, row_of_slot = routing.sort_slots(expert_of_slot)  # [N], [N]
        rows = routing.permute_rows(input_.reshape(-1, input_.shape[-1]), order, k)  # [N, H]
        splits = routing.count_rows(expert_of_slot, self.num_experts)  # [E]
        row_probs = routing.permute_slot_values(probs, order)  # [N]
        routing_map = row_of_slot.reshape(indices.shape)  # [..., k]
        plan = None
        if self.expert_parallel is not None:  # [N] rows -> this rank's [R] rows
            ep_exchange.check_ranks_agree(self, self.expert_parallel, self.num_experts)
            rows, row_probs, splits, plan = ep_exchange.exchange_forward(
                self.expert_parallel, rows, splits, row_probs)
            self.capacity_stats = ep_exchange.capacity_stats(plan)
            routing_map = ep_exchange.attach_plan(routing_map, plan)
        if ctx.requires_grad:
            ctx.save_for_backward(routing_map)
            ctx.saved = DispatchSaved(input_.shape, plan)
        return rows, [(splits, row_probs, routing_map)]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        (routing_map,) = ctx.saved_tensors
        saved = ctx.saved_as(DispatchSaved)
        row_of = routing_map.reshape(-1, routing_map.shape[-1])  # [T, k]
        d_row_probs = basic_op_grad_extra_outputs[0][1]
        if saved.exchange is not None:  # this rank's [R] rows -> the [N] rows it sent
            grad_output, d_row_probs = (
                None if g is None else saved.exchange.combine(g.contiguous())
                for g in (grad_output, d_row_probs))
        dx = None
        if ctx.input_requires_grad and grad_output is not None:
            dx = routing.permute_rows_backward(grad_output, row_of).reshape(saved.input_shape)
        dprobs = None
        if d_row_probs is not None:
            dprobs = routing.unpermute_slot_values(d_row_probs, row_of).reshape(routing_map.shape)
        return dx, [[]], [(None, dprobs)]
