"""CUDA graphs of te_seq modules with pipeline schedules and delayed-wgrad graphs (API.md §5).

`make_graphed_callables(callables, sample_args, order=...)` captures, in one memory pool and in the
order of the schedule, one forward graph and one backward graph per (chunk, microbatch) and, for
chunks whose ops delay their weight gradient, one wgrad graph per (chunk, microbatch) that replays
`module.backward_dw()`. The returned `GraphedCallable`s replay them: calling one copies the inputs
into static buffers and replays a forward graph inside an autograd node whose backward replays the
matching backward graph; `.backward_dw()` replays the wgrad graph of the oldest backward of that
chunk whose wgrad has not run yet.

Schedule (`order`): `k` is a forward of chunk k (1-based: chunk k is `callables[k - 1]`), `-k` its
backward, `-(k + 0.5)` its delayed wgrad. `validate_schedule` is pure and runs before anything
touches CUDA. Graphs share one pool, so they must replay in exactly the captured order (a later
capture may reuse memory that an earlier graph no longer needed *in that order*); the returned
callables check every call against the schedule and raise `RuntimeError` on a step out of order.

Gradients behave as in eager mode (API.md §4):
- wgrads returned to autograd (default path, and the dummies of the `grad_added_to_main_grad`
  path) come out of the backward graph as static tensors and are accumulated into `.grad` by
  autograd (never stolen: the static tensor stays owned by the graph);
- `main_grad` accumulation is captured in place, so the graphs keep writing the `main_grad`
  tensor that existed at capture time; `overwrite_main_grad` and `zero_out_wgrad` are read at
  capture time;
- `grad_added_to_main_grad = True` (a Python-side effect a graph cannot replay) is recorded at
  capture and set again after every replay of the graph that set it;
- delayed wgrads without `main_grad` are captured into a static buffer per parameter and added
  into `.grad` (set when None) after each wgrad replay, as `backward_dw()` does eagerly.
Warm-up runs real forward/backward/backward_dw iterations; `.grad`, `main_grad` and the flags
are restored afterwards, so capturing leaves no trace in the gradients.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "GraphedCallable",
    "ScheduleStep",
    "StepKind",
    "default_order",
    "make_graphed_callables",
    "module_delays_wgrad",
    "validate_schedule",
]


# ================================================================================================
# The schedule: pure, CPU-only, validated before anything touches CUDA
# ================================================================================================

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


# ================================================================================================
# What the modules look like to us (duck-typed: this file imports nothing of te_seq's core)
# ================================================================================================

def module_delays_wgrad(module: torch.nn.Module) -> bool:
    """A chunk delays wgrad when one of its (sub)modules has `delay_wgrad_compute == True`."""
    return any(getattr(m, "delay_wgrad_compute", False) is True for m in module.modules())


def _wgrad_targets(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost modules that own a `backward_dw()` (a te_seq Sequential runs all its ops')."""
    if callable(getattr(module, "backward_dw", None)):
        return [module]
    return [t for child in module.children() for t in _wgrad_targets(child)]


def _needs_backward_dw(targets: Sequence[torch.nn.Module]) -> bool:
    return any(bool(getattr(t, "need_backward_dw", lambda: False)()) for t in targets)


