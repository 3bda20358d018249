"""The fused grouped MLP with any part frozen: every combination of which of input, FC1, FC2 and
the router probabilities needs a gradient gives the unfused chain's values and gradients
(float64, to rounding), and the window still fuses. (With FC1 frozen and an input without
grad, FC1's context needs no backward while FC2's does: the fused op must save anyway.)"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from op_specs import randomize_params

import te_seq
from te_seq import ops

D = torch.float64
T, H, F, G = 9, 4, 6, 3
SPLITS = torch.tensor([4, 0, 5])

# x, FC1 params, FC2 params, probs: which need a gradient (all False runs no backward)
GRAD_MODES = [m for m in itertools.product([False, True], repeat=4) if any(m)]


def _mlp(bias: bool, act: str) -> te_seq.Sequential:
    activation = getattr(ops, act)()
    width = 2 * F if activation.gated else F
    seq = te_seq.Sequential(ops.GroupedLinear(G, H, width, bias=bias, dtype=D),
                            activation,
                            ops.GroupedLinear(G, F, H, bias=bias, dtype=D))
    randomize_params(seq)
    return seq


def _run(seq, mode, fused: bool):
    x_grad, fc1_grad, fc2_grad, probs_grad = mode
    torch.manual_seed(5)
    x = torch.randn(T, H, dtype=D, requires_grad=x_grad)
    probs = (torch.rand(T, dtype=D) + 0.5).requires_grad_(probs_grad)
    for fc, need in ((seq[0], fc1_grad), (seq[2], fc2_grad)):
        for p in fc.parameters():
            p.requires_grad_(need)
            p.grad = None
    extra = (probs,) if seq[1].num_extra_inputs else ()
    guard = contextlib.nullcontext() if fused else te_seq.fusions_disabled()
    with guard:
        y = seq(x, SPLITS, *extra, SPLITS)
        names = [s.name for s in seq.fusion_plan().forward]
        y.backward(torch.randn(y.shape, dtype=D, generator=torch.Generator().manual_seed(3)))
    grads = [x.grad, probs.grad] + [p.grad for p in seq.parameters()]
    return [y.detach(), *grads], names


@pytest.mark.parametrize("act", ["ScaledSwiGLU", "SwiGLU", "GELU"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mode", GRAD_MODES, ids=lambda m: "grad-" + "-".join(
    name for name, on in zip(("x", "fc1", "fc2", "probs"), m) if on))
def test_frozen_parts_match_unfused(mode, bias: bool, act: str) -> None:
    if act != "ScaledSwiGLU" and mode == (False, False, False, True):
        pytest.skip("no probs without ScaledSwiGLU: nothing needs a gradient")
    seq = _mlp(bias, act)
    fused, names = _run(seq, mode, fused=True)
    assert names == ["GroupedMLP"]
    unfused, names_off = _run(seq, mode, fused=False)
    assert names_off == ["GroupedLinear", act, "GroupedLinear"]
    for i, (a, b) in enumerate(zip(fused, unfused, strict=True)):
        assert (a is None) == (b is None), f"tensor {i}: a gradient on one side only"
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_all_experts_frozen_only_router_probs_need_grad() -> None:
    """The case from the issue: `not enough values to unpack (expected 8, got 0)` before."""
    seq = _mlp(bias=False, act="ScaledSwiGLU")
    seq.requires_grad_(False)
    x, probs = torch.randn(T, H, dtype=D), (torch.rand(T, dtype=D) + 0.5).requires_grad_(True)
    y = seq(x, SPLITS, probs, SPLITS)
    (dprobs,) = torch.autograd.grad(y.sum(), probs)
    fc1, _, fc2 = seq
    h = torch.cat([p @ getattr(fc1, f"weight{g}").t() for g, p in enumerate(x.split([4, 0, 5]))])
    gate, up = h.chunk(2, -1)
    a = torch.nn.functional.silu(gate) * up  # [T, F]
    w2 = torch.cat([getattr(fc2, f"weight{g}").sum(0, keepdim=True).expand(n, F)
                    for g, n in enumerate([4, 0, 5])])  # Σ_j W2_e[j, :] per row
    torch.testing.assert_close(dprobs, (a * w2).sum(-1))
