"""The native FP8 backward (CPU): dgrad as an FP8 grouped GEMM, wgrad on token-major FP8 operands.

Where the forward runs real FP8 and the gradient operand is E4M3 with per-tensor or row-wise
scales, the dgrad dx = dy W runs on the forward's kernel (`scaled_grouped_mm`: dy quantized along
N, Wᵀ quantized along N from the weight cache) and the wgrad on `quantize_token_major` operands
(`cute.scaled_grouped_wgrad` on cute, `fp8_wgrad.scaled_grouped_wgrad_emulated` on torch).

The unit tests hold the token-major operands bitwise to `qdq_columns_per_group` and the emulated
wgrad to a float64 loop. The op tests fake a Hopper GPU for the cute backend (as
tests/test_fp8_cute.py does) with recorders of both kernels that check their contracts and
compute the maths in fp32; the gradients must be within TOL of the reference backend's emulation
(same quantized values, summation order only).
"""

from __future__ import annotations

import pytest
import torch
from test_fp8 import bounds_of, emu_grouped
from test_fp8_cute import (  # noqa: F401 (fixture)
    CUDA,
    fake_cute_gpu,
    recording_scaled_grouped_mm,
    recording_scaled_grouped_wgrad,
)
from test_fp8_torch import rel_err, small_mlp

import te_seq
from te_seq import ops, recipe
from te_seq.core import fp8_gemm
from te_seq.kernels import fp8_reference as ref
from te_seq.kernels import fp8_wgrad

ROWWISE = recipe.Float8RowwiseScaling()
HYBRID_TENSOR = recipe.Float8CurrentScaling()  # default "HYBRID": E5M2 dy (native on cute)
HYBRID_ROWWISE = recipe.Float8RowwiseScaling(fp8_format="HYBRID")
E4M3_TENSOR = recipe.Float8CurrentScaling(fp8_format="E4M3")
NATIVE = [ROWWISE, E4M3_TENSOR, HYBRID_TENSOR, HYBRID_ROWWISE]
NATIVE_IDS = ["rowwise", "tensor-e4m3", "tensor-hybrid", "rowwise-hybrid"]
TOL = 1e-2  # real FP8 GEMM vs its emulation: summation order only
ROW = ref.QuantBlock(1, None)


def _offs(sizes, device="cpu"):
    return torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)


# --- quantize_token_major ---------------------------------------------------------------------

