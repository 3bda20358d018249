"""te_seq's kernels: the backends, the activation table, and thin functional entry points.

Ops call ``ctx.backend.<kernel>(...)``: the fuser puts there the `Backend` the plan chose for
the step (``backend.py`` says how). The functionals below do the same for code outside an op
(tests, benchmarks), with the backend object as an argument. Built-in backends: "reference"
(reference.py, any device; the oracle), "torch" (torch_backend.py), "cute" (cute_backend.py
over the kernels in cute/, CUDA sm_90+). Importing this package imports no CUTLASS.
"""

from __future__ import annotations

from torch import Tensor

# The built-in backends register themselves on import; the order is what error messages list.
# isort: off
from te_seq.kernels import reference  # noqa: F401
from te_seq.kernels import torch_backend  # noqa: F401
from te_seq.kernels import cute_backend  # noqa: F401
# isort: on
from te_seq.kernels.activations import ACTIVATIONS, ActSpec, GluSpec, activation
from te_seq.kernels.backend import (
    Backend,
    BackendChoice,
    KernelNeed,
    backend_available,
    backend_names,
    choose_backend,
    get_backend,
    list_backends,
    register_backend,
    unregister_backend,
)
from te_seq.kernels.offsets import split_offsets

__all__ = [
    "ACTIVATIONS",
    "ActSpec",
    "Backend",
    "BackendChoice",
    "GluSpec",
    "KernelNeed",
    "act_fc1_forward",
    "act_fc2_dgrad",
    "activation",
    "as_rows",
    "backend_available",
    "backend_names",
    "choose_backend",
    "get_backend",
    "glu_fc1_forward",
    "glu_fc2_dgrad",
    "grouped_mm",
    "grouped_wgrad",
    "list_backends",
    "register_backend",
    "split_offsets",
    "unregister_backend",
]


def as_rows(t: Tensor, width: int) -> Tensor:
    """`t` as rows [T, width]: `t` itself when it already is 2-D (a reshape would be a view,
    which a traced forward must copy before saving it), else the reshape."""
    return t if t.dim() == 2 else t.reshape(-1, width)


def grouped_mm(
    a: Tensor,
    b: Tensor,
    offs: Tensor,
    backend: Backend,
    bias: Tensor | None = None,
    bias_scales: Tensor | None = None,
) -> Tensor:
    """out[rows of e] = a[rows of e] @ b[e] (+ s_t · bias[e]); a [M, K], b [E, K, N], bias
    [E, N], bias_scales [M] -> [M, N]."""
    if bias is None:
        return backend.grouped_mm(a, b, offs)
    return backend.grouped_mm(a, b, offs, bias=bias, bias_scales=bias_scales)


def grouped_wgrad(
    grad_out: Tensor,
    x: Tensor,
    offs: Tensor,
    backend: Backend,
    out: Tensor | None = None,
    accumulate: bool = False,
) -> Tensor:
    """out[e] = grad_out[rows of e]ᵀ @ x[rows of e] -> [E, N, K] (written/added into `out`)."""
    return backend.grouped_wgrad(grad_out, x, offs, out=out, accumulate=accumulate)


# --- fused grouped-MLP pieces (GLU activations) ---------------------------------------------
# Shape legend: M rows, E experts, H hidden, F ffn; h = FC1's pre-activation [M, 2F] in the
# activation op's column layout ([gate | up] halves or glu_interleave_size blocks). Only
# backends whose supports("glu_fc1_forward", ...) is True run these; others compose
# grouped_mm with glu_forward (te_seq/ops/fused/grouped_mlp.py decides at plan time).


def glu_fc1_forward(
    x: Tensor,
    w1t: Tensor,
    offs: Tensor,
    glu: GluSpec,
    probs: Tensor | None,
    backend: Backend,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(h, a): h = x_e W1_eᵀ (+ bias[e]) [M, 2F] and a = act(gate) · up (· probs) [M, F], one
    kernel; bias [E, 2F] in h's columns."""
    if bias is None:
        return backend.glu_fc1_forward(x, w1t, offs, glu, probs)
    return backend.glu_fc1_forward(x, w1t, offs, glu, probs, bias=bias)


def glu_fc2_dgrad(
    dy: Tensor,
    w2: Tensor,
    offs: Tensor,
    h: Tensor,
    glu: GluSpec,
    probs: Tensor | None,
    backend: Backend,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(dh, a, dprobs) from dA = dY_e W2_e: the activation gradient, the re-emitted activation
    a (for FC2's wgrad) and d(probs) [M] (None without probs), one kernel."""
    return backend.glu_fc2_dgrad(dy, w2, offs, h, glu, probs)


def act_fc1_forward(
    x: Tensor, w1t: Tensor, offs: Tensor, act: str, probs: Tensor | None, backend: Backend
) -> tuple[Tensor, Tensor]:
    """(h, a) for a non-gated activation: h = x_e W1_eᵀ [M, F] (w1t [E, H, F]) and
    a = act(h) (· probs) [M, F], one kernel."""
    return backend.act_fc1_forward(x, w1t, offs, act, probs)


def act_fc2_dgrad(
    dy: Tensor,
    w2: Tensor,
    offs: Tensor,
    h: Tensor,
    act: str,
    probs: Tensor | None,
    backend: Backend,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(dh, a, dprobs) for a non-gated activation from dA = dY_e W2_e: dh = dA·probs·act'(h),
    a = act(h)·probs (for FC2's wgrad) and d(probs) = Σ_j dA·act(h) [M] (None without probs),
    one kernel."""
    return backend.act_fc2_dgrad(dy, w2, offs, h, act, probs)
