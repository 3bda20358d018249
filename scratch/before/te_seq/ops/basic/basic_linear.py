"""BasicLinear: y = x Wᵀ, the GEMM half of a linear layer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq.core import amp, checks, fp8, fp8_gemm
from te_seq.core.context import OperationContext
from te_seq.core.grad_policy import (
    ForwardWeights,
    GradContractMixin,
    WeightGradPolicy,
    WgradRequest,
)
from te_seq.core.operation import BasicOperation
from te_seq.kernels import as_rows
from te_seq.kernels.backend import KernelNeed
from te_seq.ops.basic import _linear_buffers
from te_seq.ops.basic import _tensor_parallel as tp


@dataclass(frozen=True)
class LinearSaved:
    """What BasicLinear's backward reads besides its saved tensors (x [T, in] and W, both in the
    GEMM's compute dtype)."""

    input_shape: torch.Size  # dX is reshaped back to it
    weights: ForwardWeights  # the forward's weight, weakly held, for the gradient contract
    input_dtype: torch.dtype | None = None  # dX is cast back to it (None: the compute dtype)
    compute_dtype: torch.dtype | None = None  # dY is cast to it (None: as it comes)
    grad_input_out: Tensor | None = None  # the caller's buffer dX is written into (op_kwargs)


def init_linear_weight_(weight: Tensor) -> None:
    """Initialise like `torch.nn.Linear` (Kaiming-uniform with a = sqrt(5))."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def matmul_into(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
    """out (+)= a @ b computed in out's precision (fp32 main_grad buffers)."""
    product = a.to(out.dtype) @ b.to(out.dtype)
    if accumulate:
        out.add_(product)
    else:
        out.copy_(product)


