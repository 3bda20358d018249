"""LayerNorm: y = (x - mean) / sqrt(var + eps) · γ + β over the last dimension."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from te_seq.core import checks
from te_seq.core.operation import BasicOperation, OperationContext


def parse_normalized_shape(op_name: str, normalized_shape: int | Sequence[int]) -> int:
    """The normalized size from an int or a 1-element sequence (te_seq norms: last dim only)."""
    if isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool):
        size = normalized_shape
    elif (isinstance(normalized_shape, Sequence) and len(normalized_shape) == 1
          and isinstance(normalized_shape[0], int)):
        size = normalized_shape[0]
    else:
        raise ValueError(
            f"{op_name}: normalized_shape must be an int or a 1-tuple (the last dimension), "
            f"got {normalized_shape!r}"
        )
    if size <= 0:
        raise ValueError(f"{op_name}: normalized_shape must be positive, got {size}")
    return size


def check_eps(op_name: str, eps: float) -> float:
    if not eps > 0:
        raise ValueError(f"{op_name}: eps must be positive, got {eps}")
    return float(eps)


def upcast(t: Tensor) -> Tensor:
    """fp32 compute for low-precision tensors; float64 stays float64."""
    return t if t.dtype == torch.float64 else t.float()


def effective_gamma(weight: Tensor, zero_centered: bool) -> Tensor:
    """γ = weight, or 1 + weight with zero_centered_gamma (in the compute precision)."""
    gamma = upcast(weight)
    return gamma + 1 if zero_centered else gamma


def reduce_rows(t: Tensor) -> Tensor:
    """[..., N] -> [N], summed over every leading dim."""
    return t.reshape(-1, t.shape[-1]).sum(0)


class LayerNorm(BasicOperation):
    """Layer norm over the last dim: x [..., N] -> y [..., N],

        x̂ = (x - mean(x)) · rstd,  rstd = 1 / sqrt(var(x) + eps)  (biased variance)
        y = x̂ · γ + β,  γ = weight (or 1 + weight with `zero_centered_gamma`), β = bias.

    Equivalent to `torch.nn.functional.layer_norm(x, (N,), γ, β, eps)`. Computed in fp32 for
    low-precision inputs. `normalized_shape` is an int or a 1-tuple: te_seq norms normalise the
    last dimension only. weight [N] starts at one (zero with `zero_centered_gamma`), bias [N]
    at zero.
    Backward (ĝ = dy · γ): dx = rstd · (ĝ - mean(ĝ) - x̂ · mean(ĝ · x̂)), dγ = Σ dy · x̂, dβ = Σ dy.
    """

    def __init__(self, normalized_shape: int | Sequence[int], *, eps: float = 1e-5,
                 zero_centered_gamma: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.normalized_shape = parse_normalized_shape("LayerNorm", normalized_shape)
        self.eps = check_eps("LayerNorm", eps)
        self.zero_centered_gamma = zero_centered_gamma
        n = self.normalized_shape
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(n, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(n, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"zero_centered_gamma={self.zero_centered_gamma}")

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        checks.check_last_dim(self, input_, self.normalized_shape, "normalized_shape")
        checks.check_matches_param(self, input_, self.weight)

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        x = upcast(input_)  # [..., N]
        mean = x.mean(-1, keepdim=True)  # [..., 1]
        centered = x - mean  # [..., N]
        rstd = torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + self.eps)  # [..., 1]
        gamma = effective_gamma(self.weight, self.zero_centered_gamma)
        y = centered * rstd * gamma + upcast(self.bias)
        if ctx.requires_grad:
            ctx.save_for_backward(input_, mean, rstd, self.weight)
        return y.to(input_.dtype)

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        x_in, mean, rstd, weight = ctx.saved_tensors
        x_hat = (upcast(x_in) - mean) * rstd  # [..., N]
        dy = upcast(grad_output)
        g = dy * effective_gamma(weight, self.zero_centered_gamma)
        dx = None
        if ctx.input_requires_grad:
            dx = rstd * (g - g.mean(-1, keepdim=True)
                         - x_hat * (g * x_hat).mean(-1, keepdim=True))
            dx = dx.to(x_in.dtype)
        if not ctx.weight_requires_grad:
            return dx, [None, None]
        dweight = reduce_rows(dy * x_hat).to(self.weight.dtype)
        dbias = reduce_rows(dy).to(self.bias.dtype)
        return dx, [dweight, dbias]
