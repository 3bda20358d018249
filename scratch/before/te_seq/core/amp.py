"""`torch.autocast` in te_seq: read once per call, honoured explicitly by each op.

Autocast changes the dtype of the torch functions it lists (matmuls to the low-precision dtype;
on CUDA also norms, `pow`, `rsqrt`, `sum`, ... to fp32). te_seq's ops call many such functions
internally, and their backward runs where autocast is usually off, so leaving autocast on inside
them would make dtypes depend on where each op happens to be computed (and differ between a
fused op and its unfused chain). Instead the fuser reads the state once per call
(`AutocastState.current`), hands it to every op in its context (`ctx.autocast`), and runs
te_seq's own ops with torch's autocast off (`step_scope`); each applies the policy torch applies
to its PyTorch equivalent (docs/design.md, "Mixed precision"):

- GEMMs (BasicLinear, GroupedLinear and the fused ops' GEMMs, as `torch.nn.functional.linear`):
  x, W and a GEMM's own bias are cast to the autocast dtype (`gemm_dtype`); the output has that
  dtype; backward computes in it and returns dx in the input's dtype, dW in the weight's.
- Bias: b is cast to the input's dtype (as `torch.nn.Linear`'s bias is under autocast).
- LayerNorm / RMSNorm: fp32 output where torch's autocast runs norms in fp32 (CUDA and other
  accelerators), the input's dtype on CPU (`norm_dtype`).
- Everything else keeps the input's dtype, as without autocast.

A user's op (a class defined outside te_seq, subclasses of te_seq's ops included) runs with
torch's autocast on, as any PyTorch code in the autocast region would.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

# Dtypes autocast casts (float64 never is, as in torch).
_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AutocastState:
    """torch.autocast's low-precision `dtype` for `device_type`, active for one te_seq call."""

    dtype: torch.dtype
    device_type: str

    @staticmethod
    def current(device: torch.device) -> AutocastState | None:
        """The autocast state for `device`'s type now (None when autocast is off there)."""
        kind = device.type
        try:
            if not torch.is_autocast_enabled(kind):
                return None
        except RuntimeError:  # a device type autocast does not know (meta, lazy, ...)
            return None
        return AutocastState(torch.get_autocast_dtype(kind), kind)

    @property
    def norms_in_fp32(self) -> bool:
        """Whether torch's autocast runs layer_norm / rms_norm in fp32 on this device type."""
        return self.device_type != "cpu"


def gemm_dtype(state: AutocastState | None, *tensors: Tensor) -> torch.dtype | None:
    """The dtype a GEMM over `tensors` runs in under `state` (None: as the tensors are)."""
    if state is None or not all(t.dtype in _ELIGIBLE for t in tensors):
        return None
    return state.dtype


def cast(t: Tensor, dtype: torch.dtype | None) -> Tensor:
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def norm_dtype(state: AutocastState | None, input_: Tensor) -> torch.dtype:
    """The dtype of a norm's output for this input under `state`."""
    if state is not None and state.norms_in_fp32 and input_.dtype in _ELIGIBLE:
        return torch.float32
    return input_.dtype


# The autocast state of the te_seq call whose steps run now. A plain module global, not a
# ContextVar: torch.compile(fullgraph=True) traces a global's store but not ContextVar.set. It
# only relaxes an input check, so another thread's call seeing it could at worst get torch's own
# dtype error instead of te_seq's.
_RUNNING: AutocastState | None = None


def running_state() -> AutocastState | None:
    """The autocast state of the te_seq call whose ops run now (for input checks)."""
    return _RUNNING


def mixes_allowed(input_: Tensor, param: Tensor) -> bool:
    """Whether an op may take an input whose dtype differs from its parameters': under autocast,
    when both are dtypes autocast casts."""
    return running_state() is not None and input_.dtype in _ELIGIBLE and param.dtype in _ELIGIBLE


class running:  # noqa: N801 (used like a function: `with amp.running(state):`)
    """The steps of a call made under `state` run inside: `state` is visible to input checks
    (nested calls restore the outer state)."""

    def __init__(self, state: AutocastState) -> None:
        self.state = state
        self.outer: AutocastState | None = None

    def __enter__(self) -> None:
        global _RUNNING
        self.outer, _RUNNING = _RUNNING, self.state

    def __exit__(self, *exc: object) -> None:
        global _RUNNING
        _RUNNING = self.outer


def step_scope(
    state: AutocastState, builtin: bool
) -> contextlib.AbstractContextManager[None]:
    """Where one plan step runs: torch's autocast off for te_seq's own ops (they apply its
    policy themselves), left on for a user's op."""
    if builtin:
        return torch.autocast(state.device_type, enabled=False)
    return contextlib.nullcontext()
