"""Swap the routed experts of Hugging Face `transformers` MoE blocks for te_seq's expert block.

`swap_experts(model)` replaces, in place, every sparse-MoE block of a known family by a
`TeSeqSparseMoe`: the block's own router and shared expert (the same modules and Parameters),
and the routed experts as one te_seq Sequential,
`ExpertDispatch -> GroupedLinear -> ScaledSwiGLU -> GroupedLinear -> ExpertCombine` (Llama 4:
`ExpertDispatch -> RowScale -> GroupedLinear -> SwiGLU -> GroupedLinear -> ExpertCombine`),
whose weights are copied from the experts. Same outputs (the block's return convention kept),
the grouped MLP fused (GPT-OSS: `ExpertDispatch -> GroupedLinear -> ClampedSwiGLU -> RowScale
-> GroupedLinear(scale_bias) -> ExpertCombine`, unfused: the probability scale sits between the
activation and FC2). `restore_experts(model)` writes the te_seq weights back into the
original experts and puts the original blocks back.

Blocks are recognised by class name, so this module imports nothing of `transformers`. The
per-family adapters read the layouts of transformers 4.57 (per-expert `nn.Linear`s; Llama 4's
fused `gate_up_proj` [E, H, 2F] / `down_proj` [E, F, H]); another layout is a TypeError naming
the block. Shape legend: T tokens, E experts, k top-k, H hidden, F expert ffn width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq import ops
from te_seq.core.operation import BasicOperation
from te_seq.run.sequential import Sequential

__all__ = ["FAMILIES", "ExpertWeights", "MoEFamily", "TeSeqSparseMoe", "restore_experts",
           "swap_experts"]

Routing = tuple[Tensor, Tensor, Tensor | None]  # indices [T, k], probs [T, k], router logits


@dataclass(frozen=True)
class ExpertWeights:
    """The routed experts' weights in te_seq's layout: W1 [E, 2F, H] (gate and up rows, in the
    block's own column layout), W2 [E, H, F], and the biases b1 [E, 2F], b2 [E, H] if any."""

    w1: Tensor
    w2: Tensor
    b1: Tensor | None = None
    b2: Tensor | None = None


def _softmax_topk(block, x: Tensor, renormalize: bool) -> Routing:
    """Mixtral / Qwen-MoE / OLMoE routing: softmax over all experts in fp32, top-k, optionally
    renormalised over the k, cast back to the tokens' dtype."""
    logits = block.gate(x)  # [T, E]
    weights, indices = torch.topk(torch.softmax(logits, dim=1, dtype=torch.float), block.top_k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return indices, weights.to(x.dtype), logits


def _deepseek_v3_route(block, x: Tensor) -> Routing:
    indices, weights = block.gate(x)  # grouped top-k on sigmoid scores, scaled (its own module)
    return indices, weights, None


def _llama4_route(block, x: Tensor) -> Routing:
    scores, logits = block.router(x)  # [T, E]: sigmoid of the top-k logits, 0 elsewhere
    indices = torch.topk(logits, block.top_k, dim=1).indices  # the router's own choice
    return indices, scores.gather(1, indices), logits


def _linear_experts(block, gate: str, up: str, down: str) -> ExpertWeights:
    """W1 [E, 2F, H] (gate rows, then up rows) and W2 [E, H, F] from per-expert nn.Linears."""
    experts = block.experts
    if not isinstance(experts, torch.nn.ModuleList):
        raise TypeError(
            f"{type(block).__name__}: experts are {type(experts).__name__}, expected a ModuleList "
            "of per-expert MLPs (the transformers 4.57 layout)"
        )
    w1 = torch.stack([torch.cat([getattr(e, gate).weight, getattr(e, up).weight]) for e in experts])
    w2 = torch.stack([getattr(e, down).weight for e in experts])
    return ExpertWeights(w1, w2)


def _write_linear_experts(block, names: tuple[str, str, str], weights: ExpertWeights) -> None:
    gate, up, down = names
    w1, w2 = weights.w1, weights.w2
    for e, expert in enumerate(block.experts):
        f = getattr(expert, gate).weight.shape[0]
        getattr(expert, gate).weight.copy_(w1[e, :f])
        getattr(expert, up).weight.copy_(w1[e, f:])
        getattr(expert, down).weight.copy_(w2[e])


def _fused_experts(block) -> ExpertWeights:
    """Llama 4 / GPT-OSS: gate_up_proj [E, H, 2F], down_proj [E, F, H] (x @ W layout), and
    GPT-OSS's biases gate_up_proj_bias [E, 2F], down_proj_bias [E, H]."""
    experts = block.experts
    return ExpertWeights(experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2),
                         getattr(experts, "gate_up_proj_bias", None),
                         getattr(experts, "down_proj_bias", None))


def _write_fused_experts(block, weights: ExpertWeights) -> None:
    experts = block.experts
    experts.gate_up_proj.copy_(weights.w1.transpose(1, 2))
    experts.down_proj.copy_(weights.w2.transpose(1, 2))
    if weights.b1 is not None:
        experts.gate_up_proj_bias.copy_(weights.b1)
        experts.down_proj_bias.copy_(weights.b2)


def _gpt_oss_route(block, x: Tensor) -> Routing:
    scores, indices = block.router(x)  # [T, E]: softmax over the top-k logits, 0 elsewhere
    return indices, scores.gather(1, indices), scores  # the block returns the scores


def _gpt_oss_activation(block) -> BasicOperation:
    """GPT-OSS's clamped SwiGLU over alternating gate / up columns, times the router prob."""
    experts = block.experts
    return ops.ScaledClampedQGeGLU(1, limit=experts.limit, alpha=experts.alpha)


def _qwen2_shared(block, x: Tensor) -> Tensor:
    return torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)


