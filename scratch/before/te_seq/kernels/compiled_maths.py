"""Elementwise and reduction maths compiled by `torch.compile` for CUDA data.

A function of plain torch ops runs as written (several passes, each reading and writing memory)
on CPU and whenever `te_seq.config.compile_elementwise()` is off; on CUDA data with the switch on
it runs compiled by TorchInductor into fused kernels (one read of its inputs, one write of its
outputs). Same maths: the compiled form may only reorder what is exact (elementwise products,
casts, max reductions), so results match the plain function. fp32 division is compiled as
IEEE division (`eager_numerics.division_rounding`): Triton's default `x / y` is approximate
(div.full), which moved 1051 of 4096 row-wise FP8 scales by an ulp against eager torch (H100,
2026-11-25). If compiling fails (no Triton, say) it warns once and runs the plain function.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from te_seq import config

_OPTIONS = {"eager_numerics.division_rounding": True}  # x / y as eager torch rounds it


class CompiledMaths:
    """`fn` and its `torch.compile(dynamic=True)` form, falling back to `fn` once compiling
    fails (with one warning)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.compiled = torch.compile(fn, dynamic=True, options=_OPTIONS)
        self.broken: Exception | None = None

    def __call__(self, *args):
        if self.broken is None:
            try:
                return self.compiled(*args)
            except Exception as exc:  # noqa: BLE001 - any compiler failure falls back
                self.broken = exc
                warnings.warn(
                    f"te_seq: torch.compile of {self.fn.__name__} failed ({exc}); "
                    "running the uncompiled function",
                    stacklevel=2,
                )
        return self.fn(*args)


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable) -> CompiledMaths:
    return CompiledMaths(fn)


def for_data(fn: Callable, t: Tensor) -> Callable:
    """`fn` compiled when `t` is CUDA data and `config.compile_elementwise()` is on, else `fn`
    (inside a torch.compile trace too: the outer compile fuses it already)."""
    if t.is_cuda and config.compile_elementwise() and not torch.compiler.is_compiling():
        return _compiled(fn)
    return fn
