"""Bias: y = x + b."""

from __future__ import annotations

import torch
from torch import Tensor

from te_seq.core import amp, checks
from te_seq.core.context import OperationContext
from te_seq.core.operation import BasicOperation


def reduce_to_last_dim(grad: Tensor) -> Tensor:
    """Sum a gradient [..., N] over every leading dim -> [N] (fp32 accumulate; fp64 stays fp64)."""
    acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
    return grad.reshape(-1, grad.shape[-1]).sum(0, dtype=acc).to(grad.dtype)


class Bias(BasicOperation):
    """y = x + b with b [size]; x [..., size]. Equivalent to `x + bias`; b initialises to zero.

    Under torch.autocast, b is cast to x's dtype (as `torch.nn.Linear` casts its bias), so
    BasicLinear → Bias gives the autocast dtype like `torch.nn.Linear` does; db has b's dtype."""

    def __init__(self, size: int, *, device=None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.size = checks.positive_int(self, "size", size)
        device, dtype = checks.param_device(self, device), checks.param_dtype(self, dtype)
        self.bias = torch.nn.Parameter(torch.empty(self.size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """b = 0, in place."""
        with torch.no_grad():
            self.bias.zero_()

    def extra_repr(self) -> str:
        return f"size={self.size}"

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        checks.check_last_dim(self, input_, self.size, "size")
        checks.check_matches_param(self, input_, self.bias)

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        return input_ + amp.cast(self.bias, input_.dtype)  # no cast outside torch.autocast

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        dbias = None
        if ctx.weight_requires_grad:
            dbias = amp.cast(reduce_to_last_dim(grad_output), self.bias.dtype)
        return grad_output, [dbias]
