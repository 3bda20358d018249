"""te_seq's kernels as `torch.library` custom ops, for code that `torch.compile` traces.

While dynamo traces a te_seq run, the fuser hands each op `traced(backend)` instead of the
plan's `Backend`: the same kernels, but each GEMM kernel is one custom op (``te_seq::<kernel>``,
the backend's name as a string argument) with a fake implementation that gives the output
shapes. The compiler sees opaque ops with known shapes, never the Python inside them, so a
kernel that reads ``offs`` on the host (the reference backend) or launches a CuTe DSL kernel
leaves no data-dependent guard, and new split-size values never recompile. At run time each
op calls the named backend's kernel, exactly what eager runs. Eager calls never come here.

Elementwise kernels (activations) are plain PyTorch: they are traced as the reference maths
and the compiler fuses them (the GPU backends compile the same maths in eager mode).

Shape legend: M rows, E groups, K reduction dim, N output dim, F GLU width.
"""

from __future__ import annotations

from torch import Tensor

from te_seq.kernels import reference
from te_seq.kernels._torch_op import kernel_op
from te_seq.kernels.activations import GluSpec
from te_seq.kernels.backend import Backend, get_backend

__all__ = ["TracedBackend", "traced"]


# --- fake implementations: output shapes only ------------------------------------------------


def _fake_grouped_mm(
    a: Tensor, b: Tensor, offs: Tensor, backend: str, bias: Tensor | None = None,
    bias_scales: Tensor | None = None, gather_rows: Tensor | None = None,
    scatter_rows: Tensor | None = None,
) -> Tensor:
    return a.new_empty(_rows(a, gather_rows), b.shape[2])  # [M, N]


def _rows(x: Tensor, gather_rows: Tensor | None) -> int:
    """M: x's rows, or the gathered rows' count (x is then the [T, K] token matrix)."""
    return x.shape[0] if gather_rows is None else gather_rows.shape[0]


def _fake_grouped_wgrad(grad_out: Tensor, x: Tensor, offs: Tensor, backend: str) -> Tensor:
    return x.new_empty(offs.shape[0], grad_out.shape[1], x.shape[1])  # [E, N, K]


def _fake_grouped_wgrad_into(
    grad_out: Tensor, x: Tensor, offs: Tensor, out: Tensor, accumulate: bool, backend: str
) -> None:
    return None