def _check_layout(tm, sizes, cols):
    """Spans padded to multiples of WGRAD_PAD, P the bound, zeros outside the spans."""
    pad = fp8_wgrad.WGRAD_PAD
    rows = sum(sizes)
    width = fp8_wgrad.padded_width(rows + 9, len(sizes))  # the inputs have 9 extra rows
    assert tm.data.shape == (cols, width) and tm.data.is_contiguous()
    assert tm.offs.dtype == torch.int32 and tm.scale_inv.shape == (len(sizes), cols)
    spans = [-(-n // pad) * pad for n in sizes]
    assert tm.offs.tolist() == torch.tensor(spans).cumsum(0).tolist()
    used = torch.zeros(width, dtype=torch.bool)
    start = 0
    for n, span in zip(sizes, spans):
        used[start:start + n] = True
        start += span
    assert (tm.data.view(torch.uint8)[:, ~used] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [[37, 0, 1, 200], [130], [0, 0, 5], [128, 256, 3]])
def test_token_major_is_the_per_group_quantization_bitwise(dtype, sizes):
    torch.manual_seed(sum(sizes))
    rows, cols = sum(sizes) + 9, 48  # 9 rows past offs[-1]: in no group
    t = (torch.randn(rows, cols) * torch.logspace(-3, 3, cols)).to(dtype)
    rule = ref.ScaleRule("E4M3", margin=1)
    tm = fp8_wgrad.quantize_token_major(t, _offs(sizes), rule)
    assert tm.data.dtype == torch.float8_e4m3fn
    _check_layout(tm, sizes, cols)
    bounds = bounds_of(torch.tensor(sizes))
    want = ref.qdq_columns_per_group(t, bounds, ROW, rule)
    assert torch.equal(tm.to_rows(_offs(sizes), rows), want)


def test_token_major_of_a_non_contiguous_input_with_an_inf():
    torch.manual_seed(1)
    sizes = [20, 33, 7]
    base = torch.randn(32, 69)
    t = base.t()  # [69, 32], column-major
    t[25, 3] = float("inf")  # poisons (group 1, column 3) only
    rule = ref.ScaleRule("E5M2", power_of_two=True)
    tm = fp8_wgrad.quantize_token_major(t, _offs(sizes), rule)
    want = ref.qdq_columns_per_group(t, bounds_of(torch.tensor(sizes)), ROW, rule)
    got = tm.to_rows(_offs(sizes), 69)
    assert torch.equal(got.isnan(), want.isnan()) and got[20:53, 3].isnan().all()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert tm.scale_inv[1, 3].isnan() and torch.isfinite(tm.scale_inv[[0, 2]]).all()


def test_token_major_nan_and_negative_inf_in_bf16():
    """A nan and a -inf poison only their (group, column) scales, as in the per-group loop
    (the block maxima keep a nan as non-finite through the max over a span's blocks)."""
    torch.manual_seed(4)
    sizes = [20, 0, 33, 7]
    t = torch.randn(69, 32).bfloat16()
    t[25, 3], t[2, 5] = float("nan"), -float("inf")
    tm = fp8_wgrad.quantize_token_major(t, _offs(sizes), ref.ScaleRule())
    want = ref.qdq_columns_per_group(t, bounds_of(torch.tensor(sizes)), ROW, ref.ScaleRule())
    got = tm.to_rows(_offs(sizes), 69)
    assert torch.equal(got.isnan(), want.isnan()) and got[20:53, 3].isnan().all()
    assert got[:20, 5].isnan().all() and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert tm.scale_inv.isnan().sum() == 2


def test_token_major_from_a_per_tensor_operand():
    torch.manual_seed(2)
    sizes = [3, 0, 140]
    t = torch.randn(143, 40)
    q = ref.quantize(t, ref.QuantBlock(None, None), ref.ScaleRule())
    tm = fp8_wgrad.token_major_from(q, _offs(sizes))
    _check_layout_no_extra(tm, sizes)
    assert torch.equal(tm.scale_inv, q.scale_inv.expand(3, 40))
    assert torch.equal(tm.to_rows(_offs(sizes), 143), q.dequantize())
    with pytest.raises(ValueError, match="per-tensor"):
        fp8_wgrad.token_major_from(ref.quantize(t, ROW, ref.ScaleRule()), _offs(sizes))


def _check_layout_no_extra(tm, sizes):
    assert tm.data.shape[1] == fp8_wgrad.padded_width(sum(sizes), len(sizes))
    assert (tm.offs % fp8_wgrad.WGRAD_PAD == 0).all()


# --- the emulated wgrad ------------------------------------------------------------------------

def _wgrad_case(seed=3):
    torch.manual_seed(seed)
    sizes = [37, 0, 1, 200]
    dy, x = torch.randn(238, 24), torch.randn(238, 40)
    rule = ref.ScaleRule()
    a = fp8_wgrad.quantize_token_major(dy, _offs(sizes), rule)
    b = fp8_wgrad.quantize_token_major(x, _offs(sizes), rule)
    want = []  # float64 per-group loop over the dequantized row layout
    dyr, xr = a.to_rows(_offs(sizes), 238).double(), b.to_rows(_offs(sizes), 238).double()
    for s, e in bounds_of(torch.tensor(sizes)):
        want.append(dyr[s:e].t() @ xr[s:e])
    return a, b, torch.stack(want)  # [G, N, K]


def test_emulated_wgrad_matches_a_float64_loop():
    a, b, want = _wgrad_case()
    args = (a.data, b.data, a.scale_inv, b.scale_inv, a.offs)
    got = fp8_wgrad.scaled_grouped_wgrad_emulated(*args)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got, want.to(torch.bfloat16)) or rel_err(got, want) < 4e-3
    assert (got[1] == 0).all()  # the empty group
    out = torch.randn(want.shape)
    start = out.clone()
    fp8_wgrad.scaled_grouped_wgrad_emulated(*args, out=out)
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-4)
    out.copy_(start)
    fp8_wgrad.scaled_grouped_wgrad_emulated(*args, out=out, accumulate=True)
    assert torch.allclose(out.double(), start.double() + want, rtol=1e-5, atol=1e-4)
    out16 = start.to(torch.bfloat16)
    fp8_wgrad.scaled_grouped_wgrad_emulated(*args, out=out16, accumulate=True)
    assert rel_err(out16, start.double() + want) < 4e-3


