"""Reshape: y = x.reshape(shape)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq.core import checks
from te_seq.core.context import OperationContext
from te_seq.core.operation import BasicOperation


@dataclass(frozen=True)
class ReshapeSaved:
    """The input's shape, which dx takes back."""

    input_shape: torch.Size


class Reshape(BasicOperation):
    """y = x.reshape(shape) over the whole tensor (leading dims included), like `torch.reshape`;
    `shape` may hold one -1. Backward: dx = dy.reshape(x.shape). y may be a view of x."""

    # Under torch.compile the run holding it runs eagerly (its output may be a view of the run's
    # input, which dynamo's autograd.Function cannot return).
    compile_traceable = False

    def __init__(self, shape: int | Sequence[int]) -> None:
        super().__init__()
        self.shape = checks.shape_spec(self, shape)

    def extra_repr(self) -> str:
        return f"shape={self.shape}"

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        known = math.prod(d for d in self.shape if d != -1)
        numel = input_.numel()
        if -1 in self.shape:  # the inferred size must be an integer (and unique: known > 0)
            fits = known > 0 and numel % known == 0
        else:
            fits = numel == known
        if not fits:
            raise ValueError(
                f"Reshape: cannot reshape input of shape {tuple(input_.shape)} "
                f"({numel} elements) to {self.shape}"
            )

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        ctx.saved = ReshapeSaved(input_.shape)
        return input_.reshape(self.shape)

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        return grad_output.reshape(ctx.saved_as(ReshapeSaved).input_shape), []
