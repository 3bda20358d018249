"""Pure-PyTorch definitions of te_seq's maths: any device, any dtype; the oracle for every kernel.

Shape legend: M routed rows (tokens), E groups (experts), K reduction dim, N output dim.
Group boundaries come as ``offs``: int32 cumulative row ends, ``offs[e] = sum(split_sizes[:e+1])``,
on the same device as the data. Reference functions read ``offs`` on the host (they may sync);
the GPU backends never do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from te_seq.kernels.activations import GluSpec, activation
from te_seq.kernels.backend import Backend, register_backend


def group_bounds(offs: Tensor) -> list[tuple[int, int]]:
    """(start, end) row range of every group, read on the host."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


class LazyGroupBounds(Sequence):
    """`group_bounds(offs)` read on the host only when first used: code paths that may need
    the bounds (an emulation) take this, and the paths that do not (device kernels) never
    sync."""

    def __init__(self, offs: Tensor) -> None:
        self._offs = offs
        self._bounds: list[tuple[int, int]] | None = None

    def _read(self) -> list[tuple[int, int]]:
        if self._bounds is None:
            self._bounds = group_bounds(self._offs)
        return self._bounds

    def __len__(self) -> int:
        return self._offs.shape[0]

    def __getitem__(self, index):
        return self._read()[index]


def grouped_mm(
    a: Tensor,
    b: Tensor,
    offs: Tensor,
    out_dtype: torch.dtype | None = None,
    bias: Tensor | None = None,
    bias_scales: Tensor | None = None,
) -> Tensor:
    """Varlen-M grouped GEMM: ``out[rows of e] = a[rows of e] @ b[e] (+ s_t · bias[e])``.

    a: [M, K], b: [E, K, N] (any strides), offs: [E] int32, bias: [E, N] or None, bias_scales:
    [M] or None (s_t, the bias scaled per row) -> out: [M, N] in ``out_dtype`` (default
    ``a.dtype``). Products accumulate in float32 (float64 stays float64), as on the GPU; the bias
    is added to the accumulator, then the sum is rounded once. Rows past ``offs[-1]`` are zero.
    """
    out_dtype = out_dtype or a.dtype
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    out = torch.zeros(a.shape[0], b.shape[-1], dtype=out_dtype, device=a.device)
    for e, (start, end) in enumerate(group_bounds(offs)):
        if end > start:
            rows = a[start:end].to(acc) @ b[e].to(acc)
            if bias is not None:
                rows = rows + _group_bias(bias[e], bias_scales, start, end, acc)
            out[start:end] = rows.to(out_dtype)
    return out


def _group_bias(bias_e: Tensor, scales: Tensor | None, start: int, end: int, acc) -> Tensor:
    """b_e [N] (as [1, N]), or s_t · b_e [rows, N] with per-row scales."""
    if scales is None:
        return bias_e.to(acc)
    return scales.reshape(-1)[start:end].to(acc).unsqueeze(-1) * bias_e.to(acc)


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


# --- activations ----------------------------------------------------------------------------
# f and f' come from the one table, te_seq.kernels.activations; gated ones apply f to the gate.


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
    x: Tensor,
    act: str,
    interleave: int | None = None,
    scales: Tensor | None = None,
    params: tuple[float, ...] = (),
) -> Tensor:
    """act(gate) · up (· scales per row), `up` transformed first where the activation says so
    (`params`: its parameter values); computed in fp32 for low-precision inputs."""
    spec = activation(act)
    gate, up = split_glu(_upcast(x), interleave)
    up_value = up if spec.up is None else spec.up(up, *params)
    y = spec.f(gate, *params) * up_value
    if scales is not None:
        y = y * _upcast(scales).unsqueeze(-1)
    return y.to(x.dtype)


def glu_backward(
    x: Tensor,
    dy: Tensor,
    act: str,
    interleave: int | None = None,
    scales: Tensor | None = None,
    params: tuple[float, ...] = (),
) -> tuple[Tensor, Tensor | None]:
    """(d x, d scales) of `glu_forward`."""
    spec = activation(act)
    gate, up = split_glu(_upcast(x), interleave)
    up_value = up if spec.up is None else spec.up(up, *params)
    fg = spec.f(gate, *params)
    dy32 = _upcast(dy)
    dscales = None
    if scales is not None:
        dscales = (dy32 * fg * up_value).sum(-1).to(scales.dtype)
        dy32 = dy32 * _upcast(scales).unsqueeze(-1)
    dgate = dy32 * up_value * spec.df(gate, *params)
    dup = dy32 * fg
    if spec.dup is not None:
        dup = dup * spec.dup(up, *params)
    return merge_glu(dgate, dup, interleave).to(x.dtype), dscales


def act_forward(x: Tensor, act: str) -> Tensor:
    """f(x), computed in fp32 for low-precision inputs."""
    return activation(act).f(_upcast(x)).to(x.dtype)


def act_backward(x: Tensor, dy: Tensor, act: str) -> Tensor:
    """dy · f'(x), computed in fp32 for low-precision inputs."""
    return (_upcast(dy) * activation(act).df(_upcast(x))).to(x.dtype)


def _upcast(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float64 else t.float()


class ReferenceBackend(Backend):
    """The "reference" backend: the functions above, on any device and dtype (the oracle).

    Grouped GEMMs read ``offs`` on the host (a sync): use a GPU backend inside CUDA graphs.
    """

    name = "reference"
    auto_device_types = None
    fallback = True

    def grouped_mm(self, a, b, offs, bias=None, bias_scales=None) -> Tensor:
        return grouped_mm(a, b, offs, bias=bias, bias_scales=bias_scales)

    def grouped_wgrad(self, grad_out, x, offs, out=None, accumulate=False) -> Tensor:
        return grouped_wgrad(grad_out, x, offs, out=out, accumulate=accumulate)

    def act_forward(self, x: Tensor, act: str) -> Tensor:
        return act_forward(x, act)

    def act_backward(self, x: Tensor, dy: Tensor, act: str) -> Tensor:
        return act_backward(x, dy, act)

    def glu_forward(self, x: Tensor, glu: GluSpec, scales: Tensor | None = None) -> Tensor:
        return glu_forward(x, glu.act, glu.glu_interleave_size, scales, glu.params)

    def glu_backward(self, x, dy, glu: GluSpec, scales=None) -> tuple[Tensor, Tensor | None]:
        return glu_backward(x, dy, glu.act, glu.glu_interleave_size, scales, glu.params)


REFERENCE = register_backend(ReferenceBackend())