@dataclass(frozen=True)
class MoEFamily:
    """How to read one family's MoE block: its router, expert weights and shared expert.

    `activation(block)`: the expert activation op when it is not the SiLU-gated default, a
    row-scaled one (its output times the router probability; FC2's bias is scaled too, by
    `scale_bias`); None: ScaledSwiGLU (or SwiGLU after RowScale with `scale_tokens`)."""

    route: Callable[[torch.nn.Module, Tensor], Routing]
    weights: Callable[[torch.nn.Module], ExpertWeights]
    write_back: Callable[[torch.nn.Module, ExpertWeights], None]
    shared: Callable[[torch.nn.Module, Tensor], Tensor] | None = None
    scale_tokens: bool = False  # router scores scale the tokens before FC1 (Llama 4)
    returns_logits: bool = True  # the block returns (hidden, router_logits)
    flat_output: bool = False  # the block returns [T, H] whatever its input's leading shape
    activation: Callable[[torch.nn.Module], BasicOperation] | None = None


_GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL = ("w1", "w3", "w2")


def _linear_family(names, route, shared=None, returns_logits=True) -> MoEFamily:
    return MoEFamily(route, lambda b: _linear_experts(b, *names),
                     lambda b, w: _write_linear_experts(b, names, w), shared,
                     returns_logits=returns_logits)


def _renormalized(block, x):
    return _softmax_topk(block, x, block.norm_topk_prob)


FAMILIES: dict[str, MoEFamily] = {
    "MixtralSparseMoeBlock": _linear_family(_MIXTRAL, lambda b, x: _softmax_topk(b, x, True)),
    "Qwen2MoeSparseMoeBlock": _linear_family(_GATE_UP_DOWN, _renormalized, _qwen2_shared),
    "Qwen3MoeSparseMoeBlock": _linear_family(_GATE_UP_DOWN, _renormalized),
    "OlmoeSparseMoeBlock": _linear_family(_GATE_UP_DOWN, _renormalized),
    "DeepseekV3MoE": _linear_family(_GATE_UP_DOWN, _deepseek_v3_route,
                                    lambda b, x: b.shared_experts(x), returns_logits=False),
    "Llama4TextMoe": MoEFamily(_llama4_route, _fused_experts, _write_fused_experts,
                               lambda b, x: b.shared_expert(x), scale_tokens=True,
                               flat_output=True),
    "GptOssMLP": MoEFamily(_gpt_oss_route, _fused_experts, _write_fused_experts,
                           activation=_gpt_oss_activation),
}


def _grouped_linear(w: Tensor, b: Tensor | None, scale_bias: bool = False):
    """A GroupedLinear holding copies of W [E, N, K] and b [E, N] (or no bias)."""
    E, N, K = w.shape
    has_bias = b is not None
    fc = ops.GroupedLinear(E, K, N, bias=has_bias, single_grouped_weight=True,
                           single_grouped_bias=has_bias, scale_bias=scale_bias and has_bias,
                           device=w.device, dtype=w.dtype)
    with torch.no_grad():
        fc.weight.copy_(w)
        if b is not None:
            fc.bias.copy_(b)
    return fc


