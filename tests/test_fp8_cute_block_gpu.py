"""GPU: Float8BlockScaling on the cute backend: GroupedLinear's and the fused GroupedMLP's forward
and dgrad GEMMs on `cute.block_scaled_grouped_mm`, their wgrads on
`cute.block_scaled_grouped_wgrad`, against the same ops on the torch backend,
which has no block-scaled kernel and runs the emulation (the reference), and the reference
backend itself. CPU wiring: tests/test_fp8_cute_block.py; the kernels alone:
tests/kernels/test_cute_block_fp8.py, tests/kernels/test_cute_block_wgrad.py.

Bounds (the emulation is the reference): both sides quantize exactly the same operands with the
same scales (fp8_reference's blocks), so they differ only in how the products are summed: the
emulation in fp32 on dequantized values, the kernel as FP8 WGMMA partial sums over each 128-long
k-block (below fp32 precision on Hopper) promoted to fp32 with their two scales, then one bf16
rounding each. That is the row-wise kernel's situation (1e-2 norm-relative to the emulation,
tests/test_fp8_cute_gpu.py), with the promotion every 128 elements bounding the low-precision
part: 1e-2 for y, dx and dW (the wgrad kernel promotes every 128 tokens the same way, on the
operands the emulation dequantizes: 1x128 blocks along each expert's tokens). Through the
MLP, FC2 re-quantizes FC1's bf16 h, whose ulp differences move an element across an FP8
rounding boundary (a whole FP8 step): 3e-2 there, as for row-wise.

Unverified when written (no GPU in the session that wrote them): to be run with
`bash tests/run_gpu_tests.sh tests/test_fp8_cute_block_gpu.py` on an H100 / H200.
"""

from __future__ import annotations

import pytest
import torch
from test_fp8_cute_block import block_kernel_maths
from test_fp8_torch import gpu_linear_case, on_backends, rel_err

import te_seq
from te_seq import ops, recipe
from te_seq.core import fp8
from te_seq.kernels import fp8_cute
from te_seq.kernels import fp8_reference as ref
from te_seq.kernels.backend import backend_available

BLOCK = recipe.Float8BlockScaling()
KERNEL = "cute block_scaled_grouped_mm"
EMU_TOL = 1e-2  # the block kernel vs the emulation, one GEMM
MLP_TOL = 3 * EMU_TOL  # through FC2's re-quantization of FC1's bf16 output
WGRAD_TOL = EMU_TOL  # the block wgrad kernel vs the emulation, one GEMM
OUT_TOL = 4e-3  # one bf16 rounding of an fp32-accumulated sum vs its float64 value
BACKENDS = ("reference", "torch", "cute")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not backend_available("cute")[0],
                       reason="needs the cute backend (CUDA sm_90 and the CuTe DSL)"),
]


def _assert_plans(res):
    note = res["cute_plan"].forward[0].backend_reason
    assert res["cute_plan"].forward[0].backend == "cute", note
    assert f"forward and dgrad GEMMs via {KERNEL} (real FP8" in note, note
    assert "wgrad via cute block_scaled_grouped_wgrad (real FP8" in note, note
    torch_note = res["torch_plan"].forward[0].backend_reason
    assert "emulated on torch" in torch_note and "no block-scaled FP8 kernel" in torch_note


def test_grouped_linear_block_fp8_on_gpu():
    """4 experts, one empty, 133 rows (no group a multiple of 128)."""
    res = on_backends(*gpu_linear_case(BLOCK), BACKENDS)
    _assert_plans(res)
    (y_c, dx_c, *dw_c), (y_t, dx_t, *dw_t) = res["cute"], res["torch"]
    y_r, dx_r = res["reference"][:2]
    assert y_c.dtype == torch.bfloat16 and torch.isfinite(y_c).all()
    assert rel_err(y_c, y_t) < EMU_TOL, rel_err(y_c, y_t)
    assert rel_err(dx_c, dx_t) < EMU_TOL, rel_err(dx_c, dx_t)
    assert rel_err(y_c, y_r) < EMU_TOL and rel_err(dx_c, dx_r) < EMU_TOL
    for got, want in zip(dw_c, dw_t):  # the empty expert's gradient: zero on both
        assert rel_err(got, want) < WGRAD_TOL, rel_err(got, want)


