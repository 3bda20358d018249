"""The cute backend under FP8 recipes (CPU): its FP8 grouped GEMM `cute.scaled_grouped_mm` runs
the forward GEMMs of GroupedLinear and the fused GroupedMLP (and the dgrads where dy is E4M3:
tests/test_fp8_backward.py, E5M2 dy under "HYBRID" too).

A GPU is faked: the capability check answers sm_90, the backend reports itself available, and
the device check of the cute guard is answered for CUDA (everything else it checks for real:
recipe blocks, formats, dtype, widths). The cute functional is replaced by a recorder that
checks its operands and returns the kernel's maths in fp32 on CPU. The real kernel on a GPU:
tests/test_fp8_cute_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from test_fp8 import bounds_of, emu_grouped
from test_fp8_torch import fc2_input, rel_err, small_mlp

import te_seq
from te_seq import ops, recipe
from te_seq.kernels import backend as backend_registry
from te_seq.kernels import cute, fp8_cute, fp8_torch, torch_backend
from te_seq.kernels import fp8_reference as ref
from te_seq.kernels.cute_backend import CUTE
from te_seq.kernels.fp8_wgrad import WGRAD_PAD

ROWWISE, TENSOR, BLOCK = (recipe.Float8RowwiseScaling(), recipe.Float8CurrentScaling(),
                          recipe.Float8BlockScaling())
REAL_RECIPES, REAL_IDS = [ROWWISE, TENSOR], ["rowwise", "tensor"]
TOL = 1e-2  # real FP8 GEMM vs its emulation: summation order only (tests/test_fp8_torch.py)
CUDA = torch.device("cuda", 0)  # only named: nothing touches a GPU


def recording_scaled_grouped_mm(a, b, a_scale, b_scale, offs, out_dtype=torch.bfloat16):
    """`cute.scaled_grouped_mm`'s contract checked (its `_shape_problem`), its maths in fp32:
    rows of group g = diag(a_scale) (a b[g]ᵀ) diag(b_scale[g]); the call is recorded."""
    assert b.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16
    assert a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)  # E5M2: a HYBRID gradient
    (m, k), (e, n, k_b) = a.shape, b.shape
    assert k == k_b and offs.dtype == torch.int32 and offs.shape == (e,)
    assert a_scale.dtype == b_scale.dtype == torch.float32
    assert a_scale.shape == (m,) and b_scale.shape == (e, n)
    out, start = torch.zeros(m, n), 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = (a[start:end].float() * a_scale[start:end, None]) @ (
            b[g].float() * b_scale[g][:, None]).t()
        start = end
    recording_scaled_grouped_mm.calls.append((a, b, a_scale, b_scale, offs))
    return out.to(out_dtype)


def recording_scaled_grouped_wgrad(a, b, a_scale, b_scale, offs, out=None, accumulate=False):
    """`cute.scaled_grouped_wgrad`'s contract checked, its maths in fp32, the call recorded."""
    assert b.dtype == torch.float8_e4m3fn and a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    assert a.is_contiguous() and b.is_contiguous() and a.shape[1] == b.shape[1]
    (n, p), k, g = a.shape, b.shape[0], offs.shape[0]
    assert offs.dtype == torch.int32 and (offs % WGRAD_PAD == 0).all()
    assert a_scale.shape == (g, n) and b_scale.shape == (g, k) and offs[-1] <= p
    assert a_scale.dtype == b_scale.dtype == torch.float32
    used = torch.zeros(p, dtype=torch.bool)
    used[: int(offs[-1])] = True
    assert (a.view(torch.uint8)[:, ~used] == 0).all() and (b.view(torch.uint8)[:, ~used] == 0).all()
    result, start = torch.zeros(g, n, k), 0
    for e, end in enumerate(offs.tolist()):
        prod = a[:, start:end].float() @ b[:, start:end].float().t()
        result[e] = a_scale[e][:, None] * prod * b_scale[e][None, :]
        start = end
    recording_scaled_grouped_wgrad.calls.append((a, b, a_scale, b_scale, offs))
    if out is None:
        return result.to(torch.bfloat16)
    assert out.shape == (g, n, k) and out.dtype in (torch.bfloat16, torch.float32)
    assert out.is_contiguous()  # the kernel takes contiguous buffers only
    return out.add_(result) if accumulate else out.copy_(result)


