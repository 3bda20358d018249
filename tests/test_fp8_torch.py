"""Real FP8 forward GEMMs on the torch backend (torch._scaled_mm / torch._scaled_grouped_mm).

CPU: which path the guard picks for which device / capability / dtype / widths / recipe (the
capability check faked), the plan's note, the scaled-matmul calls' scales and layouts (against
torch's own checks on meta tensors, and torch's CPU `_scaled_mm` where it has one), and the ops'
wiring with the guard forced open and the grouped kernel emulated. GPU (marked gpu): the real
kernels against the reference backend.

Tolerance of real vs emulated: the operands are the same FP8 values and scales; only the
summation order differs (and the emulation rounds the fp32 result to bf16 once, as the kernel
does), so the bf16 outputs agree to a relative error (‖a − b‖ / ‖b‖) of at most 1e-2.
"""

from __future__ import annotations

import pytest
import torch
from test_fp8 import bounds_of, emu_grouped, emu_linear

import te_seq
from te_seq import ops, recipe
from te_seq.core import fp8_gemm
from te_seq.kernels import fp8_reference as ref
from te_seq.kernels import fp8_torch

ROWWISE, TENSOR, BLOCK = (recipe.Float8RowwiseScaling(), recipe.Float8CurrentScaling(),
                          recipe.Float8BlockScaling())
