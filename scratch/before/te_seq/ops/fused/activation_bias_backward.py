"""ActivationBiasBackward: the backward of Bias → activation as one pass (dact with dbias).

Registered as the backward fusion "activation_bias_backward". Shape legend: T tokens (rows),
N the bias size (the activation's input width; 2F for gated activations).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from te_seq.core.operation import BasicOperation, FusedOperation
from te_seq.fusion.registry import NoMatch, register_fusion
from te_seq.kernels.backend import Backend, KernelNeed
from te_seq.ops.basic.activation import Activation
from te_seq.ops.basic.bias import Bias
from te_seq.ops.fused._linear_common import check_activation


def _upcast(t: Tensor | None) -> Tensor | None:
    return t if t is None or t.dtype == torch.float64 else t.float()


class ActivationBiasBackward(FusedOperation):
    """Backward of h = x + b, y = act(h): dy [..., F] -> dh [..., N] and db [N],

        dh = dy · act'(h)  (gated: the GLU backward; ScaledSwiGLU also gives d scales),
        db = Σ_rows dh.

    Computed in one fp32 pass: db is reduced from the unrounded dh, then dh is cast once (so for
    bf16 db is at least as accurate as the unfused chain's). Backward only: it reads what the
    activation's own forward saved (its input h, and `scales` for ScaledSwiGLU); Bias saves nothing.
    """

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        super().__init__(basic_ops)
        self.bias, self.activation = basic_ops

    def kernel_needs(self) -> list[KernelNeed]:
        return self.activation.kernel_needs()

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        bias_ctx, act_ctx = basic_op_ctxs
        h, *scales = act_ctx.saved_tensors  # h [..., N]; scales [T] for ScaledSwiGLU
        h32, dy32 = _upcast(h), _upcast(grad_output)
        dh32, dscales = self._dact(act_ctx.backend, h32, dy32, scales)  # [..., N] fp32
        dbias = None
        if bias_ctx.weight_requires_grad:
            dbias = dh32.reshape(-1, self.bias.size).sum(0).to(self.bias.bias.dtype)  # db = Σ dh
        act_extra = () if not scales else (dscales.reshape(scales[0].shape).to(scales[0].dtype),)
        return dh32.to(h.dtype), [[dbias], []], [(), act_extra]

    def _dact(self, backend: Backend, h32: Tensor, dy32: Tensor, scales: list[Tensor]):
        """(dh, d scales) in the compute precision, on the step's backend."""
        op = self.activation
        rows = _upcast(scales[0]).reshape(h32.shape[:-1]) if scales else None
        if not op.gated:
            if rows is not None:  # a row-scaled elementwise activation (ScaledSReLU)
                return op.scaled_backward(backend, h32, dy32, rows)
            return backend.act_backward(h32, dy32, op.act), None
        return backend.glu_backward(h32, dy32, op.glu_spec, rows)


@register_fusion(name="activation_bias_backward", phase="backward",
                 pattern=(Bias, Activation), builtin=True)
def _build_activation_bias_backward(window) -> ActivationBiasBackward | NoMatch:
    bias, act = window
    return check_activation(act, bias.size) or ActivationBiasBackward(window)
