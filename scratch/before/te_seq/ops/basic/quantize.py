"""Quantize: an explicit FP8 quantization point (identity outside te_seq.autocast)."""

from __future__ import annotations

import torch
from torch import Tensor

from te_seq.core import fp8
from te_seq.core.context import OperationContext
from te_seq.core.operation import BasicOperation
from te_seq.kernels.backend import Backend


class Quantize(BasicOperation):
    """y = x quantized as the next GEMM's input under the call's FP8 recipe; y = x without one.

    Under `te_seq.autocast(recipe=r)`, x [..., C] is quantized once along its last dimension
    with r's input blocks (and along its rows, for a wgrad). The output holds the dequantized
    values in x's dtype (exact in fp32, and in bf16/fp16 with power-of-two scales) and carries
    the quantized tensor itself (`te_seq.core.fp8.QuantizedInput`, attribute
    `_te_seq_fp8`): a BasicLinear, Linear or GroupedLinear (or the fused GroupedMLP) that gets
    it next, under the same recipe, takes those FP8 operands as they are and never quantizes
    them again. Another op sees the values only. Backward: dx = dy (straight through).
    """

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        if ctx.recipe is None:
            return input_
        fp8.check_quantizable(self, ctx.recipe, input_)
        marker = fp8.quantize_input(ctx.recipe, input_)
        out = marker.forward.dequantize().to(input_.dtype).reshape(input_.shape)
        setattr(out, fp8.QUANTIZED_ATTR, marker)
        return out

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        return grad_output, []

    def plan_note(self, backend: Backend, dtype: torch.dtype, device: torch.device) -> str:
        recipe = fp8.active_recipe()  # plans are built inside the call (and keyed on it)
        if recipe is None:
            return "no FP8 recipe: passes its input through"
        return f"quantizes for the next GEMM once ({recipe} input blocks)"