REAL_RECIPES, REAL_IDS = [ROWWISE, TENSOR], ["rowwise", "tensor"]
TOL = 1e-2  # relative error of a real FP8 GEMM vs its emulation (see the module docstring)
CUDA = torch.device("cuda", 0)  # only named: the capability check is faked on CPU


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖; where `want` is all zeros (an empty group's weight gradient),
    `got` must be exactly zero too (0.0, else inf)."""
    diff = (got.float() - want.float()).norm()
    scale = want.float().norm()
    if scale == 0:
        return 0.0 if diff == 0 else float("inf")
    return (diff / scale).item()


@pytest.fixture
def fake_gpu(monkeypatch):
    """The capability check answers for a pretend GPU; returns a setter for its capability."""
    cap = {"value": (9, 0)}
    monkeypatch.setattr(fp8_torch, "cuda_capability", lambda device: cap["value"])
    return lambda major, minor: cap.update(value=(major, minor))


# --- the guard ----------------------------------------------------------------------------------

def _reason(r, dtype=torch.bfloat16, device=CUDA, dims=((128, 256),), grouped=True,
            backend="torch"):
    return fp8_gemm.forward_reason(backend, r, dtype, device, list(dims), grouped)


@pytest.mark.parametrize("r", REAL_RECIPES + [recipe.Float8RowwiseScaling(fp8_format="HYBRID")])
def test_guard_opens_on_hopper_bf16_aligned(fake_gpu, r):
    assert _reason(r, grouped=True) == ""
    assert _reason(r, grouped=False) == ""  # HYBRID: forward operands are E4M3 all the same


def test_guard_reasons(fake_gpu):
    assert "reference backend emulates" in _reason(ROWWISE, backend="reference")
    assert "not CUDA" in _reason(ROWWISE, device=torch.device("cpu"))
    assert "not 1x128/128x128 blocks" in _reason(BLOCK)
    assert "bfloat16 only" in _reason(ROWWISE, dtype=torch.float32)
    assert "bfloat16 only" in _reason(ROWWISE, dtype=torch.float16)
    assert "K=24, N=256" in _reason(ROWWISE, dims=[(128, 256), (24, 256)])
    assert "K=128, N=40" in _reason(ROWWISE, dims=[(128, 40)], grouped=False)
    fake_gpu(8, 9)
    assert "sm_89" in _reason(ROWWISE, grouped=False) and "sm_89" in _reason(ROWWISE)
    fake_gpu(10, 0)  # _scaled_mm runs on Blackwell; torch's FP8 row-wise grouped kernel does not
    assert _reason(ROWWISE, grouped=False) == ""
    assert "sm_90 (Hopper) exactly" in _reason(ROWWISE, grouped=True)


def test_guard_without_the_torch_function(fake_gpu, monkeypatch):
    monkeypatch.delattr(torch, "_scaled_grouped_mm")
    assert "has no torch._scaled_grouped_mm" in _reason(ROWWISE, grouped=True)
    assert _reason(ROWWISE, grouped=False) == ""


def test_guard_never_asks_cuda_on_cpu(monkeypatch):
    def boom(device):
        raise AssertionError("capability asked for CPU data")

    monkeypatch.setattr(fp8_torch, "cuda_capability", boom)
    assert "not CUDA" in _reason(ROWWISE, device=torch.device("cpu"))


# --- the plan says which path runs --------------------------------------------------------------

def _grouped_model(k=128, n=256, dtype=torch.bfloat16):
    return te_seq.Sequential(ops.GroupedLinear(3, k, n, dtype=dtype))


@pytest.mark.parametrize("name", ["auto", "torch", "reference"])
def test_plan_says_emulated_on_cpu(name):
    x, splits = torch.randn(20, 128, dtype=torch.bfloat16), torch.tensor([5, 0, 15])
    for model, args in ((_grouped_model(), (x, splits)),
                        (te_seq.Sequential(ops.BasicLinear(128, 64, dtype=torch.bfloat16)), (x,))):
        with te_seq.backend(name), te_seq.autocast(recipe=ROWWISE):
            model(*args)
        why = model.fusion_plan().forward[0].backend_reason
        assert "emulated on" in why and "_scaled" not in why.split("emulated")[0]
        if model.fusion_plan().forward[0].backend == "torch":
            assert "data on cpu, not CUDA" in why


# --- the scaled matmul calls: scales and layouts ------------------------------------------------

def _quantized(t, r, role="input"):
    return ref.quantize(t, r.block(role), r.rule(role))


@pytest.mark.parametrize("r", REAL_RECIPES, ids=REAL_IDS)
def test_scaled_mm_takes_dequantization_scales(r):
    x, w = torch.randn(37, 64) * 3, torch.randn(48, 64) / 5
    xq, wq = _quantized(x, r), _quantized(w, r, "weight")
    want = xq.dequantize() @ wq.dequantize().t()
    try:
        y = fp8_torch.scaled_mm(xq, wq, torch.bfloat16)
    except (NotImplementedError, RuntimeError) as e:  # no CPU kernel in this torch build
        pytest.skip(f"torch._scaled_mm does not run on CPU here: {e}")
    assert y.dtype == torch.bfloat16 and y.shape == (37, 48)
    assert rel_err(y, want) < TOL
    assert fp8_torch.scaled_mm(_quantized(x[:0], r), wq, torch.bfloat16).shape == (0, 48)


_REAL_GROUPED = torch._scaled_grouped_mm


def emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None, **_):
    """torch._scaled_grouped_mm's maths in fp32 on CPU, after torch's own checks of shapes,
    strides and scales (its meta kernel): rows of group g = (a · scale_a) (b[g] · scale_b[g])."""
    meta = [t.to("meta") for t in (a, b, scale_a, scale_b, offs)]
    torch._check(_REAL_GROUPED(*meta[:4], offs=meta[4], out_dtype=out_dtype) is not None)
    out, start = torch.zeros(a.shape[0], b.shape[2]), 0
    for g, end in enumerate(offs.tolist()):
        rows = a[start:end].float() * scale_a[start:end, None]
        out[start:end] = rows @ (b[g].float() * scale_b[g][None, :])
        start = end
    emulated_scaled_grouped_mm.calls += 1
    return out.to(out_dtype)


@pytest.mark.parametrize("r", REAL_RECIPES, ids=REAL_IDS)
def test_scaled_grouped_mm_layouts_pass_torchs_checks(r):
    emulated_scaled_grouped_mm.calls = 0
    x, w = torch.randn(41, 64), torch.randn(3, 32, 64)
    offs = torch.tensor([13, 13, 41], dtype=torch.int32)  # unaligned sizes, an empty group
    xq, wqs = _quantized(x, r), [_quantized(w_g, r, "weight") for w_g in w]
    data, scale_inv = (torch.stack([q.data for q in wqs]),
                       torch.stack([q.scale_inv for q in wqs]))
    torch._scaled_grouped_mm = emulated_scaled_grouped_mm
    try:
        y = fp8_torch.scaled_grouped_mm(xq, data, scale_inv, offs, torch.bfloat16)
    finally:
        torch._scaled_grouped_mm = _REAL_GROUPED
    xd = xq.dequantize()
    want = torch.cat([xd[:13] @ wqs[0].dequantize().t(), xd[13:] @ wqs[2].dequantize().t()])
    assert emulated_scaled_grouped_mm.calls == 1 and rel_err(y, want) < TOL


# --- the ops' wiring with the guard forced open (CPU) -------------------------------------------

@pytest.fixture
def forced_native(monkeypatch):
    """The guard says yes on CPU; the grouped kernel is emulated (torch has no CPU one)."""
    emulated_scaled_grouped_mm.calls = 0
    monkeypatch.setattr(fp8_torch, "forward_reason", lambda *a: "")
    monkeypatch.setattr(torch, "_scaled_grouped_mm", emulated_scaled_grouped_mm)


@pytest.mark.parametrize("r", REAL_RECIPES, ids=REAL_IDS)
def test_grouped_linear_native_wiring(forced_native, r):
    torch.manual_seed(7)
    op = ops.GroupedLinear(3, 128, 256, dtype=torch.bfloat16)
    splits = torch.tensor([37, 0, 91])
    x = torch.randn(128, 128, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(128, 256, dtype=torch.bfloat16)
    model = te_seq.Sequential(op)
    with te_seq.backend("torch"), te_seq.autocast(recipe=r):
        y = model(x, splits)
    y.backward(dy)
    # forward, then the dgrad where the gradient is E4M3 (HYBRID's E5M2 dy stays emulated)
    native_dgrad = r.rule("grad").fmt == "E4M3"
    assert emulated_scaled_grouped_mm.calls == 1 + native_dgrad
    note = model.fusion_plan().forward[0].backend_reason
    assert "torch._scaled_grouped_mm" in note
    assert ("forward and dgrad GEMMs via" in note) == native_dgrad, note
    want_y, want_dx, want_dw = emu_grouped(r, x.detach(), op.stacked_weight().detach(), dy,
                                           bounds_of(splits))
    got_dw = torch.stack([op.get_parameter(f"weight{g}").grad for g in range(3)])
    assert rel_err(y, want_y) < TOL
    assert rel_err(x.grad, want_dx) < TOL and rel_err(got_dw, want_dw) < TOL


@pytest.mark.parametrize("r", REAL_RECIPES, ids=REAL_IDS)
def test_basic_linear_native_wiring(forced_native, r):
    torch.manual_seed(8)
    op = ops.BasicLinear(64, 48, dtype=torch.bfloat16)
    x = torch.randn(3, 7, 64, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(3, 7, 48, dtype=torch.bfloat16)
    model = te_seq.Sequential(op)
    with te_seq.backend("torch"), te_seq.autocast(recipe=r):
        try:
            y = model(x)
        except (NotImplementedError, RuntimeError) as e:
            pytest.skip(f"torch._scaled_mm does not run on CPU here: {e}")
    y.backward(dy)
    assert "torch._scaled_mm" in model.fusion_plan().forward[0].backend_reason
    want_y, want_dx, want_dw = emu_linear(r, x.detach().reshape(-1, 64), op.weight.detach(),
                                          dy.reshape(-1, 48))
    assert y.shape == (3, 7, 48) and y.dtype == torch.bfloat16
    assert rel_err(y.reshape(-1, 48), want_y) < TOL
    assert torch.equal(x.grad.reshape(-1, 64), want_dx)  # dgrad, wgrad: still emulated
    assert torch.equal(op.weight.grad, want_dw)


def small_mlp():
    """The small fused-MLP case of the CPU wiring tests: (fc1, fc2, the Sequential, split sizes,
    router probs, x [127, 128] requiring grad), seeded."""
    torch.manual_seed(9)
    fc1 = ops.GroupedLinear(3, 128, 512, dtype=torch.bfloat16)
    fc2 = ops.GroupedLinear(3, 256, 128, dtype=torch.bfloat16)
    model = te_seq.Sequential(fc1, ops.ScaledSwiGLU(), fc2)
    splits, probs = torch.tensor([50, 0, 77]), torch.rand(127, dtype=torch.bfloat16)
    x = torch.randn(127, 128, dtype=torch.bfloat16).requires_grad_()
    return fc1, fc2, model, splits, probs, x


def fc2_input(r, x, fc1, probs, splits):
    """What FC2 quantizes in `small_mlp` under `r`: silu(gate)·up·probs of FC1's emulated h."""
    h = emu_grouped(r, x.detach(), fc1.stacked_weight().detach(), torch.zeros(127, 512),
                    bounds_of(splits))[0]
    gate, up = h.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up * probs.float()[:, None]).to(torch.bfloat16)