def _fake_fc1(
    x: Tensor, w1t: Tensor, offs: Tensor, act: str, interleave: int | None,
    probs: Tensor | None, params: list[float], backend: str, bias: Tensor | None = None,
    gather_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    width, rows = w1t.shape[2], _rows(x, gather_rows)  # 2F, M
    return x.new_empty(rows, width), x.new_empty(rows, width // 2)


def _fake_fc2_dgrad(
    dy: Tensor, w2: Tensor, offs: Tensor, h: Tensor, act: str, interleave: int | None,
    probs: Tensor | None, params: list[float], backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    rows, f = dy.shape[0], w2.shape[2]
    dprobs = dy.new_empty(0) if probs is None else probs.new_empty(rows)
    return dy.new_empty(rows, 2 * f), dy.new_empty(rows, f), dprobs


def _fake_act_fc1(
    x: Tensor, w1t: Tensor, offs: Tensor, act: str, probs: Tensor | None, backend: str,
    gather_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    rows, f = _rows(x, gather_rows), w1t.shape[2]
    return x.new_empty(rows, f), x.new_empty(rows, f)


def _fake_act_fc2_dgrad(
    dy: Tensor, w2: Tensor, offs: Tensor, h: Tensor, act: str, probs: Tensor | None, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    rows, f = dy.shape[0], w2.shape[2]
    dprobs = dy.new_empty(0) if probs is None else probs.new_empty(rows)
    return dy.new_empty(rows, f), dy.new_empty(rows, f), dprobs


# --- the ops: each runs the named backend's kernel -------------------------------------------


@kernel_op("te_seq::grouped_mm", fake=_fake_grouped_mm)
def grouped_mm_op(
    a: Tensor, b: Tensor, offs: Tensor, backend: str, bias: Tensor | None = None,
    bias_scales: Tensor | None = None, gather_rows: Tensor | None = None,
    scatter_rows: Tensor | None = None,
) -> Tensor:
    """out[rows of e] = a[rows of e] @ b[e] (+ s_t·bias[e]): a [M, K], b [E, K, N] -> [M, N]
    (routed rows, te_seq.kernels.routed: A rows a[gather_rows], result rows at scatter_rows)."""
    inner = get_backend(backend)
    kw = _given(bias=bias, bias_scales=bias_scales, gather_rows=gather_rows,
                scatter_rows=scatter_rows)
    return inner.grouped_mm(a, b, offs, **kw)  # backends without these keep their signature


def _given(**kw) -> dict:
    """The keyword arguments that are not None."""
    return {k: v for k, v in kw.items() if v is not None}


@kernel_op("te_seq::grouped_wgrad", fake=_fake_grouped_wgrad)
def grouped_wgrad_op(grad_out: Tensor, x: Tensor, offs: Tensor, backend: str) -> Tensor:
    """out[e] = grad_out[rows of e]ᵀ @ x[rows of e] -> a new [E, N, K] in x.dtype."""
    return get_backend(backend).grouped_wgrad(grad_out, x, offs)


@kernel_op("te_seq::grouped_wgrad_into", fake=_fake_grouped_wgrad_into, mutates_args=("out",))
def grouped_wgrad_into_op(
    grad_out: Tensor, x: Tensor, offs: Tensor, out: Tensor, accumulate: bool, backend: str
) -> None:
    """The wgrad written (accumulate=False) or added (True) into `out` [E, N, K] (main_grad)."""
    get_backend(backend).grouped_wgrad(grad_out, x, offs, out=out, accumulate=accumulate)


@kernel_op("te_seq::glu_fc1_forward", fake=_fake_fc1)
def glu_fc1_forward_op(
    x: Tensor, w1t: Tensor, offs: Tensor, act: str, interleave: int | None,
    probs: Tensor | None, params: list[float], backend: str, bias: Tensor | None = None,
    gather_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(h [M, 2F], a [M, F]): FC1 (+ bias [E, 2F]) with the GLU activation (`params`: its
    values) in its epilogue (x's rows gathered by `gather_rows`, te_seq.kernels.routed)."""
    glu = GluSpec(act, interleave, tuple(params))
    kw = _given(bias=bias, gather_rows=gather_rows)
    h, a = get_backend(backend).glu_fc1_forward(x, w1t, offs, glu, probs, **kw)
    return h, a


@kernel_op("te_seq::glu_fc2_dgrad", fake=_fake_fc2_dgrad)
def glu_fc2_dgrad_op(
    dy: Tensor, w2: Tensor, offs: Tensor, h: Tensor, act: str, interleave: int | None,
    probs: Tensor | None, params: list[float], backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dh [M, 2F], a [M, F], dprobs [M], or an empty tensor without probs)."""
    glu = GluSpec(act, interleave, tuple(params))
    dh, a, dprobs = get_backend(backend).glu_fc2_dgrad(dy, w2, offs, h, glu, probs)
    return dh, a, dy.new_empty(0) if dprobs is None else dprobs


@kernel_op("te_seq::act_fc1_forward", fake=_fake_act_fc1)
def act_fc1_forward_op(
    x: Tensor, w1t: Tensor, offs: Tensor, act: str, probs: Tensor | None, backend: str,
    gather_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(h [M, F], a [M, F]): FC1 with a non-gated activation in its epilogue (x's rows
    gathered by `gather_rows`)."""
    kw = _given(gather_rows=gather_rows)
    h, a = get_backend(backend).act_fc1_forward(x, w1t, offs, act, probs, **kw)
    return h, a


@kernel_op("te_seq::act_fc2_dgrad", fake=_fake_act_fc2_dgrad)
def act_fc2_dgrad_op(
    dy: Tensor, w2: Tensor, offs: Tensor, h: Tensor, act: str, probs: Tensor | None, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    """(dh [M, F], a [M, F], dprobs [M], or an empty tensor without probs)."""
    dh, a, dprobs = get_backend(backend).act_fc2_dgrad(dy, w2, offs, h, act, probs)
    return dh, a, dy.new_empty(0) if dprobs is None else dprobs


# --- the backend the fuser hands ops while tracing -------------------------------------------


class TracedBackend(Backend):
    """`inner`'s kernels for traced code: GEMMs as the custom ops above, elementwise maths as
    the reference functions (traceable PyTorch). `implements` / `supports` are `inner`'s, so
    plan-time decisions (the grouped MLP's fused epilogue) read the same answers."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name
        # the custom ops pass routed rows through to the kernels that take them
        self.gather_kernels = getattr(inner, "gather_kernels", frozenset())
        self.scatter_kernels = getattr(inner, "scatter_kernels", frozenset())

    def routes_natively(self, kernel: str, what: str, **static) -> bool:
        return self.inner.routes_natively(kernel, what, **static)

    def implements(self, kernel: str) -> bool:
        return self.inner.implements(kernel)

    def supports(self, kernel: str, **static) -> tuple[bool, str]:
        return self.inner.supports(kernel, **static)

    def grouped_mm(self, a, b, offs, bias=None, bias_scales=None, *, gather_rows=None,
                   scatter_rows=None) -> Tensor:
        return grouped_mm_op(a, b, offs, self.name, bias, bias_scales, gather_rows, scatter_rows)

    def grouped_wgrad(self, grad_out, x, offs, out=None, accumulate=False) -> Tensor:
        if out is None:
            return grouped_wgrad_op(grad_out, x, offs, self.name)
        grouped_wgrad_into_op(grad_out, x, offs, out, accumulate, self.name)
        return out

    def glu_fc1_forward(self, x, w1t, offs, glu: GluSpec, probs=None, bias=None, *,
                        gather_rows=None):
        act, size, params = glu.act, glu.glu_interleave_size, list(glu.params)
        return glu_fc1_forward_op(x, w1t, offs, act, size, probs, params, self.name, bias,
                                  gather_rows)

    def glu_fc2_dgrad(self, dy, w2, offs, h, glu: GluSpec, probs=None):
        act, size = glu.act, glu.glu_interleave_size
        params = list(glu.params)
        dh, a, dprobs = glu_fc2_dgrad_op(dy, w2, offs, h, act, size, probs, params, self.name)
        return dh, a, None if probs is None else dprobs

    def act_fc1_forward(self, x, w1t, offs, act: str, probs=None, *,
                        gather_rows=None) -> tuple[Tensor, Tensor]:
        return act_fc1_forward_op(x, w1t, offs, act, probs, self.name, gather_rows)

    def act_fc2_dgrad(self, dy, w2, offs, h, act: str, probs=None):
        dh, a, dprobs = act_fc2_dgrad_op(dy, w2, offs, h, act, probs, self.name)
        return dh, a, None if probs is None else dprobs

    def act_forward(self, x: Tensor, act: str) -> Tensor:
        return reference.act_forward(x, act)

    def act_backward(self, x: Tensor, dy: Tensor, act: str) -> Tensor:
        return reference.act_backward(x, dy, act)

    def glu_forward(self, x: Tensor, glu: GluSpec, scales: Tensor | None = None) -> Tensor:
        return reference.glu_forward(x, glu.act, glu.glu_interleave_size, scales, glu.params)

    def glu_backward(self, x, dy, glu: GluSpec, scales=None) -> tuple[Tensor, Tensor | None]:
        return reference.glu_backward(x, dy, glu.act, glu.glu_interleave_size, scales, glu.params)

    def __repr__(self) -> str:
        return f"<te_seq backend {self.name!r} (traced)>"


_TRACED: dict[str, TracedBackend] = {}


def traced(backend: Backend) -> TracedBackend:
    """The one `TracedBackend` of `backend` (one object per backend, so it can key memos)."""
    found = _TRACED.get(backend.name)
    if found is None or found.inner is not backend:
        found = _TRACED[backend.name] = TracedBackend(backend)
    return found

