"""AllReduce: sum every rank's input, the result on every rank."""

from __future__ import annotations

from torch import Tensor

from te_seq.core.context import OperationContext
from te_seq.distributed import all_reduce_sum
from te_seq.ops.basic._communication import CommunicationOp


class AllReduce(CommunicationOp):
    """y = sum over the ranks of `process_group` of x, on every rank; x [T, ...] -> y [T, ...].

    Backward: dx = dy (as TransformerEngine's AllReduce and the row-parallel linear's output
    reduction). The output is assumed to feed computation replicated on every rank (the same
    loss on every rank), so dy is the same everywhere and already the whole gradient of each
    rank's summand; an all-reduce there would count it n times.
    """

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        return all_reduce_sum(input_, self.group(ctx))

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        return grad_output, []
