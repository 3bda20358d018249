"""CUDA graphs of te_seq modules with pipeline schedules and delayed-wgrad graphs.

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

Gradients behave as in eager mode (docs/gradient_contract.md):
- wgrads returned to autograd (default path, and the dummies of the `grad_added_to_main_grad`
  path) come out of the backward graph as static tensors and are lent to autograd: a `.grad`
  that was None becomes the static buffer itself (no copy), one that exists gets it added;
  before any later replay a `.grad` (or a kept reference to one) still aliasing the buffer is
  given memory of its own (accumulation stays exact), and a view still aliasing it is an error;
- `main_grad` accumulation is captured in place, so the graphs keep writing the `main_grad`
  tensor that existed at capture time; `overwrite_main_grad` and `zero_out_wgrad` are read at
  capture time;
- `grad_added_to_main_grad = True` (a Python-side effect a graph cannot replay) is recorded at
  capture and set again after every replay of the graph that set it;
- delayed wgrads without `main_grad` are captured into a static buffer per parameter and added
  into `.grad` (set, lent as above, when None) after each wgrad replay, as `backward_dw()`
  does eagerly.
Warm-up runs real forward/backward/backward_dw iterations; `.grad`, `main_grad` and the flags
are restored afterwards, so capturing leaves no trace in the gradients.

The package: `schedule` (the pure schedule checker and the replay cursor), `grad_state` (gradient
snapshots and flag recording), `capture` (one chunk's static inputs and graphs, and the autograd
node that replays them); this module holds the public surface. docs/cuda_graphs.md is the guide.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from te_seq.core import fp8
from te_seq.graphs.capture import (
    _ArgSpec,
    _GraphedChunk,
    _GraphedFunction,
    _needs_backward_dw,
    module_delays_wgrad,
)
from te_seq.graphs.grad_state import _GradLender, _grads_untouched
from te_seq.graphs.schedule import (
    ScheduleStep,
    StepKind,
    _ScheduleCursor,
    default_order,
    validate_schedule,
)

__all__ = [
    "GraphedCallable",
    "ScheduleStep",
    "StepKind",
    "default_order",
    "make_graphed_callables",
    "module_delays_wgrad",
    "validate_schedule",
]


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
        chunk.lender.reclaim()
        for weight_graph in chunk.weight_graphs:
            weight_graph.current()  # re-quantized if the weight changed (an optimizer step)
        step = self._cursor.advance(StepKind.FORWARD, chunk.chunk)
        outputs = _GraphedFunction.apply(chunk, step.microbatch, *users, *chunk.params)
        return tuple(outputs) if chunk.returns_tuple else outputs[0]

    def backward_dw(self) -> None:
        """Replay the wgrad graph of this chunk's oldest backward whose wgrad has not run
        (a no-op for a chunk whose ops do not delay wgrad, as in eager mode)."""
        if not self._chunk.delays_wgrad:
            return
        self._chunk.lender.reclaim()
        step = self._cursor.advance(StepKind.WGRAD, self._chunk.chunk)
        self._chunk.replay_wgrad(step.microbatch)

    def need_backward_dw(self) -> bool:
        """Whether a backward of this chunk is still waiting for its `backward_dw()`."""
        return self._chunk.pending_wgrads > 0

    def __repr__(self) -> str:
        return f"GraphedCallable(chunk={self._chunk.chunk}, module={type(self.module).__name__})"


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
    """Capture forward, backward and delayed-wgrad CUDA graphs of te_seq modules.

    The guide, with schedules for interleaved pipelines: docs/cuda_graphs.md.

    Args:
        callables: a module, or a sequence of modules; `callables[k - 1]` is chunk k.
        sample_args: per callable, the tuple of CUDA tensors it is called with (a single tuple
            when `callables` is one module). Every microbatch uses these shapes and dtypes;
            `requires_grad` must match the real inputs. Device split sizes are inputs like any
            other: copied into a static buffer at each call.
        num_warmup_iters: eager forward/backward/backward_dw iterations run before capture.
        order: the schedule (`k`, `-k`, `-(k + 0.5)`); None: `default_order`.
        sample_kwargs: per callable, an optional dict of keyword tensors.
        pool: a `torch.cuda.graph_pool_handle()` to capture into; None: a new one. With a
            pool of its own, a weight's `.grad` set from None is the graph's gradient buffer
            itself (no copy); with a given pool, which other graphs may write, it is a copy.

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
    # Weight gradients are lent to autograd without a copy only where every graph that could
    # write their memory is one of ours (a pool of our own): grad_state._GradLender.
    lender = _GradLender(enabled=pool is None)
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    chunks = [
        _GraphedChunk(i + 1, m, spec, flat, delays[i], pool, lender)
        for i, (m, (spec, flat)) in enumerate(zip(modules, surfaces))
    ]
    _warm_up(chunks, num_warmup_iters)
    for chunk in chunks:  # FP8 weights: quantized by graphs of their own, when they change
        chunk.weight_graphs = fp8.capture_weight_graphs(chunk.module, torch.cuda.graph_pool_handle)
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
