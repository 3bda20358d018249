"""The MoE block (dispatch -> grouped MLP -> combine) on CUDA: each GPU backend against the float64
reference, no host sync in forward and backward, and out-of-range indices caught on the device."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from test_routing import loop_reference

import te_seq
from te_seq import ops

pytestmark = pytest.mark.gpu

E, H, F, T, K = 8, 128, 64, 300, 2


def _block(dtype, device) -> te_seq.Sequential:
    torch.manual_seed(0)
    block = te_seq.Sequential(
        ops.ExpertDispatch(E),
        ops.GroupedLinear(E, H, 2 * F, bias=False, device=device, dtype=dtype),
        ops.ScaledSwiGLU(),
        ops.GroupedLinear(E, F, H, bias=False, device=device, dtype=dtype),
        ops.ExpertCombine(),
    )
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return block


def _routing(device):
    logits = torch.randn(T, E, device=device)
    logits[:, 3] = -1e9  # expert 3 never chosen: an empty group
    probs, indices = torch.softmax(logits, -1).topk(K)
    return indices, probs



def test_block_on_the_gpu_matches_the_float64_loop(gpu_backend: str) -> None:
    block = _block(torch.bfloat16, "cuda")
    indices, probs = _routing("cuda")
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    with te_seq.backend(gpu_backend):
        y = block(x, indices, probs.bfloat16())
    plan = block.fusion_plan()
    assert [s.name for s in plan.forward] == ["MoeBlock"]
    assert plan.forward[0].backend == gpu_backend
    ref64 = _block(torch.float64, "cpu")
    ref64.load_state_dict({k: v.double().cpu() for k, v in block.state_dict().items()})
    want = loop_reference(ref64, x.double().cpu(), indices.cpu(), probs.bfloat16().double().cpu())
    err = (y.double().cpu() - want).abs().max().item()
    assert err <= 3e-2 * max(want.abs().max().item(), 1.0), err


def test_block_makes_no_host_sync(gpu_backend: str) -> None:
    """Dispatch (sort, counts), the fused MLP and combine, forward and backward, never sync."""
    block = _block(torch.bfloat16, "cuda")
    indices, probs = _routing("cuda")
    probs = probs.bfloat16().requires_grad_()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te_seq.backend(gpu_backend):
        block(x, indices, probs).sum().backward()  # warm-up: compiles, plan, caches
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            block(x, indices, probs).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_out_of_range_device_indices_fail_a_device_check() -> None:
    script = textwrap.dedent(
        """
        import torch, te_seq
        from te_seq import ops
        d = te_seq.Sequential(ops.ExpertDispatch(4))
        x = torch.randn(3, 16, device="cuda")
        d(x, torch.tensor([[0], [4], [1]], device="cuda"), torch.rand(3, 1, device="cuda"))
        torch.cuda.synchronize()
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "device-side assert" in proc.stderr or "out of bounds" in proc.stderr, proc.stderr


def test_block_replays_new_routings_in_a_cuda_graph(gpu_backend: str) -> None:
    """Captured once, replayed with new tokens and new routings (new split sizes on the device,
    never read on the host): outputs and gradients equal the eager block's."""
    graphed_block, eager_block = _block(torch.bfloat16, "cuda"), _block(torch.bfloat16, "cuda")
    indices, probs = _routing("cuda")
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te_seq.backend(gpu_backend):
        graphed = te_seq.make_graphed_callables(graphed_block, (x, indices, probs.bfloat16()))
        for step in range(3):
            torch.manual_seed(10 + step)
            new_indices, new_probs = _routing("cuda")
            indices.copy_(new_indices)
            tokens = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            xg, xe = tokens.clone().requires_grad_(), tokens.clone().requires_grad_()
            yg = graphed(xg, indices, new_probs.bfloat16())
            ye = eager_block(xe, indices, new_probs.bfloat16())
            dy = torch.randn_like(ye)
            yg.backward(dy)
            ye.backward(dy)
            torch.testing.assert_close(yg, ye, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(xg.grad, xe.grad, rtol=2e-2, atol=2e-2)
