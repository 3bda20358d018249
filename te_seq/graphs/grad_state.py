"""Gradient state around capture: warm-up leaves no trace, capture records host-side flags.

Warm-up runs real forward/backward/backward_dw iterations, so `_grads_untouched` snapshots `.grad`,
`main_grad` (its values, restored in place into the same tensor) and `grad_added_to_main_grad`
before them and restores all three afterwards. `grad_added_to_main_grad = True` is a Python-side
effect a graph cannot replay: `_recording_flags` records which parameters a captured body flagged,
and `_set_flags` sets them again after every replay of that graph.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

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


def _storage_uses(t: Tensor) -> int:
    """How many tensors share `t`'s storage, `t` included (the storage object made to ask is
    not counted)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


def _storage_key(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _GradLender:
    """Static weight gradients of a set of graphs, lent to autograd as `.grad` without a copy.

    `lend()` hands out detached aliases of a graph's static gradient buffers, which autograd
    steals as `.grad` where that is None (a fresh-gradient step copies nothing) and otherwise
    adds into `.grad`. The graphs share one memory pool, so a later replay of *any* of them may
    write the memory of a lent buffer (one graph's scratch can be another's output); `reclaim()`
    runs before every replay and gives each tensor it knows that still aliases a lent buffer
    memory of its own, with its values, in the same tensor object (`set_`): `.grad`, the
    gradient objects autograd set as `.grad` (seen by a post-accumulate-grad hook, so a
    reference kept past `zero_grad()` keeps its values) and the aliases it handed out (a
    `torch.autograd.grad` result). A copy is made only for those. A tensor it cannot know (a
    view of one of them) would be overwritten silently, so `reclaim()` raises instead, and keeps
    raising until it is dropped. Disabled (`enabled` False: the static tensors are handed out,
    and autograd copies them) when the pool is shared with graphs this lender does not see.
    Non-contiguous buffers are never lent."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        # (chunk, parameter name, parameter, buffer, storage uses before it was lent)
        self._lent: list[tuple[int, str, torch.nn.Parameter, Tensor, int]] = []
        self._keys: set[int] = set()  # the lent buffers' storages
        self._known: list[weakref.ref[Tensor]] = []  # tensors that alias a lent buffer
        self._hooks: dict[int, Any] = {}  # per parameter id: its post-accumulate-grad hook

    def lend(
        self, chunk: int, items: Sequence[tuple[str, torch.nn.Parameter, Tensor]]
    ) -> list[Tensor]:
        """Per (name, parameter, static buffer): the tensor to hand out as its gradient."""
        lendable = [self.enabled and s.is_contiguous() for _, _, s in items]
        uses = [_storage_uses(s) if ok else 0 for (_, _, s), ok in zip(items, lendable)]
        out = []
        for (name, p, s), ok, n in zip(items, lendable, uses):
            if not ok:
                out.append(s)
                continue
            self._lent.append((chunk, name, p, s, n))
            self._keys.add(_storage_key(s))
            self._watch(p)
            out.append(s.detach())
            self._known.append(weakref.ref(out[-1]))
        return out

    def _watch(self, p: torch.nn.Parameter) -> None:
        """Remember the gradient object autograd sets as `p.grad` (it detaches what it steals,
        so it is not the alias handed out)."""
        if id(p) in self._hooks:
            return
        lender = weakref.ref(self)

        def seen(param: Tensor) -> None:
            me, grad = lender(), param.grad
            if me is not None and grad is not None and _storage_key(grad) in me._keys:
                me._known.append(weakref.ref(grad))

        self._hooks[id(p)] = p.register_post_accumulate_grad_hook(seen)
        weakref.finalize(self, self._hooks[id(p)].remove)

    def reclaim(self) -> None:
        """Before a replay: see the class docstring."""
        if not self._lent:
            return
        known = [ref() for ref in self._known] + [p.grad for _, _, p, _, _ in self._lent]
        with torch.no_grad():
            for t in known:
                if t is not None and _storage_key(t) in self._keys:
                    t.set_(t.clone())
        for chunk, name, _, s, uses in self._lent:
            extra = _storage_uses(s) - uses
            if extra > 0:
                raise RuntimeError(
                    f"graphed chunk {chunk}: the gradient of {name} from an earlier replay is "
                    f"still referenced through a view ({extra} tensor(s) share the graph's "
                    "memory it lives in), and this replay would overwrite it. A graphed "
                    "gradient is the graph's memory until the next replay: keep `.grad` itself "
                    "(or a reference to it), or a clone, not a view of it."
                )
        self._lent.clear()
        self._keys.clear()
        self._known.clear()
