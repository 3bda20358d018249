"""The schedule of graphed callables: checked before anything touches CUDA, followed at replay.

`order` lists the steps: `k` is a forward of chunk k (1-based: chunk k is `callables[k - 1]`), `-k`
its backward, `-(k + 0.5)` its delayed wgrad. `validate_schedule` resolves every entry to a
`ScheduleStep` (which microbatch of its chunk it is) or raises a `ValueError` naming the position
and the broken rule (the `_RULE_*` texts). `_ScheduleCursor` then checks every replayed step against
the schedule: the graphs share one memory pool, so they must replay in exactly the captured order.

Pure Python: this module imports neither torch nor the rest of te_seq.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class StepKind(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    WGRAD = "wgrad"


@dataclass(frozen=True)
class ScheduleStep:
    """One entry of a validated schedule.

    `chunk` is 1-based as in `order` (chunk k is `callables[k - 1]`); `microbatch` is 0-based and
    counts the forwards of that chunk: a backward or wgrad carries its forward's microbatch.
    `position` is the index of the entry in `order`.
    """

    kind: StepKind
    chunk: int
    microbatch: int
    position: int

    def __str__(self) -> str:
        return f"{self.kind.value} of chunk {self.chunk} (microbatch {self.microbatch})"


_RULE_ENTRY = "rule: entries are k, -k or -(k + 0.5) for a chunk k in 1..{n}"
_RULE_BACKWARD = (
    "rule: a chunk's backwards pair one-to-one, in order, with its earlier forwards, "
    "so a backward never comes before its forward"
)
_RULE_WGRAD_AFTER = (
    "rule: each wgrad pairs with the oldest backward of its chunk that has no wgrad yet "
    "and must come after it"
)
_RULE_WGRAD_CHUNK = (
    "rule: only chunks that delay wgrad (delay_wgrad_compute=True) take wgrad entries"
)
_RULE_COUNT = "rule: forwards and backwards of a chunk match in number"
_RULE_ONE_WGRAD = "rule: a chunk that delays wgrad needs exactly one wgrad entry per backward"
_RULE_EVERY_CHUNK = "rule: every chunk needs at least one forward and its backward"


def default_order(num_chunks: int, delays_wgrad: Sequence[bool]) -> list[float]:
    """The schedule used when `order=None`: forwards 1..N, then backwards N..1, each backward of a
    chunk that delays wgrad followed at once by its wgrad (the order of a plain layer stack, and
    torch.cuda.make_graphed_callables's)."""
    order: list[float] = list(range(1, num_chunks + 1))
    for k in range(num_chunks, 0, -1):
        order.append(-k)
        if delays_wgrad[k - 1]:
            order.append(-(k + 0.5))
    return order


def _parse_entry(position: int, entry: object, num_chunks: int) -> tuple[StepKind, int]:
    """`k` -> (FORWARD, k), `-k` -> (BACKWARD, k), `-(k + 0.5)` -> (WGRAD, k)."""
    rule = _RULE_ENTRY.format(n=num_chunks)
    is_number = isinstance(entry, numbers.Real) and not isinstance(entry, bool)
    twice = 2.0 * float(entry) if is_number else math.nan  # type: ignore[arg-type]
    if not math.isfinite(twice) or twice != round(twice) or twice == 0:
        raise ValueError(f"order[{position}] = {entry!r} is not a schedule entry ({rule})")
    halves = int(round(abs(twice)))
    if twice > 0 and halves % 2 == 1:
        raise ValueError(
            f"order[{position}] = {entry!r}: a positive entry must be a whole chunk number ({rule})"
        )
    kind = StepKind.FORWARD if twice > 0 else (
        StepKind.BACKWARD if halves % 2 == 0 else StepKind.WGRAD
    )
    chunk = halves // 2
    if not 1 <= chunk <= num_chunks:
        raise ValueError(
            f"order[{position}] = {entry!r} names chunk {chunk}, which does not exist ({rule})"
        )
    return kind, chunk


class _ScheduleState:
    """Running bookkeeping while walking `order`; raises at the first broken rule."""

    def __init__(self, delays_wgrad: Sequence[bool]) -> None:
        n = len(delays_wgrad)
        self.delays = list(delays_wgrad)
        self.forwards: list[list[int]] = [[] for _ in range(n)]  # positions, per chunk
        self.backwards: list[list[int]] = [[] for _ in range(n)]
        self.awaiting_wgrad: list[deque[tuple[int, int]]] = [deque() for _ in range(n)]

    def add(self, position: int, entry: object) -> ScheduleStep:
        kind, chunk = _parse_entry(position, entry, len(self.delays))
        c = chunk - 1
        if kind is StepKind.FORWARD:
            self.forwards[c].append(position)
            return ScheduleStep(kind, chunk, len(self.forwards[c]) - 1, position)
        if kind is StepKind.BACKWARD:
            return self._backward(position, entry, chunk)
        return self._wgrad(position, entry, chunk)

    def _backward(self, position: int, entry: object, chunk: int) -> ScheduleStep:
        c = chunk - 1
        microbatch = len(self.backwards[c])
        if microbatch >= len(self.forwards[c]):
            raise ValueError(
                f"order[{position}] = {entry!r}: backward of chunk {chunk} has no earlier forward "
                f"of chunk {chunk} left to pair with ({_RULE_BACKWARD})"
            )
        self.backwards[c].append(position)
        if self.delays[c]:
            self.awaiting_wgrad[c].append((microbatch, position))
        return ScheduleStep(StepKind.BACKWARD, chunk, microbatch, position)

    def _wgrad(self, position: int, entry: object, chunk: int) -> ScheduleStep:
        c = chunk - 1
        if not self.delays[c]:
            raise ValueError(
                f"order[{position}] = {entry!r}: chunk {chunk} does not delay wgrad, so it has no "
                f"wgrad to schedule ({_RULE_WGRAD_CHUNK})"
            )
        if not self.awaiting_wgrad[c]:
            raise ValueError(
                f"order[{position}] = {entry!r}: wgrad of chunk {chunk} comes before its backward "
                f"(every earlier backward of chunk {chunk} already has its wgrad; "
                f"{_RULE_WGRAD_AFTER})"
            )
        microbatch, _ = self.awaiting_wgrad[c].popleft()
        return ScheduleStep(StepKind.WGRAD, chunk, microbatch, position)

    def finish(self, entries: Sequence[object]) -> None:
        """End-of-schedule rules; errors name the entry left without its partner."""
        for c, (fwd, bwd) in enumerate(zip(self.forwards, self.backwards)):
            chunk = c + 1
            if not fwd:
                raise ValueError(f"order has no entry for chunk {chunk} ({_RULE_EVERY_CHUNK})")
            if len(bwd) < len(fwd):
                pos = fwd[len(bwd)]
                raise ValueError(
                    f"order[{pos}] = {entries[pos]!r}: forward of chunk {chunk} (microbatch "
                    f"{len(bwd)}) has no backward after it; chunk {chunk} has {len(fwd)} forwards "
                    f"but {len(bwd)} backwards ({_RULE_COUNT})"
                )
            if self.awaiting_wgrad[c]:
                microbatch, pos = self.awaiting_wgrad[c][0]
                raise ValueError(
                    f"order[{pos}] = {entries[pos]!r}: backward of chunk {chunk} (microbatch "
                    f"{microbatch}) has no wgrad entry after it ({_RULE_ONE_WGRAD})"
                )


def validate_schedule(
    order: Iterable[object] | None, num_chunks: int, delays_wgrad: Sequence[bool]
) -> list[ScheduleStep]:
    """Check a schedule and resolve every entry to a typed step (pure; no CUDA needed).

    `order=None` means `default_order(num_chunks, delays_wgrad)`. Every broken rule is a
    `ValueError` that names the position in `order` and the rule.
    """
    if num_chunks < 1 or len(delays_wgrad) != num_chunks:
        raise ValueError(
            f"validate_schedule: need num_chunks >= 1 and one delays_wgrad flag per chunk, got "
            f"num_chunks={num_chunks} and {len(delays_wgrad)} flags"
        )
    if order is None:
        entries: list[object] = list(default_order(num_chunks, delays_wgrad))
    elif isinstance(order, (str, bytes)) or not isinstance(order, Iterable):
        raise ValueError(f"order must be a sequence of numbers, got {type(order).__name__}")
    else:
        entries = list(order)
    state = _ScheduleState(delays_wgrad)
    steps = [state.add(position, entry) for position, entry in enumerate(entries)]
    state.finish(entries)
    return steps


class _ScheduleCursor:
    """Where the replay is in the schedule (graphs share a pool: order is a correctness matter)."""

    def __init__(self, steps: Sequence[ScheduleStep]) -> None:
        self.steps = list(steps)
        self.position = 0

    def advance(self, kind: StepKind, chunk: int, microbatch: int | None = None) -> ScheduleStep:
        step = self.steps[self.position]
        if step.kind is not kind or step.chunk != chunk or (
            microbatch is not None and step.microbatch != microbatch
        ):
            got = f"{kind.value} of chunk {chunk}" + (
                f" (microbatch {microbatch})" if microbatch is not None else ""
            )
            raise RuntimeError(
                f"graphed callables replayed out of order: the schedule expects order"
                f"[{step.position}] = {step}, but got {got}; the captured graphs share one memory "
                "pool and must run in exactly the order given to make_graphed_callables"
            )
        self.position = (self.position + 1) % len(self.steps)
        return step