@pytest.fixture
def fake_cute_gpu(monkeypatch):
    """sm_90, cute available, CPU data checked as if on CUDA, the kernel recorded."""
    recording_scaled_grouped_mm.calls = []
    recording_scaled_grouped_wgrad.calls = []
    monkeypatch.setattr(fp8_torch, "cuda_capability", lambda device: (9, 0))
    monkeypatch.setitem(backend_registry._availability, "cute", (True, ""))
    real_reason = fp8_cute.forward_reason
    monkeypatch.setattr(fp8_cute, "forward_reason",
                        lambda blocks, dtypes, gemm_dtype, device, dims:
                        real_reason(blocks, dtypes, gemm_dtype, CUDA, dims))
    monkeypatch.setattr(cute, "scaled_grouped_mm", recording_scaled_grouped_mm)
    monkeypatch.setattr(cute, "scaled_grouped_wgrad", recording_scaled_grouped_wgrad)


def _supports(kernel="grouped_mm", r=ROWWISE, dtype=torch.bfloat16, k=128, n=256, **facts):
    return CUTE.supports(kernel, k=k, n=n, dtype=dtype, device=CUDA, recipe=r, **facts)


# --- the plan-time check ------------------------------------------------------------------------

@pytest.mark.parametrize("r", REAL_RECIPES + [recipe.Float8RowwiseScaling(fp8_format="HYBRID")])
def test_cute_takes_grouped_gemms_under_rowwise_and_per_tensor(monkeypatch, r):
    monkeypatch.setattr(fp8_torch, "cuda_capability", lambda device: (9, 0))
    assert _supports("grouped_mm", r) == (True, "")
    assert _supports("grouped_wgrad", r) == (True, "")


def test_cute_declines_the_rest_with_reasons(monkeypatch):
    cap = {"value": (9, 0)}
    monkeypatch.setattr(fp8_torch, "cuda_capability", lambda device: cap["value"])
    cases = [  # block scaling runs on the block-scaled kernel: tests/test_fp8_cute_block.py
        (dict(dtype=torch.float32), "bfloat16 only"),
        (dict(dtype=torch.float16), "bfloat16 only"),
        (dict(k=136), "K=136, N=256"),
        (dict(n=40), "K=128, N=40"),
        (dict(grouped=False), "plain linear"),
        (dict(kernel="glu_fc1_forward"), "glu_fc1_forward under a recipe"),
    ]
    for facts, why in cases:
        ok, reason = _supports(**facts)
        assert not ok and why in reason and "no FP8 kernels" in reason, (facts, reason)
    ok, reason = CUTE.supports("grouped_mm", k=128, n=256, dtype=torch.bfloat16,
                               device=torch.device("cpu"), recipe=ROWWISE)
    assert not ok and "data on cpu, not CUDA" in reason
    cap["value"] = (10, 0)
    assert "needs sm_90" in _supports()[1] and "sm_100" in _supports()[1]


def test_forward_reason_and_note_name_the_cute_kernel(monkeypatch):
    from te_seq.core import fp8_gemm

    monkeypatch.setattr(fp8_torch, "cuda_capability", lambda device: (9, 0))
    reason = fp8_gemm.forward_reason
    assert reason("cute", ROWWISE, torch.bfloat16, CUDA, [(128, 256)], True) == ""
    assert "grouped GEMM only" in reason("cute", ROWWISE, torch.bfloat16, CUDA, [(128, 256)],
                                         False)
    assert reason("cute", BLOCK, torch.bfloat16, CUDA, [(128, 256)], True) == ""
    op = ops.GroupedLinear(3, 128, 256, dtype=torch.bfloat16)
    note = fp8_gemm.step_note(ROWWISE, "cute", op, torch.bfloat16, CUDA)
    assert "via cute scaled_grouped_mm (real FP8" in note and "torch._" not in note
    torch_note = fp8_gemm.step_note(ROWWISE, "torch", op, torch.bfloat16, CUDA)
    assert "via torch._scaled_grouped_mm" in torch_note


# --- emulated GEMMs on fp32 operands run on the torch backend's functions -----------------------

