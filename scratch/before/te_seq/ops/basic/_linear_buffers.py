"""BasicLinear's caller-provided buffers (`op_kwargs`): `out=` and `grad_input_out=`.

- `out` [..., out_features] in the GEMM's output dtype: the forward writes y = x Wᵀ into it and
  returns it (the very tensor: same storage). Without tensor parallelism or an FP8 recipe the
  GEMM writes straight into it (no temporary); otherwise y is computed and copied in.
- `grad_input_out` [same shape, dtype, device as the input]: the backward writes dX = dY W into
  it and hands it to autograd as the input's gradient. Given only when the input needs a
  gradient (else no backward would write it: refused rather than silently left untouched).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import Tensor

from te_seq.core import buffers
from te_seq.core.context import OperationContext
from te_seq.kernels import as_rows

# `op` below is a BasicLinear and `saved` its LinearSaved record (not imported: basic_linear.py
# imports this module, and the ops package allows no import circles).
BasicLinear = Any
LinearSaved = Any


def forward_with_buffers(
    op: BasicLinear, ctx: OperationContext, input_: Tensor, out: Tensor | None,
    grad_input_out: Tensor | None,
) -> Tensor:
    """BasicLinear's forward writing y into `out` (when given) and recording `grad_input_out`
    (when given) for its backward; returns y (`out` itself when given)."""
    if grad_input_out is not None:
        _check_grad_input_out(op, ctx, input_, grad_input_out)
    if out is None:
        y = op.op_forward(ctx, input_)
    elif ctx.recipe is None and op.tp_layout.mode is None:
        y = _gemm_into(op, ctx, input_, out)
    else:  # FP8 or tensor parallel: their own paths, then one copy
        y = op.op_forward(ctx, input_)
        buffers.check_buffer(op, "out", out, y.shape, y.dtype, y.device, (("input", input_),))
        y = buffers.copy_into(out, y)
    if grad_input_out is not None and ctx.requires_grad:
        ctx.saved = replace(ctx.saved, grad_input_out=grad_input_out)
    return y


def _gemm_into(op: BasicLinear, ctx: OperationContext, input_: Tensor, out: Tensor) -> Tensor:
    """y = x Wᵀ written into `out`: the plain forward (no tensor parallelism, no FP8)."""
    x, w = op.operands(ctx, as_rows(input_, op.in_features))  # [T, in], [out, in]
    shape = (*input_.shape[:-1], op.out_features)
    buffers.check_buffer(op, "out", out, shape, x.dtype, x.device,
                         (("input", input_), ("weight", op.weight)))
    buffers.gemm_into(out, x, w.t())
    op.save(ctx, x, input_.shape, w, input_.dtype)
    return out


def _check_grad_input_out(
    op: BasicLinear, ctx: OperationContext, input_: Tensor, grad_input_out: Tensor
) -> None:
    if not ctx.input_requires_grad:
        raise ValueError(
            f"{type(op).__name__}: grad_input_out= was given but the op's input needs no "
            "gradient in this call, so no backward would write it"
        )
    buffers.check_buffer(op, "grad_input_out", grad_input_out, input_.shape, input_.dtype,
                         input_.device, (("input", input_), ("weight", op.weight)))


def dgrad_into(op: BasicLinear, ctx: OperationContext, saved: LinearSaved, dy: Tensor,
               weight: Tensor, reduce) -> Tensor:
    """dX = dY W written into the forward's `grad_input_out` (returned). Without tensor
    parallelism the GEMM writes straight into it; otherwise `reduce` (the group sum) runs
    first and the result is copied in."""
    buffer = saved.grad_input_out
    if op.tp_layout.mode is None:
        return buffers.gemm_into(buffer, dy, weight)
    dx = (dy @ weight).reshape(saved.input_shape).to(saved.input_dtype)
    return buffers.copy_into(buffer, reduce(dx))
