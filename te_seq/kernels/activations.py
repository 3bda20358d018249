"""The one activation table: name -> (f, f', whether the cute GLU epilogue has it).

Every place that needs the activation vocabulary reads it here: the reference maths
(``reference.act_forward`` / ``glu_forward``), the cute GLU kernels' list of fused activations
(``cute/glu.py``, ``cute/glu_epilogue.py``, whose DSL formulas are keyed by these names), the
fusions (an activation op whose ``act`` is not here does not fuse) and the tests.

Adding an activation: its f and f' here (torch maths on fp32/fp64 tensors), an op class in
``te_seq/ops/basic`` with ``act = "<name>"``, and, to fuse it into the cute GLU epilogue, a DSL
branch in ``cute/glu_epilogue.py`` plus ``glu_epilogue=True``.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class ActSpec:
    """One activation: y = f(x), dy/dx = df(x) (torch maths, elementwise on the pre-activation;
    gated activations apply f to the gate half). ``glu_epilogue``: the cute GLU GEMM epilogue
    computes it (gated, in fp32 registers)."""

    name: str
    f: Callable[[Tensor], Tensor]
    df: Callable[[Tensor], Tensor]
    glu_epilogue: bool = False


ACTIVATIONS: dict[str, ActSpec] = {
    spec.name: spec
    for spec in (
        ActSpec("gelu", gelu_tanh, gelu_tanh_grad, glu_epilogue=True),  # tanh approximation
        ActSpec("gelu_erf", gelu_erf, gelu_erf_grad),
        ActSpec("silu", silu, silu_grad, glu_epilogue=True),
        ActSpec("relu", relu, relu_grad, glu_epilogue=True),
    )
}


def activation(name: str) -> ActSpec:
    """The table entry for `name`; ValueError naming the known ones if there is none."""
    spec = ACTIVATIONS.get(name)
    if spec is None:
        raise ValueError(f"unknown activation {name!r}; known: {tuple(ACTIVATIONS)}")
    return spec


def epilogue_activations() -> tuple[str, ...]:
    """Names the cute GLU epilogue computes, in table order."""
    return tuple(name for name, spec in ACTIVATIONS.items() if spec.glu_epilogue)


@dataclass(frozen=True)
class GluSpec:
    """What a gated-activation (GLU) kernel needs to know besides its tensors.

    x [..., 2F] holds the gate and up halves ``[gate | up]`` (``glu_interleave_size`` None) or
    alternating blocks of ``glu_interleave_size`` columns; y = act(gate) · up [..., F].
    (Quantization scales join here as new fields, not as new positional arguments.)
    """

    act: str
    glu_interleave_size: int | None = None

    def __post_init__(self) -> None:
        activation(self.act)
        size = self.glu_interleave_size
        if size is not None and (not isinstance(size, int) or size <= 0):
            raise ValueError(f"GluSpec: glu_interleave_size must be a positive int, got {size!r}")