def expert_block(family: MoEFamily, block: torch.nn.Module) -> Sequential:
    """The te_seq expert block of `block`'s routed experts (weights copied)."""
    weights = family.weights(block)
    E = weights.w1.shape[0]
    fc1 = _grouped_linear(weights.w1, weights.b1)
    if family.activation is not None:  # y = p · (W2 act + b2) = W2 (p · act) + p · b2
        fc2 = _grouped_linear(weights.w2, weights.b2, scale_bias=True)
        middle = [fc1, family.activation(block), fc2]
    elif family.scale_tokens:
        middle = [ops.RowScale(), fc1, ops.SwiGLU(), _grouped_linear(weights.w2, weights.b2)]
    else:
        middle = [fc1, ops.ScaledSwiGLU(), _grouped_linear(weights.w2, weights.b2)]
    return Sequential(ops.ExpertDispatch(E), *middle, ops.ExpertCombine())


class TeSeqSparseMoe(torch.nn.Module):
    """A transformers MoE block with its routed experts run by a te_seq expert block.

    Submodules: `experts` (the te_seq Sequential), and the original block's router and shared
    expert modules themselves (so their Parameters stay the model's). The original block is
    kept outside the module tree, for `restore_experts`."""

    def __init__(self, block: torch.nn.Module, family: MoEFamily) -> None:
        super().__init__()
        self.__dict__["original"] = block  # not a submodule: its experts are replaced
        self.__dict__["family"] = family
        with torch.no_grad():
            self.experts = expert_block(family, block)
        for name, child in block.named_children():
            if name != "experts":
                self.add_module(name, child)  # router, shared expert: the same objects

    def forward(self, hidden_states: Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [T, H]
        indices, probs, logits = self.family.route(self.original, x)
        y = self.experts(x, indices, probs.to(x.dtype))  # [T, H]
        if self.family.shared is not None:
            y = y + self.family.shared(self.original, x)
        if not self.family.flat_output:
            y = y.reshape(shape)
        return (y, logits) if self.family.returns_logits else y

    def restored(self) -> torch.nn.Module:
        """The original block, with this block's expert weights written back into it."""
        fc1, fc2 = (op for op in self.experts.basic_ops() if isinstance(op, ops.GroupedLinear))
        bias = (fc1.bias, fc2.bias) if fc1.has_bias else (None, None)
        with torch.no_grad():
            self.family.write_back(self.original, ExpertWeights(fc1.weight, fc2.weight, *bias))
        return self.original


_SILU = ("SiLU", "SiLUActivation")


def _check_activation(block: torch.nn.Module, family: MoEFamily) -> None:
    """The experts' activation must be SiLU (the gated experts are then SwiGLU), unless the
    family names its own."""
    if family.activation is not None:
        return
    experts = block.experts
    holder = experts[0] if isinstance(experts, torch.nn.ModuleList) else experts
    act = getattr(holder, "act_fn", None)
    if type(act).__name__ not in _SILU:
        raise ValueError(f"{type(block).__name__}: expert activation {type(act).__name__} has "
                         "no te_seq expert block here (SiLU-gated experts, i.e. SwiGLU, only)")


def _replace(model: torch.nn.Module, make: Callable[[torch.nn.Module], torch.nn.Module | None]):
    """Replace every submodule (the model itself excluded) for which `make` returns a module."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = make(child)
            if new is not None:
                setattr(parent, name, new)
                count += 1
    return count


def swap_experts(model: torch.nn.Module) -> int:
    """Replace, in place, every MoE block of a known family (`FAMILIES`, by class name) inside
    `model` by a `TeSeqSparseMoe`; returns how many were replaced. Its expert weights are
    copies: train the swapped model, then `restore_experts` to write them back."""
    def make(child):
        family = FAMILIES.get(type(child).__name__)
        if family is None:
            return None
        _check_activation(child, family)
        return TeSeqSparseMoe(child, family)

    return _replace(model, make)


def restore_experts(model: torch.nn.Module) -> int:
    """Undo `swap_experts`: the original blocks back, holding the te_seq expert weights."""
    return _replace(model, lambda c: c.restored() if isinstance(c, TeSeqSparseMoe) else None)
