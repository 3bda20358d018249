"""The fused grouped MLP runs a non-gated activation (GELU, ReLU, SiLU, SReLU, QGELU, the
row-scaled ScaledSReLU) inside the FC1 and FC2-dgrad epilogues where the backend has the
`act_fc1_forward` / `act_fc2_dgrad` kernels, and says so in its plan note.

On CPU a stand-in backend ("act_epi": the reference backend plus those two kernels, written as
the unfused composition in float64) checks what the fused op hands them: the same output and
gradients as the reference backend's GEMM + elementwise path, and one call of each kernel per
step. The cute backend's reasons for declining are checked through `plan_note` directly (its
kernels need a Hopper GPU; tests/kernels/test_cute_act.py and tests/test_gpu_grouped.py run
them there).
"""

from __future__ import annotations

import functools

import pytest
import torch

import te_seq
from te_seq import kernels, ops
from te_seq.kernels import reference
from te_seq.kernels.activations import act_epilogue_activations
from te_seq.ops.fused import GroupedMLP

FUSED_NOTE = "activation fused into the FC1 and FC2-dgrad epilogues"
SIZES = [0, 5, 3, 0, 9]


class ActEpilogueBackend(reference.ReferenceBackend):
    """The reference backend with the non-gated epilogue kernels (as the composition they fuse:
    h = x W1ᵀ, a = f(h)·p; dA = dY W2, dh = dA·p·f'(h), dp = Σ_j dA·f(h)), recording calls."""

    name = "act_epi"
    fallback = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, bool]] = []

    def supports(self, kernel: str, **static) -> tuple[bool, str]:
        if kernel in ("act_fc1_forward", "act_fc2_dgrad"):
            ok = static["act"] in act_epilogue_activations()
            return ok, "" if ok else f"no epilogue for {static['act']!r}"
        return super().supports(kernel, **static)

    def act_fc1_forward(self, x, w1t, offs, act, probs=None):
        self.calls.append(("fc1", act, probs is not None))
        h = reference.grouped_mm(x, w1t, offs)
        a = reference.act_forward(h, act)
        return h, (a if probs is None else a * probs[:, None])

    def act_fc2_dgrad(self, dy, w2, offs, h, act, probs=None):
        self.calls.append(("dgrad", act, probs is not None))
        da = reference.grouped_mm(dy, w2, offs)
        a = reference.act_forward(h, act)
        if probs is None:
            return reference.act_backward(h, da, act), a, None
        dprobs = (da * a).sum(-1)
        return reference.act_backward(h, da * probs[:, None], act), a * probs[:, None], dprobs


_BIAS_DECLINED = "an FC1 bias with a non-gated activation has no fused epilogue"


@pytest.fixture
def act_epi():
    backend = kernels.register_backend(ActEpilogueBackend())
    yield backend
    kernels.unregister_backend("act_epi")


def _model(act_cls, ffn: int = 12, bias: bool = False) -> te_seq.Sequential:
    torch.manual_seed(0)
    model = te_seq.Sequential(
        ops.GroupedLinear(len(SIZES), 8, ffn, bias=bias, dtype=torch.float64),
        act_cls(),
        ops.GroupedLinear(len(SIZES), ffn, 8, bias=True, dtype=torch.float64),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def _run(model, backend: str, row_scales: bool, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(SIZES)
    x = torch.randn(rows, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    splits = torch.tensor(SIZES)
    extras = [splits]
    if row_scales:
        probs = torch.rand(rows, generator=gen, dtype=torch.float64, requires_grad=True)
        extras.append(probs)
    extras.append(splits)
    model.zero_grad(set_to_none=True)
    with te_seq.backend(backend):
        y = model(x, *extras)
    y.backward(torch.randn(y.shape, generator=gen, dtype=torch.float64))
    grads = [x.grad] + [e.grad for e in extras if e.is_floating_point()]
    return y, grads + [p.grad for p in model.parameters()], model.fusion_plan()


ACTS = [ops.GELU, ops.ReLU, ops.SiLU, ops.SReLU, ops.QGELU, ops.ScaledSReLU]


@pytest.mark.parametrize("act_cls", ACTS, ids=[a.__name__ for a in ACTS])
def test_fused_non_gated_activation_matches_the_reference(act_epi, act_cls):
    model = _model(act_cls)
    row_scales = act_cls.row_scales
    y, grads, plan = _run(model, "act_epi", row_scales)
    (step,) = plan.forward
    assert step.name == "GroupedMLP" and FUSED_NOTE in step.backend_reason
    act = model[1].act
    assert act_epi.calls == [("fc1", act, row_scales), ("dgrad", act, row_scales)]
    y_ref, grads_ref, ref_plan = _run(model, "reference", row_scales)
    assert "activation after the GEMMs" in ref_plan.forward[0].backend_reason
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    assert len(grads) == len(grads_ref)
    assert grads[0].abs().min() > 0  # every row of dx (no row lost in the fused path)
    for g, g_ref in zip(grads, grads_ref):  # empty experts' weight grads are zeros in both
        assert g is not None
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)


def test_what_the_backend_declines_runs_after_the_gemms(act_epi):
    """gelu_erf has no epilogue on this backend, and an FC1 bias none anywhere: the plan note
    says why, and the kernels are not called."""
    erf = functools.partial(ops.GELU, approximate="none")
    for model, why in ((_model(erf), "FC1: no epilogue for 'gelu_erf'"),
                       (_model(ops.ReLU, bias=True), _BIAS_DECLINED)):
        _, _, plan = _run(model, "act_epi", False)
        assert plan.forward[0].backend_reason.endswith(f"activation after the GEMMs ({why})")
    assert act_epi.calls == []


def _cute_note(act_cls, ffn=128, bias=False, dtype=torch.bfloat16) -> str:
    mlp = GroupedMLP([ops.GroupedLinear(4, 64, ffn, bias=bias, dtype=dtype), act_cls(),
                      ops.GroupedLinear(4, ffn, 64, dtype=dtype)])
    return mlp.plan_note(kernels.get_backend("cute"), dtype, torch.device("cpu"))


def test_cute_plan_notes_give_the_kernel_reasons():
    """The cute backend's act kernels answer at plan time with their reasons (on CPU data the
    last check, CUDA, is the one that declines a supported shape)."""
    assert _cute_note(ops.GELU) == "activation after the GEMMs (FC1: needs CUDA tensors)"
    erf = functools.partial(ops.GELU, approximate="none")
    assert "FC1: act 'gelu_erf' has no fused non-gated epilogue" in _cute_note(erf)
    assert "F=100 must be a multiple of 8" in _cute_note(ops.SiLU, ffn=100)
    assert "needs bf16/fp16" in _cute_note(ops.ReLU, dtype=torch.float32)
    assert _BIAS_DECLINED in _cute_note(ops.ReLU, bias=True)


def test_epilogue_table_covers_the_non_gated_ops():
    """Every parameterless activation the GLU epilogue computes is offered non-gated too; the
    exact-erf GELU and the gated-only parameterized entries are not."""
    names = act_epilogue_activations()
    assert {"gelu", "silu", "relu", "srelu", "qgelu", "sigmoid"} == set(names)
