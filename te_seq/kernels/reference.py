"""Pure-PyTorch definitions of te_seq's maths: any device, any dtype; the oracle for every kernel.

Shape legend: M routed rows (tokens), E groups (experts), K reduction dim, N output dim.
Group boundaries come as ``offs``: int32 cumulative row ends, ``offs[e] = sum(split_sizes[:e+1])``,
on the same device as the data. Reference functions read ``offs`` on the host (they may sync);
the GPU backends never do.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_bounds(offs: Tensor) -> list[tuple[int, int]]:
    """(start, end) row range of every group, read on the host."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """Varlen-M grouped GEMM: ``out[rows of e] = a[rows of e] @ b[e]``.

    a: [M, K], b: [E, K, N] (any strides), offs: [E] int32 -> out: [M, N] in ``out_dtype``
    (default ``a.dtype``). Products accumulate in float32 (float64 stays float64), as on the GPU.
    Rows past ``offs[-1]`` are zero.
    """
    out_dtype = out_dtype or a.dtype
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    out = torch.zeros(a.shape[0], b.shape[-1], dtype=out_dtype, device=a.device)
    for e, (start, end) in enumerate(group_bounds(offs)):
        if end > start:
            out[start:end] = (a[start:end].to(acc) @ b[e].to(acc)).to(out_dtype)
    return out


def grouped_wgrad(
    grad_out: Tensor,
    x: Tensor,
    offs: Tensor,
    out: Tensor | None = None,
    accumulate: bool = False,
) -> Tensor:
    """Varlen-K grouped GEMM (weight gradient): ``out[e] = grad_out[rows of e]ᵀ @ x[rows of e]``.

    grad_out: [M, N], x: [M, K], offs: [E] -> out: [E, N, K]. An empty group gives zeros.
    With ``out`` given the result is written there (``accumulate=True``: added to it), in
    ``out.dtype`` (float32 ``main_grad`` buffers); otherwise a new tensor in ``x.dtype``.
    """
    num_groups = offs.shape[0]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    result = torch.zeros(num_groups, grad_out.shape[1], x.shape[1], dtype=acc, device=x.device)
    for e, (start, end) in enumerate(group_bounds(offs)):
        if end > start:
            result[e] = grad_out[start:end].to(acc).t() @ x[start:end].to(acc)
    if out is None:
        return result.to(x.dtype)
    if accumulate:
        out.add_(result.to(out.dtype))
    else:
        out.copy_(result)
    return out


# --- activations --------------------------------------------------------------------------
# Each activation is (f, f') on the pre-activation; gated ones apply f to the gate half.

_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_C = 0.044715


def gelu_tanh(x: Tensor) -> Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def gelu_tanh_grad(x: Tensor) -> Tensor:
    inner = _SQRT_2_OVER_PI * (x + _GELU_C * x**3)
    t = torch.tanh(inner)
    d_inner = _SQRT_2_OVER_PI * (1 + 3 * _GELU_C * x**2)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * d_inner


def gelu_erf(x: Tensor) -> Tensor:
    return torch.nn.functional.gelu(x)


def gelu_erf_grad(x: Tensor) -> Tensor:
    cdf = 0.5 * (1 + torch.erf(x * 0.7071067811865476))
    pdf = torch.exp(-0.5 * x * x) * 0.3989422804014327
    return cdf + x * pdf


def silu(x: Tensor) -> Tensor:
    return torch.nn.functional.silu(x)


def silu_grad(x: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def relu(x: Tensor) -> Tensor:
    return torch.relu(x)


def relu_grad(x: Tensor) -> Tensor:
    return (x > 0).to(x.dtype)


ACTIVATIONS = {
    "gelu": (gelu_tanh, gelu_tanh_grad),
    "gelu_erf": (gelu_erf, gelu_erf_grad),
    "silu": (silu, silu_grad),
    "relu": (relu, relu_grad),
}


def split_glu(x: Tensor, interleave: int | None = None) -> tuple[Tensor, Tensor]:
    """(gate, up) of a GLU input [..., 2F]: halves, or alternating `interleave`-column blocks."""
    if interleave is None:
        gate, up = x.chunk(2, dim=-1)
        return gate, up
    num_blocks = x.shape[-1] // (2 * interleave)  # explicit (not -1): zero-row inputs stay legal
    blocks = x.reshape(*x.shape[:-1], num_blocks, 2, interleave)  # [..., F/s, 2, s]
    return blocks[..., 0, :].flatten(-2), blocks[..., 1, :].flatten(-2)


def merge_glu(gate: Tensor, up: Tensor, interleave: int | None = None) -> Tensor:
    """Inverse of `split_glu`."""
    if interleave is None:
        return torch.cat([gate, up], dim=-1)
    blocks = gate.shape[-1] // interleave  # explicit (not -1): zero-row inputs stay legal
    g = gate.reshape(*gate.shape[:-1], blocks, 1, interleave)
    u = up.reshape(*up.shape[:-1], blocks, 1, interleave)
    return torch.cat([g, u], dim=-2).flatten(-3)


def glu_forward(
    x: Tensor, act: str, interleave: int | None = None, scales: Tensor | None = None
) -> Tensor:
    """act(gate) · up (· scales per row); computed in fp32 for low-precision inputs."""
    f, _ = ACTIVATIONS[act]
    gate, up = split_glu(_upcast(x), interleave)
    y = f(gate) * up
    if scales is not None:
        y = y * _upcast(scales).unsqueeze(-1)
    return y.to(x.dtype)


def glu_backward(
    x: Tensor, dy: Tensor, act: str, interleave: int | None = None, scales: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """(d x, d scales) of `glu_forward`."""
    f, df = ACTIVATIONS[act]
    gate, up = split_glu(_upcast(x), interleave)
    dy32 = _upcast(dy)
    dscales = None
    if scales is not None:
        dscales = (dy32 * f(gate) * up).sum(-1).to(scales.dtype)
        dy32 = dy32 * _upcast(scales).unsqueeze(-1)
    dgate = dy32 * up * df(gate)
    dup = dy32 * f(gate)
    return merge_glu(dgate, dup, interleave).to(x.dtype), dscales


def act_forward(x: Tensor, act: str) -> Tensor:
    return ACTIVATIONS[act][0](_upcast(x)).to(x.dtype)


def act_backward(x: Tensor, dy: Tensor, act: str) -> Tensor:
    return (_upcast(dy) * ACTIVATIONS[act][1](_upcast(x))).to(x.dtype)


def _upcast(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float64 else t.float()
