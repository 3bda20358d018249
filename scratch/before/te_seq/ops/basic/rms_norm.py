"""RMSNorm: y = x / sqrt(mean(x²) + eps) · γ over the last dimension(s)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from te_seq.core import amp
from te_seq.core.context import OperationContext
from te_seq.ops.basic.normalization import (
    Normalization,
    effective_gamma,
    reduce_rows,
    upcast,
)


class RMSNorm(Normalization):
    """RMS norm over the last dim: x [..., N] -> y [..., N],

        rstd = 1 / sqrt(mean(x²) + eps),  x̂ = x · rstd,
        y = x̂ · γ,  γ = weight (or 1 + weight with `zero_centered_gamma`).

    Equivalent to `x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * γ` (and to
    `torch.nn.functional.rms_norm(x, (N,), γ, eps)`). Computed in fp32 for low-precision inputs;
    the output has x's dtype (under torch.autocast on CUDA fp32, as torch's autocast runs norms
    in fp32 there).
    `normalized_shape` is an int N (the last dim) or a tuple S of trailing dims, normalized
    together (means over all of S, as torch's `rms_norm`); weight has its shape and starts at one
    (zero with `zero_centered_gamma`); there is no bias.
    Backward (ĝ = dy · γ): dx = rstd · (ĝ - x̂ · mean(ĝ · x̂)), dγ = Σ dy · x̂.
    """

    def __init__(self, normalized_shape: int | Sequence[int], *, eps: float = 1e-5,
                 zero_centered_gamma: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(normalized_shape, eps, zero_centered_gamma, device, dtype)
        self.reset_parameters()

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        x = upcast(input_)  # [..., N]
        rstd = torch.rsqrt(x.pow(2).mean(self.norm_dims, keepdim=True) + self.eps)  # [..., 1..]
        y = x * rstd * effective_gamma(self.weight, self.zero_centered_gamma)
        if ctx.requires_grad:
            ctx.save_for_backward(input_, rstd, self.weight)
        return y.to(amp.norm_dtype(ctx.autocast, input_))  # input's dtype outside autocast

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        x_in, rstd, weight = ctx.saved_tensors
        x_hat = upcast(x_in) * rstd  # [..., N]
        dy = upcast(grad_output)
        dx = None
        if ctx.input_requires_grad:
            g = dy * effective_gamma(weight, self.zero_centered_gamma)
            dx = rstd * (g - x_hat * (g * x_hat).mean(self.norm_dims, keepdim=True))
            dx = dx.to(x_in.dtype)
        if not ctx.weight_requires_grad:
            return dx, [None]
        return dx, [reduce_rows(dy * x_hat, len(self.norm_dims)).to(self.weight.dtype)]
