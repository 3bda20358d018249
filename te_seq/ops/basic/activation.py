"""Shared machinery of the activation ops (elementwise and gated). Maths: kernels/reference.py."""

from __future__ import annotations

from torch import Tensor

from te_seq.core import checks
from te_seq.core.context import OperationContext
from te_seq.core.operation import BasicOperation
from te_seq.kernels import reference


class Activation(BasicOperation):
    """y = f(x) elementwise, f named by `act` (a key of reference.ACTIVATIONS)."""

    act: str = ""
    gated: bool = False

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        checks.check_floating(self, input_)

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        if ctx.requires_grad:
            ctx.save_for_backward(input_)
        return reference.act_forward(input_, self.act)

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        (x,) = ctx.saved_tensors
        return reference.act_backward(x, grad_output, self.act), []


class GatedActivation(Activation):
    """x = [gate, up] on the last dim (halves, or blocks of `glu_interleave_size` columns);
    y = f(gate) · up with shape [..., F] for x [..., 2F]."""

    gated = True

    def __init__(self, *, glu_interleave_size: int | None = None) -> None:
        super().__init__()
        if glu_interleave_size is not None and glu_interleave_size <= 0:
            raise ValueError(
                f"{type(self).__name__}: glu_interleave_size must be positive, got "
                f"{glu_interleave_size}"
            )
        self.glu_interleave_size = glu_interleave_size

    def extra_repr(self) -> str:
        s = self.glu_interleave_size
        return "" if s is None else f"glu_interleave_size={s}"

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        checks.check_floating(self, input_)
        checks.check_even_last_dim(self, input_, self.glu_interleave_size)

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        if ctx.requires_grad:
            ctx.save_for_backward(input_)
        return reference.glu_forward(input_, self.act, self.glu_interleave_size)

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        (x,) = ctx.saved_tensors
        dx, _ = reference.glu_backward(x, grad_output, self.act, self.glu_interleave_size)
        return dx, []