class BasicLinear(GradContractMixin, BasicOperation):
    """y = x Wᵀ with W [out_features, in_features]; x [..., in_features] -> y [..., out_features].

    Equivalent to `torch.nn.functional.linear(x, weight)`. `accumulate_into_main_grad` and
    `delay_wgrad_compute` follow the gradient contract (docs/gradient_contract.md).

    Tensor parallelism (docs/distributed.md): `tensor_parallel_mode` "column" splits W along
    out_features, "row" along in_features, over `tensor_parallel_group` (None: the default
    group); `in_features`/`out_features` are the global sizes, the weight holds the local shard
    [local_out_features, local_in_features]; `sequence_parallel` splits the tokens (the input's
    first dim) around it.
    """

    fp8_gemms = True  # under te_seq.autocast(recipe=...) the GEMMs take FP8 operands
    op_kwarg_names = ("out", "grad_input_out")  # caller-provided buffers (_linear_buffers.py)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        accumulate_into_main_grad: bool = False,
        delay_wgrad_compute: bool = False,
        tensor_parallel_mode: str | None = None,
        tensor_parallel_group: torch.distributed.ProcessGroup | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = checks.positive_int(self, "in_features", in_features)
        self.out_features = checks.positive_int(self, "out_features", out_features)
        self.tp_layout = tp.tensor_parallel_layout(
            self, tensor_parallel_mode, tensor_parallel_group, sequence_parallel,
            self.in_features, self.out_features)
        self.grad_policy = WeightGradPolicy(
            checks.flag(self, "accumulate_into_main_grad", accumulate_into_main_grad),
            checks.flag(self, "delay_wgrad_compute", delay_wgrad_compute),
        )
        device, dtype = checks.param_device(self, device), checks.param_dtype(self, dtype)
        self.weight = torch.nn.Parameter(
            torch.empty(self.local_out_features, self.local_in_features, device=device,
                        dtype=dtype)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise W in place like `torch.nn.Linear` (Kaiming-uniform, a = sqrt(5))."""
        with torch.no_grad():
            init_linear_weight_(self.weight)

    # Tensor-parallel layout (see te_seq/ops/basic/_tensor_parallel.py): the weight's shape is
    # [local_out_features, local_in_features]; both equal the global sizes without parallelism.
    tensor_parallel_mode = property(lambda self: self.tp_layout.mode)
    tensor_parallel_group = property(lambda self: self.tp_layout.group)
    tensor_parallel_size = property(lambda self: self.tp_layout.size)
    sequence_parallel = property(lambda self: self.tp_layout.sequence_parallel)
    local_in_features = property(lambda self: self.tp_layout.local_in_features)
    local_out_features = property(lambda self: self.tp_layout.local_out_features)
    process_group = tensor_parallel_group  # what the fuser hands to the context

    def extra_repr(self) -> str:
        text = f"in_features={self.in_features}, out_features={self.out_features}"
        if self.tp_layout.mode is not None:
            text += f", tensor_parallel_mode={self.tp_layout.mode!r}, tensor_parallel_size=" \
                    f"{self.tp_layout.size}, sequence_parallel={self.tp_layout.sequence_parallel}"
        return text

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        in_name = "local_in_features" if self.tp_layout.mode == "row" else "in_features"
        checks.check_last_dim(self, input_, self.local_in_features, in_name)
        checks.check_matches_param(self, input_, self.weight)
        tp.check_token_dim(self, self.tp_layout, input_)

    def operands(self, ctx: OperationContext, x: Tensor) -> tuple[Tensor, Tensor]:
        """(x, W) in the GEMM's compute dtype: the autocast dtype under torch.autocast (as
        `torch.nn.functional.linear` there), else as they are (fusions call this too)."""
        if ctx.autocast is None:
            return x, self.weight
        dtype = amp.gemm_dtype(ctx.autocast, x, self.weight)
        return amp.cast(x, dtype), amp.cast(self.weight, dtype)

    def kernel_needs(self) -> list[KernelNeed]:
        """None without an FP8 recipe (a pure PyTorch op). Under one, its forward and dgrad
        GEMMs (each a one-group GEMM) ask for a backend like GroupedLinear's, so on CUDA the
        torch backend can run the forward in FP8 (core/fp8_gemm.py)."""
        if fp8.active_recipe() is None:
            return []
        k, n = self.local_in_features, self.local_out_features
        return fp8.with_recipe([KernelNeed("grouped_mm", {"k": k, "n": n}),
                                KernelNeed("grouped_mm", {"k": n, "n": k})], grouped=False)

    def op_forward(
        self, ctx: OperationContext, input_: Tensor, *, out: Tensor | None = None,
        grad_input_out: Tensor | None = None,
    ) -> Tensor:
        if out is not None or grad_input_out is not None:  # caller-provided buffers
            return _linear_buffers.forward_with_buffers(self, ctx, input_, out, grad_input_out)
        if ctx.recipe is not None:
            return self._fp8_forward(ctx, input_)
        if tp.overlaps(self.tp_layout):  # sequence parallel: the collective overlaps the GEMM
            return tp.overlapped_forward(self, ctx, input_)
        full = tp.gather_input(self.tp_layout, ctx, input_)  # all tokens (column + seq. par.)
        x, w = self.operands(ctx, as_rows(full, self.local_in_features))  # [T, in], [out, in]
        y = x @ w.t()  # [T, out]
        if full is not input_:  # column + seq. par.: save this rank's rows, gathered in backward
            x = self.operands(ctx, as_rows(input_, self.local_in_features))[0]
        self.save(ctx, x, full.shape, w, input_.dtype)
        y = y.reshape(*full.shape[:-1], self.local_out_features)
        return tp.reduce_output(self.tp_layout, ctx, y)  # row: summed over the group

    def _fp8_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        """y = Q(x) Q(W)ᵀ under the call's FP8 recipe (core/fp8.py); x, W kept for the grads."""
        if self.tp_layout.mode is not None and self.tp_layout.size > 1:
            raise RuntimeError(
                f"BasicLinear: FP8 recipe {type(ctx.recipe).__name__} with "
                f"tensor_parallel_mode={self.tp_layout.mode!r} is not supported yet"
            )
        x, w = self.operands(ctx, as_rows(input_, self.in_features))  # [T, in], [out, in]
        # y in x's dtype (the GEMM's usual output dtype); x along T, W along N for backward
        y, x, w = fp8_gemm.linear_forward(self, ctx, input_, x, w, [self.weight])
        self.save(ctx, x, input_.shape, w, input_.dtype)
        return y.reshape(*input_.shape[:-1], self.out_features)

    def save(self, ctx: OperationContext, x: Tensor, input_shape: torch.Size,
             weight: Tensor | None = None, input_dtype: torch.dtype | None = None) -> None:
        """Fill this op's context for backward from x [T, in] (the input as rows) and the weight
        as the GEMM used it (default: the parameter): the one definition of what BasicLinear's
        forward saves, which forward fusions call too.

        Saves x for wgrad and W for dgrad (each only when that gradient is needed), and a
        `LinearSaved` with the input shape and dtype (`input_dtype`, default x's) and the
        forward's weight (the gradient contract targets the Parameter this forward used, weakly
        held).
        """
        if not ctx.requires_grad:
            return
        weight = self.weight if weight is None else weight
        ctx.save_for_backward(
            x if ctx.weight_requires_grad else None,
            weight if ctx.input_requires_grad else None,
        )
        ctx.saved = LinearSaved(
            input_shape, ForwardWeights.take("BasicLinear", [("weight", self.weight)]),
            input_dtype or x.dtype, x.dtype,
        )

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        x, weight = ctx.saved_tensors
        x = tp.gather_saved_input(self.tp_layout, ctx, x)  # column + seq. par.: all tokens
        grad_output = tp.gather_grad_output(self.tp_layout, ctx, grad_output)  # row + seq. par.
        dy = dy_wgrad = self.grad_rows(ctx, grad_output)  # [T, out]
        if ctx.recipe is not None:  # FP8: dy along out for dgrad, along tokens for wgrad
            dy, dy_wgrad = fp8.grad_operands(ctx.recipe, dy, [(0, dy.shape[0])])
        dx = None
        if ctx.input_requires_grad:
            saved = ctx.saved_as(LinearSaved)
            if saved.grad_input_out is not None:  # the caller's buffer (op_kwargs)
                reduce = lambda d: tp.reduce_grad_input(self.tp_layout, ctx, d)  # noqa: E731
                return (_linear_buffers.dgrad_into(self, ctx, saved, dy, weight, reduce),
                        self.weight_grads(ctx, x, dy_wgrad))
            dx = amp.cast((dy @ weight).reshape(saved.input_shape), saved.input_dtype)  # dX = dY W
            dx = tp.reduce_grad_input(self.tp_layout, ctx, dx)  # column: summed over the group
        return dx, self.weight_grads(ctx, x, dy_wgrad)

    def grad_rows(self, ctx: OperationContext, grad_output: Tensor) -> Tensor:
        """dY as rows [T, out] in the forward GEMM's compute dtype (fusions call this too)."""
        dy = grad_output.reshape(-1, self.local_out_features)
        if ctx.autocast is None:
            return dy
        return amp.cast(dy, ctx.saved_as(LinearSaved).compute_dtype)

    def weight_grads(self, ctx: OperationContext, x: Tensor, dy: Tensor) -> list[Tensor | None]:
        """What autograd gets for `weight` (fusions call this too): the contract decides."""
        if not ctx.weight_requires_grad:
            return [None]
        weights = ctx.saved_as(LinearSaved).weights
        if not weights.any_needs_grad:
            return [None]
        return self.grad_policy.backward(self.wgrad_request(weights, x, dy))

    def wgrad_request(self, weights: ForwardWeights, x: Tensor, dy: Tensor) -> WgradRequest:
        """dW = dYᵀ X, computed now or in backward_dw() per the gradient contract."""
        return WgradRequest(
            weights,
            compute=lambda: [dy.t() @ x],
            compute_into=lambda outs, acc: matmul_into(outs[0], dy.t(), x, acc),
        )
