"""ExpertCombine: expert output rows back in token order, the top-k contributions summed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq.core import checks
from te_seq.core.operation import BasicOperation
from te_seq.kernels import routing

# Shape legend: T tokens, k experts per token (top-k), N = T·k routed rows, H hidden.


@dataclass(frozen=True)
class CombineSaved:
    """What backward needs besides the saved routing map: the input's shape."""

    input_shape: torch.Size


class ExpertCombine(BasicOperation):
    """y[t] = Σ_j rows[routing[t, j]]: routed rows [N, H] (or [..., H] with N rows in all)
    summed back per token -> [..., H] with routing's leading shape.

    Extra input `routing` int64 [..., k] (routing[t, j]: the row of token t's j-th choice), as
    ExpertDispatch makes it; bound to the "routing" channel by default, so after an
    ExpertDispatch in the same Sequential the caller does not pass it. Router probabilities
    are not applied here: scale the rows before (ScaledSwiGLU, RowScale). Equivalent to
    `torch.zeros(T, H).index_add_(0, token_of_row, rows)`, but computed as a gather and a sum
    over the k choices (deterministic, no atomics). Backward: d rows[routing[t, j]] = dy[t].
    """

    num_extra_inputs = 1
    extra_input_names = ("routing",)
    default_input_channels = {"routing": "routing"}

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
        if input_.dim() == 0 or rows != routing_map.numel():
            raise ValueError(
                f"{name}: input has shape {tuple(input_.shape)} ({rows} rows), expected "
                f"[N, H] with N = routing.numel() = {routing_map.numel()} rows"
            )
        if routing_map.device != input_.device:
            raise ValueError(f"{name}: routing is on {routing_map.device}, input on "
                             f"{input_.device}")

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        ctx = basic_op_ctxs[0]
        (routing_map,) = basic_op_extra_inputs[0]
        row_of = routing_map.reshape(-1, routing_map.shape[-1])  # [T, k]
        y = routing.unpermute_rows(input_.reshape(-1, input_.shape[-1]), row_of)  # [T, H]
        if ctx.requires_grad:
            ctx.save_for_backward(routing_map)
            ctx.saved = CombineSaved(input_.shape)
        return y.reshape(*routing_map.shape[:-1], input_.shape[-1]), [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        (routing_map,) = ctx.saved_tensors
        row_of = routing_map.reshape(-1, routing_map.shape[-1])  # [T, k]
        dy = grad_output.reshape(row_of.shape[0], grad_output.shape[-1])  # [T, H]
        drows = routing.unpermute_rows_backward(dy, row_of)  # [N, H]
        return drows.reshape(ctx.saved_as(CombineSaved).input_shape), [[]], [(None,)]
