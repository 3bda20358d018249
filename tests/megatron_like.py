"""A minimal Megatron-style data-parallel wrapper, for testing the gradient
contract (docs/gradient_contract.md).

It does what Megatron-LM's `DistributedDataParallel` does to every parameter, minus communication:

- an fp32 `main_grad` buffer of the parameter's shape, and `grad_added_to_main_grad = False`;
- a post-accumulate-grad hook that, once autograd has written `.grad`, adds it into `main_grad`
  when `grad_added_to_main_grad` is False *or* `zero_out_wgrad` is True, then sets `.grad = None`
  (megatron/core/distributed/distributed_data_parallel.py, `_make_backward_post_hook`);
- `zero_grad_buffer()` zeroes the buffers and resets the flags (start of an iteration).

A delayed wgrad without `main_grad` lands in `.grad` from `backward_dw()`, outside autograd, so no
hook sees it; `finish_delayed()` folds such leftovers into `main_grad` (Megatron registers wgrad
hooks for delayed wgrad for the same reason). After `finish_delayed()`, `main_grad` alone holds
the gradient of the iteration, so a test can check that nothing was counted twice or lost.
"""

from __future__ import annotations

import torch


class MegatronLikeDDP:
    """Equip `module`'s parameters as Megatron's DDP does (see the module docstring)."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        with_flag: bool = True,
        zero_out_wgrad: bool = False,
        overwrite_main_grad: bool = False,
    ) -> None:
        self.params = list(module.parameters())
        self.hook_calls = 0
        self._handles = []
        for param in self.params:
            param.main_grad = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
            if with_flag:
                param.grad_added_to_main_grad = False
            if zero_out_wgrad:
                param.zero_out_wgrad = True
            param.overwrite_main_grad = overwrite_main_grad
            self._handles.append(param.register_post_accumulate_grad_hook(self._hook))

    def _hook(self, param: torch.nn.Parameter) -> None:
        self.hook_calls += 1
        if param.grad is not None and (
            not getattr(param, "grad_added_to_main_grad", False)
            or getattr(param, "zero_out_wgrad", False)
        ):
            param.main_grad.add_(param.grad.data)
        param.grad = None

    def finish_delayed(self) -> None:
        """Fold `.grad` left by `backward_dw()` (delayed wgrad without main_grad) into main_grad."""
        for param in self.params:
            if param.grad is not None:
                param.main_grad.add_(param.grad.data)
                param.grad = None

    def zero_grad_buffer(self) -> None:
        for param in self.params:
            param.main_grad.zero_()
            if hasattr(param, "grad_added_to_main_grad"):
                param.grad_added_to_main_grad = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