def test_fp32_gemms_run_on_the_torch_backend_functions():
    torch.manual_seed(3)
    a, b = torch.randn(50, 32), torch.randn(3, 32, 48)  # a [M, K], b [E, K, N]
    offs = torch.tensor([20, 20, 50], dtype=torch.int32)
    assert torch.equal(CUTE.grouped_mm(a, b, offs), torch_backend.grouped_mm(a, b, offs))
    dy, x = torch.randn(50, 48), torch.randn(50, 32)
    want = torch_backend.grouped_wgrad(dy, x, offs)
    assert torch.equal(CUTE.grouped_wgrad(dy, x, offs), want)
    out = torch.randn(3, 48, 32)
    start = out.clone()
    CUTE.grouped_wgrad(dy, x, offs, out=out, accumulate=True)
    assert torch.equal(out, start + want)


# --- the ops under a recipe on backend "cute" ---------------------------------------------------

def _quantized_operands(r, x, w):
    """What the forward GEMM must receive: x and each expert's W quantized along K."""
    xq = ref.quantize(x, r.block("input"), r.rule("input"))
    wq = [ref.quantize(w_g, r.block("weight"), r.rule("weight")) for w_g in w]
    return xq, wq


def _assert_call(call, r, x, w, splits):
    """The recorded call got x [M, K] and W [G, N, K] quantized as the recipe says, their
    dequantization scales as [M] and [G, N], and the group ends."""
    a, b, a_scale, b_scale, offs = call
    xq, wq = _quantized_operands(r, x.float(), w.float())
    assert a.shape == x.shape and b.shape == w.shape
    assert torch.equal(a.view(torch.uint8), xq.data.view(torch.uint8))
    assert torch.equal(b.view(torch.uint8), torch.stack([q.data for q in wq]).view(torch.uint8))
    assert torch.equal(a_scale, xq.scale_inv.reshape(-1).expand(x.shape[0]))
    want_b = torch.stack([q.scale_inv.reshape(-1).expand(w.shape[1]) for q in wq])
    assert torch.equal(b_scale, want_b)
    assert offs.tolist() == torch.cumsum(splits, 0).tolist()


