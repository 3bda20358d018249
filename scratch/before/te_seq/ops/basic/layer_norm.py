"""LayerNorm: y = (x - mean) / sqrt(var + eps) · γ + β over the last dimension(s)."""

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


class LayerNorm(Normalization):
    """Layer norm over the last dim: x [..., N] -> y [..., N],

        x̂ = (x - mean(x)) · rstd,  rstd = 1 / sqrt(var(x) + eps)  (biased variance)
        y = x̂ · γ + β,  γ = weight (or 1 + weight with `zero_centered_gamma`), β = bias.

    Equivalent to `torch.nn.functional.layer_norm(x, (N,), γ, β, eps)`. Computed in fp32 for
    low-precision inputs; the output has x's dtype (under torch.autocast on CUDA fp32, as torch's
    autocast runs layer_norm in fp32 there). `normalized_shape` is an int N (the last dim) or a
    tuple S of trailing dims normalized together (statistics over all of S, as torch's); weight
    and bias have its shape; weight starts at one (zero with `zero_centered_gamma`), bias at zero.
    Backward (ĝ = dy · γ): dx = rstd · (ĝ - mean(ĝ) - x̂ · mean(ĝ · x̂)), dγ = Σ dy · x̂, dβ = Σ dy.
    """

    def __init__(self, normalized_shape: int | Sequence[int], *, eps: float = 1e-5,
                 zero_centered_gamma: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(normalized_shape, eps, zero_centered_gamma, device, dtype)
        self.bias = torch.nn.Parameter(
            torch.empty(self.normalized_shape, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """γ = 1 (weight = 0 with zero_centered_gamma) and β = 0, in place."""
        super().reset_parameters()
        with torch.no_grad():
            self.bias.zero_()

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        x = upcast(input_)  # [..., N]
        mean = x.mean(self.norm_dims, keepdim=True)  # [..., 1]
        centered = x - mean  # [..., N]
        var = centered.pow(2).mean(self.norm_dims, keepdim=True)  # [..., 1] (one 1 per dim of S)
        rstd = torch.rsqrt(var + self.eps)
        gamma = effective_gamma(self.weight, self.zero_centered_gamma)
        y = centered * rstd * gamma + upcast(self.bias)
        if ctx.requires_grad:
            ctx.save_for_backward(input_, mean, rstd, self.weight)
        return y.to(amp.norm_dtype(ctx.autocast, input_))  # input's dtype outside autocast

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        x_in, mean, rstd, weight = ctx.saved_tensors
        x_hat = (upcast(x_in) - mean) * rstd  # [..., N]
        dy = upcast(grad_output)
        g = dy * effective_gamma(weight, self.zero_centered_gamma)
        dx = None
        if ctx.input_requires_grad:
            dx = rstd * (g - g.mean(self.norm_dims, keepdim=True)
                         - x_hat * (g * x_hat).mean(self.norm_dims, keepdim=True))
            dx = dx.to(x_in.dtype)
        if not ctx.weight_requires_grad:
            return dx, [None, None]
        dweight = reduce_rows(dy * x_hat, len(self.norm_dims)).to(self.weight.dtype)
        dbias = reduce_rows(dy, len(self.norm_dims)).to(self.bias.dtype)
        return dx, [dweight, dbias]
