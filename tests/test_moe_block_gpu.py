"""The fused MoE block ("moe_block") on the GPU backends in bf16: fused vs unfused vs float64.

E = 8 experts (one of them never chosen), H = 256, F = 192 (FC1 2F = 384 for the gated
activation), T = 300 tokens (not a multiple of any tile), top-2. The fused block and the unfused
chain (the fusion disabled) run on the same bf16 data; both are judged against the float64 chain
on the CPU by norm-relative error at bf16 rounding, and against each other. On cute the plan must
say that FC1's gather and the scatters run inside the GEMMs (no [N, H] permuted copy).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import te_seq
from te_seq import ops

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

E, H, F, T, K = 8, 256, 192, 300, 2
EMPTY = 5  # an expert no token chooses
TOL = 2e-2  # bf16, as tests/test_hf_moe_gpu.py


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _block(dtype: torch.dtype, device: str, act: str, f: int = F) -> te_seq.Sequential:
    activation = {"scaled_swiglu": ops.ScaledSwiGLU, "swiglu": ops.SwiGLU,
                  "scaled_srelu": ops.ScaledSReLU}[act]()
    width = 2 * f if activation.gated else f
    return te_seq.Sequential(
        ops.ExpertDispatch(E),
        ops.GroupedLinear(E, H, width, bias=False, dtype=dtype, device=device),
        activation,
        ops.GroupedLinear(E, f, H, bias=False, dtype=dtype, device=device),
        ops.ExpertCombine(),
    )


def _routing():
    logits = torch.randn(T, E)
    logits[:, EMPTY] = -float("inf")
    probs, indices = torch.softmax(logits, -1).topk(K, dim=-1)
    return indices, probs


def _run(block, x, indices, probs, dout, backend: str | None, disabled: bool):
    """(y, dx, dprobs, every weight grad) of one fresh forward+backward."""
    x = x.detach().clone().requires_grad_()
    probs = probs.detach().clone().requires_grad_()
    scope = te_seq.fusions_disabled("moe_block") if disabled else contextlib.nullcontext()
    chosen = te_seq.backend(backend) if backend else contextlib.nullcontext()
    with scope, chosen:
        y = block(x, indices, probs)
        y = y[0] if isinstance(y, tuple) else y
        grads = torch.autograd.grad(y, [x, probs, *block.parameters()], dout)
    return [y.detach(), *grads], block.fusion_plan()



@pytest.mark.parametrize("ffn", [F, 256])  # 256: the GLU epilogue (F % 128 == 0) on cute
@pytest.mark.parametrize("act", ["scaled_swiglu", "swiglu", "scaled_srelu"])
def test_fused_block_matches_unfused_and_float64(gpu_backend: str, act: str, ffn: int) -> None:
    block = _block(torch.bfloat16, "cuda", act, ffn)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    ref = _block(torch.float64, "cpu", act, ffn)
    ref.load_state_dict({k: v.double().cpu() for k, v in block.state_dict().items()})
    indices, probs = _routing()
    x, dout = torch.randn(T, H), torch.randn(T, H)
    cuda = [t.cuda() for t in (indices, probs)]
    bf16 = [t.cuda().bfloat16() for t in (x, dout)]
    fused, plan = _run(block, bf16[0], cuda[0], cuda[1].bfloat16(), bf16[1], gpu_backend, False)
    assert [s.name for s in plan.forward] == ["MoeBlock"], plan
    assert plan.forward[0].backend == gpu_backend, plan
    unfused, plan_off = _run(block, bf16[0], cuda[0], cuda[1].bfloat16(), bf16[1], gpu_backend,
                             True)
    assert "GroupedMLP" in [s.name for s in plan_off.forward], plan_off
    want, _ = _run(ref, x.double(), indices, probs.double(), dout.double(), None, False)
    names = ["y", "dx", "dprobs"] + [n for n, _ in block.named_parameters()]
    for name, a, b, w in zip(names, fused, unfused, want):
        if w.norm() == 0:  # the empty expert's weights: no gradient on either side
            assert a.norm() == 0 and b.norm() == 0, name
            continue
        assert _rel_err(a, w) < TOL, (name, "fused vs float64", _rel_err(a, w))
        assert _rel_err(b, w) < TOL, (name, "unfused vs float64", _rel_err(b, w))
        assert _rel_err(a, b) < TOL, (name, "fused vs unfused", _rel_err(a, b))


def test_cute_plan_routes_rows_inside_the_gemms() -> None:
    available, reason = te_seq.kernels.backend.backend_available("cute")
    if not available:
        pytest.skip(f"cute backend unavailable: {reason}")
    block = _block(torch.bfloat16, "cuda", "scaled_swiglu")
    indices, probs = _routing()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    with te_seq.backend("cute"):
        block(x, indices.cuda(), probs.cuda().bfloat16())
    step = block.fusion_plan().forward[0]
    assert step.name == "MoeBlock" and step.backend == "cute", step
    note = step.backend_reason
    for part in ("FC1 gather: inside the GEMM", "FC2 scatter: inside the GEMM",
                 "dX scatter: inside the GEMM"):
        assert part in note, note
