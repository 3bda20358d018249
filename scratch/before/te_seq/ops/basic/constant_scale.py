"""ConstantScale: y = scale · x."""

from __future__ import annotations

from torch import Tensor

from te_seq.core import checks
from te_seq.core.context import OperationContext
from te_seq.core.operation import BasicOperation


class ConstantScale(BasicOperation):
    """y = scale · x for a fixed Python number `scale`; x any shape, y the same shape and dtype.
    Equivalent to `x * scale`. Backward: dx = scale · dy."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = checks.real_number(self, "scale", scale, "a real number")

    def extra_repr(self) -> str:
        return f"scale={self.scale}"

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        return input_ * self.scale

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        return grad_output * self.scale, []
