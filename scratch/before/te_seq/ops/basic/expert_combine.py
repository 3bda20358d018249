"""ExpertCombine: expert output rows back in token order, the top-k contributions summed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq.core import checks
from te_seq.core.operation import BasicOperation
from te_seq.kernels import routing
from te_seq.ops.basic import _expert_parallel as ep_exchange
from te_seq.ops.basic._communication import _SharedGroup

# Shape legend: T tokens, k experts per token (top-k), N = T·k routed rows, H hidden.


@dataclass(frozen=True)
class CombineSaved:
    """What backward needs besides the saved routing map: the input's shape."""

    input_shape: torch.Size
    exchange: object = None  # the expert-parallel exchange plan (None: no expert parallelism)


class ExpertCombine(BasicOperation):
    """y[t] = Σ_j rows[routing[t, j]]: routed rows [N, H] (or [..., H] with N rows in all)
    summed back per token -> [..., H] with routing's leading shape.

    Extra input `routing` int64 [..., k] (routing[t, j]: the row of token t's j-th choice), as
    ExpertDispatch makes it; bound to the "routing" channel by default, so after an
    ExpertDispatch in the same Sequential the caller does not pass it. Router probabilities
    are not applied here: scale the rows before (ScaledSwiGLU, RowScale). Equivalent to
    `torch.zeros(T, H).index_add_(0, token_of_row, rows)`, but computed as a gather and a sum
    over the k choices (deterministic, no atomics). Backward: d rows[routing[t, j]] = dy[t].

    Expert parallelism: after an ExpertDispatch with an `ep_group`, the input is this rank's
    share [R, H] of the rows; the exchange plan comes with the routing map, so the combine
    first sends the rows back to the ranks that dispatched them (R -> N rows, zero for rows
    capacity mode dropped), then sums per token as above. `ep_group` is optional; given, it
    must be the dispatch's group (ValueError otherwise).
    """

    num_extra_inputs = 1
    extra_input_names = ("routing",)
    default_input_channels = {"routing": "routing"}

    def __init__(self, *, ep_group: object = None) -> None:
        super().__init__()
        if ep_group is not None:
            ep_exchange.checked_group_size(self, ep_group)
        self._ep_group = _SharedGroup(ep_group)  # a deep copy shares the group

    @property
    def ep_group(self) -> object:
        """The expert-parallel group given (None: taken from the dispatch's routing map)."""
        return self._ep_group.group

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        name = checks.op_name(self)
        checks.check_floating(self, input_)
        routing_map = checks.check_tensor(self, "routing", extra_inputs[0])
        if routing_map.is_floating_point() or routing_map.dim() == 0:
            raise ValueError(
                f"{name}: routing must be an integer tensor [..., k], got {routing_map.dtype} "
                f"{tuple(routing_map.shape)}"
            )
        rows = int(torch.Size(input_.shape[:-1]).numel()) if input_.dim() else 1
        plan = ep_exchange.plan_of(routing_map)
        ep_exchange.check_combine_group(self, self.ep_group, plan)
        expected = routing_map.numel() if plan is None else ep_exchange.local_row_count(plan)
        if input_.dim() == 0 or rows != expected:
            what = ("routing.numel()" if plan is None
                    else "the rows the expert-parallel dispatch gave this rank")
            raise ValueError(
                f"{name}: input has shape {tuple(input_.shape)} ({rows} rows), expected "
                f"[N, H] with N = {what} = {expected} rows"
            )
        if routing_map.device != input_.device:
            raise ValueError(f"{name}: routing is on {routing_map.device}, input on "
                             f"{input_.device}")

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        ctx = basic_op_ctxs[0]
        (routing_map,) = basic_op_extra_inputs[0]
        row_of = routing_map.reshape(-1, routing_map.shape[-1])  # [T, k]
        rows = input_.reshape(-1, input_.shape[-1])
        plan = ep_exchange.plan_of(routing_map)
        if plan is not None:  # this rank's [R] rows -> the [N] rows this rank dispatched
            rows = plan.combine(rows.contiguous())
        y = routing.unpermute_rows(rows, row_of)  # [T, H]
        if ctx.requires_grad:
            ctx.save_for_backward(routing_map)
            ctx.saved = CombineSaved(input_.shape, plan)
        return y.reshape(*routing_map.shape[:-1], input_.shape[-1]), [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        (routing_map,) = ctx.saved_tensors
        row_of = routing_map.reshape(-1, routing_map.shape[-1])  # [T, k]
        dy = grad_output.reshape(row_of.shape[0], grad_output.shape[-1])  # [T, H]
        drows = routing.unpermute_rows_backward(dy, row_of)  # [N, H]
        saved = ctx.saved_as(CombineSaved)
        if saved.exchange is not None:  # [N] -> this rank's [R] rows (the dispatch exchange)
            drows = saved.exchange.dispatch(drows)
        return drows.reshape(saved.input_shape), [[]], [(None,)]
