"""Kernel backends: the `Backend` protocol, the registry, the user's selection and the plan-time
choice of the backend each op actually runs on.

A backend is an object with a `name`, an `available()` probe, a `supports(kernel, **static)`
query answered from what is known when a plan is built, and the kernels as methods. Ops call
`ctx.backend.<kernel>(...)`; the fuser puts there the backend the plan chose, so what
`fusion_plan()` shows is what runs (no kernel swaps backends per call).

Kernels and the static facts `supports` is asked with (every query also gets `dtype`, the
data's dtype, and `device`):

| kernel | maths | facts |
|---|---|---|
| grouped_mm | out[rows of e] = a[rows of e] @ b[e] (+ s_t·bias[e]); a [M, K], b [E, K, N] | k, n |
| grouped_wgrad | out[e] = grad_out[rows of e]ᵀ @ x[rows of e] -> [E, N, K] | k, n |
| glu_fc1_forward | h = x W1ᵀ (+ b1), a = act(gate)·up(·probs), 1 kernel | hidden, ffn, glu, bias |
| glu_fc2_dgrad | dA = dY W2 through the GLU gradient, one fused kernel | hidden, ffn, glu |
| act_fc1_forward | h = x W1ᵀ, a = act(h)(·probs) (non-gated), one fused kernel | hidden, ffn, act |
| act_fc2_dgrad | dA = dY W2 through act'(h) (non-gated), one fused kernel | hidden, ffn, act |
| act_forward, act_backward | y = f(x); dx = dy·f'(x) | act |
| glu_forward, glu_backward | y = f(gate)·up(·scales); its gradient | glu |
| group_col_sums | db[e] = Σ_{rows t of e} (s_t·) dout_t (bias gradients) | (every backend) |
| group_offsets | offs[e] = Σ_{j ≤ e} splits[j] (int32), checked at run time | (every backend) |

Biases: `grouped_mm(..., bias=[E, N], bias_scales=[M])` and `glu_fc1_forward(..., bias=[E, 2F])`
add the per-expert bias to the fp32 accumulator before rounding; `Backend` supplies
`group_col_sums` in plain PyTorch (``te_seq.kernels.bias``), which a backend may override;
likewise `group_offsets` (``te_seq.kernels.offsets``: a cumsum and its checks).

Routed rows (the fused MoE block, ``te_seq.kernels.routed``): `grouped_mm`, `glu_fc1_forward` and
`act_fc1_forward` may take `gather_rows=` [M] (A's row r is x[gather_rows[r]], x of any row count)
and `grouped_mm` `scatter_rows=` [M] (result row r written to out[scatter_rows[r]]), each only
where the backend lists the kernel in `gather_kernels` / `scatter_kernels` (`routes_natively`).

Adding a backend: one module with a `Backend` subclass and one `register_backend(...)` call
(imported from `te_seq/kernels/__init__.py`, or by the user before use).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from te_seq.kernels import bias as bias_maths
from te_seq.kernels import offsets as offsets_maths
from te_seq.kernels.activations import GluSpec

AUTO = "auto"
KERNELS = (
    "grouped_mm",
    "grouped_wgrad",
    "glu_fc1_forward",
    "glu_fc2_dgrad",
    "act_forward",
    "act_backward",
    "glu_forward",
    "glu_backward",
    "act_fc1_forward",
    "act_fc2_dgrad",
)
GLU_EPILOGUE_KERNELS = ("glu_fc1_forward", "glu_fc2_dgrad", "act_fc1_forward", "act_fc2_dgrad")
ELEMENTWISE_KERNELS = ("act_forward", "act_backward", "glu_forward", "glu_backward")


class Backend:
    """A set of kernels te_seq's ops can run on. Subclasses set the class attributes, override
    `available` / `supports` where they are narrower than "always", and implement the kernels
    (signatures and maths: ``te_seq.kernels.reference``; GLU kernels take a `GluSpec`)."""

    name: str = ""
    auto_priority: int = 0  # "auto" tries higher first
    auto_device_types: frozenset[str] | None = frozenset({"cuda"})  # None: any device
    fallback: bool = False  # runs every kernel on any device: auto's last resort, pure ops' home
    # Kernels that take `gather_rows=` (A row r is x[gather_rows[r]]) / `scatter_rows=` (result
    # row r goes to out[scatter_rows[r]]) natively; te_seq.kernels.routed falls back for the rest.
    gather_kernels: frozenset[str] = frozenset()
    scatter_kernels: frozenset[str] = frozenset()
    # `glu_fc1_forward(..., store_h=False)` skips writing h (returned as None): a forward whose
    # backward never runs (no_grad, inference) moves 2F columns fewer per row
    fc1_h_optional: bool = False

    def available(self) -> tuple[bool, str]:
        """Whether this backend can run on this machine, and why not."""
        return True, ""

    def implements(self, kernel: str) -> bool:
        """Whether this backend has `kernel` at all (its class overrides the method)."""
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; kernels are {KERNELS}")
        return getattr(type(self), kernel) is not getattr(Backend, kernel)

    def supports(self, kernel: str, **static: Any) -> tuple[bool, str]:
        """Whether `kernel` runs here for the static facts (see the module table), and why not.
        By default: wherever the backend implements it."""
        if self.implements(kernel):
            return True, ""
        if kernel in GLU_EPILOGUE_KERNELS:
            return False, f"the {self.name} backend has no fused activation epilogue"
        return False, f"the {self.name} backend has no {kernel} kernel"

    def routes_natively(self, kernel: str, what: str, **static: Any) -> bool:
        """Whether `kernel` takes `gather_rows` (what="gather") or `scatter_rows` ("scatter")
        itself for the static facts (those of `supports`); te_seq.kernels.routed gathers or
        scatters in a separate pass otherwise. Default: the kernel is in `gather_kernels` /
        `scatter_kernels`; a backend that accepts them only for some shapes overrides this."""
        if what not in ("gather", "scatter"):
            raise ValueError(f"routes_natively: what must be 'gather' or 'scatter', got {what!r}")
        return kernel in (self.gather_kernels if what == "gather" else self.scatter_kernels)

    def auto_eligible(self, device: torch.device) -> bool:
        """Whether "auto" considers this backend for data on `device`."""
        return self.auto_device_types is None or device.type in self.auto_device_types

    def _missing(self, kernel: str) -> NotImplementedError:
        return NotImplementedError(f"backend {self.name!r} has no {kernel} kernel")

    # --- kernels ------------------------------------------------------------------------------
    def grouped_mm(
        self,
        a: Tensor,
        b: Tensor,
        offs: Tensor,
        bias: Tensor | None = None,
        bias_scales: Tensor | None = None,
    ) -> Tensor:
        raise self._missing("grouped_mm")

    def grouped_wgrad(
        self,
        grad_out: Tensor,
        x: Tensor,
        offs: Tensor,
        out: Tensor | None = None,
        accumulate: bool = False,
    ) -> Tensor:
        raise self._missing("grouped_wgrad")

    def glu_fc1_forward(
        self,
        x: Tensor,
        w1t: Tensor,
        offs: Tensor,
        glu: GluSpec,
        probs: Tensor | None = None,
        bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        raise self._missing("glu_fc1_forward")

    def glu_fc2_dgrad(
        self,
        dy: Tensor,
        w2: Tensor,
        offs: Tensor,
        h: Tensor,
        glu: GluSpec,
        probs: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        raise self._missing("glu_fc2_dgrad")

    def act_forward(self, x: Tensor, act: str) -> Tensor:
        raise self._missing("act_forward")

    def act_backward(self, x: Tensor, dy: Tensor, act: str) -> Tensor:
        raise self._missing("act_backward")

    def glu_forward(self, x: Tensor, glu: GluSpec, scales: Tensor | None = None) -> Tensor:
        raise self._missing("glu_forward")

    def glu_backward(
        self, x: Tensor, dy: Tensor, glu: GluSpec, scales: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        raise self._missing("glu_backward")

    def act_fc1_forward(
        self, x: Tensor, w1t: Tensor, offs: Tensor, act: str, probs: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        raise self._missing("act_fc1_forward")

    def act_fc2_dgrad(
        self,
        dy: Tensor,
        w2: Tensor,
        offs: Tensor,
        h: Tensor,
        act: str,
        probs: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        raise self._missing("act_fc2_dgrad")

    def group_col_sums(self, dout: Tensor, offs: Tensor, scales: Tensor | None = None) -> Tensor:
        """Per-expert column sums [E, N] (float32; float64 data: float64) of dout [M, N], rows
        scaled by ``scales`` [M] if given: the bias gradients. Default: ``bias.group_col_sums``."""
        return bias_maths.group_col_sums(dout, offs, scales)

    def group_offsets(self, splits: Tensor, rows: int, device: torch.device) -> Tensor:
        """int32 cumulative row ends [G] on ``device`` of split sizes [G], checked at run time
        to be non-negative and to sum to ``rows`` (device split sizes: no host sync).
        Default: ``offsets.checked_offsets`` (torch ops)."""
        return offsets_maths.checked_offsets(splits, rows, device)

    def __repr__(self) -> str:
        return f"<te_seq backend {self.name!r}>"


# --- registry -------------------------------------------------------------------------------

_registry: dict[str, Backend] = {}
_availability: dict[str, tuple[bool, str]] = {}
_version = [0]


def register_backend(backend: Backend) -> Backend:
    """Add `backend` under `backend.name` (ValueError if the name is taken or reserved)."""
    name = backend.name
    if not name or name == AUTO:
        raise ValueError(f"a backend needs a name other than {AUTO!r}, got {name!r}")
    if name in _registry:
        raise ValueError(f"backend {name!r} is already registered")
    _registry[name] = backend
    _version[0] += 1
    return backend


def unregister_backend(name: str) -> None:
    """Remove a registered backend (ValueError if there is none of that name)."""
    get_backend(name)
    del _registry[name]
    _availability.pop(name, None)
    _version[0] += 1


def get_backend(name: str) -> Backend:
    """The registered backend called `name`; ValueError listing the choices if none."""
    found = _registry.get(name)
    if found is None:
        raise ValueError(f"unknown backend {name!r}; choose one of {backend_names()}")
    return found


def backend_names() -> tuple[str, ...]:
    """What `te_seq.backend(name)` accepts: "auto", then the backends in registration order."""
    return (AUTO, *_registry)


def list_backends() -> list[Backend]:
    """The registered backends in the order "auto" tries them (highest priority first)."""
    return sorted(_registry.values(), key=lambda b: -b.auto_priority)


def registry_version() -> int:
    """Bumped by every register / unregister (part of the plan cache key)."""
    return _version[0]


def backend_available(name: str) -> tuple[bool, str]:
    """`available()` of a registered backend ("auto" always is), probed once and cached."""
    if name == AUTO:
        return True, ""
    if name not in _availability:
        _availability[name] = get_backend(name).available()
    return _availability[name]


def _fallback() -> Backend:
    for candidate in list_backends():
        if candidate.fallback:
            return candidate
    raise RuntimeError("no fallback backend is registered (te_seq.kernels.reference is)")


# --- the user's selection -------------------------------------------------------------------

_state = threading.local()
_global_backend = [AUTO]


def _require_available(name: str) -> None:
    if name != AUTO:
        get_backend(name)
    ok, reason = backend_available(name)
    if not ok:
        raise RuntimeError(f"backend {name!r} is not available: {reason}")


def set_backend(name: str) -> None:
    """Set the process-wide backend (outside any `backend(...)` block)."""
    _require_available(name)
    _global_backend[0] = name


def current_backend() -> str:
    """The name of the backend asked for here ("auto" unless set)."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else _global_backend[0]


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


