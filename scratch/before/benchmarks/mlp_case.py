"""The grouped-MLP benchmark's data, its fp32 checking reference and the variant interface.

Shape legend: M routed rows (tokens, already permuted by expert), E experts, H hidden, F ffn.
The MLP: h = x W1_eᵀ [M, 2F] (gate then up), a = silu(gate) · up · probs[:, None] [M, F]
(ScaledSwiGLU, router probs; without probs with `--act swiglu`), y = a W2_eᵀ [M, H].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from grad_modes import GradState
from torch import Tensor

ACTS = ("scaled_swiglu", "swiglu")


@dataclass(frozen=True)
class Shape:
    E: int
    H: int
    F: int
    M: int
    skewed: bool = False  # Zipf-like counts, some empty experts, sizes not multiples of 8
    jittered: bool = False  # near-uniform counts, each 0.9-1.1x the mean (`jittered_counts`)


SHAPES = {
    "A": Shape(E=8, H=4096, F=14336, M=32768),
    "B": Shape(E=128, H=4096, F=1024, M=65536),
    "Q": Shape(E=128, H=2048, F=768, M=32768),
    "Z": Shape(E=128, H=2048, F=768, M=32768, skewed=True),
    "J": Shape(E=128, H=2048, F=768, M=32768, jittered=True),  # Q as a router balances it
    # tiny shapes for --dry-run and GPU smoke runs
    "T": Shape(E=6, H=64, F=40, M=203, skewed=True),
    "U": Shape(E=4, H=32, F=24, M=128),
}


def zipf_counts(num_experts: int, num_rows: int, seed: int = 0, s: float = 1.1) -> list[int]:
    """Zipf-like split sizes summing to M: ~1/16 of experts (≥ 1) empty, no size a multiple of 8."""
    gen = torch.Generator().manual_seed(seed)
    rank = torch.randperm(num_experts, generator=gen)  # popularity rank of each expert
    weight = (rank + 1.0) ** -s
    weight[rank >= num_experts - max(1, num_experts // 16)] = 0.0  # least popular are empty
    counts = (weight / weight.sum() * num_rows).floor().long().tolist()
    big = max(range(num_experts), key=lambda e: counts[e])
    for e in range(num_experts):
        if e != big and counts[e] > 0 and counts[e] % 8 == 0:
            counts[e] -= 1
    counts[big] += num_rows - sum(counts)
    if counts[big] % 8 == 0:  # move one row to an expert that stays unaligned
        other = next(e for e in range(num_experts) if e != big and counts[e] % 8 not in (0, 7))
        counts[big] -= 1
        counts[other] += 1
    return counts


def jittered_counts(num_experts: int, num_rows: int, seed: int = 0) -> list[int]:
    """Near-uniform split sizes summing to M, each 0.9-1.1x the mean (a balanced router's
    counts are never all equal): the rounding remainder goes one row each to the experts
    whose shares lost the most to rounding down."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.rand(num_experts, generator=gen, dtype=torch.float64) * 0.2 + 0.9
    share = weight / weight.sum() * num_rows
    counts = share.floor().long()
    left = num_rows - int(counts.sum())
    counts[torch.argsort(share - counts, descending=True)[:left]] += 1
    return counts.tolist()


def split_counts(shape: Shape, seed: int = 0) -> list[int]:
    """The shape's split sizes: Zipf-like, jittered or exactly uniform."""
    if shape.skewed:
        return zipf_counts(shape.E, shape.M, seed)
    if shape.jittered:
        return jittered_counts(shape.E, shape.M, seed)
    return _uniform_counts(shape.E, shape.M)


def _uniform_counts(num_experts: int, num_rows: int) -> list[int]:
    base, extra = divmod(num_rows, num_experts)
    return [base + (1 if e < extra else 0) for e in range(num_experts)]


@dataclass
class Case:
    """One shape's random data; weights in te_seq's layout (FC1 [E, 2F, H], FC2 [E, H, F])."""

    name: str
    shape: Shape
    act: str  # "scaled_swiglu" (with probs) or "swiglu"
    sizes: list[int]  # split sizes on the host
    split_sizes: Tensor  # [E] int64 on the device
    offs: Tensor  # [E] int32 cumulative ends on the device
    x: Tensor  # [M, H]
    w1: Tensor  # [E, 2F, H]
    w2: Tensor  # [E, H, F]
    dy: Tensor  # [M, H]
    probs: Tensor | None  # [M] fp32 router probs in (0, 1); None for plain SwiGLU

    @property
    def uses_probs(self) -> bool:
        return self.probs is not None


