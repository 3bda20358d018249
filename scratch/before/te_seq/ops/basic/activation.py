"""Shared machinery of the activation ops (elementwise and gated).

The maths is named, not written, here: `act` is a key of the activation table
(te_seq/kernels/activations.py), and the step's backend (`ctx.backend`) runs it. The fusions
match these two base classes, so a new activation op is a subclass with a new `act`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_seq.core import checks
from te_seq.core.context import OperationContext
from te_seq.core.operation import BasicOperation, no_value_checks
from te_seq.kernels.activations import ACTIVATIONS, GluSpec
from te_seq.kernels.backend import KernelNeed


class Activation(BasicOperation):
    """y = f(x) elementwise, f named by `act` (a key of te_seq.kernels.activations.ACTIVATIONS).

    `row_scales`: the op takes one extra input, a scale per row that multiplies y (a gated
    activation's router probabilities); the fusions know that contract and no other extra input.
    """

    act: str = ""
    gated: bool = False
    row_scales: bool = False

    def __init__(self, *, cache_quantized_input: bool = False) -> None:
        super().__init__()
        self.cache_quantized_input = refuse_cached_quantized_input(self, cache_quantized_input)

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        checks.check_floating(self, input_)

    value_checks = no_value_checks  # its checks read only the call's signature

    def kernel_needs(self) -> list[KernelNeed]:
        if self.act not in ACTIVATIONS:  # a user op with its own maths: nothing to choose
            return []
        facts = {"act": self.act}
        return [KernelNeed("act_forward", facts), KernelNeed("act_backward", facts)]

    def plan_facts(self) -> tuple:
        return (self.act,)

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        if ctx.requires_grad:
            ctx.save_for_backward(input_)
        return ctx.backend.act_forward(input_, self.act)

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        (x,) = ctx.saved_tensors
        return ctx.backend.act_backward(x, grad_output, self.act), []


def refuse_cached_quantized_input(op: object, value: object) -> bool:
    """TransformerEngine's `cache_quantized_input` (keep the activation's input FP8-quantized for
    backward). te_seq's activations save their input in its own dtype, under an FP8 recipe too
    (recipes quantize GEMM operands only), so only False is accepted: True would otherwise be
    a setting that silently does nothing."""
    if checks.flag(op, "cache_quantized_input", value):
        raise ValueError(
            f"{checks.op_name(op)}: cache_quantized_input=True is not supported: te_seq's "
            "activations save their input in its own dtype (FP8 recipes quantize GEMM operands "
            "only, docs/fp8.md); leave it False"
        )
    return False


_GLU_SPECS: dict[tuple, GluSpec] = {}  # (act, glu_interleave_size) -> its GluSpec


class GatedActivation(Activation):
    """x = [gate, up] on the last dim (halves, or blocks of `glu_interleave_size` columns);
    y = f(gate) · up with shape [..., F] for x [..., 2F]."""

    gated = True

    def __init__(
        self, *, glu_interleave_size: int | None = None, cache_quantized_input: bool = False
    ) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input)
        self.glu_interleave_size = checks.optional_positive_int(
            self, "glu_interleave_size", glu_interleave_size
        )

    @property
    def glu_spec(self) -> GluSpec:
        """The activation and column layout, as the GLU kernels take them (one shared frozen
        record per pair: building and checking one costs ~1 µs of every fused forward)."""
        key = (self.act, self.glu_interleave_size)
        if torch.compiler.is_compiling():  # a memo read while tracing would become a guard
            return GluSpec(*key)  # that the next eager call breaks (a recompile)
        spec = _GLU_SPECS.get(key)
        if spec is None:
            spec = _GLU_SPECS[key] = GluSpec(*key)
        return spec

    def extra_repr(self) -> str:
        s = self.glu_interleave_size
        return "" if s is None else f"glu_interleave_size={s}"

    def kernel_needs(self) -> list[KernelNeed]:
        if self.act not in ACTIVATIONS:
            return []
        facts = {"glu": self.glu_spec}
        return [KernelNeed("glu_forward", facts), KernelNeed("glu_backward", facts)]

    def plan_facts(self) -> tuple:
        return (self.act, self.glu_interleave_size)

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        checks.check_floating(self, input_)
        checks.check_even_last_dim(self, input_, self.glu_interleave_size)

    value_checks = no_value_checks  # its checks read only the call's signature

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        if ctx.requires_grad:
            ctx.save_for_backward(input_)
        return ctx.backend.glu_forward(input_, self.glu_spec)

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        (x,) = ctx.saved_tensors
        dx, _ = ctx.backend.glu_backward(x, grad_output, self.glu_spec)
        return dx, []
