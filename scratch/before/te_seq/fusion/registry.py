"""The fusion registry: declarative `FusionPattern` records and their enabled state.

User fusions are tried before built-in ones, each group in registration order. Every change
bumps `registry_version()`, which is part of every cached plan's key, so a plan is never stale.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from te_seq.core.operation import BasicOperation

PHASES = ("joint", "forward", "backward")

OpClass = type | tuple[type, ...]


@dataclass(frozen=True)
class NoMatch:
    """Returned by a fusion's build function to decline a matched window, with the reason."""

    reason: str

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True)
class FusionPattern:
    """A registered fusion: a window pattern and the function that builds the fused op."""

    name: str
    phase: str
    pattern: tuple[OpClass, ...]
    build: Callable[[Any], Any]
    enabled: bool = True
    builtin: bool = False

    def matches(self, ops: Sequence[Any]) -> bool:
        return len(ops) == len(self.pattern) and all(
            isinstance(op, cls) for op, cls in zip(ops, self.pattern)
        )


_lock = threading.Lock()
_patterns: dict[str, FusionPattern] = {}
_version = 0


def registry_version() -> int:
    return _version


def _bump() -> None:
    global _version
    _version += 1


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"register_fusion: name must be a str, got {type(name).__name__} {name!r}")
    if not name:
        raise ValueError("register_fusion: name must be a non-empty string, got ''")
    return name


def _check_element(name: str, element: object) -> OpClass:
    """One pattern element: a BasicOperation subclass or a non-empty tuple of them."""
    classes = element if isinstance(element, tuple) else (element,)
    if not classes:
        raise ValueError(f"register_fusion({name!r}): a pattern element is an empty tuple")
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, BasicOperation)):
            what = cls.__name__ if isinstance(cls, type) else f"{type(cls).__name__} {cls!r}"
            raise TypeError(
                f"register_fusion({name!r}): pattern elements must be basic op classes "
                f"(subclasses of te_seq.ops.BasicOperation) or tuples of them, got {what}"
            )
    return element


def _check_free(name: str) -> None:
    if name in _patterns:
        raise ValueError(f"register_fusion: a fusion named {name!r} is already registered")


def _validate(name: object, phase: object, pattern: object) -> tuple[OpClass, ...]:
    """The checked pattern; TypeError / ValueError naming the fusion and the bad value."""
    name = _check_name(name)
    if not isinstance(phase, str) or phase not in PHASES:
        raise ValueError(f"register_fusion({name!r}): phase must be one of {PHASES}, got {phase!r}")
    if isinstance(pattern, type) or not isinstance(pattern, tuple | list):
        raise TypeError(
            f"register_fusion({name!r}): pattern must be a tuple of op classes (one per op of "
            f"the window), got {pattern!r}"
        )
    if not pattern:
        raise ValueError(f"register_fusion({name!r}): pattern is empty")
    return tuple(_check_element(name, element) for element in pattern)


def register_fusion(
    *, name: str, phase: str, pattern: Sequence[OpClass], builtin: bool = False
) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
    """Decorator registering `build(window) -> FusedOperation | NoMatch` under `name`.

    `phase` is "joint" (replaces forward and backward), "forward" or "backward". The arguments
    are checked at once (TypeError / ValueError naming the fusion); `build` when decorated.
    """
    checked = _validate(name, phase, pattern)
    _check_free(name)

    def decorator(build: Callable[[Any], Any]) -> Callable[[Any], Any]:
        if not callable(build):
            raise TypeError(
                f"register_fusion({name!r}): build must be a callable taking the window, got "
                f"{type(build).__name__} {build!r}"
            )
        with _lock:
            _check_free(name)
            _patterns[name] = FusionPattern(name, phase, checked, build, True, bool(builtin))
            _bump()
        return build

    return decorator


def unregister_fusion(name: str) -> None:
    """Remove a fusion (tests and notebooks that re-register use this)."""
    with _lock:
        _require(name)
        del _patterns[name]
        _bump()


def _require(name: str) -> FusionPattern:
    if name not in _patterns:
        known = ", ".join(sorted(_patterns)) or "none"
        raise ValueError(f"no fusion named {name!r} is registered (registered: {known})")
    return _patterns[name]


def _set_enabled(name: str, enabled: bool) -> None:
    with _lock:
        record = _require(name)
        if record.enabled != enabled:
            _patterns[name] = replace(record, enabled=enabled)
            _bump()


def disable_fusion(name: str) -> None:
    _set_enabled(name, False)


def enable_fusion(name: str) -> None:
    _set_enabled(name, True)


def list_fusions() -> list[FusionPattern]:
    """All registered fusions in matching order (user before built-in, registration order)."""
    ordered = sorted(
        _patterns.values(), key=lambda p: p.builtin
    )  # stable: keeps registration order
    return list(ordered)


def patterns_for_phase(phase: str) -> list[FusionPattern]:
    return [p for p in list_fusions() if p.phase == phase and p.enabled]


@contextlib.contextmanager
def fusions_disabled(*names: str) -> Iterator[None]:
    """Disable the named fusions (all when none are named) inside the block, then restore."""
    targets = list(names) if names else [p.name for p in list_fusions()]
    previous = {n: _require(n).enabled for n in targets}
    for n in targets:
        _set_enabled(n, False)
    try:
        yield
    finally:
        for n, was_enabled in previous.items():
            if n in _patterns:
                _set_enabled(n, was_enabled)
