"""The one sliding-window matcher: applies registered fusions to a run of basic ops.

Joint fusions are matched first over all ops; forward and backward fusions then match the ops no
joint fusion took. Each position tries every enabled pattern in registry order; the first build
that returns a fused op wins and the scan jumps past its window; a build that declines leaves a
`PlanMiss` with its reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq.core.operation import BasicOperation, FusedOperation, FusibleOperation
from te_seq.fusion.plan import PlanMiss
from te_seq.fusion.registry import FusionPattern, NoMatch, patterns_for_phase


class Window(tuple):
    """The matched basic ops, in order, with their extra inputs and indices in the Sequential."""

    extra_inputs: tuple[tuple, ...]
    basic_op_indices: tuple[int, ...]

    def __new__(cls, ops, extra_inputs, basic_op_indices):
        window = super().__new__(cls, ops)
        window.extra_inputs = tuple(extra_inputs)
        window.basic_op_indices = tuple(basic_op_indices)
        return window


def same_extra_input(a: object, b: object) -> bool:
    """Whether two extra inputs are 'the same' for fusion decisions, without a host sync:
    the same object, or small host integer tensors (split sizes) with equal values."""
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
) -> tuple[list[Segment], list[PlanMiss]]:
    """Fused segments for one phase over the free positions (marks them taken)."""
    segments: list[Segment] = []
    misses: list[PlanMiss] = []
    patterns = patterns_for_phase(phase)
    pos = 0
    while pos < len(ops):
        span = _match_at(ops, taken, pos, patterns, extra_inputs, offset, misses)
        if span is None:
            pos += 1
            continue
        segments.append(span)
        for p in span.positions:
            taken[p] = True
        pos = span.positions[-1] + 1
    return segments, misses


def _match_at(ops, taken, pos, patterns, extra_inputs, offset, misses) -> Segment | None:
    for pattern in patterns:
        positions = tuple(range(pos, pos + len(pattern.pattern)))
        if positions[-1] >= len(ops) or any(taken[p] for p in positions):
            continue
        window_ops = [ops[p] for p in positions]
        if not pattern.matches(window_ops):
            continue
        indices = tuple(p + offset for p in positions)
        window = Window(window_ops, [extra_inputs[p] for p in positions], indices)
        result = _build(pattern, window)
        if isinstance(result, NoMatch):
            misses.append(PlanMiss(pattern.name, indices, result.reason))
            continue
        return Segment(result, positions)
    return None


def fill_unfused(ops: Sequence[BasicOperation], fused: list[Segment]) -> list[Segment]:
    """All segments of a phase in forward order: the fused ones plus one per remaining op."""
    covered = {p for seg in fused for p in seg.positions}
    singles = [Segment(op, (p,)) for p, op in enumerate(ops) if p not in covered]
    return sorted(fused + singles, key=lambda seg: seg.positions[0])
