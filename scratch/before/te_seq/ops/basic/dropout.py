"""Dropout: inverted dropout in training, identity in eval."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq.core import checks
from te_seq.core.context import OperationContext
from te_seq.core.operation import BasicOperation


@dataclass(frozen=True)
class DropoutSaved:
    """Whether this call dropped anything (training and p > 0); if so, the mask is saved."""

    active: bool


class Dropout(BasicOperation):
    """Training: y = x · m / (1 - p) with m_i ~ Bernoulli(1 - p) drawn per element per call;
    eval (or p = 0): y = x. x any shape; y the same. Equivalent in distribution to
    `torch.nn.functional.dropout(x, p, training)`. The mask m (bool, x's shape) is saved for
    backward: dx = dy · m / (1 - p).
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = checks.real_number(self, "p", p, "a number in [0, 1)", lambda v: 0 <= v < 1)

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        checks.check_floating(self, input_)

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        active = self.training and self.p > 0
        ctx.saved = DropoutSaved(active)
        if not active:
            return input_
        keep = torch.rand_like(input_, dtype=torch.float32) >= self.p  # [..] bool
        if ctx.requires_grad:
            ctx.save_for_backward(keep)
        return self._apply_mask(input_, keep)

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        if not ctx.saved_as(DropoutSaved).active:
            return grad_output, []
        (keep,) = ctx.saved_tensors
        return self._apply_mask(grad_output, keep), []

    def _apply_mask(self, t: Tensor, keep: Tensor) -> Tensor:
        """t · m / (1 - p), scaled in t's compute precision (fp32 for low-precision t)."""
        compute = t if t.dtype == torch.float64 else t.float()
        return (compute * keep * (1.0 / (1.0 - self.p))).to(t.dtype)