def make_case(
    name: str, device: torch.device, dtype: torch.dtype, act: str = "scaled_swiglu", seed: int = 0
) -> Case:
    s = SHAPES[name]
    sizes = split_counts(s, seed)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

    split_sizes = torch.tensor(sizes, dtype=torch.int64, device=device)
    probs = torch.rand(s.M, device=device, generator=gen) if act == "scaled_swiglu" else None
    return Case(
        name=name,
        shape=s,
        act=act,
        sizes=sizes,
        split_sizes=split_sizes,
        offs=split_sizes.cumsum(0).to(torch.int32),
        x=randn(s.M, s.H),
        w1=randn(s.E, 2 * s.F, s.H, scale=s.H**-0.5),
        w2=randn(s.E, s.H, s.F, scale=s.F**-0.5),
        dy=randn(s.M, s.H),
        probs=probs,
    )


def swiglu(h: Tensor, probs: Tensor | None) -> Tensor:
    """silu(gate) · up (· probs[:, None]) in h's dtype, as a model writes it: h [M, 2F] -> [M, F].
    fp32 probs promote the product to fp32 before it is rounded back (Megatron's weighted
    SwiGLU does the same)."""
    gate, up = h.chunk(2, dim=-1)  # [M, F] each
    a = F.silu(gate) * up
    return a if probs is None else (a * probs[:, None]).to(h.dtype)


# --------------------------------------------------------------------------- checking reference


def reference_outputs(case: Case) -> tuple[Tensor, ...]:
    """(y_fwd, y, dx, dW1, dW2[, dprobs]) in fp32: a per-expert loop of fp32 matmuls (TF32 off)
    with autograd, on the case's data. Every variant is compared with it before it is timed."""
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        copies = (t.to(torch.float32, copy=True) for t in (case.x, case.w1, case.w2))
        x, w1, w2 = (t.requires_grad_() for t in copies)  # copies: never the case's own tensors
        probs = case.probs.clone().requires_grad_() if case.uses_probs else None
        parts = []
        rows = x.split(case.sizes)
        p_rows = probs.split(case.sizes) if probs is not None else [None] * len(rows)
        for e, (x_e, p_e) in enumerate(zip(rows, p_rows)):
            h_e = x_e @ w1[e].t()  # [M_e, 2F]
            parts.append(swiglu(h_e, p_e) @ w2[e].t())  # [M_e, H]
        y = torch.cat(parts)  # [M, H]
        y.backward(case.dy.float())
        grads = (x.grad, w1.grad, w2.grad) + ((probs.grad,) if probs is not None else ())
        return (y.detach(), y.detach(), *grads)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32


# --------------------------------------------------------------------------- variants


class Variant:
    """A way to run the MLP. ``forward`` returns y; ``forward_backward`` runs one training step
    and leaves what ``outputs`` returns: (y, dx, dW1 [E, 2F, H], dW2 [E, H, F][, dprobs]),
    weight gradients as the grad mode defines them (the steps since ``reset``; not timed)."""

    name: str
    note: str = ""
    is_peer: bool = False  # a baseline (`vs` is against the best bf16 peer of the run)
    precision: str = "bf16"  # "fp8": quantizes its GEMM operands (not a bf16 baseline)
    check_tol: float | None = None  # overrides the dtype's tolerance (fp8, a bf16-only path)
    times_host: bool = False  # also measure one call's host time (host_ms): te_seq variants

    def forward(self) -> Tensor:
        raise NotImplementedError

    def forward_backward(self) -> None:
        raise NotImplementedError

    def outputs(self) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def reset(self) -> None:
        """Before the checking step: gradients as if no step ran yet."""


class AutogradVariant(Variant):
    """A variant whose backward is autograd's: leaf x (and probs), weights under a GradState.
    Subclasses set ``self.weights`` (a GradState), and define ``run(x, probs) -> y`` and
    ``stacked_wgrads(grads) -> (dW1 [E, 2F, H], dW2 [E, H, F])``."""

    weights: GradState

    def __init__(self, case: Case, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or case.x.dtype
        self.case, self.dtype = case, dtype
        self.x = case.x.to(dtype, copy=True).requires_grad_()
        self.probs = case.probs.clone().requires_grad_() if case.uses_probs else None
        self.dy = case.dy.to(dtype)
        self.y: Tensor | None = None

    def run(self, x: Tensor, probs: Tensor | None) -> Tensor:
        raise NotImplementedError

    def stacked_wgrads(self, grads: list[Tensor]) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def inputs(self) -> list[Tensor]:
        return [self.x] + ([self.probs] if self.probs is not None else [])

    def forward(self) -> Tensor:
        return self.run(self.x, self.probs)

    def forward_backward(self) -> None:
        self.weights.before_step(self.inputs())
        self.y = None
        self.y = self.run(self.x, self.probs)
        self.y.backward(self.dy)

    def reset(self) -> None:
        self.weights.reset()
        for t in self.inputs():
            t.grad = None

    def outputs(self) -> tuple[Tensor, ...]:
        dw1, dw2 = self.stacked_wgrads(self.weights.weight_grads())
        extra = (self.probs.grad,) if self.probs is not None else ()
        return (self.y, self.x.grad, dw1, dw2, *extra)