# --- the plan-time choice -------------------------------------------------------------------


class KernelNeed(NamedTuple):
    """A kernel an op will call, with its static facts besides dtype and device."""

    kernel: str
    facts: Mapping[str, Any]


class BackendChoice(NamedTuple):
    """The backend a plan step runs on and why (shown in `fusion_plan()`)."""

    backend: Backend
    reason: str


def choose_backend(
    requested: str, dtype: torch.dtype, device: torch.device, needs: Sequence[KernelNeed]
) -> BackendChoice:
    """The backend that runs an op needing `needs` for `dtype` data on `device`.

    An explicit request runs where it supports every kernel; otherwise "auto"'s choice among
    the rest runs, and the reason says why. "auto" takes the highest-priority available backend
    eligible for the device that supports every kernel, the fallback last. An op with no kernel
    of its own runs on the fallback.
    """
    if not needs:
        return _choose_without_kernels(requested, dtype, device)
    if requested == AUTO:
        return _choose_auto(dtype, device, needs)
    wanted = get_backend(requested)
    ok, why = backend_available(requested)
    if ok:
        ok, why = _runs_all(wanted, dtype, device, needs)
    if ok:
        return BackendChoice(wanted, "requested")
    chosen = _choose_auto(dtype, device, needs, skip=wanted).backend
    return BackendChoice(chosen, f"{requested} requested; runs {chosen.name}: {why}")


