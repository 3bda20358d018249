"""Per-call keyword arguments of basic ops: `Sequential.forward(x, op_kwargs={index: {...}})`.

`op_kwargs` maps a basic-op index (as `basic_ops()` and the fusion plan count them) to the
keyword arguments that op's forward gets for this call, e.g. caller-provided buffers
(`{"out": buf}` for a BasicLinear). An op accepts the names in its `op_kwarg_names`; a `None`
value means "not given". The names given per op are part of the plan key: a fused op covering an
op that got keyword arguments must honour them (`honoured_op_kwargs`) or the window runs unfused
(fusion/matcher.py records why).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from te_seq.core.operation import BasicOperation

OpKwargs = Mapping[int, Mapping[str, Any]]


def split_op_kwargs(ops: Sequence[BasicOperation], op_kwargs: OpKwargs | None) -> list[dict]:
    """One dict of keyword arguments per basic op (empty for ops given none), checked.

    TypeError: `op_kwargs` not a mapping, an index not an int, an op's entry not a mapping, or a
    name the op does not accept (naming the op and the names it accepts). IndexError: an index
    outside [0, number of basic ops)."""
    per_op: list[dict] = [{} for _ in ops]
    if not op_kwargs:
        return per_op
    if not isinstance(op_kwargs, Mapping):
        raise TypeError(
            "Sequential: op_kwargs must map basic-op indices to dicts of keyword arguments, "
            f"got {type(op_kwargs).__name__}"
        )
    for index, kwargs in op_kwargs.items():
        op = ops[_checked_index(index, len(ops))]
        per_op[index] = _checked_kwargs(op, index, kwargs)
    return per_op


def _checked_index(index: object, count: int) -> int:
    if isinstance(index, bool) or not isinstance(index, numbers.Integral):
        raise TypeError(
            f"Sequential: op_kwargs keys must be basic-op indices (int), got {index!r}"
        )
    if not 0 <= index < count:
        raise IndexError(
            f"Sequential: op_kwargs names basic op {index}, but the Sequential has {count} "
            f"basic op(s) (indices 0..{count - 1}, as basic_ops() lists them)"
        )
    return int(index)


def _checked_kwargs(op: BasicOperation, index: int, kwargs: object) -> dict:
    name = f"{type(op).__name__} (basic op {index})"
    if not isinstance(kwargs, Mapping):
        raise TypeError(
            f"{name}: op_kwargs[{index}] must be a dict of keyword arguments, "
            f"got {type(kwargs).__name__}"
        )
    accepted = tuple(getattr(op, "op_kwarg_names", ()))
    unknown = [k for k in kwargs if k not in accepted]
    if unknown:
        raise TypeError(
            f"{name} got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; it "
            f"accepts {', '.join(map(repr, accepted)) if accepted else 'no keyword arguments'}"
        )
    return {k: v for k, v in kwargs.items() if v is not None}


def kwargs_signature(per_op: Sequence[Mapping[str, Any]] | None) -> tuple:
    """The part of a plan key that op keyword arguments decide: the names given per op."""
    if not per_op:
        return ()
    return tuple(tuple(sorted(kwargs)) for kwargs in per_op)

