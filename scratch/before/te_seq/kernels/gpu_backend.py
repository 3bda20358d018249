"""What the GPU backends share: elementwise maths compiled by `torch.compile` on CUDA.

Subclasses ("torch", "cute") bring the GEMMs. The activations not fused into a GEMM run as the
reference function compiled into one kernel (TorchInductor) on CUDA data while
`te_seq.config.compile_elementwise()` is on, and as the plain reference maths otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from te_seq import config
from te_seq.kernels import reference
from te_seq.kernels.activations import GluSpec
from te_seq.kernels.backend import ELEMENTWISE_KERNELS, Backend
from te_seq.kernels.compiled_maths import CompiledMaths


@functools.lru_cache(maxsize=None)
def _compiled(name: str) -> CompiledMaths:
    """The reference function `name` compiled into one fused kernel (TorchInductor): the
    reference computes in fp32 over several passes (upcast, split, activation, product, cast);
    compiled, it is one read of its inputs and one write of its outputs (measured on an H200,
    2026-11-22: the unfused SwiGLU forward+backward cost more than the FC GEMMs on shape Q)."""
    return CompiledMaths(getattr(reference, name))


def _maths(name: str, x: Tensor) -> Callable:
    """The reference function `name`, compiled for CUDA data when the switch is on."""
    if x.is_cuda and config.compile_elementwise():
        return _compiled(name)
    return getattr(reference, name)


class GpuBackend(Backend):
    """Base of the GPU backends: elementwise kernels for CUDA data (off CUDA they would only be
    the reference maths, so `supports` says no and the plan runs those ops on the reference)."""

    def supports(self, kernel: str, **static: Any) -> tuple[bool, str]:
        if kernel in ELEMENTWISE_KERNELS:
            return self._supports_elementwise(**static)
        return super().supports(kernel, **static)

    def _supports_elementwise(self, *, device: torch.device, **_: Any) -> tuple[bool, str]:
        if device.type != "cuda":
            return False, f"{self.name} compiles elementwise maths for CUDA data only"
        return True, ""

    def act_forward(self, x: Tensor, act: str) -> Tensor:
        return _maths("act_forward", x)(x, act)

    def act_backward(self, x: Tensor, dy: Tensor, act: str) -> Tensor:
        return _maths("act_backward", x)(x, dy, act)

    def glu_forward(self, x: Tensor, glu: GluSpec, scales: Tensor | None = None) -> Tensor:
        return _maths("glu_forward", x)(x, glu.act, glu.glu_interleave_size, scales, glu.params)

    def glu_backward(self, x, dy, glu: GluSpec, scales=None) -> tuple[Tensor, Tensor | None]:
        maths = _maths("glu_backward", x)
        return maths(x, dy, glu.act, glu.glu_interleave_size, scales, glu.params)
