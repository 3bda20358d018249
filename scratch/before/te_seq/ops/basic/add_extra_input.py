"""AddExtraInput: y = x + extra (a residual connection)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq.core import checks
from te_seq.core.context import OperationContext
from te_seq.core.operation import BasicOperation


@dataclass(frozen=True)
class AddSaved:
    """What backward needs: shapes and dtypes only (the gradient of a sum needs no values)."""

    input_shape: torch.Size
    input_dtype: torch.dtype
    extra_shape: torch.Size
    extra_dtype: torch.dtype
    extra_requires_grad: bool


def sum_to_shape(grad: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """Reduce a gradient over the dims its tensor was broadcast along (fp32 accumulate)."""
    if grad.shape == shape:
        return grad.to(dtype)
    acc = grad if grad.dtype == torch.float64 else grad.float()
    return acc.sum_to_size(shape).to(dtype)


def can_write_into(extra: Tensor, input_: Tensor) -> bool:
    """Whether y = x + extra may be written into `extra`'s memory.

    Only when autograd does not need `extra`'s value: an `extra` that requires grad is part of
    the autograd graph, where the op that produced it may have saved it for its own backward (or
    it is a leaf, which PyTorch forbids writing into), so its memory must stay untouched. The sum
    must also fit: same shape, device and result dtype, and no broadcast (zero-stride) dims.
    """
    return (
        not extra.requires_grad
        and extra.shape == input_.shape
        and extra.device == input_.device
        and extra.dtype == torch.result_type(input_, extra)
        and all(stride != 0 or size <= 1 for stride, size in zip(extra.stride(), extra.shape))
    )


class AddExtraInput(BasicOperation):
    """y = x + extra with x [..., N] and the extra input `extra` broadcastable to x's shape;
    y has x's shape (dtype by PyTorch's type promotion). Equivalent to `x + extra`.

    Backward: dx = dy; d extra = dy summed over the dims `extra` was broadcast along.
    `in_place=True` writes the sum into `extra` (same values, one tensor less) when `extra` does
    not require grad, has y's shape and dtype (see `can_write_into`) and shares no memory with
    the rest of the Sequential call: its input, its other extra inputs (or this one given twice)
    and the parameters (`CallInputs.aliased`; an earlier op may have saved that memory for its
    backward). Otherwise it runs out of place. As with any in-place op, `extra`'s old value is
    gone afterwards.
    """

    num_extra_inputs = 1
    extra_input_names = ("extra",)

    def __init__(self, *, in_place: bool = False) -> None:
        super().__init__()
        self.in_place = checks.flag(self, "in_place", in_place)

    def extra_repr(self) -> str:
        return f"in_place={self.in_place}"

    @property
    def compile_traceable(self) -> bool:
        """Under torch.compile an in-place add runs eagerly (dynamo's autograd.Function cannot
        write into its input)."""
        return not self.in_place

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        extra = checks.check_tensor(self, "extra", extra_inputs[0])
        if extra.device != input_.device:
            raise ValueError(f"AddExtraInput: extra is on {extra.device}, input on {input_.device}")
        try:
            shape = torch.broadcast_shapes(input_.shape, extra.shape)
        except RuntimeError:
            shape = None
        if shape != input_.shape:
            raise ValueError(
                f"AddExtraInput: extra of shape {tuple(extra.shape)} does not broadcast to the "
                f"input's shape {tuple(input_.shape)}"
            )

    @staticmethod
    def save(ctx: OperationContext, input_: Tensor, extra: Tensor) -> None:
        """Fill this op's context (fused ops that run this op's forward call it too; `input_` may
        then be a stand-in with the input's shape, dtype and device)."""
        ctx.saved = AddSaved(input_.shape, input_.dtype, extra.shape, extra.dtype,
                             extra.requires_grad)

    def writes_in_place(self, ctx: OperationContext, input_: Tensor, extra: Tensor) -> bool:
        """Whether y = x + extra goes into `extra`'s memory in this call (fusions ask too)."""
        if not (self.in_place and can_write_into(extra, input_)):
            return False
        return ctx.call_inputs is None or not ctx.call_inputs.aliased(extra)

    def add(self, ctx: OperationContext, input_: Tensor, extra: Tensor) -> Tensor:
        if self.writes_in_place(ctx, input_, extra):
            return extra.add_(input_)
        return input_ + extra

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        (extra,) = basic_op_extra_inputs[0]
        self.save(basic_op_ctxs[0], input_, extra)
        return self.add(basic_op_ctxs[0], input_, extra), [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        saved = ctx.saved_as(AddSaved)
        dx = sum_to_shape(grad_output, saved.input_shape, saved.input_dtype)
        dextra = None
        if saved.extra_requires_grad:
            dextra = sum_to_shape(grad_output, saved.extra_shape, saved.extra_dtype)
        return dx, [[]], [(dextra,)]
