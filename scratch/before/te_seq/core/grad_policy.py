"""The gradient contract (docs/gradient_contract.md): the one place that decides where a
weight gradient goes.

Every op with weights (BasicLinear, GroupedLinear, the fused GroupedMLP) records its weights at
forward (`ForwardWeights.take`, weak references to the very Parameter objects the forward used),
describes its wgrad at backward as a `WgradRequest` and hands it to its `WeightGradPolicy`; the
policy runs it now or queues it for `backward_dw()`, writes `.grad` or `main_grad`, sets
`grad_added_to_main_grad`, and says what autograd gets back:

| configuration                               | wgrad goes to                    | autograd gets |
|---------------------------------------------|----------------------------------|---------------|
| default                                     | `.grad` via autograd             | real wgrad    |
| delayed                                     | `.grad` (added) in backward_dw() | None          |
| main_grad, param has no flag attribute      | main_grad (+= or = if overwrite) | None          |
| main_grad, param has grad_added_to_main_grad| main_grad; flag set True         | dummy         |
| delayed + main_grad (without / with flag)   | main_grad in backward_dw()       | None / dummy  |

The attributes (`main_grad`, `overwrite_main_grad`, `grad_added_to_main_grad`, `zero_out_wgrad`)
are read on the forward's Parameter when the wgrad is computed (at backward, or in backward_dw()
when delayed), so a trainer may set or swap `main_grad` or `overwrite_main_grad` in between.

A dummy is a freshly allocated tensor shaped like the weight (zeros when the parameter has
`zero_out_wgrad=True`, otherwise uninitialised): it never shares storage with anything, so a
later in-place write through `.grad` cannot corrupt another parameter.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ForwardWeights:
    """The weights one forward call used, by weak reference, and which of them need a gradient.

    Taken in forward so that the wgrad targets the forward's Parameter objects even if the module's
    attribute is replaced before backward; weak so a queued wgrad never keeps a weight alive.
    """

    op_name: str
    names: tuple[str, ...]
    refs: tuple[weakref.ref, ...]
    needs_grad: tuple[bool, ...]

    @staticmethod
    def take(
        op_name: str, named_params: Sequence[tuple[str, torch.nn.Parameter]]
    ) -> ForwardWeights:
        return ForwardWeights(
            op_name,
            tuple(name for name, _ in named_params),
            tuple(weakref.ref(p) for _, p in named_params),
            tuple(bool(p.requires_grad) for _, p in named_params),
        )

    @property
    def any_needs_grad(self) -> bool:
        return any(self.needs_grad)

    def check_main_grads(self) -> None:
        """Check every main_grad buffer a wgrad of these weights will write (see
        `check_main_grad`), and that the weights are still alive."""
        for name, param, needed in zip(self.names, self.params(), self.needs_grad):
            if needed:
                check_main_grad(f"{self.op_name}.{name}", param)

    def params(self) -> list[torch.nn.Parameter]:
        """The original Parameter objects; a clear error if one was freed meanwhile."""
        out = []
        for name, ref in zip(self.names, self.refs):
            param = ref()
            if param is None:
                raise RuntimeError(
                    f"{self.op_name}.{name}: the weight used in forward was freed before its "
                    "gradient was computed (keep the Parameter alive until backward / "
                    "backward_dw() has run)"
                )
            out.append(param)
        return out


@dataclass
class WgradRequest:
    """One pending weight gradient of an op: the forward's weights and how to compute their grads.

    `compute()` returns one gradient per weight (in the weight's dtype). `compute_into(outs,
    accumulate)`, when given, writes (or adds) all gradients straight into the given buffers —
    the fp32 `main_grad` path, with no intermediate low-precision copy.
    """

    weights: ForwardWeights
    compute: Callable[[], Sequence[Tensor]]
    compute_into: Callable[[Sequence[Tensor], bool], None] | None = None

    def params(self) -> list[torch.nn.Parameter]:
        return self.weights.params()


def check_main_grad(label: str, param: torch.nn.Parameter) -> Tensor:
    """`param.main_grad`, checked before anything is written into it: a floating-point tensor
    with the weight's shape on the weight's device (RuntimeError naming op and parameter)."""
    buffer = getattr(param, "main_grad", None)
    if buffer is None:
        raise RuntimeError(
            f"{label}: accumulate_into_main_grad=True but the parameter has no `main_grad` "
            "buffer when its weight gradient is computed (set `param.main_grad` to an fp32 "
            "tensor of the weight's shape before backward)"
        )
    if not isinstance(buffer, Tensor):
        raise RuntimeError(
            f"{label}: main_grad must be a torch.Tensor, got {type(buffer).__name__}"
        )
    if not buffer.is_floating_point():
        raise RuntimeError(
            f"{label}: main_grad has dtype {buffer.dtype}; it must be floating point (fp32)"
        )
    if buffer.device != param.device:
        raise RuntimeError(f"{label}: main_grad is on {buffer.device}, weight on {param.device}")
    if buffer.shape != param.shape:
        raise RuntimeError(
            f"{label}: main_grad has shape {tuple(buffer.shape)}, expected the weight's shape "
            f"{tuple(param.shape)}"
        )
    return buffer


def _main_grads(
    request: WgradRequest, params: Sequence[torch.nn.Parameter], checked: bool
) -> list[Tensor | None]:
    """The main_grad buffer of every weight that needs a gradient (None for the others), all
    checked before any is written (unless `checked`: the fuser did it moments before)."""
    weights = request.weights
    if checked:
        return [p.main_grad if n else None for p, n in zip(params, weights.needs_grad)]
    return [
        check_main_grad(f"{weights.op_name}.{name}", param) if needed else None
        for name, param, needed in zip(weights.names, params, weights.needs_grad)
    ]


def _write_main_grad(request: WgradRequest, checked: bool = False) -> None:
    """main_grad += wgrad, or = wgrad where the parameter says overwrite_main_grad (read now)."""
    params = request.params()
    buffers = _main_grads(request, params, checked)
    overwrite = [bool(getattr(p, "overwrite_main_grad", False)) for p in params]
    uniform = len(set(overwrite)) <= 1 and all(b is not None for b in buffers)
    if request.compute_into is not None and uniform:
        request.compute_into(buffers, not overwrite[0])
        return
    for buffer, grad, over in zip(buffers, request.compute(), overwrite):
        if buffer is None:
            continue
        if over:
            buffer.copy_(grad)
        else:
            buffer.add_(grad)


def _add_to_grad(request: WgradRequest) -> None:
    """Delayed wgrad without main_grad: add into `.grad` (set it when None)."""
    params = request.params()
    for param, grad, needed in zip(params, request.compute(), request.weights.needs_grad):
        if not needed:
            continue
        if param.grad is None:
            param.grad = grad.to(param.dtype).clone(memory_format=torch.contiguous_format)
        else:
            param.grad.add_(grad.to(param.grad.dtype))


def _dummy_or_none(param: torch.nn.Parameter, needed: bool) -> Tensor | None:
    """What autograd gets when the wgrad went (or will go) to main_grad."""
    if not needed or not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    if getattr(param, "zero_out_wgrad", False):
        return torch.zeros_like(param, memory_format=torch.contiguous_format)
    return torch.empty_like(param, memory_format=torch.contiguous_format)


class WeightGradPolicy:
    """Per-op gradient-contract state: the configuration and the FIFO of delayed wgrads."""

    def __init__(self, accumulate_into_main_grad: bool, delay_wgrad_compute: bool) -> None:
        self.accumulate_into_main_grad = bool(accumulate_into_main_grad)
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        self._pending: deque[WgradRequest] = deque()
        # The weights whose main_grad buffers `precheck` checked for the backward running now
        # (each buffer is then checked once per backward: ~0.5 us per Parameter, measured on
        # CPU, 2026, adds up over 2 x 128 expert weights).
        self._checked: ForwardWeights | None = None

    def precheck(self, weights: ForwardWeights) -> None:
        """Check the main_grad buffers the coming non-delayed wgrad of `weights` will write."""
        weights.check_main_grads()
        self._checked = weights

    def backward(self, request: WgradRequest) -> list[Tensor | None]:
        """Route one wgrad at backward time; returns what autograd gets for each weight."""
        needs = request.weights.needs_grad
        if self.delay_wgrad_compute:
            self._pending.append(request)
        elif self.accumulate_into_main_grad:
            checked, self._checked = request.weights is self._checked, None
            with torch.no_grad():
                _write_main_grad(request, checked)
        else:
            return [g if n else None for g, n in zip(request.compute(), needs)]
        if not self.accumulate_into_main_grad:
            return [None] * len(needs)
        return [_dummy_or_none(p, n) for p, n in zip(request.params(), needs)]

    def need_backward_dw(self) -> bool:
        return bool(self._pending)

    def backward_dw(self) -> None:
        """Run the oldest pending wgrad (FIFO over microbatches), then drop its saved tensors.

        If it raises (missing main_grad, freed weight), the wgrad stays queued and nothing has
        been written, so the caller can fix the parameter and call again.
        """
        if not self._pending:
            return
        request = self._pending[0]
        with torch.no_grad():
            if self.accumulate_into_main_grad:
                _write_main_grad(request)
            else:
                _add_to_grad(request)
        self._pending.popleft()

    def clear(self) -> None:
        """Drop every pending wgrad (and the activations it holds) without computing it."""
        self._pending.clear()

    # --- copies and pickling ------------------------------------------------------------------
    # A pending wgrad belongs to the forward that queued it: it targets that forward's Parameter
    # objects (weakly held) and holds its activations. A copy of the op has other Parameters, so
    # it must not inherit the queue (its backward_dw() would write into the original's weights):
    # copies start with none, and the original still runs its own. Pickling cannot carry the
    # queue at all (weak references, closures), so it refuses rather than drop it silently.
    def __deepcopy__(self, memo: dict) -> WeightGradPolicy:
        """The same configuration with no pending wgrads (they stay with the original)."""
        return WeightGradPolicy(self.accumulate_into_main_grad, self.delay_wgrad_compute)

    def __getstate__(self) -> dict:
        if self._pending:
            name = self._pending[0].weights.op_name
            raise RuntimeError(
                f"{name}: cannot pickle an op with {len(self._pending)} delayed weight "
                "gradient(s) pending (delay_wgrad_compute=True): run backward_dw() first (a "
                "pending wgrad refers to this process's Parameters and activations)"
            )
        return {"accumulate_into_main_grad": self.accumulate_into_main_grad,
                "delay_wgrad_compute": self.delay_wgrad_compute}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["accumulate_into_main_grad"], state["delay_wgrad_compute"])


class GradContractMixin:
    """The gradient-contract surface of an op with weights (BasicLinear, GroupedLinear): its
    configuration and delayed-wgrad queue, all delegated to `self.grad_policy`."""

    grad_policy: WeightGradPolicy

    @property
    def delay_wgrad_compute(self) -> bool:
        return self.grad_policy.delay_wgrad_compute

    @property
    def accumulate_into_main_grad(self) -> bool:
        return self.grad_policy.accumulate_into_main_grad

    def need_backward_dw(self) -> bool:
        return self.grad_policy.need_backward_dw()

    def backward_dw(self) -> None:
        """Run this op's oldest pending wgrad (FIFO over microbatches)."""
        self.grad_policy.backward_dw()

    def pre_backward_checks(self, ctx) -> None:
        """Called by the fuser before any backward step of the call runs: the main_grad buffers
        this backward will write (main_grad mode, not delayed) are checked now, so a bad one
        stops the backward before any gradient anywhere in the run is written."""
        policy = self.grad_policy
        if policy.delay_wgrad_compute or not policy.accumulate_into_main_grad:
            return
        weights = getattr(ctx.saved, "weights", None)
        if ctx.weight_requires_grad and isinstance(weights, ForwardWeights):
            policy.precheck(weights)
