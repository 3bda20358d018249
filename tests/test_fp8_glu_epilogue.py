"""The fused GroupedMLP under FP8 on the cute backend with the activation in the FP8 GEMMs'
epilogues (CPU, a Hopper GPU faked as in tests/test_fp8_cute.py): the wiring of
`cute.scaled_glu_fc1_forward` / `scaled_glu_fc2_dgrad` (faked by their maths on CPU: the
recorded FP8 GEMM, then the reference GLU), the plan's note, the fallbacks (FC1 bias, HYBRID
gradients, the torch backend), and the results against the reference backend. The kernels
themselves on a GPU: tests/kernels/test_cute_fp8_glu.py."""

from __future__ import annotations

import pytest
import torch
from test_fp8_cute import (  # noqa: F401 (fixture)
    fake_cute_gpu,
    recording_scaled_grouped_mm,
    recording_scaled_grouped_wgrad,
)
from test_fp8_torch import rel_err

import te_seq
from te_seq import ops, recipe
from te_seq.kernels import cute
from te_seq.kernels import reference as ref_kernels

TOL = 2e-2
ROWWISE = recipe.Float8RowwiseScaling()


class FakeGlu:
    """A fused FP8 GLU functional: its GEMM by `gemm` (a recorder that checks the operands:
    `recording_scaled_grouped_mm` by default), its epilogue by the reference GLU maths on the
    bf16 result; calls recorded."""

    def __init__(self, mode: str, gemm=None):
        self.mode, self.calls, self.gemm = mode, [], gemm or recording_scaled_grouped_mm

    @staticmethod
    def supports(*args, **kwargs):
        return True, ""

    def __call__(self, a, b, a_scale, b_scale, offs, *rest, store_h=True):
        self.calls.append((a, b, a_scale, b_scale, offs))
        self.store_h = store_h
        acc = self.gemm(a, b, a_scale, b_scale, offs)  # bf16, as h / dA
        if self.mode == "fc1":
            act, interleave, probs, params = rest
            a = ref_kernels.glu_forward(acc, act, interleave, probs, params)
            return (acc if store_h else None), a
        h, act, interleave, probs, params = rest
        dh, dprobs = ref_kernels.glu_backward(h, acc, act, interleave, probs, params)
        return dh, ref_kernels.glu_forward(h, act, interleave, probs, params), dprobs


@pytest.fixture
def fused_glu(fake_cute_gpu, monkeypatch):  # noqa: F811 (the imported fixture)
    fakes = FakeGlu("fc1"), FakeGlu("dgrad")
    monkeypatch.setattr(cute, "scaled_glu_fc1_forward", fakes[0], raising=False)
    monkeypatch.setattr(cute, "scaled_glu_fc2_dgrad", fakes[1], raising=False)
    return fakes


def _mlp(bias: bool = False):
    torch.manual_seed(11)
    fc1 = ops.GroupedLinear(3, 128, 512, bias=bias, dtype=torch.bfloat16)
    fc2 = ops.GroupedLinear(3, 256, 128, bias=bias, dtype=torch.bfloat16)
    model = te_seq.Sequential(fc1, ops.ScaledSwiGLU(), fc2)
    splits, probs = torch.tensor([50, 0, 77]), torch.rand(127, dtype=torch.bfloat16)
    x = torch.randn(127, 128, dtype=torch.bfloat16)
    return model, splits, probs, x


def _run(backend: str, r, bias: bool = False):
    model, splits, probs, x = _mlp(bias)
    xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
    with te_seq.backend(backend), te_seq.autocast(recipe=r):
        y = model(xi, splits, pi, splits)
    y.backward(torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(3)))
    grads = [y, xi.grad, pi.grad, *[p.grad for p in model.parameters()]]
    return grads, model.fusion_plan().forward[0]


def test_fp8_glu_runs_in_both_epilogues(fused_glu):
    fc1, dgrad = fused_glu
    got, step = _run("cute", ROWWISE)
    assert step.name == "GroupedMLP"
    assert "activation fused into the FP8 FC1 and FC2-dgrad epilogues" in step.backend_reason
    assert len(fc1.calls) == 1 and len(dgrad.calls) == 1
    # the plain FP8 GEMMs: FC2 forward and FC1 dgrad (plus the two fakes' own GEMMs)
    assert len(recording_scaled_grouped_mm.calls) == 4
    assert len(recording_scaled_grouped_wgrad.calls) == 2
    a, b, a_scale, b_scale, _ = fc1.calls[0]
    assert a.shape == (127, 128) and b.shape == (3, 512, 128)  # x [M, H], W1 [E, 2F, H]
    assert a_scale.shape == (127,) and b_scale.shape == (3, 512)
    a, b, _, b_scale, _ = dgrad.calls[0]
    assert a.shape == (127, 128) and b.shape == (3, 256, 128)  # dy [M, H], W2ᵀ [E, F, H]
    assert b_scale.shape == (3, 256)
    want, _ = _run("reference", ROWWISE)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and rel_err(g, w) < TOL, rel_err(g, w)


def test_fp8_forward_without_backward_asks_fc1_for_no_h(fused_glu):
    """Under no_grad the fused FP8 MLP asks its FC1 kernel not to write h (nothing reads it)
    and gives the training forward's y; with grad it asks for h."""
    fc1, _ = fused_glu
    model, splits, probs, x = _mlp()
    with te_seq.backend("cute"), te_seq.autocast(recipe=ROWWISE):
        with torch.no_grad():
            y_eval = model(x, splits, probs, splits)
        assert fc1.store_h is False
        y = model(x.clone().requires_grad_(), splits, probs, splits)
        assert fc1.store_h is True
    assert torch.equal(y_eval, y.detach())


def test_fp8_glu_epilogues_fall_back_with_reasons(fused_glu):
    fc1, dgrad = fused_glu
    _, step = _run("cute", ROWWISE, bias=True)
    assert "an FC1 bias has no FP8 epilogue kernel" in step.backend_reason
    hybrid = recipe.Float8RowwiseScaling(fp8_format="HYBRID")
    _, step = _run("cute", hybrid)
    assert "activation fused into the FP8 FC1 epilogue; its backward after the GEMMs" in \
        step.backend_reason and "E4M3" in step.backend_reason
    assert len(fc1.calls) == 1 and not dgrad.calls  # HYBRID: FC1's epilogue only
    _, step = _run("torch", ROWWISE)
    assert "activation after the GEMMs" in step.backend_reason
    assert len(fc1.calls) == 1 and not dgrad.calls
