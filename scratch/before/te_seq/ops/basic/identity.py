"""Identity: y = x."""

from __future__ import annotations

from torch import Tensor

from te_seq.core.context import OperationContext
from te_seq.core.operation import BasicOperation


class Identity(BasicOperation):
    """y = x for x of any shape; equivalent to `torch.nn.Identity()`. Backward: dx = dy."""

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        return input_

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        return grad_output, []
