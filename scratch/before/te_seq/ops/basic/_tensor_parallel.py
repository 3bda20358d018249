"""Tensor parallelism of BasicLinear (TransformerEngine's meaning), kept out of its maths.

With n ranks in the tensor-parallel group, y = x Wᵀ, W [out, in] (global sizes):

- "column": W split along out_features, each rank holds W_r [out/n, in] and computes
  y_r = x W_rᵀ [T, out/n] (its block of y's columns). dx = Σ_r dy_r W_r is summed over the group
  (all-reduce). With `sequence_parallel`, each rank's input is its block of T/n tokens: the
  forward all-gathers x along the token dim first and the backward reduce-scatters dx.
- "row": W split along in_features, each rank holds W_r [out, in/n] and its block of x's
  columns x_r [T, in/n]; y = Σ_r x_r W_rᵀ is all-reduced (every rank gets all of y), or
  reduce-scattered along the token dim with `sequence_parallel` (each rank gets T/n rows of y;
  the backward all-gathers dy).

The token dim is the input's first dimension. dW_r = dy_rᵀ x (column) or dyᵀ x_r (row): each
rank's weight gradient is that of its own shard, complete (no reduction over the group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from te_seq import config
from te_seq.core import checks
from te_seq.core.context import OperationContext
from te_seq.distributed import (
    all_gather_rows,
    all_reduce_sum,
    group_size,
    reduce_scatter_rows,
    resolve_group,
)
from te_seq.distributed.overlap import all_gather_matmul, matmul_reduce_scatter

MODES = ("column", "row")


@dataclass(frozen=True)
class TensorParallel:
    """A linear's tensor-parallel layout: mode None (not parallel), "column" or "row"."""

    mode: str | None
    group: dist.ProcessGroup | None
    size: int
    sequence_parallel: bool
    local_in_features: int
    local_out_features: int

    def __deepcopy__(self, memo: dict) -> TensorParallel:
        # A copied module (copy.deepcopy) communicates on the same group: process groups cannot
        # be copied, and a copy of one would not be a group of the same ranks anyway.
        return self


def tensor_parallel_layout(op: object, mode: object, group: object, sequence_parallel: object,
                           in_features: int, out_features: int) -> TensorParallel:
    """Check the options and shard the global sizes (TransformerEngine's rules: a group of one
    rank means no parallelism; group None is the default group)."""
    name = checks.op_name(op)
    sequence_parallel = checks.flag(op, "sequence_parallel", sequence_parallel)
    if mode is None:
        if group is not None or sequence_parallel:
            raise ValueError(
                f"{name}: tensor_parallel_group and sequence_parallel=True need a "
                f"tensor_parallel_mode ('column' or 'row'), got tensor_parallel_mode=None"
            )
        return TensorParallel(None, None, 1, False, in_features, out_features)
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"{name}: tensor_parallel_mode must be None, 'column' or 'row', got "
                         f"{mode!r}")
    group = resolve_group(name, group)
    size = group_size(group)
    if size == 1:
        return TensorParallel(None, None, 1, False, in_features, out_features)
    split, what = (out_features, "out_features") if mode == "column" else (in_features,
                                                                          "in_features")
    if split % size != 0:
        raise ValueError(
            f"{name}: tensor_parallel_mode={mode!r} splits {what}={split} over the group's "
            f"{size} ranks; it must be divisible by {size}"
        )
    local_in = in_features // size if mode == "row" else in_features
    local_out = out_features // size if mode == "column" else out_features
    return TensorParallel(mode, group, size, sequence_parallel, local_in, local_out)


