"""Where a variant's weight gradients go, per `--grad-mode` (the same protocol for every variant).

- ``fresh``: the weights' ``.grad`` is set to None before each step (a training step without
  gradient accumulation; the default).
- ``accumulate``: ``.grad`` is kept across steps, so every step after the first adds its wgrad
  into it (gradient accumulation over microbatches).
- ``megatron``: Megatron-LM's data-parallel setup: every weight has an fp32 ``main_grad`` buffer
  and ``grad_added_to_main_grad = False``, and a post-accumulate-grad hook that adds ``.grad``
  into ``main_grad`` unless the flag says the op already did, then frees ``.grad``
  (megatron/core/distributed/distributed_data_parallel.py, ``_make_backward_post_hook``).
  te_seq runs with ``accumulate_into_main_grad=True`` (its wgrad lands in ``main_grad`` and sets
  the flag); the peers return a bf16 ``.grad`` that the hook adds into ``main_grad``.

In every mode the inputs' gradients (x, probs) are set to None before each step: in a model
they are activations' gradients, handed to the layer below, never accumulated.
"""

from __future__ import annotations

import torch
from torch import Tensor

GRAD_MODES = ("fresh", "accumulate", "megatron")


def mode_label(grad_mode: str) -> str:
    """The result's mode for forward+backward: "fwd+bwd" (fresh) or "fwd+bwd:<grad mode>"."""
    return "fwd+bwd" if grad_mode == "fresh" else f"fwd+bwd:{grad_mode}"


def _megatron_hook(param: torch.nn.Parameter) -> None:
    """Megatron's backward post-hook: fold `.grad` into `main_grad` unless the op already wrote
    `main_grad` (flag set), then free `.grad`."""
    if param.grad is not None and not getattr(param, "grad_added_to_main_grad", False):
        param.main_grad.add_(param.grad)
    param.grad = None


class GradState:
    """The gradient protocol of one set of weights (shared by the variants that share them)."""

    def __init__(self, grad_mode: str, weights: list[torch.nn.Parameter]) -> None:
        if grad_mode not in GRAD_MODES:
            raise ValueError(f"grad mode {grad_mode!r} is not one of {GRAD_MODES}")
        self.grad_mode, self.weights = grad_mode, weights
        if grad_mode == "megatron":
            for p in weights:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                p.grad_added_to_main_grad = False
                p.register_post_accumulate_grad_hook(_megatron_hook)

    def before_step(self, inputs: list[Tensor]) -> None:
        """Before each forward+backward: inputs' grads None; weights' as the mode says."""
        for t in inputs:
            t.grad = None
        if self.grad_mode == "fresh":
            for p in self.weights:
                p.grad = None

    def reset(self) -> None:
        """Before the checking step: no gradient anywhere, main_grad zero, flags down."""
        for p in self.weights:
            p.grad = None
            if self.grad_mode == "megatron":
                p.main_grad.zero_()
                p.grad_added_to_main_grad = False

    def weight_grads(self) -> list[Tensor]:
        """Each weight's gradient of the steps since `reset` (`main_grad` in megatron mode)."""
        if self.grad_mode == "megatron":
            return [p.main_grad for p in self.weights]
        return [p.grad for p in self.weights]
