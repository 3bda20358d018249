"""The gradient contract (API.md §4): the one place that decides where a weight gradient goes.

Every op with weights (BasicLinear, GroupedLinear, the fused GroupedMLP) describes its wgrad as a
`WgradRequest` and hands it to its `WeightGradPolicy`; the policy runs it now or queues it for
`backward_dw()`, writes `.grad` or `main_grad`, sets `grad_added_to_main_grad`, and says what
autograd gets back:

| configuration                               | wgrad goes to                    | autograd gets |
|---------------------------------------------|----------------------------------|---------------|
| default                                     | `.grad` via autograd             | real wgrad    |
| delayed                                     | `.grad` (added) in backward_dw() | None          |
| main_grad, param has no flag attribute      | main_grad (+= or = if overwrite) | None          |
| main_grad, param has grad_added_to_main_grad| main_grad; flag set True         | dummy         |
| delayed + main_grad (without / with flag)   | main_grad in backward_dw()       | None / dummy  |

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


@dataclass
class WgradRequest:
    """One pending weight gradient of an op: the weights and how to compute their gradients.

    `compute()` returns one gradient per weight (in the weight's dtype). `compute_into(outs,
    accumulate)`, when given, writes (or adds) the gradients straight into the given buffers —
    the fp32 `main_grad` path, with no intermediate low-precision copy.
    """

    op_name: str
    param_names: tuple[str, ...]
    param_refs: tuple[weakref.ref, ...]
    compute: Callable[[], Sequence[Tensor]]
    compute_into: Callable[[Sequence[Tensor], bool], None] | None = None

    @staticmethod
    def for_params(
        op_name: str,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        compute: Callable[[], Sequence[Tensor]],
        compute_into: Callable[[Sequence[Tensor], bool], None] | None = None,
    ) -> WgradRequest:
        names = tuple(name for name, _ in named_params)
        refs = tuple(weakref.ref(p) for _, p in named_params)
        return WgradRequest(op_name, names, refs, compute, compute_into)

    def params(self) -> list[torch.nn.Parameter]:
        """The original Parameter objects; a clear error if one was freed meanwhile."""
        out = []
        for name, ref in zip(self.param_names, self.param_refs):
            param = ref()
            if param is None:
                raise RuntimeError(
                    f"{self.op_name}.{name}: the weight was freed before its gradient was "
                    "computed (keep the module alive until backward/backward_dw has run)"
                )
            out.append(param)
        return out


def _main_grads(request: WgradRequest, params: Sequence[torch.nn.Parameter]) -> list[Tensor]:
    buffers = []
    for name, param in zip(request.param_names, params):
        buffer = getattr(param, "main_grad", None)
        if buffer is None:
            raise RuntimeError(
                f"{request.op_name}.{name}: accumulate_into_main_grad=True but the parameter has "
                "no `main_grad` buffer when its weight gradient is computed (set "
                "`param.main_grad` to an fp32 tensor of the weight's shape before backward)"
            )
        if buffer.shape != param.shape:
            raise RuntimeError(
                f"{request.op_name}.{name}: main_grad has shape {tuple(buffer.shape)}, "
                f"expected the weight's shape {tuple(param.shape)}"
            )
        buffers.append(buffer)
    return buffers


def _write_main_grad(request: WgradRequest) -> None:
    """main_grad += wgrad, or = wgrad where the parameter says overwrite_main_grad."""
    params = request.params()
    buffers = _main_grads(request, params)
    overwrite = [bool(getattr(p, "overwrite_main_grad", False)) for p in params]
    if request.compute_into is not None and len(set(overwrite)) <= 1:
        request.compute_into(buffers, not (overwrite and overwrite[0]))
        return
    for buffer, grad, over in zip(buffers, request.compute(), overwrite):
        if over:
            buffer.copy_(grad)
        else:
            buffer.add_(grad)


def _add_to_grad(request: WgradRequest) -> None:
    """Delayed wgrad without main_grad: add into `.grad` (set it when None)."""
    params = request.params()
    with torch.no_grad():
        for param, grad in zip(params, request.compute()):
            if param.grad is None:
                param.grad = grad.to(param.dtype).clone(memory_format=torch.contiguous_format)
            else:
                param.grad.add_(grad.to(param.grad.dtype))


def _dummy_or_none(param: torch.nn.Parameter) -> Tensor | None:
    """What autograd gets when the wgrad went (or will go) to main_grad."""
    if not hasattr(param, "grad_added_to_main_grad"):
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

    def backward(self, request: WgradRequest) -> list[Tensor | None]:
        """Route one wgrad at backward time; returns what autograd gets for each weight."""
        if self.delay_wgrad_compute:
            self._pending.append(request)
        elif self.accumulate_into_main_grad:
            with torch.no_grad():
                _write_main_grad(request)
        else:
            return list(request.compute())
        if not self.accumulate_into_main_grad:
            return [None] * len(request.param_names)
        return [_dummy_or_none(p) for p in request.params()]

    def need_backward_dw(self) -> bool:
        return bool(self._pending)

    def backward_dw(self) -> None:
        """Run the oldest pending wgrad (FIFO over microbatches), then drop its saved tensors."""
        if not self._pending:
            return
        request = self._pending.popleft()
        with torch.no_grad():
            if self.accumulate_into_main_grad:
                _write_main_grad(request)
            else:
                _add_to_grad(request)

    def clear(self) -> None:
        self._pending.clear()
