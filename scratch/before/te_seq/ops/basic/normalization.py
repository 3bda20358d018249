"""Shared machinery of the normalization ops (LayerNorm, RMSNorm): over the trailing dims."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from te_seq.core import checks
from te_seq.core.operation import BasicOperation


def upcast(t: Tensor) -> Tensor:
    """fp32 compute for low-precision tensors; float64 stays float64."""
    return t if t.dtype == torch.float64 else t.float()


def effective_gamma(weight: Tensor, zero_centered: bool) -> Tensor:
    """γ = weight, or 1 + weight with zero_centered_gamma (in the compute precision)."""
    gamma = upcast(weight)
    return gamma + 1 if zero_centered else gamma


def reduce_rows(t: Tensor, ndim: int = 1) -> Tensor:
    """[..., *S] -> S (S the last `ndim` dims), summed over every leading dim."""
    return t.reshape(-1, *t.shape[t.dim() - ndim:]).sum(0)


class Normalization(BasicOperation):
    """A norm over the trailing dims S = `normalized_shape` (an int N: the last dim) with a
    weight γ of shape S (ones, or zeros with `zero_centered_gamma`, meaning γ = 1 + weight).

    `norm_dims` are the dims the statistics reduce over (-len(S), ..., -1); `normalized_shape`
    stays an int when one dim is normalized."""

    def __init__(self, normalized_shape: int | Sequence[int], eps: float,
                 zero_centered_gamma: bool, device, dtype: torch.dtype | None) -> None:
        super().__init__()
        dims = checks.normalized_dims(self, normalized_shape)
        self.normalized_shape = dims[0] if len(dims) == 1 else dims
        self.norm_dims = tuple(range(-len(dims), 0))
        self.eps = checks.real_number(self, "eps", eps, "positive", lambda v: v > 0)
        self.zero_centered_gamma = checks.flag(self, "zero_centered_gamma", zero_centered_gamma)
        device, dtype = checks.param_device(self, device), checks.param_dtype(self, dtype)
        self.weight = torch.nn.Parameter(
            torch.empty(self.normalized_shape, device=device, dtype=dtype))
        # Subclasses allocate their other parameters, then call reset_parameters().

    def reset_parameters(self) -> None:
        """γ = 1 in place (weight = 0 with zero_centered_gamma, meaning γ = 1 + weight = 1)."""
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"zero_centered_gamma={self.zero_centered_gamma}")

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        if isinstance(self.normalized_shape, tuple):
            checks.check_trailing_dims(self, input_, self.normalized_shape)
        else:
            checks.check_last_dim(self, input_, self.normalized_shape, "normalized_shape")
        checks.check_matches_param(self, input_, self.weight)