def _runs_all(candidate: Backend, dtype, device, needs: Sequence[KernelNeed]) -> tuple[bool, str]:
    """Whether `candidate` supports every kernel in `needs`, and the first reason it does not."""
    for need in needs:
        ok, why = candidate.supports(need.kernel, dtype=dtype, device=device, **need.facts)
        if not ok:
            return False, why
    return True, ""


def _choose_auto(
    dtype, device: torch.device, needs: Sequence[KernelNeed], skip: Backend | None = None
) -> BackendChoice:
    fallback = _fallback()
    notes = []  # why each faster backend eligible for the device was passed over
    for candidate in list_backends():
        if candidate in (skip, fallback) or not candidate.auto_eligible(device):
            continue
        ok, why = backend_available(candidate.name)
        if not ok:
            notes.append(f"{candidate.name} unavailable: {why}")
            continue
        ok, why = _runs_all(candidate, dtype, device, needs)
        if ok:
            return BackendChoice(candidate, "; ".join(["auto: fastest available", *notes]))
        notes.append(f"{candidate.name}: {why}")
    if not notes:
        why = f"data on {device.type}: auto runs the {fallback.name} there"
        return BackendChoice(fallback, why)
    return BackendChoice(fallback, "; ".join(["auto: fastest available", *notes]))


def _choose_without_kernels(requested: str, dtype, device: torch.device) -> BackendChoice:
    fallback = _fallback()
    if requested == fallback.name:
        return BackendChoice(fallback, "requested")
    if requested == AUTO:
        auto = _choose_auto(dtype, device, ())
        if auto.backend is fallback:
            return auto
    return BackendChoice(fallback, "pure PyTorch op: no GPU kernel of its own")