def _mlp_case():
    """(build, run): a fused MLP (ScaledSwiGLU with probs, no biases, so only the blocks keep
    the activation out of the FP8 epilogues), 3 experts, one empty, unaligned group sizes."""
    splits = torch.tensor([70, 0, 133], device="cuda")
    x = torch.randn(203, 256, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(203, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(203, 256, device="cuda", dtype=torch.bfloat16)

    def build():
        return te_seq.Sequential(
            ops.GroupedLinear(3, 256, 512, bias=False, dtype=torch.bfloat16),
            ops.ScaledSwiGLU(),
            ops.GroupedLinear(3, 256, 256, bias=False, dtype=torch.bfloat16))

    def run(model):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        with te_seq.autocast(recipe=BLOCK):
            y = model(xi, splits, pi, splits)
        y.backward(dy)
        return (y.detach(), xi.grad, pi.grad, *[p.grad for p in model.parameters()])

    return build, run


def test_fused_grouped_mlp_block_fp8_on_gpu():
    res = on_backends(*_mlp_case(), BACKENDS)
    assert res["cute_plan"].forward[0].name == "GroupedMLP"
    _assert_plans(res)
    assert "activation fused into the FP8 FC1 and FC2-dgrad epilogues" in \
        res["cute_plan"].forward[0].backend_reason
    for name in ("torch", "reference"):
        for got, want in zip(res["cute"], res[name]):
            assert torch.isfinite(got).all()
            assert rel_err(got, want) < MLP_TOL, (name, rel_err(got, want))


@pytest.mark.parametrize("k, n, splits", [
    (256, 384, [37, 0, 91, 5]),   # an empty expert, unaligned groups
    (208, 336, [64, 0, 30]),      # K and N not multiples of 128 (partial blocks)
    (1040, 128, [129]),           # one expert
    (128, 256, [0, 0, 0]),        # no rows at all
])
def test_block_layouts_on_the_kernel(k, n, splits):
    """`fp8_cute.scaled_grouped_mm` with fp8_reference's block operands (the forward: x against
    W; the dgrad: dy against Wᵀ with the transposed grid, as the ops cache it) equals the
    kernel's sum in float64 up to the output's one bf16 rounding."""
    torch.manual_seed(k + n)
    m, g = sum(splits), len(splits)
    offs = torch.cumsum(torch.tensor(splits), 0).to(torch.int32).cuda()
    w = torch.randn(g, n, k, device="cuda") * torch.logspace(-1, 1, n, device="cuda")[:, None]
    weights = fp8.cached_weights(torch.nn.Module(), BLOCK, w, [])
    block, rule = BLOCK.block("input"), BLOCK.rule("input")
    for width, (b_data, b_scale) in ((k, weights.fp8), (n, weights.dgrad_fp8)):
        a_q = ref.quantize(torch.randn(m, width, device="cuda") * 4, block, rule)
        got = fp8_cute.scaled_grouped_mm(a_q, b_data, b_scale, offs, torch.bfloat16)
        assert got.shape == (m, b_data.shape[1]) and got.dtype == torch.bfloat16
        a_scale, b_scale_k = fp8_cute.block_scales(a_q, b_scale, b_data.shape[1])
        want = block_kernel_maths(a_q.data.cpu(), b_data.cpu(), a_scale.cpu(), b_scale_k.cpu(),
                                  offs.cpu())
        assert rel_err(got.cpu(), want) < OUT_TOL, rel_err(got.cpu(), want)