# --- the ops on a faked Hopper GPU, cute backend -----------------------------------------------

@pytest.fixture
def fake_kernels(fake_cute_gpu):  # noqa: F811 (the imported fixture: both kernels recorded)
    return fake_cute_gpu


def _linear(seed=7, **kw):
    torch.manual_seed(seed)
    op = ops.GroupedLinear(3, 128, 256, dtype=torch.bfloat16, **kw)
    splits = torch.tensor([37, 0, 91])
    x = torch.randn(128, 128, dtype=torch.bfloat16)
    dy = torch.randn(128, 256, dtype=torch.bfloat16)
    return op, splits, x, dy


def _run(op, splits, x, dy, r, backend="cute"):
    xi = x.clone().requires_grad_()
    model = te_seq.Sequential(op)
    with te_seq.backend(backend), te_seq.autocast(recipe=r):
        y = model(xi, splits)
    y.backward(dy)
    return model, xi.grad


def _stacked_grads(op, attr="grad"):
    grads = [getattr(p, attr).float() for _, p in op.named_weights()]
    return grads[0] if op.single_grouped_weight else torch.stack(grads)


def _assert_dgrad_call(call, r, dy, w):
    """The dgrad's kernel call: dy [T, N] quantized along N, Wᵀ [G, K, N] along N."""
    a, b, a_scale, b_scale, offs = call
    dyq = ref.quantize(dy.float(), r.block("grad"), r.rule("grad"))
    wq = [ref.quantize(w_g.float().t(), r.block("weight"), r.rule("weight")) for w_g in w]
    assert a.shape == dy.shape and b.shape == (w.shape[0], w.shape[2], w.shape[1])
    assert torch.equal(a.view(torch.uint8), dyq.data.view(torch.uint8))
    assert torch.equal(b.view(torch.uint8), torch.stack([q.data for q in wq]).view(torch.uint8))
    assert torch.equal(a_scale, dyq.scale_inv.reshape(-1).expand(dy.shape[0]))
    want_b = torch.stack([q.scale_inv.reshape(-1).expand(w.shape[2]) for q in wq])
    assert torch.equal(b_scale, want_b)


