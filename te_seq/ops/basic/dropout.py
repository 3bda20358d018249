"""Dropout: inverted dropout in training, identity in eval."""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from te_seq.core import checks
from te_seq.core.operation import BasicOperation, OperationContext


class Dropout(BasicOperation):
    """Training: y = x · m / (1 - p) with m_i ~ Bernoulli(1 - p) drawn per element per call;
    eval (or p = 0): y = x. x any shape; y the same. Equivalent in distribution to
    `torch.nn.functional.dropout(x, p, training)`. The mask m (bool, x's shape) is saved for
    backward: dx = dy · m / (1 - p).
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        if not isinstance(p, numbers.Real) or isinstance(p, bool) or not 0 <= p < 1:
            raise ValueError(f"Dropout: p must be a number in [0, 1), got {p!r}")
        self.p = float(p)

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        checks.check_floating(self, input_)

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        ctx.active = self.training and self.p > 0
        if not ctx.active:
            return input_
        keep = torch.rand_like(input_, dtype=torch.float32) >= self.p  # [..] bool
        if ctx.requires_grad:
            ctx.save_for_backward(keep)
        return self._apply_mask(input_, keep)

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        if not ctx.active:
            return grad_output, []
        (keep,) = ctx.saved_tensors
        return self._apply_mask(grad_output, keep), []

    def _apply_mask(self, t: Tensor, keep: Tensor) -> Tensor:
        """t · m / (1 - p), scaled in t's compute precision (fp32 for low-precision t)."""
        compute = t if t.dtype == torch.float64 else t.float()
        return (compute * keep * (1.0 / (1.0 - self.p))).to(t.dtype)
