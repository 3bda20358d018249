"""Float8BlockScaling on the cute backend (CPU): the forward and dgrad GEMMs of GroupedLinear and
the fused GroupedMLP run `cute.block_scaled_grouped_mm` (1x128 tiles of x / dy along K, 128x128
blocks of W, E4M3, bf16, sm_90, K and N multiples of 16); the wgrad (1x128 tiles along each
expert's tokens) runs the varlen-K `cute.block_scaled_grouped_wgrad`; the GLU epilogues
(row-wise kernels) do not run, and the plan says so.

A Hopper GPU is faked as in tests/test_fp8_cute.py; the kernels are replaced by recorders that
check their contracts (block_fp8's / block_fp8_wgrad's own operand and scale checks) and
compute their maths on CPU.
The scale layouts are checked against fp8_reference's block quantization in float64. The real
kernel in the ops: tests/test_fp8_cute_block_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from test_fp8 import bounds_of, emu_grouped
from test_fp8_cute import fake_cute_gpu, recording_scaled_grouped_mm  # noqa: F401 (fixture)
from test_fp8_glu_epilogue import FakeGlu, fused_glu  # noqa: F401 (fixture)
from test_fp8_torch import rel_err

import te_seq
from te_seq import ops, recipe
from te_seq.core import fp8, fp8_gemm
from te_seq.kernels import cute, fp8_cute, fp8_torch, fp8_wgrad
from te_seq.kernels import fp8_reference as ref
from te_seq.kernels.cute import block_fp8, block_fp8_wgrad
from te_seq.kernels.cute_backend import CUTE

BLOCK = recipe.Float8BlockScaling()
CUDA = torch.device("cuda", 0)  # only named: nothing touches a GPU
E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
TOL = 1e-2  # a real FP8 GEMM vs its emulation: summation order only (tests/test_fp8_torch.py)
KERNEL = "cute block_scaled_grouped_mm"
WGRAD_KERNEL = "cute block_scaled_grouped_wgrad"


class _HybridBlocks(recipe.Float8BlockScaling):
    """Block scaling with E5M2 gradients, which Float8BlockScaling itself refuses: what the
    dispatch must decline should such a recipe reach it."""

    FORMATS = ("E4M3", "HYBRID")


def block_kernel_maths(a, b, a_scale, b_scale, offs, dtype=torch.float64):
    """The block kernel's sum, in `dtype`: rows m of group g,
    out[m, n] = Σ_kb a_scale[m, kb] · b_scale[g, n // 128, kb] · Σ_{k in kb} a[m, k] b[g, n, k]."""
    (m, k), n = a.shape, b.shape[1]
    out, start = torch.zeros(m, n, dtype=dtype), 0
    for g, end in enumerate(offs.tolist()):
        for kb in range(-(-k // 128)):
            cols = slice(kb * 128, (kb + 1) * 128)
            part = a[start:end, cols].to(dtype) @ b[g, :, cols].to(dtype).t()  # [rows, N]
            b_row = b_scale[g, :, kb].to(dtype).repeat_interleave(128)[:n]  # per column n
            out[start:end] += a_scale[start:end, kb, None].to(dtype) * b_row * part
        start = end
    return out


def recording_block_scaled_grouped_mm(a, b, a_scale, b_scale, offs, out_dtype=BF16):
    """`cute.block_scaled_grouped_mm` with its contract checked (block_fp8's checks but the
    device one), its maths in fp32 on CPU; the call is recorded."""
    assert out_dtype == BF16 and offs.dtype == torch.int32 and offs.shape == (b.shape[0],)
    why = block_fp8._operand_problem(a, b) or block_fp8._scale_problem(a, b, a_scale, b_scale)
    assert why == "", why
    recording_block_scaled_grouped_mm.calls.append((a, b, a_scale, b_scale, offs))
    return block_kernel_maths(a, b, a_scale, b_scale, offs, torch.float32).to(out_dtype)


def recording_block_scaled_grouped_wgrad(a, b, a_scale, b_scale, offs, out=None,
                                         accumulate=False):
    """`cute.block_scaled_grouped_wgrad` with its contract checked (block_fp8_wgrad's checks
    but the device one; spans on 128-token blocks, zeros past the last span), its maths (the
    fp32 emulation) on CPU; the call is recorded."""
    why = (block_fp8_wgrad._operand_problem(a, b, offs.shape[0])
           or block_fp8_wgrad._scale_problem(a, b, a_scale, b_scale))
    assert why == "", why
    assert offs.dtype == torch.int32 and (offs % 128 == 0).all() and offs[-1] <= a.shape[1]
    assert (a.view(torch.uint8)[:, int(offs[-1]):] == 0).all()
    if out is not None:
        assert out.dtype in (torch.float32, BF16) and out.is_contiguous()
    recording_block_scaled_grouped_wgrad.calls.append((a, b, a_scale, b_scale, offs))
    return fp8_wgrad.block_scaled_grouped_wgrad_emulated(a, b, a_scale, b_scale, offs, out,
                                                         accumulate)


# the block-scaled GLU steps: their GEMM by the block recorder, the GLU maths by the reference
BLOCK_GLU = FakeGlu("fc1", recording_block_scaled_grouped_mm)
BLOCK_GLU_DGRAD = FakeGlu("dgrad", recording_block_scaled_grouped_mm)


@pytest.fixture
def fake_block_gpu(fake_cute_gpu, monkeypatch):  # noqa: F811 (the imported fixture)
    recording_block_scaled_grouped_mm.calls = []
    recording_block_scaled_grouped_wgrad.calls = []
    monkeypatch.setattr(cute, "block_scaled_grouped_mm", recording_block_scaled_grouped_mm)
    monkeypatch.setattr(cute, "block_scaled_grouped_wgrad", recording_block_scaled_grouped_wgrad)
    BLOCK_GLU.calls, BLOCK_GLU_DGRAD.calls = [], []
    monkeypatch.setattr(cute, "block_scaled_glu_fc1_forward", BLOCK_GLU)
    monkeypatch.setattr(cute, "block_scaled_glu_fc2_dgrad", BLOCK_GLU_DGRAD)
    return recording_block_scaled_grouped_mm.calls


# --- the dispatch decisions ---------------------------------------------------------------------

def test_block_scaling_takes_the_block_kernel_for_forward_and_dgrad(monkeypatch):
    monkeypatch.setattr(fp8_torch, "cuda_capability", lambda device: (9, 0))
    dims = [(256, 384)]
    assert fp8_gemm.forward_reason("cute", BLOCK, BF16, CUDA, dims, True) == ""
    assert fp8_gemm.backward_reason("cute", BLOCK, BF16, CUDA, dims, True) == ""
    assert fp8_gemm.wgrad_reason(BLOCK) == ""
    assert fp8_gemm.wgrad_reason(recipe.Float8RowwiseScaling()) == ""
    for kernel in ("grouped_mm", "grouped_wgrad"):
        assert CUTE.supports(kernel, k=256, n=384, dtype=BF16, device=CUDA,
                             recipe=BLOCK) == (True, "")
    note = fp8_gemm.step_note(BLOCK, "cute", ops.GroupedLinear(3, 256, 384, dtype=BF16), BF16,
                              CUDA)
    assert note.startswith(f"FP8 Float8BlockScaling: forward and dgrad GEMMs via {KERNEL} "
                           f"(real FP8"), note
    assert note.endswith(f"; wgrad via {WGRAD_KERNEL} (real FP8, fp32 accumulation)"), note
    # the torch backend has no block-scaled kernel: all three GEMMs emulated there
    torch_why = fp8_gemm.forward_reason("torch", BLOCK, BF16, CUDA, dims, True)
    assert "no block-scaled FP8 kernel" in torch_why and "1x128/128x128" in torch_why


def test_block_scaling_declines_with_reasons(monkeypatch):
    cap = {"value": (9, 0)}
    monkeypatch.setattr(fp8_torch, "cuda_capability", lambda device: cap["value"])
    blocks = fp8_torch.BLOCK_SCALED

    def why(dtypes=(E4M3, E4M3), gemm=BF16, device=CUDA, dims=((256, 384),), b=blocks):
        return fp8_cute.forward_reason(b, dtypes, gemm, device, list(dims))

    assert why() == ""
    assert why(gemm=torch.float16) == f"the GEMM dtype is torch.float16, {KERNEL} outputs " \
                                      "bfloat16 only"
    assert why(dims=((256, 384), (136, 128))) == \
        f"K=136, N=128: both must be multiples of 16 for {KERNEL}"
    assert why(device=torch.device("cpu")) == "data on cpu, not CUDA"
    assert why(dtypes=(E5M2, E4M3)) == \
        f"{KERNEL} takes E4M3 operands, got torch.float8_e5m2/torch.float8_e4m3fn"
    mixed = (ref.QuantBlock(1, 128), ref.QuantBlock(1, None))
    assert "not 1x128/1xall blocks" in why(b=mixed)
    cap["value"] = (10, 0)
    assert why() == f"{KERNEL} needs sm_90 (Hopper WGMMA), the GPU is sm_100"
    assert "sm_100" in CUTE.supports("grouped_mm", k=256, n=384, dtype=BF16, device=CUDA,
                                     recipe=BLOCK)[1]


def test_e5m2_gradients_decline_the_block_dgrad(monkeypatch):
    monkeypatch.setattr(fp8_torch, "cuda_capability", lambda device: (9, 0))
    hybrid = _HybridBlocks(fp8_format="HYBRID")
    assert hybrid.rule("grad").dtype == E5M2
    dims = [(256, 384)]
    assert fp8_gemm.forward_reason("cute", hybrid, BF16, CUDA, dims, True) == ""
    why = fp8_gemm.backward_reason("cute", hybrid, BF16, CUDA, dims, True)
    assert why == f"dgrad: {KERNEL} takes E4M3 operands, got torch.float8_e5m2/" \
                  "torch.float8_e4m3fn"
    note = fp8_gemm.step_note(hybrid, "cute", ops.GroupedLinear(3, 256, 384, dtype=BF16), BF16,
                              CUDA)
    assert f"forward GEMMs via {KERNEL}" in note and "dgrad and wgrad emulated" in note
    assert "E4M3" in note


def test_block_scaling_fuses_the_activation_into_both_epilogues(fake_block_gpu):
    model = _run_mlp("cute")[0]  # gated, no FC1 bias
    step = model.fusion_plan().forward[0]
    assert step.name == "GroupedMLP" and step.backend == "cute"
    assert "activation fused into the FP8 FC1 and FC2-dgrad epilogues" in step.backend_reason, \
        step.backend_reason
    assert len(BLOCK_GLU.calls) == 1 and len(BLOCK_GLU_DGRAD.calls) == 1
    dy, w2t, dy_scale, w2t_scale, _ = BLOCK_GLU_DGRAD.calls[0]  # dy [M, H], W2ᵀ [E, F, H]
    assert dy.shape == (127, 128) and w2t.shape == (3, 256, 128)
    assert dy_scale.shape == (127, 1) and w2t_scale.shape == (3, 2, 1)


def test_block_glu_declines_with_the_reason(monkeypatch):
    """F not a multiple of 128 (the gate and up halves' weight blocks) keeps the activation
    after the GEMMs, and the reason names the kernel's check."""
    monkeypatch.setattr(fp8_torch, "cuda_capability", lambda device: (9, 0))
    spec = ops.ScaledSwiGLU().glu_spec
    why = fp8_cute.block_glu_reason(spec, 256, 192, torch.device("cpu"))
    assert why == "FC1: F=192 must be a multiple of 128 (whole weight blocks per half)"


# --- the scale layouts against fp8_reference (float64) ------------------------------------------

def _grouped_ref(a_deq: torch.Tensor, w_deq: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of group g: a_deq[rows] @ w_deq[g]ᵀ in float64 (w_deq [G, N, K])."""
    out, start = torch.zeros(a_deq.shape[0], w_deq.shape[1], dtype=torch.float64), 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a_deq[start:end].double() @ w_deq[g].double().t()
        start = end
    return out


@pytest.mark.parametrize("k, n, splits", [
    (256, 384, [37, 0, 91]),        # an empty expert
    (208, 336, [64, 5, 0, 30]),     # K and N not multiples of 128: partial blocks
    (1040, 48, [129]),              # one expert, a partial last k-block
    (128, 128, [0, 0, 17]),         # leading empty experts
    (256, 256, [40, 90]),           # a square 2x2 grid: a missing transpose keeps the shape
])
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32-scales"])
def test_block_scales_lay_out_the_reference_quantization(k, n, splits, pow2):
    """Forward (x [M, K] against W [G, N, K]) and dgrad (dy [M, N] against Wᵀ [G, K, N], the
    transposed block grid): the kernel's sum with `block_scales`' scales equals the GEMM of
    fp8_reference's dequantized operands. Power-of-two scales make the dequantization and every
    product exact (then bitwise); with fp32 scales the reference's fp32 dequantization rounds
    each element once (2^-24 relative), where the kernel scales the exact block sums: 1e-6,
    far below what a wrong or misplaced scale (a factor of 2 or more on a block) would give."""
    torch.manual_seed(k + n)
    r = recipe.Float8BlockScaling(power_of_two_scales=pow2)
    m, g = sum(splits), len(splits)
    offs = torch.cumsum(torch.tensor(splits), 0).to(torch.int32)
    x = torch.randn(m, k) * torch.logspace(-2, 2, k)  # scales that differ per 128-block
    dy = torch.randn(m, n) * 3
    w = torch.randn(g, n, k) * torch.logspace(-1, 1, n)[:, None]
    weights = fp8.cached_weights(torch.nn.Module(), r, w, [])
    check = (lambda got, want: torch.equal(got, want)) if pow2 else \
        (lambda got, want: rel_err(got, want) < 1e-6)
    w_deq = torch.stack([ref.qdq(w_g, r.block("weight"), r.rule("weight")) for w_g in w])
    for a, (b_data, b_scale), b_deq in (
        (x, weights.fp8, w_deq),                          # forward: y = x Wᵀ
        (dy, weights.dgrad_fp8, w_deq.transpose(1, 2)),   # dgrad: dx = dy W = dy (Wᵀ)ᵀ
    ):
        a_q = ref.quantize(a, r.block("input"), r.rule("input"))
        a_scale, b_scale_k = fp8_cute.block_scales(a_q, b_scale, b_data.shape[1])
        kb, nb = -(-a.shape[1] // 128), -(-b_data.shape[1] // 128)
        assert a_scale.shape == (m, kb) and b_scale_k.shape == (g, nb, kb)
        assert a_scale.is_contiguous() and b_scale_k.is_contiguous()
        assert block_fp8._scale_problem(a_q.data, b_data, a_scale, b_scale_k) == ""
        got = block_kernel_maths(a_q.data, b_data, a_scale, b_scale_k, offs)
        want = _grouped_ref(a_q.dequantize(), b_deq, offs)
        assert check(got, want), (got - want).abs().max()


def test_block_scales_name_shapes_that_do_not_fit():
    x = ref.quantize(torch.randn(5, 256), ref.QuantBlock(1, 128), ref.ScaleRule())
    with pytest.raises(ValueError, match=r"block_scaled_grouped_mm.*\[2, 3, 2\]"):
        fp8_cute.block_scales(x, torch.ones(2, 2, 2), 384)  # NB should be 3
    rows = ref.quantize(torch.randn(5, 256), ref.QuantBlock(1, None), ref.ScaleRule())
    with pytest.raises(ValueError, match="QuantBlock"):
        fp8_cute.block_scales(rows, torch.ones(2, 3, 2), 384)


# --- the ops on the faked kernel ----------------------------------------------------------------

def _grouped_linear(name, splits, groups=3, k=128, n=256, seed=7):
    torch.manual_seed(seed)
    op = ops.GroupedLinear(groups, k, n, dtype=BF16)
    m = int(sum(splits))
    x = torch.randn(m, k, dtype=BF16).requires_grad_()
    dy = torch.randn(m, n, dtype=BF16)
    model = te_seq.Sequential(op)
    with te_seq.backend(name), te_seq.autocast(recipe=BLOCK):
        y = model(x, torch.tensor(splits))
    y.backward(dy)
    grads = [op.get_parameter(f"weight{g}").grad for g in range(groups)]
    return model, op, x, dy, y.detach(), grads


def _assert_block_call(call, a, w, transpose: bool):
    """The recorded call got a quantized in 1x128 tiles and W's (or Wᵀ's) 128x128 blocks."""
    a_data, _, a_scale, _, _ = call
    a_q = ref.quantize(a.detach().float(), ref.QuantBlock(1, 128), BLOCK.rule("input"))
    assert torch.equal(a_data.view(torch.uint8), a_q.data.view(torch.uint8))
    assert torch.equal(a_scale, a_q.scale_inv)
    _assert_weight_operand(call, w, transpose)


def _assert_weight_operand(call, w, transpose: bool):
    """The call's b: each expert's W [N, K] in 128x128 blocks (transposed grid: Wᵀ for dgrad)."""
    _, b_data, _, b_scale, _ = call
    w_q = [ref.quantize(w_g.float(), ref.QuantBlock(128, 128), BLOCK.rule("weight")) for w_g in w]
    data = torch.stack([q.data.t() if transpose else q.data for q in w_q])
    scale = torch.stack([q.scale_inv.t() if transpose else q.scale_inv for q in w_q])
    assert torch.equal(b_data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(b_scale, scale)


@pytest.mark.parametrize("splits", [[37, 0, 91], [0, 50, 0], [128]],
                         ids=["empty-expert", "empty-ends", "one-expert"])
def test_grouped_linear_runs_its_gemms_on_the_block_kernels(fake_block_gpu, splits):
    groups = len(splits)
    model, op, x, dy, y, grads = _grouped_linear("cute", splits, groups)
    step = model.fusion_plan().forward[0]
    assert step.backend == "cute" and f"forward and dgrad GEMMs via {KERNEL}" in \
        step.backend_reason and f"wgrad via {WGRAD_KERNEL}" in step.backend_reason
    assert recording_scaled_grouped_mm.calls == []  # never the row-wise kernel
    assert len(fake_block_gpu) == 2  # forward, dgrad
    w = op.stacked_weight().detach()
    _assert_block_call(fake_block_gpu[0], x, w, transpose=False)
    _assert_block_call(fake_block_gpu[1], dy, w, transpose=True)
    assert fake_block_gpu[1][4].tolist() == torch.cumsum(torch.tensor(splits), 0).tolist()
    want_y, want_dx, _ = emu_grouped(BLOCK, x.detach(), w, dy, bounds_of(torch.tensor(splits)))
    assert y.dtype == BF16 and rel_err(y, want_y) < TOL
    assert x.grad.dtype == BF16 and rel_err(x.grad, want_dx) < TOL
    (wgrad_call,) = recording_block_scaled_grouped_wgrad.calls
    _assert_block_wgrad_call(wgrad_call, splits, dy, x.detach())
    # the same quantized values as the reference's emulation: summation order only
    ref_grads = _grouped_linear("reference", splits, groups)[5]
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < 1e-3


def _assert_block_wgrad_call(call, splits, dy, x):
    """The recorded wgrad got dy and x (None: not checked) quantized in 1x128 blocks along
    each expert's tokens, token-major (`quantize_token_major_blocks`, itself the reference's
    quantization: tests/test_fp8_wgrad_blocks.py)."""
    offs = torch.cumsum(torch.tensor(splits), 0).to(torch.int32)
    a, b, a_scale, b_scale, padded_offs = call
    for data, scale, t, role in ((a, a_scale, dy, "grad"), (b, b_scale, x, "input")):
        if t is None:
            continue
        want = fp8_wgrad.quantize_token_major_blocks(t, offs, BLOCK.rule(role))
        assert torch.equal(data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(scale, want.scale_inv) and torch.equal(padded_offs, want.offs)


def _run_mlp(name):
    """A fused MLP (SwiGLU with probs, no biases, an empty expert) under BLOCK on backend
    `name`, seeded: (model, fc1, fc2, x, [y, dx, d probs, param grads])."""
    torch.manual_seed(9)
    fc1 = ops.GroupedLinear(3, 128, 512, bias=False, dtype=BF16)
    fc2 = ops.GroupedLinear(3, 256, 128, bias=False, dtype=BF16)
    model = te_seq.Sequential(fc1, ops.ScaledSwiGLU(), fc2)
    splits = torch.tensor([50, 0, 77])
    probs = torch.rand(127, dtype=BF16).requires_grad_()
    x = torch.randn(127, 128, dtype=BF16).requires_grad_()
    dy = torch.randn(127, 128, dtype=BF16)
    with te_seq.backend(name), te_seq.autocast(recipe=BLOCK):
        y = model(x, splits, probs, splits)
    y.backward(dy)
    grads = [y.detach(), x.grad, probs.grad, *[p.grad for p in model.parameters()]]
    return model, fc1, fc2, x, grads


def test_fused_mlp_runs_its_gemms_on_the_block_kernel(fake_block_gpu, fused_glu):  # noqa: F811
    model, fc1, fc2, x, got = _run_mlp("cute")
    step = model.fusion_plan().forward[0]
    assert step.name == "GroupedMLP" and step.backend == "cute"
    assert f"forward and dgrad GEMMs via {KERNEL}" in step.backend_reason
    assert f"wgrad via {WGRAD_KERNEL}" in step.backend_reason
    assert "activation fused into the FP8 FC1 and FC2-dgrad epilogues" in step.backend_reason
    assert fused_glu[0].calls == [] and fused_glu[1].calls == []  # no row-wise GLU epilogues
    a, b, a_scale, b_scale, _ = BLOCK_GLU.calls[0]  # FC1 through the block GLU
    assert a.shape == (127, 128) and b.shape == (3, 512, 128)
    assert a_scale.shape == (127, 1) and b_scale.shape == (3, 4, 1)
    assert recording_scaled_grouped_mm.calls == []
    # FC1 forward, FC2 forward, FC2 dgrad, FC1 dgrad
    shapes = [(tuple(c[0].shape), tuple(c[1].shape)) for c in fake_block_gpu]
    assert shapes == [((127, 128), (3, 512, 128)), ((127, 256), (3, 128, 256)),
                      ((127, 128), (3, 256, 128)), ((127, 512), (3, 128, 512))]
    _assert_block_call(fake_block_gpu[0], x, fc1.stacked_weight().detach(), transpose=False)
    _assert_weight_operand(fake_block_gpu[1], fc2.stacked_weight().detach(), transpose=False)
    _assert_weight_operand(fake_block_gpu[2], fc2.stacked_weight().detach(), transpose=True)
    _assert_weight_operand(fake_block_gpu[3], fc1.stacked_weight().detach(), transpose=True)
    # FC2's wgrad (on the recomputed activation), then FC1's (on x)
    wgrads = recording_block_scaled_grouped_wgrad.calls
    assert [(tuple(c[0].shape), tuple(c[1].shape)) for c in wgrads] == [
        ((128, 512), (256, 512)), ((512, 512), (128, 512))]
    _assert_block_wgrad_call(wgrads[1], [50, 0, 77], None, x.detach())
    want = _run_mlp("reference")[4]  # the emulation, the same weights, data and dy
    # h's bf16 rounding feeds FC2's quantization: an FP8 step where it crosses a boundary
    for g, w in zip(got, want):
        assert g is not None and rel_err(g, w) < 3 * TOL, rel_err(g, w)
