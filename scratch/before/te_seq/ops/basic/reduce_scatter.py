"""ReduceScatter: sum over ranks, each rank keeping its block of the first (token) dimension."""

from __future__ import annotations

from torch import Tensor

from te_seq.core.context import OperationContext
from te_seq.distributed import all_gather_rows, group_size, reduce_scatter_rows
from te_seq.ops.basic._communication import CommunicationOp


class ReduceScatter(CommunicationOp):
    """y_r = (sum over ranks of x)[r*T/n:(r+1)*T/n] on rank r of `process_group` (n ranks):
    x [T, ...] -> y [T/n, ...]; T must be divisible by n (ValueError naming the values).

    Backward is its adjoint, an all-gather: dx = cat([dy_0, ..., dy_{n-1}], dim 0) on every
    rank.
    """

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        super().pre_forward_checks(input_, extra_inputs)
        n = group_size(self.process_group)
        if input_.shape[0] % n != 0:
            raise ValueError(
                f"ReduceScatter: the first (token) dimension {input_.shape[0]} of the input "
                f"(shape {tuple(input_.shape)}) is not divisible by the group size {n}"
            )

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        return reduce_scatter_rows(input_, self.group(ctx), "ReduceScatter")

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        if not ctx.input_requires_grad:
            return None, []
        return all_gather_rows(grad_output, self.group(ctx)), []
