"""The peers: the grouped MLP as a user writes it without te_seq, at its best.

- ``grouped_mm`` / ``grouped_mm_compiled``: ``torch._grouped_mm`` for FC1 and FC2 with the
  activation in between, backward by autograd (torch's own ``_grouped_mm`` backward: no padding
  of its own), eager and ``torch.compile``d (the compiled one fuses the activation into one
  kernel and its backward too).
- ``loop``: a per-expert Python loop of matmuls over host split sizes, one weight per expert,
  backward by autograd.
- ``torchao_fp8`` / ``torchao_fp8_compiled``: the same MLP with torchao's rowwise-FP8 grouped
  GEMM (``_to_fp8_rowwise_then_scaled_grouped_mm``: dynamic rowwise quantization of both operands
  in every GEMM, forward and backward), eager and compiled. An FP8 peer: timed and reported in
  bf16-equivalent TFLOP/s, never the bf16 baseline.
- ``quack``: QuACK's varlen GEMMs, in ``peer_quack.py``.

The grouped_mm and torchao peers of one grad mode share one set of weights (one ``GradState``)
to save memory: each step starts from the same gradient state whoever ran before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from grad_modes import GradState
from mlp_case import AutogradVariant, Case, swiglu
from torch import Tensor

# The bf16 tolerance for variants that must compute in bf16 when the run is fp32 (dry run), and
# the tolerance of the FP8 peer: rowwise e4m3 (3 mantissa bits) on both operands of every GEMM
# gives relative errors of a few percent on y, dx and the wgrads.
BF16_TOL = 3e-2
FP8_TOL = 1e-1


class PeerWeights:
    """One [E, 2F, H] and one [E, H, F] weight Parameter (te_seq's layout), their GradState."""

    def __init__(self, case: Case, grad_mode: str, dtype: torch.dtype) -> None:
        self.w1 = torch.nn.Parameter(case.w1.to(dtype, copy=True))
        self.w2 = torch.nn.Parameter(case.w2.to(dtype, copy=True))
        self.state = GradState(grad_mode, [self.w1, self.w2])


class SharedWeights:
    """PeerWeights per dtype for the peers of one case and grad mode."""

    def __init__(self, case: Case, grad_mode: str) -> None:
        self.case, self.grad_mode = case, grad_mode
        self._by_dtype: dict[torch.dtype, PeerWeights] = {}

    def get(self, dtype: torch.dtype) -> PeerWeights:
        if dtype not in self._by_dtype:
            self._by_dtype[dtype] = PeerWeights(self.case, self.grad_mode, dtype)
        return self._by_dtype[dtype]


def grouped_mm_mlp(x: Tensor, w1: Tensor, w2: Tensor, probs: Tensor | None, offs: Tensor) -> Tensor:
    """y = swiglu(x W1_eᵀ) W2_eᵀ per expert with torch._grouped_mm; x [M, H] -> [M, H]."""
    h = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)  # [M, 2F]; H_e = X_e W1_eᵀ
    return torch._grouped_mm(swiglu(h, probs), w2.transpose(1, 2), offs=offs)  # [M, H]


def _compile(fn: Callable, backend: str, fullgraph: bool = True) -> Callable:
    # fullgraph for our own function: a graph break would time a half-eager function under the
    # "compiled" name. torchao's FP8 path is compiled as its users do, graph breaks allowed.
    return torch.compile(fn, backend=backend, fullgraph=fullgraph)


class _SharedWeightsPeer(AutogradVariant):
    """A peer running ``self.mlp(x, w1, w2, probs, offs)`` on the shared [E, ...] weights."""

    is_peer = True

    def _bind(self, shared: SharedWeights, mlp: Callable) -> None:
        pw = shared.get(self.dtype)
        self.weights, self.w1, self.w2, self.mlp = pw.state, pw.w1, pw.w2, mlp

    def run(self, x: Tensor, probs: Tensor | None) -> Tensor:
        return self.mlp(x, self.w1, self.w2, probs, self.case.offs)

    def stacked_wgrads(self, grads: list[Tensor]) -> tuple[Tensor, Tensor]:
        return grads[0], grads[1]


class GroupedMMPeer(_SharedWeightsPeer):
    """torch._grouped_mm MLP with autograd, eager or compiled (``compile_backend``)."""

    def __init__(self, case: Case, shared: SharedWeights, compile_backend: str | None) -> None:
        # torch's meta function for _grouped_mm takes bf16 only, so on an fp32 (CPU dry) run the
        # compiled peer computes in bf16 and is checked with the bf16 tolerance.
        dtype = case.x.dtype
        if compile_backend and dtype == torch.float32:
            dtype, self.check_tol = torch.bfloat16, BF16_TOL
            self.note = "bf16 (torch.compile of _grouped_mm takes bf16 only)"
        super().__init__(case, dtype)
        self.name = "grouped_mm_compiled" if compile_backend else "grouped_mm"
        mlp = grouped_mm_mlp
        self._bind(shared, _compile(mlp, compile_backend) if compile_backend else mlp)


