"""Functional kernel entry points. Ops call only these; the backend string picks the code.

Backends: "reference" (kernels/reference.py, any device), "torch" (kernels/torch_backend.py),
"cute" (kernels/cute, CUDA sm_90+). Dispatch lives here and nowhere else.
"""

from __future__ import annotations

import torch
from torch import Tensor

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

        if not cute.supports_mm(a, b)[0]:
            backend = "torch"
    return _module(backend).grouped_mm(a, b, offs)


def grouped_wgrad(grad_out: Tensor, x: Tensor, offs: Tensor, backend: str,
                  out: Tensor | None = None, accumulate: bool = False) -> Tensor:
    """out[e] = grad_out[rows of e]ᵀ @ x[rows of e] -> [E, N, K] (written/added into `out`)."""
    if backend == "cute":
        from te_seq.kernels import cute

        if not cute.supports_wgrad(grad_out, x)[0]:
            backend = "torch"
    return _module(backend).grouped_wgrad(grad_out, x, offs, out=out, accumulate=accumulate)
