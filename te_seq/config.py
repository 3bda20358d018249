"""Configuration, resolved in one place: the kernel backend and capability probes.

Backends (API.md §6): "reference" (pure PyTorch, any device), "torch" (PyTorch's grouped GEMM),
"cute" (te_seq's CUTLASS Python DSL kernels, CUDA sm_90+), and "auto" (the fastest available
for the data's device). Probes return `(ok, reason)` and are cached; none runs at import.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "reference", "torch", "cute")

_state = threading.local()
_global_backend = "auto"
_compile_elementwise = True


def compile_elementwise() -> bool:
    """Whether the GPU backends run activations through `torch.compile` (default True)."""
    return _compile_elementwise


def set_compile_elementwise(enabled: bool) -> None:
    """Turn the compiled elementwise path of the GPU backends on or off (off: plain PyTorch)."""
    global _compile_elementwise
    _compile_elementwise = bool(enabled)


@functools.lru_cache(maxsize=None)
def backend_available(name: str) -> tuple[bool, str]:
    """Whether a backend can run on this machine, and why not."""
    if name in ("auto", "reference"):
        return True, ""
    if name == "torch":
        from te_seq.kernels import torch_backend

        return torch_backend.available()
    if name == "cute":
        from te_seq.kernels import cute

        return cute.available()
    raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")


def _check_name(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")


def _require_available(name: str) -> None:
    _check_name(name)
    ok, reason = backend_available(name)
    if not ok:
        raise RuntimeError(f"backend {name!r} is not available: {reason}")


def set_backend(name: str) -> None:
    """Set the process-wide backend (outside any `backend(...)` block)."""
    global _global_backend
    _require_available(name)
    _global_backend = name


def current_backend() -> str:
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else _global_backend


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Run the block with the given backend; RuntimeError (saying why) if it is unavailable."""
    _require_available(name)
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def grouped_backend(requested: str, device: torch.device) -> str:
    """The backend a grouped GEMM runs on for data on `device` under the requested backend.

    "auto" prefers cute, then torch, on CUDA, and the reference elsewhere. An explicit "torch"
    also runs on CPU data (`torch._grouped_mm` has a CPU path, so CI exercises that backend's
    padding logic); an explicit "cute" on CPU data runs the reference (the plan shows it).
    """
    if device.type != "cuda":
        return "torch" if requested == "torch" else "reference"
    if requested != "auto":
        return requested
    for name in ("cute", "torch"):
        if backend_available(name)[0]:
            return name
    return "reference"


def backend_reason(requested: str, chosen: str, device: torch.device) -> str:
    """Why a plan step runs on `chosen` when `requested` was asked for (shown in the plan)."""
    if chosen == "reference" and grouped_backend(requested, device) != "reference":
        return "pure PyTorch op: no GPU kernel of its own"
    if requested == chosen:
        return "requested"
    if device.type != "cuda":
        return (
            f"data on {device.type}: {'auto' if requested == 'auto' else requested} "
            "runs the reference there"
        )
    skipped = [
        f"{name} unavailable: {backend_available(name)[1]}"
        for name in ("cute", "torch")
        if name != chosen and not backend_available(name)[0]
    ]
    prefix = "auto: fastest available" if requested == "auto" else f"{requested} requested"
    return "; ".join([prefix] + skipped)
