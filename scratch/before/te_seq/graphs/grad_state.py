"""Gradient state around capture: warm-up leaves no trace, capture records host-side flags.

Warm-up runs real forward/backward/backward_dw iterations, so `_grads_untouched` snapshots `.grad`,
`main_grad` (its values, restored in place into the same tensor) and `grad_added_to_main_grad`
before them and restores all three afterwards. `grad_added_to_main_grad = True` is a Python-side
effect a graph cannot replay: `_recording_flags` records which parameters a captured body flagged,
and `_set_flags` sets them again after every replay of that graph.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor


def _unique(tensors: Iterable[Tensor]) -> list[Tensor]:
    """Each tensor once (by identity, not value), in the order first seen."""
    seen: dict[int, Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


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
