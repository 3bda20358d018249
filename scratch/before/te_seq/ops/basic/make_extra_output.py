"""MakeExtraOutput: y = x, and x is also returned as an extra output (a residual branch)."""

from __future__ import annotations

from torch import Tensor

from te_seq.core import checks
from te_seq.core.operation import BasicOperation


def add_grads(grad_output: Tensor | None, grad_extra: Tensor | None) -> Tensor | None:
    """dx = dy + d extra, out of place (None counts as zero)."""
    if grad_extra is None:
        return grad_output
    if grad_output is None:
        return grad_extra
    return grad_output + grad_extra


class MakeExtraOutput(BasicOperation):
    """y = x for x of any shape; x is also returned as the extra output (same values, same
    storage, a distinct tensor object so autograd tracks the two branches' gradients apart).
    In a Sequential: `y, residual = seq(x)`. Backward: dx = dy + d residual.

    `in_place=True` is accepted for TransformerEngine compatibility and gives the same values.
    te_seq never writes into gradient tensors that autograd hands it: autograd may share one
    gradient tensor between several branches (or keep it for a hook), so dx is always a new tensor.
    """

    num_extra_outputs = 1

    def __init__(self, *, in_place: bool = False) -> None:
        super().__init__()
        self.in_place = checks.flag(self, "in_place", in_place)

    def extra_repr(self) -> str:
        return f"in_place={self.in_place}"

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        return input_, [(input_.detach(),)]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        (grad_extra,) = basic_op_grad_extra_outputs[0]
        return add_grads(grad_output, grad_extra), [[]], [()]
