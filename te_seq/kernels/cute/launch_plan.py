"""Launch plans: what a CuTe DSL functional decides from a call's signature, kept for the next call.

A functional's host work before its kernel call is mostly a function of the call's *signature*
(the operands' dtypes, shapes, strides and devices, and its options): the tiling, the kernel
config and its compiled kernel, the persistent grid's cluster count, and whether an operand must
be copied into the kernel's layout. ``PlanCache`` maps a signature to that ``LaunchPlan``,
built on the first call and reused while the signature matches; any change of shape, dtype,
stride, device or option is a new signature, so it is decided afresh. Tensor data and ``offs``
are never part of a signature (nothing is read on the host, no sync). Per-call work that
depends on data stays per call (copies, placeholders for absent tensors).

``clear_plans()`` empties every cache (after swapping compile entries, as tests and the host
profiler do). ``PreparedLaunch`` is the base of a call prepared once, outside the caches, for
later calls of the same operand facts (the fused grouped MLP's steady launches).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from .launch import tiling_settings

_CACHES: list[PlanCache] = []
_GENERATION = [0]  # bumped by every `clear_plans` (see `PreparedLaunch`)
_MAX_PLANS = 256  # distinct signatures per functional; a full cache starts over


class LaunchPlan(NamedTuple):
    """A call signature's decisions: the compiled kernel, the cluster count of its persistent
    grid, whether B must be copied into a contiguous layout before its permuted view
    (``launch._b_view``), whether the kernel takes dynamic units (it then needs
    ``unit_order``'s tensor), and whether it stores through its C operand (a GLU FC1 asked
    not to write h may still write it: ``glu.fc1_writes_h``)."""

    kernel: object
    clusters: int
    b_copy: bool = False
    dynamic: bool = False
    writes_c: bool = True


class PlanCache:
    """signature (a hashable tuple) -> `LaunchPlan`, at most ``_MAX_PLANS`` of them."""

    def __init__(self) -> None:
        self._plans: dict[tuple, LaunchPlan] = {}
        # get(signature) -> the plan or None: the dict's own method, no Python frame (read
        # before every launch)
        self.get = self._plans.get
        _CACHES.append(self)

    def put(self, signature: tuple, plan: LaunchPlan) -> LaunchPlan:
        if len(self._plans) >= _MAX_PLANS:  # a workload with ever-changing shapes: no growth
            self._plans.clear()
        self._plans[signature] = plan
        return plan

    def __len__(self) -> int:
        return len(self._plans)


def tensor_signature(t: Tensor | None) -> tuple | None:
    """What a plan may depend on in a tensor: dtype, shape, strides, device (None stays None)."""
    return None if t is None else (t.dtype, t.shape, t.stride(), t.device)


def clear_plans() -> None:
    """Forget every plan (the compiled kernels they hold stay in the compile caches)."""
    _GENERATION[0] += 1
    for cache in _CACHES:
        cache._plans.clear()


class PreparedLaunch:
    """A functional's call prepared once for later calls with the same operand facts
    (``glu.Fc1Launch``, ``fp8_glu.ScaledFc1Launch`` / ``ScaledFc2DgradLaunch``,
    ``fp8.ScaledMmLaunch``): its plan is the subclass's ``_make_plan(*operands)``, made by
    `_planned` at its making and again by `_current` after `clear_plans` (compile entries
    swapped) or a change of the tiling settings (``launch.tiling_settings``, read from the
    environment)."""

    _plan: object

    def _planned(self, *operands):
        """The plan of these operands, made now (and the moment it was made)."""
        self._generation, self._settings = _GENERATION[0], tiling_settings()
        self._plan = self._make_plan(*operands)
        return self._plan

    def _current(self, *operands):
        """The plan, made anew from the call's operands where it is out of date."""
        if self._generation != _GENERATION[0] or self._settings != tiling_settings():
            return self._planned(*operands)
        return self._plan

    def _make_plan(self, *operands):
        raise NotImplementedError
