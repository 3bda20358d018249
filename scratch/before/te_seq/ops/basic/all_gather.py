"""AllGather: concatenate every rank's input along the first (token) dimension."""

from __future__ import annotations

from torch import Tensor

from te_seq.core.context import OperationContext
from te_seq.distributed import all_gather_rows, reduce_scatter_rows
from te_seq.ops.basic._communication import CommunicationOp


class AllGather(CommunicationOp):
    """y = cat([x_0, ..., x_{n-1}], dim 0) on every rank of `process_group` (n ranks, rank
    order): x [T, ...] -> y [n*T, ...].

    Backward is its adjoint, a reduce-scatter: dx_r = (sum over ranks of dy)[r*T:(r+1)*T]. The
    output is assumed to feed computation that differs per rank (e.g. a column-parallel
    linear), so each rank's dy is a partial gradient and the sum is the whole one.
    """

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        return all_gather_rows(input_, self.group(ctx))

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        if not ctx.input_requires_grad:
            return None, []
        return reduce_scatter_rows(grad_output, self.group(ctx), "AllGather (backward)"), []
