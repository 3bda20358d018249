"""Real clients: the sparse-MoE blocks of Hugging Face transformers, reproduced by te_seq.

Each family's block is built from a tiny random config (no download), in float64 on CPU; a deep
copy has its routed experts swapped for te_seq's expert block (`te_seq.integrations.
transformers.swap_experts`: ExpertDispatch -> grouped MLP -> ExpertCombine). Both run the same
tokens: the outputs, the router logits, and the gradients of the tokens, the router weights
(through the routing probabilities), the shared experts and every expert weight must match.
The reference is transformers' own code, which nobody here wrote.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch

import te_seq
from te_seq.integrations.transformers import FAMILIES, restore_experts, swap_experts

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[hf]')")



class Dims(NamedTuple):
    """A block's sizes: hidden, expert ffn width, experts, top-k."""

    H: int
    F: int
    E: int
    K: int


SMALL = Dims(16, 12, 6, 2)
H, T = SMALL.H, 11  # hidden, tokens


def _mixtral(d: Dims = SMALL):
    from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock
    return MixtralSparseMoeBlock(MixtralConfig(hidden_size=d.H, intermediate_size=d.F,
                                               num_local_experts=d.E, num_experts_per_tok=d.K))


def _qwen2_moe(d: Dims = SMALL):
    from transformers.models.qwen2_moe.modeling_qwen2_moe import (
        Qwen2MoeConfig,
        Qwen2MoeSparseMoeBlock,
    )
    return Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(
        hidden_size=d.H, moe_intermediate_size=d.F, shared_expert_intermediate_size=2 * d.F,
        num_experts=d.E, num_experts_per_tok=d.K, norm_topk_prob=False))


def _qwen3_moe(d: Dims = SMALL):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeConfig,
        Qwen3MoeSparseMoeBlock,
    )
    return Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(
        hidden_size=d.H, moe_intermediate_size=d.F, num_experts=d.E, num_experts_per_tok=d.K,
        norm_topk_prob=True))


def _olmoe(d: Dims = SMALL):
    from transformers.models.olmoe.modeling_olmoe import OlmoeConfig, OlmoeSparseMoeBlock
    return OlmoeSparseMoeBlock(OlmoeConfig(hidden_size=d.H, intermediate_size=d.F,
                                           num_experts=d.E, num_experts_per_tok=d.K,
                                           norm_topk_prob=False))


def _deepseek_v3(d: Dims = SMALL):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Config,
        DeepseekV3MoE,
    )
    config = DeepseekV3Config(hidden_size=d.H, moe_intermediate_size=d.F, n_routed_experts=d.E,
                              num_experts_per_tok=d.K, n_group=2, topk_group=1, n_shared_experts=1,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    block = DeepseekV3MoE(config)
    with torch.no_grad():  # allocated with torch.empty: random values, as a checkpoint has
        block.gate.weight.normal_(0, 0.5)
        block.gate.e_score_correction_bias.normal_(0, 0.1)
    return block


def _llama4(d: Dims = SMALL):
    from transformers.models.llama4.modeling_llama4 import Llama4TextConfig, Llama4TextMoe
    block = Llama4TextMoe(Llama4TextConfig(hidden_size=d.H, intermediate_size=d.F,
                                           num_local_experts=d.E, num_experts_per_tok=1))
    with torch.no_grad():  # the fused expert parameters are allocated with torch.empty
        block.experts.gate_up_proj.normal_(0, 0.3)
        block.experts.down_proj.normal_(0, 0.3)
    return block


def _gpt_oss(d: Dims = SMALL):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssConfig, GptOssMLP
    block = GptOssMLP(GptOssConfig(hidden_size=d.H, intermediate_size=d.F,
                                   num_local_experts=d.E, num_experts_per_tok=d.K))
    # Every parameter is allocated with torch.empty. The std keeps FC1's outputs (std ~2) well
    # inside the clamps (±7) at any hidden size: the clamps' gradients jump at the bounds, and
    # bf16 rounding that moves a value across one would make two correct bf16 runs disagree.
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5 * (SMALL.H / d.H) ** 0.5)
    return block


