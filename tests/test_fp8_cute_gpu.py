"""GPU: the cute backend's real FP8 forward GEMMs (`cute.scaled_grouped_mm`) in GroupedLinear and
the fused GroupedMLP, against the torch backend (`torch._scaled_grouped_mm`) and the reference
(the emulation) on the same data and weights.

Bounds: both kernels multiply the same FP8 operands with the same scales and differ only in
summation order (Hopper FP8 WGMMA accumulates below fp32 precision: tests/kernels/test_cute_fp8.py
holds both kernels to one element bound), so their bf16 outputs agree to a norm-relative 4e-3, and
each is within 1e-2 of the emulation (tests/test_fp8_torch.py's bound; twice that through the
MLP, whose FC2 quantizes FC1's bf16 output). Backward: under Float8RowwiseScaling (E4M3 dy) both
backends run a real FP8 dgrad (cute's kernel vs torch._scaled_grouped_mm: the forward's bound
between them, 1e-2 to the emulation); cute's wgrad is its `scaled_grouped_wgrad` kernel, torch's
the fp32 emulation of the same FP8 operands (1e-2). Under Float8CurrentScaling ("HYBRID", E5M2
dy) cute runs the same real FP8 backward (E5M2 x E4M3 WGMMA) while torch's is emulated (its
kernel takes E4M3 only): both within 1e-2 of the emulation.
"""

from __future__ import annotations

import pytest
import torch
from test_fp8_torch import gpu_linear_case, gpu_mlp_case, on_backends, rel_err

import te_seq
from te_seq import ops, recipe
from te_seq.kernels.backend import backend_available

RECIPES = [recipe.Float8RowwiseScaling(), recipe.Float8CurrentScaling(),
           recipe.Float8CurrentScaling(fp8_format="E4M3")]
IDS = ["rowwise", "tensor", "tensor-e4m3"]
KERNEL_TOL = 4e-3  # cute vs torch real FP8 outputs (norm-relative)
EMU_TOL = 1e-2  # a real FP8 GEMM vs the emulation
BACKENDS = ("reference", "torch", "cute")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not backend_available("cute")[0],
                       reason="needs the cute backend (CUDA sm_90 and the CuTe DSL)"),
]


def _assert_forward(res, kernel_tol=KERNEL_TOL, emu_tol=EMU_TOL):
    step = res["cute_plan"].forward[0]
    assert step.backend == "cute" and "via cute scaled_grouped_mm" in step.backend_reason
    assert "via torch._scaled_grouped_mm" in res["torch_plan"].forward[0].backend_reason
    y_cute, y_torch, y_ref = res["cute"][0], res["torch"][0], res["reference"][0]
    assert y_cute.dtype == torch.bfloat16 and torch.isfinite(y_cute).all()
    assert rel_err(y_cute, y_torch) < kernel_tol, rel_err(y_cute, y_torch)
    assert rel_err(y_cute, y_ref) < emu_tol and rel_err(y_torch, y_ref) < emu_tol


@pytest.mark.parametrize("r", RECIPES, ids=IDS)
def test_grouped_linear_cute_fp8_on_gpu(r):
    res = on_backends(*gpu_linear_case(r), BACKENDS)
    _assert_forward(res)
    note = res["cute_plan"].forward[0].backend_reason
    assert "forward and dgrad GEMMs via cute scaled_grouped_mm" in note  # E5M2 dy too
    assert "wgrad via cute scaled_grouped_wgrad" in note
    torch_native = r.rule("grad").fmt == "E4M3"  # torch's kernel takes E4M3 dy only
    if not torch_native:
        assert "grad format E5M2" in res["torch_plan"].forward[0].backend_reason
    dx_cute, dx_torch, dx_ref = res["cute"][1], res["torch"][1], res["reference"][1]
    # two real FP8 dgrad kernels (E4M3), or cute's real one against torch's emulation (HYBRID)
    assert rel_err(dx_cute, dx_torch) < (KERNEL_TOL if torch_native else EMU_TOL)
    assert rel_err(dx_cute, dx_ref) < EMU_TOL and rel_err(dx_torch, dx_ref) < EMU_TOL
    # weight grads: cute's wgrad kernel vs torch's emulation of it and the reference
    for got, want, ref_ in zip(res["cute"][2:], res["torch"][2:], res["reference"][2:]):
        assert rel_err(got, want) < EMU_TOL and rel_err(got, ref_) < EMU_TOL


@pytest.mark.parametrize("r", RECIPES, ids=IDS)
def test_fused_grouped_mlp_cute_fp8_on_gpu(r):
    build, run = gpu_mlp_case(r)
    res = on_backends(build, run, BACKENDS)
    assert res["cute_plan"].forward[0].name == "GroupedMLP"
    # FC2's input is the activation re-quantized to E4M3 (3 mantissa bits): where the two FC1
    # kernels' bf16 h differ by an ulp (summation order), an element near an FP8 rounding
    # boundary moves by a whole FP8 step, so cute and torch differ through the MLP by up to the
    # FP8 quantization error itself (2.1 % cute vs torch with row-wise scales, 2.09 % cute vs the
    # emulation with per-tensor scales, measured on an H100), not by the single GEMM's 4e-3.
    # Both kernels are held to that bound against the emulation and against each other; the
    # backward (the same emulated one, from each forward's h) likewise. A wrong scale or row is
    # off by far more.
    mlp_tol = 3 * EMU_TOL
    _assert_forward(res, kernel_tol=mlp_tol, emu_tol=mlp_tol)
    for got, want in zip(res["cute"][1:], res["torch"][1:]):
        assert rel_err(got, want) < mlp_tol, rel_err(got, want)


