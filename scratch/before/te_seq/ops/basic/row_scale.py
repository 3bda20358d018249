"""RowScale: y = x · s, one scale per row (router scores applied to the tokens)."""

from __future__ import annotations

from torch import Tensor

from te_seq.core import checks
from te_seq.core.operation import BasicOperation


class RowScale(BasicOperation):
    """y = x · s[:, None]; x [..., D], extra input `scales` with one entry per row of x (shape
    [T] or x.shape[:-1]) -> y [..., D] in x's dtype (s is cast to it, as a model multiplying
    its tokens by the router scores does). Backward: dx = dy · s; ds_t = Σ_j dy_tj · x_tj.

    Llama 4 scales each routed token by its router score before FC1:
    `Sequential(ExpertDispatch(E), RowScale(), GroupedLinear(...), SwiGLU(), ...)`; `scales`
    subscribes to the "probs" channel by default (ExpertDispatch publishes it).
    """

    num_extra_inputs = 1
    extra_input_names = ("scales",)
    default_input_channels = {"scales": "probs"}

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        checks.check_floating(self, input_)
        checks.check_tensor(self, "scales", extra_inputs[0])
        checks.check_per_row(self, "scales", extra_inputs[0], input_)

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        ctx = basic_op_ctxs[0]
        (scales,) = basic_op_extra_inputs[0]
        s = scales.reshape(*input_.shape[:-1], 1).to(input_.dtype)  # [..., 1]
        if ctx.requires_grad:
            ctx.save_for_backward(input_, scales)
        return input_ * s, [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        x, scales = ctx.saved_tensors
        s = scales.reshape(*x.shape[:-1], 1).to(x.dtype)
        dx = grad_output * s if ctx.input_requires_grad else None
        ds = (grad_output * x).sum(-1).reshape(scales.shape).to(scales.dtype)
        return dx, [[]], [(ds,)]