def _unique(tensors: Iterable[Tensor]) -> list[Tensor]:
    seen: dict[int, Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


@dataclass(frozen=True)
class _ArgSpec:
    """How a callable is called: positional tensors, then keyword tensors in sorted name order."""

    chunk: int
    num_positional: int
    kwarg_names: tuple[str, ...]

    def flatten(self, args: Sequence[object], kwargs: Mapping[str, object]) -> list[Tensor]:
        if len(args) != self.num_positional or set(kwargs) != set(self.kwarg_names):
            raise ValueError(
                f"graphed chunk {self.chunk}: called with {len(args)} positional arguments and "
                f"keywords {sorted(kwargs)}, but captured with {self.num_positional} and "
                f"{list(self.kwarg_names)}"
            )
        flat = list(args) + [kwargs[name] for name in self.kwarg_names]
        for j, t in enumerate(flat):
            if not isinstance(t, Tensor):
                raise ValueError(
                    f"graphed chunk {self.chunk}: argument {j} is {type(t).__name__}; "
                    "graphed callables take tensors only"
                )
        return flat  # type: ignore[return-value]

    def unflatten(self, flat: Sequence[Tensor]) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
        n = self.num_positional
        return tuple(flat[:n]), dict(zip(self.kwarg_names, flat[n:]))


def _sample_surface(
    chunk: int, args: object, kwargs: Mapping[str, object] | None
) -> tuple[_ArgSpec, list[Tensor]]:
    """Check one callable's sample inputs: a tuple of CUDA tensors (plus optional tensor kwargs)."""
    if not isinstance(args, (tuple, list)):
        raise ValueError(
            f"sample_args[{chunk - 1}] must be a tuple of tensors, got {type(args).__name__}"
        )
    kwargs = dict(kwargs or {})
    spec = _ArgSpec(chunk, len(args), tuple(sorted(kwargs)))
    flat = spec.flatten(args, kwargs)
    for j, t in enumerate(flat):
        if t.device.type != "cuda":
            raise ValueError(
                f"sample_args[{chunk - 1}] argument {j} is on {t.device}; graphed inputs must be "
                "CUDA tensors (a host tensor, e.g. host split sizes, would be read at capture and "
                "its values baked into the graph)"
            )
    return spec, flat


# ================================================================================================
# Gradient state: kept out of warm-up, recorded during capture
# ================================================================================================

@dataclass
class _ParamGradState:
    param: torch.nn.Parameter
    grad: Tensor | None
    main_grad: Tensor | None = None
    main_grad_copy: Tensor | None = None
    has_flag: bool = False
    flag: object = None


def _snapshot_grad_state(params: Sequence[torch.nn.Parameter]) -> list[_ParamGradState]:
    states = []
    for p in params:
        state = _ParamGradState(p, p.grad)
        main_grad = getattr(p, "main_grad", None)
        if isinstance(main_grad, Tensor):
            state.main_grad, state.main_grad_copy = main_grad, main_grad.detach().clone()
        if hasattr(p, "grad_added_to_main_grad"):
            state.has_flag, state.flag = True, p.grad_added_to_main_grad
        states.append(state)
    return states


def _restore_grad_state(states: Sequence[_ParamGradState]) -> None:
    with torch.no_grad():
        for s in states:
            s.param.grad = s.grad
            if s.main_grad is not None and s.main_grad_copy is not None:
                s.param.main_grad = s.main_grad
                s.main_grad.copy_(s.main_grad_copy)
            if s.has_flag:
                s.param.grad_added_to_main_grad = s.flag


@contextmanager
def _grads_untouched(params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """Run real iterations (warm-up) without leaving a trace in `.grad`, `main_grad` or flags."""
    states = _snapshot_grad_state(_unique(params))
    for s in states:
        s.param.grad = None  # so an in-place `.grad += ...` cannot reach the user's tensor
    torch.cuda.synchronize()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        _restore_grad_state(states)
        torch.cuda.synchronize()


@contextmanager
def _recording_flags(params: Sequence[torch.nn.Parameter]) -> Iterator[list[torch.nn.Parameter]]:
    """Yield a list that, on exit, holds the params whose `grad_added_to_main_grad` the body set
    True (a host-side effect a graph replay cannot repeat); the flags are then restored."""
    flagged = [p for p in params if hasattr(p, "grad_added_to_main_grad")]
    saved = [p.grad_added_to_main_grad for p in flagged]
    for p in flagged:
        p.grad_added_to_main_grad = False
    raised: list[torch.nn.Parameter] = []
    try:
        yield raised
    finally:
        raised.extend(p for p in flagged if p.grad_added_to_main_grad is True)
        for p, value in zip(flagged, saved):
            p.grad_added_to_main_grad = value


def _set_flags(params: Sequence[torch.nn.Parameter]) -> None:
    for p in params:
        p.grad_added_to_main_grad = True


# ================================================================================================
# Static buffers and graphs of one (chunk, microbatch)
# ================================================================================================

@dataclass
class _StaticInputs:
    """Static copies of a callable's inputs. A tensor passed at several positions of the sample
    (e.g. one device split-size tensor given to both GroupedLinears, which is what lets the grouped
    MLP fuse) gets one buffer, so the captured call sees the same aliasing."""

    buffers: list[Tensor]
    slots: tuple[int, ...]        # per flat position: index into buffers
    first_position: tuple[int, ...]  # per buffer: the first flat position that uses it

    @staticmethod
    def clone_of(sample: Sequence[Tensor]) -> _StaticInputs:
        index: dict[int, int] = {}
        buffers: list[Tensor] = []
        firsts: list[int] = []
        slots = []
        for j, t in enumerate(sample):
            if id(t) not in index:
                index[id(t)] = len(buffers)
                buffers.append(t.detach().clone().requires_grad_(t.requires_grad))
                firsts.append(j)
            slots.append(index[id(t)])
        return _StaticInputs(buffers, tuple(slots), tuple(firsts))

    def per_position(self) -> list[Tensor]:
        return [self.buffers[s] for s in self.slots]

    def user_tensors(self, chunk: int, flat: Sequence[Tensor]) -> list[Tensor]:
        """One user tensor per buffer, checked against the captured shapes, dtypes, aliasing."""
        for j, slot in enumerate(self.slots):
            first = self.first_position[slot]
            if flat[j] is not flat[first]:
                raise ValueError(
                    f"graphed chunk {chunk}: arguments {first} and {j} were one tensor at capture "
                    "(e.g. shared split sizes) and must be one tensor at every call"
                )
        users = [flat[j] for j in self.first_position]
        for buf, t, j in zip(self.buffers, users, self.first_position):
            if t.shape != buf.shape or t.dtype != buf.dtype:
                raise ValueError(
                    f"graphed chunk {chunk}: argument {j} is {t.dtype} {tuple(t.shape)}, captured "
                    f"as {buf.dtype} {tuple(buf.shape)}"
                )
            if t.requires_grad and not buf.requires_grad:
                raise ValueError(
                    f"graphed chunk {chunk}: argument {j} requires grad but its sample did not, so "
                    "no graph computes its gradient (capture with a sample that requires grad)"
                )
        return users

    def copy_from(self, users: Sequence[Tensor]) -> None:
        with torch.no_grad():
            for buf, t in zip(self.buffers, users):
                if buf.data_ptr() != t.data_ptr():
                    buf.copy_(t)


@dataclass
class _Microbatch:
    inputs: _StaticInputs
    fwd_graph: torch.cuda.CUDAGraph
    outputs: tuple[Tensor, ...]
    output_needs_grad: tuple[bool, ...]
    bwd_graph: torch.cuda.CUDAGraph | None = None
    grad_outputs: tuple[Tensor | None, ...] = ()
    grad_inputs: tuple[Tensor | None, ...] = ()  # per Function input: input buffers, then params
    bwd_flags: tuple[torch.nn.Parameter, ...] = ()
    wgrad_graph: torch.cuda.CUDAGraph | None = None
    wgrad_grads: tuple[tuple[torch.nn.Parameter, Tensor], ...] = ()
    wgrad_flags: tuple[torch.nn.Parameter, ...] = ()


def _flatten_outputs(out: object, chunk: int) -> tuple[tuple[Tensor, ...], bool]:
    if isinstance(out, Tensor):
        return (out,), False
    if isinstance(out, (tuple, list)) and all(isinstance(o, Tensor) for o in out):
        return tuple(out), True
    raise ValueError(
        f"chunk {chunk}: a graphed callable must return a Tensor or a tuple of Tensors, "
        f"got {type(out).__name__}"
    )


@dataclass
class _GraphedChunk:
    """One callable: its module, sample inputs, and the graphs of each of its microbatches."""

    chunk: int
    module: torch.nn.Module
    spec: _ArgSpec
    sample: list[Tensor]
    delays_wgrad: bool
    pool: Any = None
    params: tuple[torch.nn.Parameter, ...] = ()
    wgrad_targets: tuple[torch.nn.Module, ...] = ()
    training: bool = True
    returns_tuple: bool = False
    microbatches: list[_Microbatch] = field(default_factory=list)
    pending_wgrads: int = 0
    cursor: _ScheduleCursor | None = None  # set once every graph is captured

    def __post_init__(self) -> None:
        self.params = tuple(p for p in self.module.parameters() if p.requires_grad)
        self.wgrad_targets = tuple(_wgrad_targets(self.module)) if self.delays_wgrad else ()
        if self.delays_wgrad and not self.wgrad_targets:
            raise ValueError(
                f"chunk {self.chunk} delays wgrad (delay_wgrad_compute=True) but none of its "
                "modules has backward_dw()"
            )
        self.training = self.module.training

    # --- warm-up ---------------------------------------------------------------------------
    def _backward_targets(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        return [t for t in _unique(inputs) if t.requires_grad] + list(self.params)

    def run_eager_iteration(self) -> None:
        """forward, backward (torch.autograd.grad, so `.grad` stays untouched), backward_dw."""
        args, kwargs = self.spec.unflatten(self.sample)
        outputs, _ = _flatten_outputs(self.module(*args, **kwargs), self.chunk)
        needs = [o for o in outputs if o.requires_grad]
        if needs:
            torch.autograd.grad(
                needs, self._backward_targets(self.sample),
                [torch.zeros_like(o) for o in needs], allow_unused=True,
            )
        for target in self.wgrad_targets:
            while _needs_backward_dw([target]):
                target.backward_dw()

    # --- capture ---------------------------------------------------------------------------
    def capture_forward(self) -> None:
        inputs = _StaticInputs.clone_of(self.sample)
        args, kwargs = self.spec.unflatten(inputs.per_position())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.module(*args, **kwargs)
        outputs, self.returns_tuple = _flatten_outputs(out, self.chunk)
        needs = tuple(o.requires_grad for o in outputs)
        self.microbatches.append(_Microbatch(inputs, graph, outputs, needs))

    def capture_backward(self, microbatch: int) -> None:
        mb = self.microbatches[microbatch]
        needs = [o for o in mb.outputs if o.requires_grad]
        if not needs:
            raise RuntimeError(
                f"chunk {self.chunk}: no output requires grad, so there is no backward to capture "
                "(give an input requires_grad=True or keep a parameter trainable)"
            )
        grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in mb.outputs)
        input_targets = [b for b in mb.inputs.buffers if b.requires_grad]
        graph = torch.cuda.CUDAGraph()
        with _recording_flags(self.params) as flags, torch.cuda.graph(graph, pool=self.pool):
            grads = torch.autograd.grad(
                needs, input_targets + list(self.params),
                [g for g in grad_outputs if g is not None], allow_unused=True,
            )
        grads_iter = iter(grads)
        per_buffer = [next(grads_iter) if b.requires_grad else None for b in mb.inputs.buffers]
        mb.grad_inputs = (*per_buffer, *grads_iter)
        mb.bwd_graph, mb.grad_outputs, mb.bwd_flags = graph, grad_outputs, tuple(flags)
        mb.outputs = tuple(o.detach() for o in mb.outputs)  # drop the captured autograd graph

    def capture_wgrad(self, microbatch: int) -> None:
        if not _needs_backward_dw(self.wgrad_targets):
            raise RuntimeError(
                f"chunk {self.chunk}: the schedule has a wgrad here but no op of the chunk queued "
                "a delayed wgrad during its backward"
            )
        mb = self.microbatches[microbatch]
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None  # backward_dw() then *sets* .grad: the graph writes a static buffer
        graph = torch.cuda.CUDAGraph()
        try:
            with _recording_flags(self.params) as flags, torch.cuda.graph(graph, pool=self.pool):
                for target in self.wgrad_targets:
                    target.backward_dw()
            mb.wgrad_grads = tuple((p, p.grad) for p in self.params if p.grad is not None)
        finally:
            for p, grad in zip(self.params, saved):
                p.grad = grad
        mb.wgrad_graph, mb.wgrad_flags = graph, tuple(flags)

    # --- replay ----------------------------------------------------------------------------
    def replay_forward(self, microbatch: int, users: Sequence[Tensor]) -> tuple[Tensor, ...]:
        mb = self.microbatches[microbatch]
        mb.inputs.copy_from(users)
        mb.fwd_graph.replay()
        return tuple(o.detach() for o in mb.outputs)

    def replay_backward(
        self, microbatch: int, grads: Sequence[Tensor | None]
    ) -> tuple[Tensor | None, ...]:
        mb = self.microbatches[microbatch]
        for static, grad in zip(mb.grad_outputs, grads):
            if static is not None and grad is not None and static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        assert mb.bwd_graph is not None  # the schedule captured it
        mb.bwd_graph.replay()
        _set_flags(mb.bwd_flags)
        if self.delays_wgrad:
            self.pending_wgrads += 1
        # The static tensors themselves (not detached aliases): autograd then sees them as
        # shared and clones or adds them into `.grad` instead of stealing graph memory.
        return mb.grad_inputs

    def replay_wgrad(self, microbatch: int) -> None:
        mb = self.microbatches[microbatch]
        assert mb.wgrad_graph is not None  # the schedule captured it
        mb.wgrad_graph.replay()
        with torch.no_grad():
            for p, grad in mb.wgrad_grads:  # as backward_dw() does: add, or set when None
                if p.grad is None:
                    p.grad = grad.clone(memory_format=torch.contiguous_format)
                else:
                    p.grad.add_(grad)
        _set_flags(mb.wgrad_flags)
        self.pending_wgrads -= 1


# ================================================================================================
# Replay: schedule cursor, autograd node, the returned callables
# ================================================================================================

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


class _GraphedFunction(torch.autograd.Function):
    """forward: copy inputs into static buffers, replay the forward graph; backward: copy the
    output grads into static buffers, replay the backward graph, return static grads."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, chunk: _GraphedChunk, microbatch: int, *tensors: Tensor
    ) -> tuple[Tensor, ...]:
        num_inputs = len(chunk.microbatches[microbatch].inputs.buffers)
        outputs = chunk.replay_forward(microbatch, tensors[:num_inputs])
        ctx.chunk, ctx.microbatch = chunk, microbatch
        needs = chunk.microbatches[microbatch].output_needs_grad
        ctx.mark_non_differentiable(*(o for o, need in zip(outputs, needs) if not need))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, *grads: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        chunk: _GraphedChunk = ctx.chunk
        assert chunk.cursor is not None  # set before any replay
        chunk.cursor.advance(StepKind.BACKWARD, chunk.chunk, ctx.microbatch)
        return (None, None, *chunk.replay_backward(ctx.microbatch, grads))


class GraphedCallable:
    """A captured module: call it like the module; `backward_dw()` replays its wgrad graph.

    Runs the original module instead of the graphs when its training mode differs from capture
    time or when autograd is disabled (such calls are not part of the schedule).
    """

    def __init__(self, chunk: _GraphedChunk, cursor: _ScheduleCursor) -> None:
        self._chunk = chunk
        self._cursor = cursor
        chunk.cursor = cursor
        self.module = chunk.module

    def __call__(self, *args: Tensor, **kwargs: Tensor) -> Tensor | tuple[Tensor, ...]:
        chunk = self._chunk
        if self.module.training != chunk.training or not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        flat = chunk.spec.flatten(args, kwargs)
        users = chunk.microbatches[0].inputs.user_tensors(chunk.chunk, flat)
        step = self._cursor.advance(StepKind.FORWARD, chunk.chunk)
        outputs = _GraphedFunction.apply(chunk, step.microbatch, *users, *chunk.params)
        return tuple(outputs) if chunk.returns_tuple else outputs[0]

    def backward_dw(self) -> None:
        """Replay the wgrad graph of this chunk's oldest backward whose wgrad has not run
        (a no-op for a chunk whose ops do not delay wgrad, as in eager mode)."""
        if not self._chunk.delays_wgrad:
            return
        step = self._cursor.advance(StepKind.WGRAD, self._chunk.chunk)
        self._chunk.replay_wgrad(step.microbatch)

    def need_backward_dw(self) -> bool:
        """Whether a backward of this chunk is still waiting for its `backward_dw()`."""
        return self._chunk.pending_wgrads > 0

    def __repr__(self) -> str:
        return f"GraphedCallable(chunk={self._chunk.chunk}, module={type(self.module).__name__})"


# ================================================================================================
# make_graphed_callables
# ================================================================================================

def _normalize_callables(
    callables: torch.nn.Module | Sequence[torch.nn.Module],
    sample_args: Sequence[object],
    sample_kwargs: Sequence[Mapping[str, Tensor] | None] | Mapping[str, Tensor] | None,
) -> tuple[list[torch.nn.Module], list[object], list[Mapping[str, Tensor] | None], bool]:
    single = isinstance(callables, torch.nn.Module)
    if single:
        modules = [callables]
        args_list, kwargs_list = [sample_args], [sample_kwargs]  # type: ignore[list-item]
    else:
        modules = list(callables)  # type: ignore[arg-type]
        args_list = list(sample_args)
        kwargs_list = [None] * len(modules) if sample_kwargs is None else list(sample_kwargs)  # type: ignore[arg-type]
    if not modules or len(args_list) != len(modules) or len(kwargs_list) != len(modules):
        raise ValueError(
            f"make_graphed_callables: got {len(modules)} callables, {len(args_list)} sample_args "
            f"and {len(kwargs_list)} sample_kwargs; need one of each per callable (at least one)"
        )
    for i, m in enumerate(modules):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"callables[{i}] must be a torch.nn.Module, got {type(m).__name__}")
        for j in range(i):
            if modules[j] is m:
                raise ValueError(
                    f"callables[{j}] and callables[{i}] are the same module; pass each chunk once "
                    "and give it several forwards in `order` instead"
                )
    return modules, args_list, kwargs_list, single


def _capture_schedule(chunks: Sequence[_GraphedChunk], steps: Sequence[ScheduleStep]) -> None:
    """Capture every step in schedule order, so memory reuse in the pool matches the replays."""
    for step in steps:
        chunk = chunks[step.chunk - 1]
        if step.kind is StepKind.FORWARD:
            chunk.capture_forward()
        elif step.kind is StepKind.BACKWARD:
            chunk.capture_backward(step.microbatch)
        else:
            chunk.capture_wgrad(step.microbatch)
    for chunk in chunks:
        if _needs_backward_dw(chunk.wgrad_targets):
            raise RuntimeError(
                f"chunk {chunk.chunk}: a delayed wgrad is still pending after capture; its ops "
                "queued more wgrads than the schedule has wgrad entries"
            )


def make_graphed_callables(
    callables: torch.nn.Module | Sequence[torch.nn.Module],
    sample_args: Sequence[object],
    *,
    num_warmup_iters: int = 3,
    order: Sequence[float] | None = None,
    sample_kwargs: Sequence[Mapping[str, Tensor] | None] | None = None,
    pool: Any = None,
) -> GraphedCallable | tuple[GraphedCallable, ...]:
    """Capture forward, backward and delayed-wgrad CUDA graphs of te_seq modules (API.md §5).

    Args:
        callables: a module, or a sequence of modules; `callables[k - 1]` is chunk k.
        sample_args: per callable, the tuple of CUDA tensors it is called with (a single tuple
            when `callables` is one module). Every microbatch uses these shapes and dtypes;
            `requires_grad` must match the real inputs. Device split sizes are inputs like any
            other: copied into a static buffer at each call.
        num_warmup_iters: eager forward/backward/backward_dw iterations run before capture.
        order: the schedule (`k`, `-k`, `-(k + 0.5)`); None: `default_order`.
        sample_kwargs: per callable, an optional dict of keyword tensors.
        pool: a `torch.cuda.graph_pool_handle()` to capture into; None: a new one.

    Returns:
        One `GraphedCallable` per callable (a single one when `callables` is one module). They
        must then run exactly in the order of the schedule, iteration after iteration.

    Raises:
        ValueError: a broken schedule rule (naming the position and the rule) or bad sample
            inputs; raised before anything touches CUDA.
        RuntimeError: CUDA is not available.
    """
    modules, args_list, kwargs_list, single = _normalize_callables(
        callables, sample_args, sample_kwargs
    )
    delays = [module_delays_wgrad(m) for m in modules]
    steps = validate_schedule(order, len(modules), delays)
    if num_warmup_iters < 0:
        raise ValueError(f"num_warmup_iters must be >= 0, got {num_warmup_iters}")
    surfaces = [
        _sample_surface(i + 1, args, kwargs)
        for i, (args, kwargs) in enumerate(zip(args_list, kwargs_list))
    ]
    if not torch.cuda.is_available():
        raise RuntimeError(
            "make_graphed_callables needs CUDA, and torch.cuda.is_available() is False"
        )
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    chunks = [
        _GraphedChunk(i + 1, m, spec, flat, delays[i], pool)
        for i, (m, (spec, flat)) in enumerate(zip(modules, surfaces))
    ]
    _warm_up(chunks, num_warmup_iters)
    _capture_schedule(chunks, steps)
    cursor = _ScheduleCursor(steps)
    graphed = tuple(GraphedCallable(chunk, cursor) for chunk in chunks)
    return graphed[0] if single else graphed


def _warm_up(chunks: Sequence[_GraphedChunk], num_iters: int) -> None:
    """Eager iterations on a side stream, so lazy initialisation (plan building, kernel
    compilation, workspace allocation) happens before capture and not inside a graph."""
    params = [p for chunk in chunks for p in chunk.params]
    with _grads_untouched(params):
        with torch.cuda.stream(torch.cuda.Stream()):
            for chunk in chunks:
                for _ in range(num_iters):
                    chunk.run_eager_iteration()
