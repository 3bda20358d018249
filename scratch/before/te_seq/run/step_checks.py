"""Checks of what a plan step returned against its window of basic ops.

A fused op (a user's above all) that returns one grad list too few, or drops an op's extra
output, would otherwise lose a gradient or an output silently (lists are consumed per basic op).
Each check raises a `RuntimeError` naming the op that ran the step and its basic-op indices.
The fuser checks the steps of a user's ops (classes defined outside te_seq); te_seq's own are
tested and skip the checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from te_seq.core.context import OperationContext
from te_seq.core.operation import BasicOperation, FusibleOperation


def step_label(op: FusibleOperation, indices: Sequence[int]) -> str:
    kind = "fused op" if op.is_fused_op else "op"
    return f"{type(op).__name__} ({kind} over basic ops {list(indices)})"


# Labels and messages are built only when a check fails.


def _per_op_lists(label, method: str, what: str, lists: Any, count: int) -> None:
    if not isinstance(lists, Sequence) or len(lists) != count:
        got = len(lists) if isinstance(lists, Sequence) else type(lists).__name__
        raise RuntimeError(
            f"{label()}: {method} returned {got} {what} lists, expected {count} (one per basic "
            "op, in forward order)"
        )


def checked_forward(
    op: FusibleOperation, ops: Sequence[BasicOperation], indices: Sequence[int], result: Any
) -> tuple[Tensor, Sequence[Sequence[Tensor]]]:
    """`fuser_forward`'s (output, extra outputs per basic op), checked against the ops'
    `num_extra_outputs`."""
    def label() -> str:
        return step_label(op, indices)

    if not (isinstance(result, tuple | list) and len(result) == 2):
        raise RuntimeError(f"{label()}: fuser_forward must return (output, extra outputs per op)")
    output, per_op = result
    if not isinstance(output, Tensor):
        raise RuntimeError(
            f"{label()}: fuser_forward returned a {type(output).__name__} as output, not a Tensor"
        )
    _per_op_lists(label, "fuser_forward", "extra-output", per_op, len(ops))
    for index, basic, outs in zip(indices, ops, per_op):
        if len(outs) != basic.num_extra_outputs or not all(isinstance(t, Tensor) for t in outs):
            raise RuntimeError(
                f"{label()}: fuser_forward returned {len(outs)} extra output(s) for "
                f"{type(basic).__name__} (basic op {index}), which makes "
                f"{basic.num_extra_outputs} (num_extra_outputs), each a Tensor"
            )
    return output, per_op


def checked_backward(
    op: FusibleOperation,
    ctxs: Sequence[OperationContext],
    indices: Sequence[int],
    result: Any,
    counts: tuple[Sequence[int], Sequence[int]],
    extra_needs_grad: Sequence[bool],
    input_shape: torch.Size | None,
) -> tuple[Tensor | None, Sequence, Sequence]:
    """`fuser_backward`'s (dx, param grads per op, extra-input grads per op), checked: one list
    per basic op, each holding a slot per parameter (per extra input), or empty where no such
    gradient is needed; dx None or of the input's shape (when the fuser knows it)."""
    def label() -> str:
        return step_label(op, indices)

    if not (isinstance(result, tuple | list) and len(result) == 3):
        raise RuntimeError(
            f"{label()}: fuser_backward must return (grad input, param grads per op, extra-input "
            "grads per op)"
        )
    dx, pgrads, egrads = result
    _per_op_lists(label, "fuser_backward", "parameter-gradient", pgrads, len(ctxs))
    _per_op_lists(label, "fuser_backward", "extra-input-gradient", egrads, len(ctxs))
    param_counts, extra_counts = counts
    for k, ctx in enumerate(ctxs):
        _check_slots(label, indices[k], "parameter", pgrads[k], param_counts[k],
                     ctx.weight_requires_grad)
        _check_slots(label, indices[k], "extra-input", egrads[k], extra_counts[k],
                     extra_needs_grad[k])
    if dx is not None:
        if not isinstance(dx, Tensor):
            raise RuntimeError(
                f"{label()}: fuser_backward returned a {type(dx).__name__} as grad input"
            )
        if input_shape is not None and dx.shape != input_shape:
            raise RuntimeError(
                f"{label()}: fuser_backward returned a grad input of shape {tuple(dx.shape)}, "
                f"expected the input's shape {tuple(input_shape)}"
            )
    return dx, pgrads, egrads


def _check_slots(label, index: int, what: str, grads: Any, count: int, needed: bool) -> None:
    """One basic op's gradient list: `count` slots (None allowed), or empty if none is needed."""
    size = len(grads) if isinstance(grads, Sequence) else -1
    if size == count or (size == 0 and not needed):
        return
    raise RuntimeError(
        f"{label()}: fuser_backward returned {size if size >= 0 else type(grads).__name__} "
        f"{what} gradient(s) for basic op {index}, expected {count} (one per {what}, None where "
        "there is none)"
    )