def gpu_linear_case(r):
    """(build, run) of the GPU GroupedLinear case under recipe `r` (None: no recipe; an empty
    group, unaligned sizes): run(model) returns y, dx and every parameter's gradient."""
    splits = torch.tensor([37, 0, 91, 5], device="cuda")
    x = torch.randn(133, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(133, 128, device="cuda", dtype=torch.bfloat16)

    def build():
        return te_seq.Sequential(ops.GroupedLinear(4, 256, 128, dtype=torch.bfloat16))

    def run(model):
        xi = x.clone().requires_grad_()
        with te_seq.autocast(enabled=r is not None, recipe=r):
            y = model(xi, splits)
        y.backward(dy)
        return (y.detach(), xi.grad, *[p.grad for p in model.parameters()])

    return build, run


def gpu_mlp_case(r):
    """(build, run) of the GPU fused-MLP case under recipe `r`: run(model) returns y, dx,
    d probs and every parameter's gradient."""
    splits = torch.tensor([70, 0, 133], device="cuda")
    x = torch.randn(203, 256, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(203, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(203, 256, device="cuda", dtype=torch.bfloat16)

    def build():
        return te_seq.Sequential(ops.GroupedLinear(3, 256, 512, dtype=torch.bfloat16),
                                 ops.ScaledSwiGLU(),
                                 ops.GroupedLinear(3, 256, 256, dtype=torch.bfloat16))

    def run(model):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        with te_seq.autocast(recipe=r):
            y = model(xi, splits, pi, splits)
        y.backward(dy)
        return (y.detach(), xi.grad, pi.grad, *[p.grad for p in model.parameters()])

    return build, run


@pytest.mark.parametrize("r", REAL_RECIPES, ids=REAL_IDS)
def test_fused_mlp_native_wiring(forced_native, r):
    fc1, fc2, model, splits, probs, x = small_mlp()
    dy = torch.randn(127, 128, dtype=torch.bfloat16)
    with te_seq.backend("torch"), te_seq.autocast(recipe=r):
        y = model(x, splits, probs, splits)
    y.backward(dy)
    step = model.fusion_plan().forward[0]
    assert step.name == "GroupedMLP" and "torch._scaled_grouped_mm" in step.backend_reason
    # FC1 and FC2 forward, and their dgrads where the gradient is E4M3 (not HYBRID's E5M2)
    assert emulated_scaled_grouped_mm.calls == (4 if r.rule("grad").fmt == "E4M3" else 2)
    bounds = bounds_of(splits)
    a = fc2_input(r, x, fc1, probs, splits)
    want_y = emu_grouped(r, a, fc2.stacked_weight().detach(), torch.zeros(127, 128), bounds)[0]
    assert rel_err(y, want_y) < 2 * TOL  # h's bf16 rounding feeds FC2's quantization
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


# --- GPU: the real kernels against the reference backend ----------------------------------------

def on_backends(build, run, names=("reference", "torch")) -> dict:
    """`run(model)` (outputs, then grads) and the plan on each backend in `names`, each with the
    same freshly seeded weights."""
    results = {}
    for name in names:
        torch.manual_seed(11)
        model = build().cuda()
        with te_seq.backend(name):
            results[name] = run(model)
        results[name + "_plan"] = model.fusion_plan()
    return results


def _assert_close_all(got, want, tol=TOL):
    for g, w in zip(got, want):
        assert rel_err(g, w) < tol, (rel_err(g, w), tol)


@pytest.mark.gpu
@pytest.mark.parametrize("r", REAL_RECIPES, ids=REAL_IDS)
def test_basic_linear_scaled_mm_on_gpu(r):
    x = torch.randn(5, 37, 256, device="cuda", dtype=torch.bfloat16)  # 185 rows: unaligned M
    dy = torch.randn(5, 37, 128, device="cuda", dtype=torch.bfloat16)

    def run(model):
        xi = x.clone().requires_grad_()
        with te_seq.autocast(recipe=r):
            y = model(xi)
        y.backward(dy)
        return y, xi.grad, model[0].weight.grad

    res = on_backends(
        lambda: te_seq.Sequential(ops.BasicLinear(256, 128, dtype=torch.bfloat16)), run)
    step = res["torch_plan"].forward[0]
    assert step.backend == "torch" and "torch._scaled_mm" in step.backend_reason
    _assert_close_all(res["torch"], res["reference"])


@pytest.mark.gpu
@pytest.mark.parametrize("r", REAL_RECIPES, ids=REAL_IDS)
def test_grouped_linear_scaled_grouped_mm_on_gpu(r):
    res = on_backends(*gpu_linear_case(r))
    step = res["torch_plan"].forward[0]
    assert step.backend == "torch" and "torch._scaled_grouped_mm" in step.backend_reason
    assert "emulated" in res["reference_plan"].forward[0].backend_reason
    _assert_close_all(res["torch"], res["reference"])


@pytest.mark.gpu
@pytest.mark.parametrize("r", REAL_RECIPES, ids=REAL_IDS)
def test_fused_mlp_scaled_grouped_mm_on_gpu(r):
    build, run = gpu_mlp_case(r)
    res = on_backends(build, run)
    step = res["torch_plan"].forward[0]
    assert step.name == "GroupedMLP" and step.backend == "torch"
    assert "torch._scaled_grouped_mm" in step.backend_reason
    # FC1's bf16 output differs by rounding, and FC2 quantizes it: twice the GEMM tolerance
    _assert_close_all(res["torch"], res["reference"], tol=2 * TOL)


@pytest.mark.gpu
def test_guard_falls_back_on_gpu():
    """fp32 data, widths not multiples of 16, block scaling: emulated on torch, as the plan says,
    and equal to the reference within the same tolerance."""
    cases = [(ROWWISE, torch.float32, 256, 128, "bfloat16 only"),
             (ROWWISE, torch.bfloat16, 264, 136, "multiples of 16"),
             (BLOCK, torch.bfloat16, 256, 128, "per-tensor or row-wise")]
    splits = torch.tensor([40, 0, 60], device="cuda")
    for r, dtype, k, n, why in cases:
        x = torch.randn(100, k, device="cuda", dtype=dtype)

        def run(model, r=r, x=x):
            with te_seq.autocast(recipe=r):
                return (model(x, splits),)

        res = on_backends(
            lambda k=k, n=n, dtype=dtype: te_seq.Sequential(
                ops.GroupedLinear(3, k, n, dtype=dtype)), run)
        reason = res["torch_plan"].forward[0].backend_reason
        assert "emulated on torch" in reason and why in reason, reason
        _assert_close_all(res["torch"], res["reference"])