class LoopPeer(AutogradVariant):
    """Per-expert matmuls over host split sizes, one weight Parameter per expert."""

    name, is_peer = "loop", True

    def __init__(self, case: Case, grad_mode: str) -> None:
        super().__init__(case)
        self.w1 = [torch.nn.Parameter(w.clone()) for w in case.w1]  # E × [2F, H]
        self.w2 = [torch.nn.Parameter(w.clone()) for w in case.w2]  # E × [H, F]
        self.weights = GradState(grad_mode, self.w1 + self.w2)

    def run(self, x: Tensor, probs: Tensor | None) -> Tensor:
        parts = []
        rows = x.split(self.case.sizes)
        p_rows = probs.split(self.case.sizes) if probs is not None else [None] * len(rows)
        for e, (x_e, p_e) in enumerate(zip(rows, p_rows)):
            h_e = x_e @ self.w1[e].t()  # [M_e, 2F]
            parts.append(swiglu(h_e, p_e) @ self.w2[e].t())  # [M_e, H]
        return torch.cat(parts)  # [M, H]

    def stacked_wgrads(self, grads: list[Tensor]) -> tuple[Tensor, Tensor]:
        E = len(self.w1)
        return torch.stack(grads[:E]), torch.stack(grads[E:])


# --------------------------------------------------------------------------- torchao FP8

def torchao_fp8_unavailable(case: Case) -> str:
    """Why the torchao FP8 peer cannot run here ("" when it can)."""
    try:
        import torchao.prototype.moe_training as moe_training
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip
        return (
            "torchao not importable (benchmark extra: pip install torchao==0.18.0; "
            f"benchmarks/README.md): {type(exc).__name__}: {exc}"[:240]
        )
    if not hasattr(moe_training, "_to_fp8_rowwise_then_scaled_grouped_mm"):
        return f"torchao {_version('torchao')} has no _to_fp8_rowwise_then_scaled_grouped_mm"
    if case.x.device.type != "cuda":
        return "torchao's FP8 grouped GEMM needs CUDA (sm_90+); this run is on the CPU"
    s = case.shape
    odd = [n for n in case.sizes if n % 16]
    if odd or s.H % 16 or s.F % 16:
        # torchao 0.18 asserts pad_token_groups_for_grouped_mm=False: groups must be aligned
        return (
            "torchao's FP8 grouped GEMM needs group sizes, H and F multiples of 16 "
            f"({len(odd)} of {s.E} groups are not; torchao 0.18 cannot pad them itself)"
        )
    return ""


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def make_torchao_fp8_mlp() -> Callable:
    """grouped_mm_mlp with torchao's rowwise FP8 grouped GEMM (bf16 in, bf16 out); the import
    happens here, outside the function torch.compile traces."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as fp8_mm

    def torchao_fp8_mlp(
        x: Tensor, w1: Tensor, w2: Tensor, probs: Tensor | None, offs: Tensor
    ) -> Tensor:
        def mm(a: Tensor, b_t: Tensor) -> Tensor:  # b_t [E, K, N], column-major per group
            # positional: out_dtype, float8_dtype, pad_token_groups_for_grouped_mm (torchao 0.18
            # implements only False: the groups must already be multiples of 16)
            return fp8_mm(a, b_t, offs, torch.bfloat16, torch.float8_e4m3fn, False)

        h = mm(x, w1.transpose(1, 2))  # [M, 2F]; H_e = X_e W1_eᵀ
        return mm(swiglu(h, probs), w2.transpose(1, 2))  # [M, H]

    return torchao_fp8_mlp


class TorchaoFP8Peer(_SharedWeightsPeer):
    """The grouped_mm MLP with torchao's rowwise-FP8 grouped GEMM, eager or compiled."""

    precision, check_tol = "fp8", FP8_TOL

    def __init__(self, case: Case, shared: SharedWeights, compile_backend: str | None) -> None:
        reason = torchao_fp8_unavailable(case)
        if reason:
            raise RuntimeError(reason)
        super().__init__(case)
        self.name = "torchao_fp8_compiled" if compile_backend else "torchao_fp8"
        self.note = f"torchao {_version('torchao')} rowwise FP8; bf16-equivalent TFLOP/s"
        mlp = make_torchao_fp8_mlp()
        if compile_backend:
            mlp = _compile(mlp, compile_backend, fullgraph=False)
        self._bind(shared, mlp)
