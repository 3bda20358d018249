"""L2Normalization: y = x / sqrt(Σ x² + eps) over the last dimension (e.g. Llama 4's qk-norm)."""

from __future__ import annotations

import torch
from torch import Tensor

from te_seq.core import checks
from te_seq.core.context import OperationContext
from te_seq.core.operation import BasicOperation
from te_seq.ops.basic.normalization import upcast


class L2Normalization(BasicOperation):
    """Parameter-free L2 normalization over the last dim: x [..., N] -> y [..., N],

        r = 1 / sqrt(Σ_j x_j² + eps),  y = x · r.

    (TransformerEngine's formula: eps is added to the sum of squares, not to the norm, so this
    differs from `torch.nn.functional.normalize`, which divides by max(‖x‖, eps).) Computed in
    fp32 for low-precision inputs; y has x's dtype. Backward: dx = r · dy − x · r³ · Σ_j dy_j x_j.

    `seq_length` and `micro_batch_size` are accepted for TransformerEngine compatibility (its
    JIT warm-up hints) and change nothing here.
    """

    def __init__(
        self,
        *,
        eps: float = 1e-6,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        self.eps = checks.real_number(self, "eps", eps, "positive", lambda v: v > 0)
        self.seq_length = checks.optional_positive_int(self, "seq_length", seq_length)
        self.micro_batch_size = checks.optional_positive_int(
            self, "micro_batch_size", micro_batch_size
        )

    def extra_repr(self) -> str:
        return f"eps={self.eps}"

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        checks.check_floating(self, input_)
        if input_.dim() == 0:
            raise ValueError("L2Normalization: input is a scalar; expected [..., N]")

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        x = upcast(input_)  # [..., N]
        r = torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + self.eps)  # [..., 1]
        if ctx.requires_grad:
            ctx.save_for_backward(input_, r)
        return (x * r).to(input_.dtype)

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        x_in, r = ctx.saved_tensors
        x, dy = upcast(x_in), upcast(grad_output)
        dx = r * dy - x * r.pow(3) * (dy * x).sum(-1, keepdim=True)
        return dx.to(x_in.dtype), []
