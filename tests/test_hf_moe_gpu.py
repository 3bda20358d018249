"""The Hugging Face MoE blocks of tests/test_hf_moe.py in bf16 on the GPU backends.

Same families and the same swap (`te_seq.integrations.transformers.swap_experts`), at sizes the
cute kernels take (F a multiple of 128, so the gated activations run in the GEMM epilogues where
the table allows). The reference is transformers' own block on the same GPU in bf16: the router
is the same module in both, so both route every token to the same experts, and only the
experts' arithmetic differs (te_seq accumulates in fp32 and rounds once per GEMM; transformers
runs one bf16 matmul per expert). Judged by norm-relative error at bf16 rounding.

On the GPU host transformers comes from `bash benchmarks/stage_peers.sh --hf` (carried wheels).
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_hf_moe import BUILDERS, Dims, _expert_grads, _hidden

import te_seq
from te_seq.integrations.transformers import swap_experts

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

GPU_BACKENDS = [b for b in ("torch", "cute") if te_seq.kernels.backend_available(b)[0]]
DIMS = Dims(H=256, F=256, E=8, K=2)
TOKENS = 2 * 193  # uneven expert loads; not a multiple of any tile
TOL = 2e-2  # bf16 (the same blocks on CPU in bf16, reference backend: 3e-3 to 6e-3)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if want.norm() == 0:  # an expert no token reached: no gradient on either side
        assert got.norm() == 0, what
        return
    assert _rel_err(got, want) < TOL, (what, _rel_err(got, want))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("name", list(BUILDERS))
def test_swapped_block_matches_transformers_bf16(name: str, backend: str) -> None:
    torch.manual_seed(0)
    hf_block = BUILDERS[name][0](DIMS).to("cuda", torch.bfloat16)
    holder = torch.nn.Sequential(copy.deepcopy(hf_block))
    assert swap_experts(holder) == 1
    swapped = holder[0]
    x = torch.randn(2, TOKENS // 2, DIMS.H, device="cuda", dtype=torch.bfloat16)
    x_hf, x_te = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_hf = _hidden(hf_block(x_hf))
    with te_seq.backend(backend):
        out_te = _hidden(swapped(x_te))
        dy = torch.randn_like(out_hf)
        out_te.backward(dy)
    out_hf.backward(dy)
    _assert_close(out_te, out_hf, "output")
    _assert_close(x_te.grad, x_hf.grad, "tokens' grad")
    fc1, fc2 = (op for op in swapped.experts.basic_ops()
                if isinstance(op, te_seq.ops.GroupedLinear))
    want = _expert_grads(hf_block)
    for e in range(DIMS.E):
        _assert_close(fc1.weight.grad[e], want.w1[e], f"dW1 of expert {e}")
        _assert_close(fc2.weight.grad[e], want.w2[e], f"dW2 of expert {e}")
    if want.b1 is not None:
        _assert_close(fc1.bias.grad, want.b1, "FC1 bias grad")
        _assert_close(fc2.bias.grad, want.b2, "FC2 bias grad")
    hf_params = dict(hf_block.named_parameters())
    for pname, p in swapped.named_parameters():  # router, shared expert: HF's own modules
        if not pname.startswith("experts."):
            _assert_close(p.grad, hf_params[pname].grad, pname)