@pytest.mark.parametrize("r", [*RECIPES, recipe.Float8BlockScaling()], ids=[*IDS, "block"])
@pytest.mark.parametrize("case", [gpu_linear_case, gpu_mlp_case], ids=["linear", "mlp"])
def test_token_major_input_in_forward_or_backward_gives_the_same_bits(case, r):
    """x quantized along the tokens in backward (the default: the forward keeps x itself) or
    in forward (`set_fp8_token_major_input(True)`: its FP8 copy kept): the same operands, so
    the same bits, d(probs) aside (fp32 atomic adds across N tiles: summation order)."""
    from te_seq import config

    results = {}
    for enabled in (False, True):
        config.set_fp8_token_major_input(enabled)
        torch.manual_seed(5)  # the same data: the case draws it when made
        try:
            results[enabled] = on_backends(*case(r), ("cute",))["cute"]
        finally:
            config.set_fp8_token_major_input(False)
    deferred, kept = results[False], results[True]
    probs_at = 2 if case is gpu_mlp_case else None
    for i, (got, want) in enumerate(zip(deferred, kept)):
        if i == probs_at:
            assert rel_err(got, want) < 1e-5
        else:
            assert torch.equal(got, want), i


@pytest.mark.parametrize("r", [*RECIPES, recipe.Float8BlockScaling()], ids=[*IDS, "block"])
@pytest.mark.parametrize("case", [gpu_linear_case, gpu_mlp_case], ids=["linear", "mlp"])
def test_high_precision_wgrad_keeps_the_fp8_forward_and_dgrad(case, r):
    """`fp8_wgrad=False`: y and dx are the all-FP8 run's bits (d(probs) to its atomics' order);
    the weight gradients come from the 16-bit wgrad, which for one GroupedLinear reads the very
    dy and x of a run without a recipe, so they are that run's bits."""
    import dataclasses

    runs = {}
    for name, each in (("fp8", r), ("high", dataclasses.replace(r, fp8_wgrad=False))):
        torch.manual_seed(5)  # the same data: the case draws it when made
        runs[name] = on_backends(*case(each), ("cute",))
    high, fp8 = runs["high"]["cute"], runs["fp8"]["cute"]
    assert "fp8_wgrad=False" in str(runs["high"]["cute_plan"])
    count = 2 if case is gpu_linear_case else 3  # y, dx (and d(probs))
    for i, (got, want) in enumerate(zip(high[:count], fp8[:count])):
        assert (rel_err(got, want) < 1e-5) if i == 2 else torch.equal(got, want), i
    if case is gpu_linear_case:  # no recipe, same data: the same 16-bit wgrad kernel
        torch.manual_seed(5)
        plain = on_backends(*case(None), ("cute",))["cute"]
        for got, want in zip(high[2:], plain[2:]):
            assert torch.equal(got, want)


@pytest.mark.parametrize("single", [True, False], ids=["single_weight", "per_expert"])
def test_fused_grouped_mlp_fp8_main_grad_adds_the_fresh_wgrads(single):
    """Megatron mode under Float8RowwiseScaling on the cute backend: each weight's fp32
    main_grad grows by the FP8 wgrad that a fresh-grads run of the same model, data and
    weights writes to .grad (the accumulate's kernel adds in fp32 what the fresh one rounds to
    bf16: within bf16's rounding) and the flag is set; the groups (70, 0 and 133
    tokens) are short, so the accumulate runs its ping-pong default."""
    r = recipe.Float8RowwiseScaling()
    splits = torch.tensor([70, 0, 133], device="cuda")
    x = torch.randn(203, 256, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(203, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(203, 256, device="cuda", dtype=torch.bfloat16)
    grads = {}
    for megatron in (False, True):
        torch.manual_seed(5)
        kw = dict(dtype=torch.bfloat16, device="cuda", single_grouped_weight=single,
                  accumulate_into_main_grad=megatron, bias=False)  # weights only
        model = te_seq.Sequential(ops.GroupedLinear(3, 256, 512, **kw), ops.ScaledSwiGLU(),
                                  ops.GroupedLinear(3, 256, 256, **kw))
        starts = []
        for p in model.parameters():
            p.main_grad = torch.randn(p.shape, device="cuda")
            p.grad_added_to_main_grad = False
            starts.append(p.main_grad.clone())
        with te_seq.backend("cute"), te_seq.autocast(recipe=r):
            y = model(x.clone().requires_grad_(), splits, probs.clone().requires_grad_(), splits)
        y.backward(dy)
        assert model.fusion_plan().forward[0].name == "GroupedMLP"
        if not megatron:
            grads = [p.grad.float() for p in model.parameters()]
            continue
        for p, start, fresh in zip(model.parameters(), starts, grads, strict=True):
            assert p.grad_added_to_main_grad  # autograd got a dummy (uninitialised) .grad
            assert p.grad.untyped_storage().data_ptr() != p.main_grad.untyped_storage().data_ptr()
            assert rel_err(p.main_grad - start, fresh) < 8e-3, rel_err(p.main_grad - start, fresh)
