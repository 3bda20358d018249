"""The QuACK peer (quack-kernels 0.6.5, the CuTe DSL GEMM library under SonicMoE's MoE kernels):
the grouped SwiGLU MLP from its varlen GEMMs, as its users write it.

Forward:  (h, a) = gemm_gated(x, W1ᵀ, activation="swiglu", cu_seqlens_m)   h [M, 2F], a [M, F]
          a ·= probs[:, None] (one elementwise pass; gemm_gated has no row scale)
          y = gemm(a, W2ᵀ, cu_seqlens_m)                                    [M, H]
Backward: (dh, a·probs, dprobs) = gemm_dgated(dy, W2, h, colvec_scale=probs, colvec_reduce=True)
          dW2 = gemm(dyᵀ, a·probs, cu_seqlens_k)   dW2_e = dY_eᵀ A_e       [E, H, F]
          dx  = gemm(dh, W1, cu_seqlens_m)          dX_e = dH_e W1_e        [M, H]
          dW1 = gemm(dhᵀ, x, cu_seqlens_k)          dW1_e = dH_eᵀ X_e       [E, 2F, H]
Without probs: no scale pass, gemm_dgated without colvec_scale / colvec_reduce.

QuACK's gated GEMMs pair gate and up in adjacent columns, so this peer keeps W1 in that
interleaved layout (rows gate_0, up_0, gate_1, up_1, ...), as a QuACK user would; its dW1 is
de-interleaved to te_seq's [gate; up] layout only for the check, outside the timing.
Untuned (QuACK's default sm90 config) by default; ``tuned=True`` runs its autotuner first.

quack 0.6.5's compile-cache keyer (``quack.gemm_runtime.identity.semantic_value_key``) raises
``TypeError: epilogue fn depends on <ContextVar ...>`` for closures that nvidia-cutlass-dsl 4.8.1
creates. ``key_unkeyable_by_identity`` wraps it, in this process only, so that a value it cannot
key is keyed by its identity: the key only feeds quack's in-process compile cache, and an
identity key is finer than a semantic one (it can miss the cache, never share a wrong kernel).
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch
from grad_modes import GradState
from mlp_case import AutogradVariant, Case
from torch import Tensor

QUACK_PIN = "quack-kernels==0.6.5"


def quack_unavailable(case: Case) -> str:
    """Why the quack peer cannot run here ("" when it can)."""
    if importlib.util.find_spec("quack") is None:
        return f"quack-kernels is not installed (benchmark extra: pip install {QUACK_PIN})"
    if case.x.device.type != "cuda":
        return "quack-kernels needs CUDA (sm_90+); this run is on the CPU"
    if case.x.dtype not in (torch.bfloat16, torch.float16):
        return f"quack-kernels runs bf16/fp16 here, not {case.x.dtype}"
    if case.shape.H % 8 or case.shape.F % 8:
        return f"quack-kernels needs H and F multiples of 8 (H={case.shape.H}, F={case.shape.F})"
    try:
        _quack()
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip
        return f"quack-kernels not importable: {type(exc).__name__}: {exc}"[:240]
    return ""


def key_unkeyable_by_identity(identity: ModuleType) -> None:
    """Wrap ``identity.semantic_value_key`` (idempotent): a value it rejects with TypeError is
    keyed by (its type, its id). Its recursive calls go through the module global, so only the
    values it cannot key are keyed by identity; everything around them keeps its semantic key."""
    original = identity.semantic_value_key
    if getattr(original, "keys_by_identity", False):
        return

    def semantic_value_key(value: object, seen: set) -> object:
        try:
            return original(value, seen)
        except TypeError:
            return ("by_identity", type(value).__module__, type(value).__qualname__, id(value))

    semantic_value_key.keys_by_identity = True
    identity.semantic_value_key = semantic_value_key


def _quack() -> ModuleType:
    """quack.gemm_interface, with the compile-cache keyer wrapped (see the module docstring)."""
    import quack.gemm_interface as gemm_interface
    from quack.gemm_runtime import identity

    key_unkeyable_by_identity(identity)
    return gemm_interface


def interleave_gate_up(w1: Tensor) -> Tensor:
    """[E, 2F, H] with rows [gate; up] -> rows gate_0, up_0, gate_1, up_1, ... (a copy)."""
    E, F2, H = w1.shape
    return w1.view(E, 2, F2 // 2, H).transpose(1, 2).reshape(E, F2, H)


def deinterleave_gate_up(w1: Tensor) -> Tensor:
    """The inverse of `interleave_gate_up`: [E, 2F, H] interleaved rows -> [gate; up]."""
    E, F2, H = w1.shape
    return w1.view(E, F2 // 2, 2, H).transpose(1, 2).reshape(E, F2, H)


def quack_forward(
    qk: ModuleType, x: Tensor, w1: Tensor, w2: Tensor, probs: Tensor | None, cu: Tensor, *,
    tuned: bool, store_preact: bool,
) -> tuple[Tensor | None, Tensor]:
    """(h [M, 2F] interleaved or None, y [M, H]); w1 [E, 2F, H] interleaved, w2 [E, H, F]."""
    h, a = qk.gemm_gated(
        x, w1.transpose(1, 2), activation="swiglu", cu_seqlens_m=cu, store_preact=store_preact,
        tuned=tuned,
    )  # h = x W1_eᵀ, a = silu(gate) · up [M, F]
    if probs is not None:
        a.mul_(probs[:, None])  # fp32 product, rounded into a's dtype
    return h, qk.gemm(a, w2.transpose(1, 2), cu_seqlens_m=cu, tuned=tuned)  # y = a W2_eᵀ


class _QuackMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, probs, cu, qk, tuned):  # noqa: ANN001 - autograd signature
        h, y = quack_forward(qk, x, w1, w2, probs, cu, tuned=tuned, store_preact=True)
        ctx.qk, ctx.tuned, ctx.has_probs = qk, tuned, probs is not None
        ctx.save_for_backward(x, w1, w2, h, probs, cu)  # probs may be None
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001
        x, w1, w2, h, probs, cu = ctx.saved_tensors
        qk, tuned = ctx.qk, ctx.tuned
        dy = dy.contiguous()
        scale = {"colvec_scale": probs, "colvec_reduce": True} if ctx.has_probs else {}
        dh, a, *dprobs = qk.gemm_dgated(
            dy, w2, h, activation="swiglu", cu_seqlens_m=cu, tuned=tuned, **scale
        )  # dh [M, 2F] interleaved, a = silu(gate) · up (· probs) [M, F], dprobs [M] fp32
        dw2 = qk.gemm(dy.t(), a, cu_seqlens_k=cu, tuned=tuned)  # [E, H, F]; dW2_e = dY_eᵀ A_e
        dx = qk.gemm(dh, w1, cu_seqlens_m=cu, tuned=tuned)  # [M, H]; dX_e = dH_e W1_e
        dw1 = qk.gemm(dh.t(), x, cu_seqlens_k=cu, tuned=tuned)  # [E, 2F, H]; dW1_e = dH_eᵀ X_e
        dp = dprobs[0].to(probs.dtype) if ctx.has_probs else None
        return dx, dw1, dw2, dp, None, None, None


class QuackPeer(AutogradVariant):
    """QuACK's varlen GEMMs (module docstring), autograd through one Function."""

    is_peer = True

    def __init__(
        self, case: Case, grad_mode: str, tuned: bool = False, qk: ModuleType | None = None
    ) -> None:
        """``qk``: quack.gemm_interface, or a stand-in with its functions (tests on the CPU)."""
        if qk is None:
            reason = quack_unavailable(case)
            if reason:
                raise RuntimeError(reason)
            qk = _quack()
        super().__init__(case)
        self.qk, self.tuned = qk, tuned
        self.name = "quack_tuned" if tuned else "quack"
        self.note = "autotuned" if tuned else "default sm90 config (untuned)"
        self.w1 = torch.nn.Parameter(interleave_gate_up(case.w1))  # [E, 2F, H] interleaved
        self.w2 = torch.nn.Parameter(case.w2.clone())  # [E, H, F]
        self.weights = GradState(grad_mode, [self.w1, self.w2])
        self.cu = torch.cat([case.offs.new_zeros(1), case.offs])  # [E + 1] int32, from 0

    def run(self, x: Tensor, probs: Tensor | None) -> Tensor:
        if not torch.is_grad_enabled():  # forward only: no pre-activation to store
            w1, w2, cu = self.w1, self.w2, self.cu
            return quack_forward(self.qk, x, w1, w2, probs, cu, tuned=self.tuned,
                                 store_preact=False)[1]
        return _QuackMLP.apply(x, self.w1, self.w2, probs, self.cu, self.qk, self.tuned)

    def stacked_wgrads(self, grads: list[Tensor]) -> tuple[Tensor, Tensor]:
        return deinterleave_gate_up(grads[0]), grads[1]
