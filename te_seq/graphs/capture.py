"""One graphed chunk: its static inputs, and the forward, backward and wgrad graphs per microbatch.

`_GraphedChunk` warms a module up, captures its graphs (one forward and one backward graph per
microbatch, plus one wgrad graph replaying `backward_dw()` when its ops delay the weight gradient)
and replays them. `_GraphedFunction` is the autograd node of one replayed forward: its backward
replays the matching backward graph.

Gradients behave as in eager mode:
- wgrads returned to autograd come out of the backward graph as static tensors, lent to autograd
  (`grad_state._GradLender`): `.grad` set from None is the static buffer itself, no copy; before
  any later replay a `.grad` still aliasing it (accumulation) gets memory of its own;
- delayed wgrads without `main_grad` are captured into a static buffer per parameter and added
  into `.grad` (set, lent, when None) after each wgrad replay, as `backward_dw()` does eagerly.

Modules are duck-typed (`delay_wgrad_compute`, `backward_dw`, `need_backward_dw`): this module
imports nothing of te_seq's core (the package's `__init__` asks `core.fp8` for the FP8 weight
graphs, which a chunk holds in `weight_graphs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from te_seq.graphs.grad_state import _GradLender, _recording_flags, _set_flags, _unique
from te_seq.graphs.schedule import StepKind, _ScheduleCursor


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
    lender: _GradLender = field(default_factory=lambda: _GradLender(enabled=False))
    weight_graphs: list[Any] = field(default_factory=list)  # core.fp8._WeightGraph, in forward
    params: tuple[torch.nn.Parameter, ...] = ()
    param_names: tuple[str, ...] = ()  # per param, its name in the module (for messages)
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
        names = {id(p): name for name, p in self.module.named_parameters()}
        self.param_names = tuple(names.get(id(p), "a parameter") for p in self.params)

    def _lend(self, grads: Sequence[tuple[torch.nn.Parameter, Tensor]]) -> list[Tensor]:
        names = dict(zip(map(id, self.params), self.param_names))
        return self.lender.lend(self.chunk, [(names[id(p)], p, g) for p, g in grads])

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
        # Input gradients: the static tensors themselves (autograd copies them where it keeps
        # them); weight gradients: lent, so a `.grad` set from None is the static buffer.
        num_inputs = len(mb.inputs.buffers)
        weight_grads = mb.grad_inputs[num_inputs:]
        pairs = [(p, g) for p, g in zip(self.params, weight_grads) if g is not None]
        lent = iter(self._lend(pairs))
        return (*mb.grad_inputs[:num_inputs],
                *(g if g is None else next(lent) for g in weight_grads))

    def replay_wgrad(self, microbatch: int) -> None:
        mb = self.microbatches[microbatch]
        assert mb.wgrad_graph is not None  # the schedule captured it
        mb.wgrad_graph.replay()
        with torch.no_grad():
            for p, grad in mb.wgrad_grads:  # as backward_dw() does: add, or set when None
                if p.grad is not None:
                    p.grad.add_(grad)
                    continue
                (lent,) = self._lend([(p, grad)])
                # not lent (the pool is shared, or not contiguous): a copy of its own
                p.grad = grad.clone(memory_format=torch.contiguous_format) if lent is grad else lent
        _set_flags(mb.wgrad_flags)
        self.pending_wgrads -= 1


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
        chunk.lender.reclaim()
        chunk.cursor.advance(StepKind.BACKWARD, chunk.chunk, ctx.microbatch)
        return (None, None, *chunk.replay_backward(ctx.microbatch, grads))
