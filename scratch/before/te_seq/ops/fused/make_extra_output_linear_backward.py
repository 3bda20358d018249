"""MakeExtraOutputLinearBackward: the backward of MakeExtraOutput → BasicLinear, with the
linear's dgrad accumulated onto the residual's gradient by one GEMM.

Registered as the backward fusion "make_extra_output_linear_backward". Shape legend: T tokens
(rows), K in_features, N out_features.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from te_seq.core import amp
from te_seq.core.operation import BasicOperation, FusedOperation
from te_seq.fusion.registry import NoMatch, register_fusion
from te_seq.ops.basic.basic_linear import BasicLinear, LinearSaved
from te_seq.ops.basic.make_extra_output import MakeExtraOutput


class MakeExtraOutputLinearBackward(FusedOperation):
    """Backward of r = x (the extra output), y = x Wᵀ: dy [..., N], dr [..., K] ->

        dX = dR + dY W   (one `torch.addmm`, out of place: autograd's dR is never written),
        dW = dYᵀ X       (through BasicLinear's gradient contract).

    Backward only: it reads what BasicLinear's own forward saved (x, W, the input shape);
    MakeExtraOutput saves nothing.
    """

    # BasicLinear's `out=` buffer acts in its own (unfused) forward only; its backward state is
    # unchanged by it. Its `grad_input_out=` is not honoured: the window then runs unfused.
    honoured_op_kwargs = frozenset({"out"})

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        super().__init__(basic_ops)
        self.make_extra_output, self.linear = basic_ops

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        _, linear_ctx = basic_op_ctxs
        (d_residual,) = basic_op_grad_extra_outputs[0]
        x, weight = linear_ctx.saved_tensors
        linear = self.linear
        dy = linear.grad_rows(linear_ctx, grad_output)  # [T, N] in the GEMM's compute dtype
        dx = None
        if linear_ctx.input_requires_grad:
            saved = linear_ctx.saved_as(LinearSaved)
            d_r = None if d_residual is None else d_residual.reshape(-1, linear.in_features)
            if d_r is None:
                dx = amp.cast(dy @ weight, saved.input_dtype)  # dX = dY W   [T, K]
            elif d_r.dtype == weight.dtype:
                dx = torch.addmm(d_r, dy, weight)  # dX = dR + dY W   [T, K]
            else:  # under torch.autocast: the GEMM in its dtype, the sum in the input's
                dx = d_r + (dy @ weight).to(d_r.dtype)
            dx = dx.reshape(saved.input_shape)
        wgrads = linear.weight_grads(linear_ctx, x, dy)  # dW = dYᵀ X, per the gradient contract
        return dx, [[], wgrads], [(), ()]


@register_fusion(name="make_extra_output_linear_backward", phase="backward",
                 pattern=(MakeExtraOutput, BasicLinear), builtin=True)
def _build_make_extra_output_linear_backward(
    window,
) -> MakeExtraOutputLinearBackward | NoMatch:
    linear = window[1]
    if linear.tensor_parallel_mode is not None:  # its collectives live in its own backward
        return NoMatch(f"BasicLinear is tensor-parallel ({linear.tensor_parallel_mode!r}); "
                       "its backward runs unfused")
    return MakeExtraOutputLinearBackward(window)
