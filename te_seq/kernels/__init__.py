"""Functional kernel entry points. Ops call only these; the backend string picks the code.

Backends: "reference" (kernels/reference.py, any device), "torch" (kernels/torch_backend.py),
"cute" (kernels/cute, CUDA sm_90+). Dispatch lives here and nowhere else.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from te_seq import config
from te_seq.kernels import reference


def _module(backend: str):
    if backend == "torch":
        from te_seq.kernels import torch_backend

        return torch_backend
    if backend == "cute":
        from te_seq.kernels import cute

        return cute
    return reference


def split_offsets(split_sizes: Tensor, device: torch.device) -> Tensor:
    """int32 cumulative row ends [E] on `device` (no host sync for device split sizes)."""
    sizes = split_sizes.to(device=device, non_blocking=True)
    return torch.cumsum(sizes, 0, dtype=torch.int32)


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor, backend: str) -> Tensor:
    """out[rows of e] = a[rows of e] @ b[e]; a [M, K], b [E, K, N] -> [M, N]."""
    if backend == "cute":
        from te_seq.kernels import cute

        if not cute.supports(a, b)[0]:
            backend = "torch"
    return _module(backend).grouped_mm(a, b, offs)


def grouped_wgrad(
    grad_out: Tensor,
    x: Tensor,
    offs: Tensor,
    backend: str,
    out: Tensor | None = None,
    accumulate: bool = False,
) -> Tensor:
    """out[e] = grad_out[rows of e]ᵀ @ x[rows of e] -> [E, N, K] (written/added into `out`)."""
    if backend == "cute":
        from te_seq.kernels import cute

        if not cute.supports_wgrad(grad_out, x)[0]:
            backend = "torch"
    return _module(backend).grouped_wgrad(grad_out, x, offs, out=out, accumulate=accumulate)


# --- fused grouped-MLP pieces (GLU activations) ---------------------------------------------
# Shape legend: M rows, E experts, H hidden, F ffn; h = FC1's pre-activation [M, 2F] in the
# activation op's column layout ([gate | up] halves or glu_interleave_size blocks).


def _cute_glu(backend: str, name: str):
    """The cute kernel for a fused GLU step, or None where it does not apply."""
    if backend != "cute":
        return None
    from te_seq.kernels import cute

    return getattr(cute, name, None)


def glu_epilogue_status(
    x: Tensor, w1t: Tensor, w2: Tensor, act: str, interleave: int | None, backend: str
) -> tuple[bool, str]:
    """Whether the fused grouped MLP's activation runs in the GEMM epilogues, and if not why.

    x [M, H] may be empty (only dtype, width and device are read); w1t [E, H, 2F]; w2 [E, H, F].
    """
    fc1, dgrad = _cute_glu(backend, "glu_fc1_forward"), _cute_glu(backend, "glu_fc2_dgrad")
    if fc1 is None or dgrad is None:
        return False, f"the {backend} backend has no fused activation epilogue"
    for name, (ok, why) in (
        ("FC1", fc1.supports(x, w1t, act, interleave)),
        ("FC2 dgrad", dgrad.supports(x, w2, act, interleave)),
    ):
        if not ok:
            return False, f"{name}: {why}"
    return True, ""


def glu_fc1_forward(
    x: Tensor,
    w1t: Tensor,
    offs: Tensor,
    act: str,
    interleave: int | None,
    probs: Tensor | None,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """(h, a): h = x_e W1_eᵀ [M, 2F] and a = act(gate) · up (· probs) [M, F]."""
    fused = _cute_glu(backend, "glu_fc1_forward")
    if fused is not None and fused.supports(x, w1t, act, interleave)[0]:
        return fused(x, w1t, offs, act, interleave, probs)
    h = grouped_mm(x, w1t, offs, backend)
    return h, elementwise("glu_forward", backend, h.device)(h, act, interleave, probs)


def glu_fc2_dgrad(
    dy: Tensor,
    w2: Tensor,
    offs: Tensor,
    h: Tensor,
    act: str,
    interleave: int | None,
    probs: Tensor | None,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(dh, a, dprobs) from dA = dY_e W2_e: the activation gradient, the re-emitted activation
    a (for FC2's wgrad) and d(probs) [M] (None without probs)."""
    fused = _cute_glu(backend, "glu_fc2_dgrad")
    if fused is not None and fused.supports(dy, w2, act, interleave)[0]:
        return fused(dy, w2, offs, h, act, interleave, probs)
    da = grouped_mm(dy, w2, offs, backend)
    dh, dprobs = elementwise("glu_backward", backend, h.device)(h, da, act, interleave, probs)
    return dh, elementwise("glu_forward", backend, h.device)(h, act, interleave, probs), dprobs


# --- elementwise maths on the GPU backends ----------------------------------------------------


class _CompiledElementwise:
    """A reference function compiled by `torch.compile` into one fused kernel (TorchInductor).

    The reference computes in fp32 over several passes (upcast, split, activation, product,
    cast); compiled, it is one read of its inputs and one write of its outputs (measured on an
    H200, 2026-11-22: the unfused SwiGLU forward+backward cost more than the FC GEMMs on shape
    Q). Same maths, so results match the reference to rounding. If compiling fails (no Triton,
    say), it warns once and runs the reference.
    """

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.compiled = torch.compile(fn, dynamic=True)
        self.broken: Exception | None = None

    def __call__(self, *args):
        if self.broken is None:
            try:
                return self.compiled(*args)
            except Exception as exc:  # noqa: BLE001 - any compiler failure falls back
                self.broken = exc
                warnings.warn(
                    f"te_seq: torch.compile of {self.fn.__name__} failed ({exc}); "
                    "running the uncompiled reference",
                    stacklevel=2,
                )
        return self.fn(*args)


@functools.lru_cache(maxsize=None)
def _compiled(name: str) -> _CompiledElementwise:
    return _CompiledElementwise(getattr(reference, name))


def elementwise(name: str, backend: str, device: torch.device) -> Callable:
    """The reference elementwise function `name`, compiled on CUDA for the GPU backends."""
    if backend in ("torch", "cute") and device.type == "cuda" and config.compile_elementwise():
        return _compiled(name)
    return getattr(reference, name)
