"""LinearBiasActivation: BasicLinear → Bias → activation, forward as one op (addmm, then act).

Registered as the forward fusion "linear_bias_activation". Shape legend: T tokens (rows),
K in_features, N out_features (the activation's input width; 2F for gated activations).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from te_seq.core import amp
from te_seq.core.operation import BasicOperation, FusedOperation
from te_seq.fusion.registry import NoMatch, register_fusion
from te_seq.kernels import as_rows
from te_seq.kernels.backend import KernelNeed
from te_seq.ops.basic.activation import Activation
from te_seq.ops.basic.basic_linear import BasicLinear
from te_seq.ops.basic.bias import Bias
from te_seq.ops.fused._linear_common import check_activation, check_linear_bias


class LinearBiasActivation(FusedOperation):
    """y = act(x Wᵀ + b): x [..., K], W [N, K], b [N] -> h [..., N] -> y [..., N] (or [..., N/2]
    for gated activations; ScaledSwiGLU also takes its `scales` extra input).

    Equivalent to the unfused chain `act(torch.nn.functional.linear(x, W, b))`; the bias add runs
    inside the GEMM (`torch.addmm`), so the pre-activation h is written once. Forward only: each
    basic op's context is filled as its own forward would (BasicLinear saves x and W, Bias
    nothing, the activation h), so the basic ops' backward or a backward fusion runs from them.
    """

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        super().__init__(basic_ops)
        self.linear, self.bias, self.activation = basic_ops

    def kernel_needs(self) -> list[KernelNeed]:
        return self.activation.kernel_needs()  # the GEMM is torch.addmm on every backend

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        linear_ctx, _, act_ctx = basic_op_ctxs
        act_extra = basic_op_extra_inputs[2]
        x = as_rows(input_, self.linear.in_features)  # [T, K]
        x, w = self.linear.operands(linear_ctx, x)  # in the compute dtype (core/amp.py)
        h = torch.addmm(amp.cast(self.bias.bias, x.dtype), x, w.t())  # h = b + X Wᵀ   [T, N]
        self.linear.save(linear_ctx, x, input_.shape, w, input_.dtype)
        h = h.reshape(*input_.shape[:-1], self.linear.out_features)  # [..., N]
        self.activation.pre_forward_checks(h, act_extra)
        y, _ = self.activation.fuser_forward(
            [act_ctx], h, basic_op_extra_inputs=[act_extra], basic_op_kwargs=[{}]
        )
        return y, [(), (), ()]


@register_fusion(name="linear_bias_activation", phase="forward",
                 pattern=(BasicLinear, Bias, Activation), builtin=True)
def _build_linear_bias_activation(window) -> LinearBiasActivation | NoMatch:
    linear, bias, act = window
    reason = check_linear_bias(linear, bias) or check_activation(act, linear.out_features)
    return reason or LinearBiasActivation(window)
