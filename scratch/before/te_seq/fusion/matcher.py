"""The one sliding-window matcher: applies registered fusions to a run of basic ops.

Joint fusions are matched first over all ops; forward and backward fusions then match the ops no
joint fusion took. Each position tries every enabled pattern in registry order; the first build
that returns a fused op wins and the scan jumps past its window; a build that declines leaves a
`PlanMiss` with its reason.

Subclasses: a pattern element matches by `isinstance`, with one guard (`overridden_maths`): a
fusion implements the maths of the class it was written for, so an op whose class overrides that
maths (`MATHS_METHODS`) does not match unless the overriding class declares `fusion_safe = True`;
the window then runs unfused and the plan has a `PlanMiss` naming the class and the methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq.core import fp8
from te_seq.core.operation import (
    BasicOperation,
    FusedOperation,
    FusibleOperation,
    is_te_seq_class,
)
from te_seq.fusion.plan import PlanMiss
from te_seq.fusion.registry import FusionPattern, NoMatch, OpClass, patterns_for_phase

# The methods that define an op's maths. Any of them counts, whatever the fusion's phase: a
# forward fusion fills the contexts the op's own backward reads, and a backward fusion reads the
# contexts the op's own forward filled, so an override of either half can break the other.
MATHS_METHODS = ("op_forward", "op_backward", "fuser_forward", "fuser_backward")


class Window(tuple):
    """The matched basic ops, in order, with their extra inputs and indices in the Sequential,
    and the names of the keyword arguments (op_kwargs) each got for the call."""

    extra_inputs: tuple[tuple, ...]
    basic_op_indices: tuple[int, ...]
    op_kwarg_names: tuple[frozenset[str], ...]

    def __new__(cls, ops, extra_inputs, basic_op_indices, op_kwargs=None):
        window = super().__new__(cls, ops)
        window.extra_inputs = tuple(extra_inputs)
        window.basic_op_indices = tuple(basic_op_indices)
        window.op_kwarg_names = tuple(
            frozenset(kwargs) for kwargs in (op_kwargs or [{} for _ in ops])
        )
        return window


def same_extra_input(a: object, b: object) -> bool:
    """Whether two extra inputs are 'the same' for fusion decisions, without a host sync:
    the same object, or small host integer tensors (split sizes) with equal values. Slots bound
    to the same channel publication hold one shared ChannelRef (core/channels.py), so they are
    the same object: a structural fact, known when the plan is built."""
    if a is b:
        return True
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        return False
    small_host_ints = all(
        t.device.type == "cpu" and not t.is_floating_point() and t.numel() <= 4096 for t in (a, b)
    )
    return small_host_ints and a.shape == b.shape and bool(torch.equal(a, b))


@dataclass(frozen=True)
class Segment:
    """A span of local basic-op positions run by one op (basic or fused)."""

    op: FusibleOperation
    positions: tuple[int, ...]


def fused_maths_class(cls: type, element: type) -> type:
    """The class whose maths a fusion written for the pattern class `element` runs for an op of
    class `cls`: the nearest class in `cls`'s MRO that is `element` itself or one of te_seq's own
    subclasses of it (te_seq's classes are what the built-in fusions implement, e.g. ScaledSwiGLU
    for a pattern naming Activation)."""
    return next(
        c for c in cls.__mro__ if c is element or (issubclass(c, element) and is_te_seq_class(c))
    )


def _resolve(cls: type, name: str) -> tuple[type, object]:
    """(the class in `cls`'s MRO that defines `name`, the raw attribute it holds)."""
    owner = next(c for c in cls.__mro__ if name in c.__dict__)
    return owner, owner.__dict__[name]


def overridden_maths(cls: type, base: type) -> list[str]:
    """The maths methods that `cls` resolves differently from `base`, except those defined by a
    class that declares `fusion_safe = True` in its own body (a subclass that overrides the
    maths again must declare it again)."""
    out = []
    for name in MATHS_METHODS:
        owner, attr = _resolve(cls, name)
        if attr is not _resolve(base, name)[1] and owner.__dict__.get("fusion_safe") is not True:
            out.append(name)
    return out


def _unsafe_subclass(op: BasicOperation, element: OpClass) -> str | None:
    """Why `op` must not match the pattern element (None when it may): every alternative of the
    element that `op` is an instance of has maths overridden by `op`'s class."""
    why = None
    for alt in element if isinstance(element, tuple) else (element,):
        if not isinstance(op, alt):
            continue
        base = fused_maths_class(type(op), alt)
        overridden = overridden_maths(type(op), base)
        if not overridden:
            return None
        why = why or (
            f"{type(op).__name__} overrides {', '.join(overridden)} of {base.__name__}: the "
            f"fusion would run {base.__name__}'s maths (declare `fusion_safe = True` on "
            f"{type(op).__name__} if the fused maths is still right)"
        )
    return why


def subclass_miss(pattern: FusionPattern, ops: Sequence[BasicOperation]) -> str | None:
    """The reason a matched window may not fuse because of op subclasses (None if it may)."""
    reasons = [_unsafe_subclass(op, el) for op, el in zip(ops, pattern.pattern)]
    found = [r for r in reasons if r]
    return "; ".join(found) if found else None


def _build(pattern: FusionPattern, window: Window) -> FusedOperation | NoMatch:
    result = pattern.build(window)
    if isinstance(result, NoMatch | FusedOperation):
        return result
    raise TypeError(
        f"fusion {pattern.name!r} returned {type(result).__name__}; a build function must return "
        "a FusedOperation or te_seq.NoMatch(reason)"
    )


def match_phase(
    ops: Sequence[BasicOperation],
    taken: list[bool],
    phase: str,
    extra_inputs: Sequence[tuple],
    offset: int,
    op_kwargs: Sequence[dict] | None = None,
) -> tuple[list[Segment], list[PlanMiss]]:
    """Fused segments for one phase over the free positions (marks them taken). `op_kwargs`:
    the call's keyword arguments per op (run/op_kwargs.py; None: none given)."""
    segments: list[Segment] = []
    misses: list[PlanMiss] = []
    patterns = patterns_for_phase(phase)
    inputs = (extra_inputs, op_kwargs or [{} for _ in ops])
    pos = 0
    while pos < len(ops):
        span = _match_at(ops, taken, pos, patterns, inputs, offset, misses)
        if span is None:
            pos += 1
            continue
        segments.append(span)
        for p in span.positions:
            taken[p] = True
        pos = span.positions[-1] + 1
    return segments, misses


def _match_at(ops, taken, pos, patterns, inputs, offset, misses) -> Segment | None:
    extra_inputs, op_kwargs = inputs
    for pattern in patterns:
        positions = tuple(range(pos, pos + len(pattern.pattern)))
        if positions[-1] >= len(ops) or any(taken[p] for p in positions):
            continue
        window_ops = [ops[p] for p in positions]
        if not pattern.matches(window_ops):
            continue
        indices = tuple(p + offset for p in positions)
        unsafe = subclass_miss(pattern, window_ops)
        if unsafe:
            misses.append(PlanMiss(pattern.name, indices, unsafe))
            continue
        window = Window(window_ops, [extra_inputs[p] for p in positions], indices,
                        [op_kwargs[p] for p in positions])
        result = _build(pattern, window)
        if isinstance(result, FusedOperation):
            result = _fp8_checked(result, window_ops)
        if isinstance(result, FusedOperation):
            result = _kwargs_checked(result, window)
        if isinstance(result, NoMatch):
            misses.append(PlanMiss(pattern.name, indices, result.reason))
            continue
        return Segment(result, positions)
    return None


def _fp8_checked(fused: FusedOperation, ops) -> FusedOperation | NoMatch:
    """Under an FP8 recipe, a fused op over ops with FP8 GEMMs (`fp8_gemms`) must run them
    itself (its class declares `fp8_gemms = True`); otherwise it would run them unquantized, so
    the window runs unfused (the plan cache key holds the recipe)."""
    recipe = fp8.active_recipe()
    if recipe is None or getattr(type(fused), "fp8_gemms", False):
        return fused
    if not any(getattr(op, "fp8_gemms", False) for op in ops):
        return fused
    return NoMatch(f"FP8 recipe {recipe}: {type(fused).__name__} has no FP8 GEMMs, so its ops "
                   "run unfused")


def _kwargs_checked(fused: FusedOperation, window: Window) -> FusedOperation | NoMatch:
    """A fused op over ops that got keyword arguments (caller-provided buffers...) for this call
    must honour them (its class's `honoured_op_kwargs` names them); otherwise it would silently
    drop them, so the window runs unfused (the plan cache key holds the names given)."""
    honoured = frozenset(getattr(type(fused), "honoured_op_kwargs", ()))
    missed = [
        f"basic op {index} got {', '.join(sorted(names - honoured))}"
        for index, names in zip(window.basic_op_indices, window.op_kwarg_names)
        if names - honoured
    ]
    if not missed:
        return fused
    return NoMatch(f"{'; '.join(missed)} (op_kwargs) that {type(fused).__name__} does not "
                   "honour, so its ops run unfused")


def fill_unfused(ops: Sequence[BasicOperation], fused: list[Segment]) -> list[Segment]:
    """All segments of a phase in forward order: the fused ones plus one per remaining op."""
    covered = {p for seg in fused for p in seg.positions}
    singles = [Segment(op, (p,)) for p, op in enumerate(ops) if p not in covered]
    return sorted(fused + singles, key=lambda seg: seg.positions[0])