def check_token_dim(op: object, layout: TensorParallel, input_: Tensor) -> None:
    """Sequence parallel moves tokens along the input's first dim (it needs one besides the
    features); row + sequence parallel reduce-scatters the output there: it must divide."""
    if layout.sequence_parallel and input_.dim() < 2:
        raise ValueError(
            f"{checks.op_name(op)}: sequence_parallel needs an input with a token dimension "
            f"before the features, got shape {tuple(input_.shape)}"
        )
    if layout.mode == "row" and layout.sequence_parallel and input_.shape[0] % layout.size:
        raise ValueError(
            f"{checks.op_name(op)}: row-parallel with sequence_parallel reduce-scatters the output "
            f"along the first (token) dimension, whose size {input_.shape[0]} (input shape "
            f"{tuple(input_.shape)}) is not divisible by the group size {layout.size}"
        )


def overlaps(layout: TensorParallel) -> bool:
    """Whether forward runs the GEMM overlapped with its collective (sequence parallel only: the
    other layouts have no collective on the GEMM's input or output rows to overlap)."""
    return layout.sequence_parallel and config.tensor_parallel_overlap()


def overlapped_forward(linear, ctx: OperationContext, input_: Tensor) -> Tensor:
    """y = x Wᵀ of a sequence-parallel linear with its all-gather (column) or reduce-scatter (row)
    overlapped with the GEMM; the same values and saved state as the plain forward. The token
    dim is input_'s first: its other leading dims ride along inside each row block."""
    layout = linear.tp_layout
    lead = input_.shape[1:-1]
    per_token = max(lead.numel(), 1)
    x, w = linear.operands(ctx, input_.reshape(-1, layout.local_in_features))  # [T, K], [N, K]
    if layout.mode == "column":  # saves this rank's rows x, gathered again in backward
        x_all, y = all_gather_matmul(x, w.t(), ctx.process_group)
        full_shape = torch.Size((x_all.shape[0] // per_token, *lead, layout.local_in_features))
    else:
        y = matmul_reduce_scatter(x, w.t(), ctx.process_group,
                                  "BasicLinear (row, sequence parallel)")
        full_shape = input_.shape
    linear.save(ctx, x, full_shape, w, input_.dtype)
    return y.reshape(y.shape[0] // per_token, *lead, layout.local_out_features)


def gather_input(layout: TensorParallel, ctx: OperationContext, x: Tensor) -> Tensor:
    """The GEMM's input: x, all-gathered along the token dim for column + sequence parallel."""
    if layout.mode == "column" and layout.sequence_parallel:
        return all_gather_rows(x, ctx.process_group)
    return x


def reduce_output(layout: TensorParallel, ctx: OperationContext, y: Tensor) -> Tensor:
    """Row parallel sums the partial products over the group (y is the GEMM's fresh output)."""
    if layout.mode != "row":
        return y
    if layout.sequence_parallel:
        return reduce_scatter_rows(y, ctx.process_group, "BasicLinear (row, sequence parallel)")
    return all_reduce_sum(y, ctx.process_group, in_place=True)


def gather_saved_input(layout: TensorParallel, ctx: OperationContext,
                       x: Tensor | None) -> Tensor | None:
    """Column + sequence parallel saves only this rank's input rows (as TransformerEngine: 1/n
    of the memory); the weight gradient needs every rank's, gathered again here."""
    if x is None or not (layout.mode == "column" and layout.sequence_parallel):
        return x
    return all_gather_rows(x, ctx.process_group)


def gather_grad_output(layout: TensorParallel, ctx: OperationContext, dy: Tensor) -> Tensor:
    """dY of the GEMM: all-gathered along the token dim for row + sequence parallel."""
    if layout.mode == "row" and layout.sequence_parallel:
        return all_gather_rows(dy, ctx.process_group)
    return dy


def reduce_grad_input(layout: TensorParallel, ctx: OperationContext, dx: Tensor) -> Tensor:
    """Column parallel: each rank's dx is the part of its output columns; sum over the group
    (reduce-scatter back to the rank's tokens under sequence parallel)."""
    if layout.mode != "column":
        return dx
    if layout.sequence_parallel:
        return reduce_scatter_rows(dx, ctx.process_group, "BasicLinear (column backward)")
    return all_reduce_sum(dx, ctx.process_group, in_place=True)
