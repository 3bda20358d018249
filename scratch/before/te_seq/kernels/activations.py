"""The one activation table: name -> (f, f', whether the cute GLU epilogue has it).

Every place that needs the activation vocabulary reads it here: the reference maths
(``reference.act_forward`` / ``glu_forward``), the cute GLU kernels' list of fused activations
(``cute/glu.py``, ``cute/glu_epilogue.py``, whose DSL formulas are keyed by these names), the
fusions (an activation op whose ``act`` is not here does not fuse) and the tests.

Adding an activation: its f and f' here (torch maths on fp32/fp64 tensors; a gated one may
also transform its up half, and take float parameters), an op class in
``te_seq/ops/basic`` with ``act = "<name>"``, and, to fuse it into the cute GLU epilogue, a DSL
branch in ``cute/glu_maths.py`` plus ``glu_epilogue=True`` (a parameterless non-gated one then
runs in the cute non-gated epilogue too, ``cute/act_epilogue.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

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


def sigmoid(x: Tensor) -> Tensor:
    return torch.sigmoid(x)


def sigmoid_grad(x: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return s * (1 - s)


def qgelu(x: Tensor, alpha: float = 1.702) -> Tensor:
    """Quick GELU: x · sigmoid(alpha · x)."""
    return x * torch.sigmoid(alpha * x)


def qgelu_grad(x: Tensor, alpha: float = 1.702) -> Tensor:
    s = torch.sigmoid(alpha * x)
    return s + alpha * x * s * (1 - s)


def srelu(x: Tensor) -> Tensor:
    """Squared ReLU: relu(x)²."""
    return torch.relu(x) ** 2


def srelu_grad(x: Tensor) -> Tensor:
    return 2 * torch.relu(x)


# --- gated activations with parameters (the up half gets a transform of its own) ------------
# GPT-OSS's clamped SwiGLU: gate clamped above at `limit`, up clamped to ±limit plus an offset.
# Gradients as TransformerEngine's kernels: the gate's passes where gate <= limit, the up's
# where -limit <= up <= limit (the bounds themselves included).


def clamped_qgelu(x: Tensor, limit: float = 7.0, alpha: float = 1.702, offset: float = 1.0):
    """qgelu(min(x, limit), alpha): the clamped SwiGLU's gate."""
    return qgelu(torch.clamp(x, max=limit), alpha)


def clamped_qgelu_grad(x: Tensor, limit: float = 7.0, alpha: float = 1.702, offset: float = 1.0):
    inside = (x <= limit).to(x.dtype)
    return qgelu_grad(torch.clamp(x, max=limit), alpha) * inside


def clamped_linear(u: Tensor, limit: float = 7.0, alpha: float = 1.702, offset: float = 1.0):
    """clamp(u, -limit, limit) + offset: the clamped SwiGLU's up."""
    return torch.clamp(u, -limit, limit) + offset


def clamped_linear_grad(u: Tensor, limit: float = 7.0, alpha: float = 1.702, offset: float = 1.0):
    return ((u >= -limit) & (u <= limit)).to(u.dtype)


# SiTU-GLU (soft-capped SiLU GLU): gate β1·tanh(x/β1)·sigmoid(x), up β2·tanh(u/β2).


def situ_gate(x: Tensor, beta1: float = 4.0, beta2: float = 25.0) -> Tensor:
    return beta1 * torch.tanh(x / beta1) * torch.sigmoid(x)


def situ_gate_grad(x: Tensor, beta1: float = 4.0, beta2: float = 25.0) -> Tensor:
    t, s = torch.tanh(x / beta1), torch.sigmoid(x)
    return (1 - t * t) * s + beta1 * t * s * (1 - s)


def situ_up(u: Tensor, beta1: float = 4.0, beta2: float = 25.0) -> Tensor:
    return beta2 * torch.tanh(u / beta2)


def situ_up_grad(u: Tensor, beta1: float = 4.0, beta2: float = 25.0) -> Tensor:
    t = torch.tanh(u / beta2)
    return 1 - t * t