def _assert_wgrad_call(call, r, x, dy, splits):
    """The wgrad's kernel call: dY and X token-major, quantized along each group's tokens."""
    a, b, a_scale, b_scale, offs = call
    want_a = fp8_wgrad.quantize_token_major(dy, _offs(splits.tolist()), r.rule("grad"))
    if r.block("input") == ref.QuantBlock(None, None):
        xq = ref.quantize(x, r.block("input"), r.rule("input"))
        want_b = fp8_wgrad.token_major_from(xq, _offs(splits.tolist()))
        want_a = fp8_wgrad.token_major_from(
            ref.quantize(dy, r.block("grad"), r.rule("grad")), _offs(splits.tolist()))
    else:
        want_b = fp8_wgrad.quantize_token_major(x, _offs(splits.tolist()), r.rule("input"))
    for got, want in ((a, want_a.data), (b, want_b.data)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(a_scale, want_a.scale_inv) and torch.equal(b_scale, want_b.scale_inv)
    assert torch.equal(offs, want_a.offs)


@pytest.mark.parametrize("single", [False, True], ids=["per-group", "single"])
@pytest.mark.parametrize("r", NATIVE, ids=NATIVE_IDS)
def test_grouped_linear_native_backward_on_cute(fake_kernels, r, single):
    op, splits, x, dy = _linear(single_grouped_weight=single)
    model, dx = _run(op, splits, x, dy, r)
    note = model.fusion_plan().forward[0].backend_reason
    assert "forward and dgrad GEMMs via cute scaled_grouped_mm" in note
    assert "wgrad via cute scaled_grouped_wgrad (real FP8" in note
    w = op.stacked_weight().detach()
    mm_calls = recording_scaled_grouped_mm.calls
    assert len(mm_calls) == 2 and len(recording_scaled_grouped_wgrad.calls) == 1
    _assert_dgrad_call(mm_calls[1], r, dy, w)
    _assert_wgrad_call(recording_scaled_grouped_wgrad.calls[0], r, x, dy, splits)
    _, want_dx, want_dw = emu_grouped(r, x, w, dy, bounds_of(splits))
    assert dx.dtype == torch.bfloat16 and rel_err(dx, want_dx) < TOL
    got_dw = _stacked_grads(op)
    assert op.named_weights()[0][1].grad.dtype == torch.bfloat16
    assert rel_err(got_dw.reshape(want_dw.shape), want_dw) < TOL
    assert (got_dw.reshape(want_dw.shape)[1] == 0).all()  # the empty group


def test_native_backward_into_a_strided_main_grad(fake_kernels):
    """A main_grad that is a transposed view (not contiguous) is accumulated into through one
    fp32 result: the kernel itself takes contiguous buffers only."""
    op, splits, x, dy = _linear(single_grouped_weight=True)
    _run(op, splits, x, dy, ROWWISE)
    want = _stacked_grads(op)
    acc = ops.GroupedLinear(3, 128, 256, dtype=torch.bfloat16, single_grouped_weight=True,
                            accumulate_into_main_grad=True)
    acc.load_state_dict(op.state_dict())
    (_, p), = acc.named_weights()
    p.main_grad = torch.randn(3, 128, 256).transpose(1, 2)  # [3, 256, 128], strided
    start = p.main_grad.clone()
    _run(acc, splits, x, dy, ROWWISE)
    assert not p.main_grad.is_contiguous()
    assert rel_err(p.main_grad - start, want) < 4e-3


@pytest.mark.parametrize("single", [False, True], ids=["per-group", "single"])
def test_native_backward_main_grad_and_delayed_wgrad(fake_kernels, single):
    op, splits, x, dy = _linear(single_grouped_weight=single)
    _run(op, splits, x, dy, ROWWISE)
    want = _stacked_grads(op)
    acc = ops.GroupedLinear(3, 128, 256, dtype=torch.bfloat16, single_grouped_weight=single,
                            accumulate_into_main_grad=True)
    acc.load_state_dict(op.state_dict())
    starts = []
    for _, p in acc.named_weights():
        p.main_grad = torch.randn(p.shape)  # fp32, accumulated into
        starts.append(p.main_grad.clone())
    _run(acc, splits, x, dy, ROWWISE)
    start = starts[0] if single else torch.stack(starts)
    assert rel_err(_stacked_grads(acc, "main_grad") - start, want) < 4e-3
    delayed = ops.GroupedLinear(3, 128, 256, dtype=torch.bfloat16,
                                single_grouped_weight=single, delay_wgrad_compute=True)
    delayed.load_state_dict(op.state_dict())
    calls = len(recording_scaled_grouped_wgrad.calls)
    _run(delayed, splits, x, dy, ROWWISE)
    assert len(recording_scaled_grouped_wgrad.calls) == calls  # not run yet
    assert delayed.need_backward_dw()
    delayed.backward_dw()
    assert len(recording_scaled_grouped_wgrad.calls) == calls + 1
    assert torch.equal(_stacked_grads(delayed), want)


def test_hybrid_backward_is_native_on_cute_only(fake_kernels):
    """E5M2 gradients: the cute kernels take them (WGMMA mixes E5M2 and E4M3), torch's
    `_scaled_grouped_mm` does not, so the torch backend keeps the emulated backward."""
    dims, bf16 = [(128, 256)], torch.bfloat16
    assert fp8_gemm.backward_reason("cute", HYBRID_TENSOR, bf16, CUDA, dims, True) == ""
    why = fp8_gemm.backward_reason("torch", HYBRID_TENSOR, bf16, CUDA, dims, True)
    assert "grad format E5M2 (HYBRID): torch's FP8 kernels take E4M3" in why


@pytest.mark.parametrize("r", NATIVE, ids=NATIVE_IDS)
def test_fused_mlp_native_backward_on_cute(fake_kernels, r):
    results = {}
    for name in ("reference", "cute"):
        fc1, fc2, model, splits, probs, x = small_mlp()
        pi = probs.clone().requires_grad_()
        dy = torch.randn(127, 128, dtype=torch.bfloat16)
        with te_seq.backend(name), te_seq.autocast(recipe=r):
            y = model(x, splits, pi, splits)
        y.backward(dy)
        results[name] = [y, x.grad, pi.grad, *[p.grad for p in model.parameters()]]
        results[name + "_plan"] = model.fusion_plan().forward[0]
    step = results["cute_plan"]
    assert step.name == "GroupedMLP" and "wgrad via cute scaled_grouped_wgrad" in \
        step.backend_reason
    assert len(recording_scaled_grouped_mm.calls) == 4  # FC1, FC2 forward; FC2, FC1 dgrad
    wgrads = recording_scaled_grouped_wgrad.calls
    assert len(wgrads) == 2  # FC2 (the recomputed activation), then FC1
    assert wgrads[0][1].shape[0] == 256 and wgrads[1][1].shape[0] == 128  # K: F, then H
    for got, want in zip(results["cute"], results["reference"]):
        assert got.shape == want.shape and rel_err(got, want) < 2 * TOL, rel_err(got, want)


# --- the torch backend on a faked sm_90: dgrad on torch._scaled_grouped_mm, wgrad emulated ------

def test_torch_backend_native_dgrad_and_emulated_fp8_wgrad(monkeypatch):
    from test_fp8_torch import emulated_scaled_grouped_mm

    from te_seq.kernels import fp8_torch

    emulated_scaled_grouped_mm.calls = 0
    monkeypatch.setattr(fp8_torch, "forward_reason", lambda *a: "")
    monkeypatch.setattr(torch, "_scaled_grouped_mm", emulated_scaled_grouped_mm)
    real_wgrad, calls = fp8_wgrad.scaled_grouped_wgrad_emulated, []

    def recorded(*args, **kw):
        calls.append(args)
        return real_wgrad(*args, **kw)

    monkeypatch.setattr(fp8_wgrad, "scaled_grouped_wgrad_emulated", recorded)
    op, splits, x, dy = _linear(seed=12)
    model, dx = _run(op, splits, x, dy, ROWWISE, backend="torch")
    note = model.fusion_plan().forward[0].backend_reason
    assert "forward and dgrad GEMMs via torch._scaled_grouped_mm" in note
    assert "wgrad emulated (FP8 operands along the tokens" in note
    assert emulated_scaled_grouped_mm.calls == 2 and len(calls) == 1
    _assert_wgrad_call(calls[0], ROWWISE, x, dy, splits)
    _, want_dx, want_dw = emu_grouped(ROWWISE, x, op.stacked_weight().detach(), dy,
                                      bounds_of(splits))
    assert rel_err(dx, want_dx) < TOL and rel_err(_stacked_grads(op), want_dw) < TOL