# (builder, dtype, tolerance). DeepSeek-V3's block computes its router and its expert sum in
# float32 (hard-coded casts in transformers) and fails in float64 (index_add_ of float64 rows
# into its float32 sum), so it runs in float32, judged at float32 rounding.
BUILDERS = {
    "Mixtral": (_mixtral, torch.float64, 1e-12),
    "Qwen2-MoE": (_qwen2_moe, torch.float64, 1e-12),
    "Qwen3-MoE": (_qwen3_moe, torch.float64, 1e-12),
    "OLMoE": (_olmoe, torch.float64, 1e-12),
    "DeepSeek-V3": (_deepseek_v3, torch.float32, 2e-5),
    "Llama4": (_llama4, torch.float64, 1e-12),
    "GPT-OSS": (_gpt_oss, torch.float64, 1e-12),
}


def _hidden(out):
    return out[0] if isinstance(out, tuple) else out


def _expert_grads(block):
    """dW1 [E, 2F, H], dW2 [E, H, F] (and the bias grads) of an original block, in te_seq's
    layout: the family's weight reader applied to a copy whose expert Parameters hold their
    gradients (an expert no token reached has none: zeros)."""
    grads = copy.deepcopy(block)
    with torch.no_grad():
        for p, q in zip(block.experts.parameters(), grads.experts.parameters()):
            q.copy_(torch.zeros_like(p) if p.grad is None else p.grad)
        return FAMILIES[type(block).__name__].weights(grads)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_swapped_block_matches_transformers(name: str) -> None:
    torch.manual_seed(0)
    build, dtype, tol = BUILDERS[name]
    hf_block = build().to(dtype)
    holder = torch.nn.Sequential(copy.deepcopy(hf_block))
    assert swap_experts(holder) == 1
    swapped = holder[0]
    x = torch.randn(2, (T + 1) // 2, H, dtype=dtype)
    x_hf, x_te = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_hf, out_te = hf_block(x_hf), swapped(x_te)
    assert type(out_hf) is type(out_te)
    torch.testing.assert_close(_hidden(out_te), _hidden(out_hf), rtol=tol, atol=tol)
    if isinstance(out_hf, tuple):
        torch.testing.assert_close(out_te[1], out_hf[1], rtol=0, atol=0)  # router logits
    plan = swapped.experts.fusion_plan()
    # the whole block fuses (MoeBlock), or its expert MLP where a RowScale sits before FC1
    assert {"GroupedMLP", "MoeBlock"} & {s.name for s in plan.forward}, plan

    dy = torch.randn_like(_hidden(out_hf))
    _hidden(out_hf).backward(dy)
    _hidden(out_te).backward(dy)
    torch.testing.assert_close(x_te.grad, x_hf.grad, rtol=tol, atol=tol)
    # Router and shared expert: the swapped block holds copies of the same modules' Parameters.
    hf_params = dict(hf_block.named_parameters())
    for pname, p in swapped.named_parameters():
        if pname.startswith("experts."):
            continue
        assert p.grad is not None, pname
        torch.testing.assert_close(p.grad, hf_params[pname].grad, rtol=tol, atol=tol,
                                   msg=lambda m, n=pname: f"{n}: {m}")
    fc1, fc2 = (op for op in swapped.experts.basic_ops()
                if isinstance(op, te_seq.ops.GroupedLinear))
    want = _expert_grads(hf_block)
    torch.testing.assert_close(fc1.weight.grad, want.w1, rtol=tol, atol=tol)
    torch.testing.assert_close(fc2.weight.grad, want.w2, rtol=tol, atol=tol)
    if want.b1 is not None:
        torch.testing.assert_close(fc1.bias.grad, want.b1, rtol=tol, atol=tol)
        torch.testing.assert_close(fc2.bias.grad, want.b2, rtol=tol, atol=tol)


def test_restore_writes_the_trained_weights_back() -> None:
    torch.manual_seed(1)
    block = _mixtral().double()
    model = torch.nn.Sequential(block)
    x = torch.randn(1, T, H, dtype=torch.float64)
    swap_experts(model)
    swapped = model[0]
    fc1 = swapped.experts[1]
    with torch.no_grad():
        fc1.weight.mul_(1.5)  # "training" changed the experts
    want = _hidden(swapped(x))
    assert restore_experts(model) == 1
    assert model[0] is block
    torch.testing.assert_close(_hidden(block(x)), want, rtol=1e-12, atol=1e-12)


def test_an_unsupported_activation_is_refused() -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock
    block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=SMALL.F,
                                                num_local_experts=SMALL.E, hidden_act="gelu"))
    with pytest.raises(ValueError, match="MixtralSparseMoeBlock: expert activation "
                                         "GELUActivation has no te_seq expert block"):
        swap_experts(torch.nn.Sequential(block))