def _grouped_linear_run(name, r, seed=7):
    torch.manual_seed(seed)
    op = ops.GroupedLinear(3, 128, 256, dtype=torch.bfloat16)
    splits = torch.tensor([37, 0, 91])
    x = torch.randn(128, 128, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(128, 256, dtype=torch.bfloat16)
    model = te_seq.Sequential(op)
    with te_seq.backend(name), te_seq.autocast(recipe=r):
        y = model(x, splits)
    y.backward(dy)
    grads = [x.grad, *[op.get_parameter(f"weight{g}").grad for g in range(3)]]
    return model, op, x.detach(), dy, splits, y.detach(), grads


@pytest.mark.parametrize("r", REAL_RECIPES, ids=REAL_IDS)
def test_grouped_linear_forward_runs_the_cute_kernel(fake_cute_gpu, r):
    model, op, x, dy, splits, y, grads = _grouped_linear_run("cute", r)
    step = model.fusion_plan().forward[0]
    assert step.backend == "cute" and step.backend_reason.startswith("requested")
    assert "via cute scaled_grouped_mm (real FP8" in step.backend_reason
    # the dgrad runs the kernel too, on dy in the recipe's grad format (E5M2 under HYBRID;
    # tests/test_fp8_backward.py checks its operands)
    assert len(recording_scaled_grouped_mm.calls) == 2
    assert recording_scaled_grouped_mm.calls[1][0].dtype == r.rule("grad").dtype
    _assert_call(recording_scaled_grouped_mm.calls[0], r, x, op.stacked_weight().detach(),
                 splits)
    want_y = emu_grouped(r, x, op.stacked_weight().detach(), dy, bounds_of(splits))[0]
    assert y.dtype == torch.bfloat16 and rel_err(y, want_y) < TOL


def test_basic_linear_is_not_taken_by_cute(fake_cute_gpu):
    model = te_seq.Sequential(ops.BasicLinear(128, 64, dtype=torch.bfloat16))
    with te_seq.backend("cute"), te_seq.autocast(recipe=ROWWISE):
        model(torch.randn(5, 128, dtype=torch.bfloat16))
    step = model.fusion_plan().forward[0]
    assert step.backend != "cute" and "plain linear" in step.backend_reason
    assert recording_scaled_grouped_mm.calls == []


@pytest.mark.parametrize("r", REAL_RECIPES, ids=REAL_IDS)
def test_fused_mlp_runs_the_cute_kernel_for_fc1_and_fc2(fake_cute_gpu, r):
    fc1, fc2, model, splits, probs, x = small_mlp()
    with te_seq.backend("cute"), te_seq.autocast(recipe=r):
        y = model(x, splits, probs, splits)
    y.backward(torch.randn_like(y))
    step = model.fusion_plan().forward[0]
    assert step.name == "GroupedMLP" and step.backend == "cute"
    assert "via cute scaled_grouped_mm" in step.backend_reason
    calls = recording_scaled_grouped_mm.calls
    # FC1 then FC2 forward, then the two dgrads (tests/test_fp8_backward.py)
    assert len(calls) == 4
    _assert_call(calls[0], r, x.detach(), fc1.stacked_weight().detach(), splits)
    assert calls[1][0].shape == (127, 256) and calls[1][1].shape == (3, 128, 256)
    a = fc2_input(r, x, fc1, probs, splits)
    _assert_call(calls[1], r, a, fc2.stacked_weight().detach(), splits)
    want_y = emu_grouped(r, a, fc2.stacked_weight().detach(), torch.zeros(127, 128),
                         bounds_of(splits))[0]
    assert rel_err(y, want_y) < 2 * TOL  # h's bf16 rounding feeds FC2's quantization
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize("r", REAL_RECIPES, ids=REAL_IDS)
def test_unfused_grouped_linears_run_the_cute_kernel(fake_cute_gpu, r):
    torch.manual_seed(10)
    fc1 = ops.GroupedLinear(3, 128, 256, dtype=torch.bfloat16)
    fc2 = ops.GroupedLinear(3, 256, 128, dtype=torch.bfloat16)
    te_seq.disable_fusion("grouped_mlp")  # the conftest fixture enables it again
    model = te_seq.Sequential(fc1, ops.GELU(), fc2)
    splits = torch.tensor([9, 30, 0])
    x = torch.randn(39, 128, dtype=torch.bfloat16)
    with te_seq.backend("cute"), te_seq.autocast(recipe=r):
        model(x, splits, splits)
    steps = model.fusion_plan().forward
    linears = [s for s in steps if s.name == "GroupedLinear"]
    assert len(steps) == 3 and len(linears) == 2
    assert all(s.backend == "cute" and "via cute scaled_grouped_mm" in s.backend_reason
               for s in linears)
    assert len(recording_scaled_grouped_mm.calls) == 2
    _assert_call(recording_scaled_grouped_mm.calls[0], r, x, fc1.stacked_weight().detach(),
                 splits)


@pytest.mark.parametrize("module, kernel", [(fp8_cute, "cute scaled_grouped_mm"),
                                            (fp8_torch, "torch._scaled_grouped_mm")],
                         ids=["cute", "torch"])
def test_forward_reason_names_dtype_and_widths(monkeypatch, module, kernel):
    """Both FP8 forward checks (one shared rule) refuse a non-bf16 GEMM and unaligned widths,
    naming the kernel and the values, and take a bf16 GEMM of aligned widths."""
    monkeypatch.setattr(fp8_torch, "cuda_capability", lambda device: (9, 0))
    row = ref.QuantBlock(1, None)
    args = ((row, row), (torch.float8_e4m3fn,) * 2)
    extra = () if module is fp8_cute else (True,)
    assert module.forward_reason(*args, torch.bfloat16, CUDA, [(256, 128)], *extra) == ""
    why = module.forward_reason(*args, torch.float16, CUDA, [(256, 128)], *extra)
    assert why == f"the GEMM dtype is torch.float16, {kernel} outputs bfloat16 only"
    why = module.forward_reason(*args, torch.bfloat16, CUDA, [(256, 128), (72, 40)], *extra)
    assert why == f"K=72, N=40: both must be multiples of 16 for {kernel}"