@dataclass(frozen=True)
class ActSpec:
    """One activation: y = f(x), dy/dx = df(x) (torch maths, elementwise on the pre-activation;
    gated activations apply f to the gate half and `up` (identity when None) to the up half:
    y = f(gate) · up(up)). ``params``: names of the float parameters every function takes after
    x, in order (their defaults are the functions' defaults); a gated op passes its values in
    its `GluSpec`. ``glu_epilogue``: the cute GLU GEMM epilogue computes it (gated, in fp32
    registers)."""

    name: str
    f: Callable[..., Tensor]
    df: Callable[..., Tensor]
    glu_epilogue: bool = False
    up: Callable[..., Tensor] | None = None
    dup: Callable[..., Tensor] | None = None
    params: tuple[str, ...] = ()


_CLAMPED = ("limit", "alpha", "glu_linear_offset")

ACTIVATIONS: dict[str, ActSpec] = {
    spec.name: spec
    for spec in (
        ActSpec("gelu", gelu_tanh, gelu_tanh_grad, glu_epilogue=True),  # tanh approximation
        ActSpec("gelu_erf", gelu_erf, gelu_erf_grad),
        ActSpec("silu", silu, silu_grad, glu_epilogue=True),
        ActSpec("relu", relu, relu_grad, glu_epilogue=True),
        ActSpec("sigmoid", sigmoid, sigmoid_grad, glu_epilogue=True),
        ActSpec("qgelu", qgelu, qgelu_grad, glu_epilogue=True),
        ActSpec("srelu", srelu, srelu_grad, glu_epilogue=True),
        ActSpec("clamped_qgelu", clamped_qgelu, clamped_qgelu_grad, glu_epilogue=True,
                up=clamped_linear, dup=clamped_linear_grad, params=_CLAMPED),
        ActSpec("situ", situ_gate, situ_gate_grad, glu_epilogue=True, up=situ_up,
                dup=situ_up_grad, params=("beta1", "beta2")),
    )
}


def activation(name: str) -> ActSpec:
    """The table entry for `name`; ValueError naming the known ones if there is none."""
    spec = ACTIVATIONS.get(name)
    if spec is None:
        raise ValueError(f"unknown activation {name!r}; known: {tuple(ACTIVATIONS)}")
    return spec


def param_values(name: str, params: tuple[float, ...] = ()) -> tuple[float, ...]:
    """`params` as floats, or, when empty, the defaults of the entry's functions (in the order
    of its ``params``; empty for an entry without parameters)."""
    spec = activation(name)
    if params and len(params) != len(spec.params):
        raise ValueError(f"activation {name!r} takes params {spec.params}, got {params!r}")
    if params:
        return tuple(float(v) for v in params)
    after_x = list(inspect.signature(spec.f).parameters.values())[1 : 1 + len(spec.params)]
    return tuple(float(p.default) for p in after_x)


def epilogue_activations() -> tuple[str, ...]:
    """Names the cute GLU epilogue computes, in table order."""
    return tuple(name for name, spec in ACTIVATIONS.items() if spec.glu_epilogue)


def act_epilogue_activations() -> tuple[str, ...]:
    """Names the cute non-gated epilogue computes (y = f(x)), in table order: the entries the
    GLU epilogue has (its f and f' are the gate's) that take no parameters."""
    return tuple(
        name
        for name, spec in ACTIVATIONS.items()
        if spec.glu_epilogue and spec.up is None and not spec.params
    )


@dataclass(frozen=True)
class GluSpec:
    """What a gated-activation (GLU) kernel needs to know besides its tensors.

    x [..., 2F] holds the gate and up halves ``[gate | up]`` (``glu_interleave_size`` None) or
    alternating blocks of ``glu_interleave_size`` columns; y = act(gate) · up(up) [..., F].
    ``params``: the activation's parameter values, in the order of its table entry's
    ``params`` (empty: the defaults). (Quantization scales join here as new fields, not as new
    positional arguments.)
    """

    act: str
    glu_interleave_size: int | None = None
    params: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        spec = activation(self.act)
        size = self.glu_interleave_size
        if size is not None and (not isinstance(size, int) or size <= 0):
            raise ValueError(f"GluSpec: glu_interleave_size must be a positive int, got {size!r}")
        if self.params and len(self.params) != len(spec.params):
            raise ValueError(
                f"GluSpec: {self.act!r} takes params {spec.params}, got {self.params!r}"
            )
