"""MoE routing as ops: ExpertDispatch / ExpertCombine around the grouped MLP, joined by channels.

The reference is a per-token, per-choice Python loop (y_t = Σ_j p_tj · FC2_e(act(FC1_e(x_t))),
e = idx[t, j]) written without any permutation, so it shares nothing with the ops' sort and
gather. Grid axes, and why: k = 1 (no sum), k = 2 and 3 (sums of several choices); routings with
empty experts, all tokens to one expert, and zero tokens (edge cases of the sort and the count).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import te_seq
from te_seq import ops

T, H, FFN, E = 9, 8, 6, 4  # tokens, hidden, ffn, experts
DT = torch.float64


def moe_block(experts: int = E, dtype=DT, scaled: bool = True) -> te_seq.Sequential:
    act = ops.ScaledSwiGLU() if scaled else ops.SwiGLU()
    block = te_seq.Sequential(
        ops.ExpertDispatch(experts),
        ops.GroupedLinear(experts, H, 2 * FFN, bias=False, dtype=dtype),
        act,
        ops.GroupedLinear(experts, FFN, H, bias=False, dtype=dtype),
        ops.ExpertCombine(),
    )
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return block


def loop_reference(block: te_seq.Sequential, x, indices, probs):
    """y_t = Σ_j p_tj · FC2_e(silu(gate) · up) with e = indices[t, j], one token at a time."""
    fc1, fc2 = block[1], block[3]
    out = []
    for t in range(x.shape[0]):
        acc = x.new_zeros(fc2.out_features)
        for j in range(indices.shape[1]):
            e = int(indices[t, j])
            gate, up = (x[t] @ getattr(fc1, f"weight{e}").T).chunk(2)
            acc = acc + probs[t, j] * ((F.silu(gate) * up) @ getattr(fc2, f"weight{e}").T)
        out.append(acc)
    return torch.stack(out) if out else x[:0]


def routing_case(kind: str, tokens: int = T, k: int = 2):
    """Top-k indices and probabilities (leaves that need grad) of the given kind."""
    logits = torch.randn(tokens, E, dtype=DT)
    if kind == "one_expert":
        indices = torch.full((tokens, k), 2, dtype=torch.int64)
    elif kind == "empty_experts":  # experts 1 and 3 never chosen
        indices = torch.tensor([0, 2])[torch.randint(0, 2, (tokens, k))]
    else:
        indices = logits.topk(k).indices
    probs = torch.softmax(torch.randn(tokens, k, dtype=DT), -1)
    return indices, probs


def _grads(outputs, leaves, grad_out):
    """Gradients of every leaf; an expert no token reached gets zeros (the loop's None)."""
    grads = torch.autograd.grad(outputs, leaves, grad_out, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("kind", ["topk", "empty_experts", "one_expert"])
def test_block_matches_the_per_token_loop(k: int, kind: str) -> None:
    torch.manual_seed(k)
    block = moe_block()
    indices, probs = routing_case(kind, k=k)
    x = torch.randn(T, H, dtype=DT, requires_grad=True)
    probs.requires_grad_()
    y = block(x, indices, probs)
    want = loop_reference(block, x, indices, probs)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    leaves = [x, probs, *block.parameters()]
    for got, ref in zip(_grads(y, leaves, dy), _grads(want, leaves, dy)):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_the_block_fuses_the_grouped_mlp_through_channels() -> None:
    block = moe_block()
    indices, probs = routing_case("topk")
    block(torch.randn(T, H, dtype=DT, requires_grad=True), indices, probs)
    assert [s.name for s in block.fusion_plan().forward] == ["MoeBlock"]  # the whole block
    with te_seq.fusions_disabled("moe_block"):
        block(torch.randn(T, H, dtype=DT, requires_grad=True), indices, probs)
        plan = block.fusion_plan()
    assert [s.name for s in plan.forward] == ["ExpertDispatch", "GroupedMLP", "ExpertCombine"]
    assert plan.forward[1].basic_op_indices == (1, 2, 3)
    assert [s.name for s in plan.backward] == ["ExpertCombine", "GroupedMLP", "ExpertDispatch"]


def test_gradcheck_of_the_whole_block() -> None:
    torch.manual_seed(3)
    block = moe_block()
    indices, probs = routing_case("topk", tokens=5)
    x = torch.randn(5, H, dtype=DT, requires_grad=True)
    probs.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: block(a, indices, b), (x, probs))


def test_zero_tokens() -> None:
    block = moe_block()
    x = torch.randn(0, H, dtype=DT, requires_grad=True)
    indices, probs = torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2, dtype=DT)
    y = block(x, indices, probs.requires_grad_())
    assert y.shape == (0, H)
    y.sum().backward()
    assert x.grad.shape == (0, H) and probs.grad.shape == (0, 2)


def test_dispatch_order_is_stable_and_outputs_reach_the_caller_alone() -> None:
    """Alone, every extra output goes to the caller (nobody subscribes to the defaults)."""
    x = torch.randn(4, H, dtype=DT)
    indices = torch.tensor([[2, 0], [0, 2], [2, 2], [3, 0]])
    probs = torch.rand(4, 2, dtype=DT)
    rows, splits, row_probs, routing = ops.ExpertDispatch(E)(x, indices, probs)
    # slots (t, j) sorted by expert, then token, then choice
    order = [(0, 1), (1, 0), (3, 1), (0, 0), (1, 1), (2, 0), (2, 1), (3, 0)]
    assert torch.equal(rows, torch.stack([x[t] for t, _ in order]))
    assert torch.equal(row_probs, torch.stack([probs[t, j] for t, j in order]))
    assert splits.tolist() == [3, 0, 4, 1] and splits.dtype == torch.int64
    for r, (t, j) in enumerate(order):
        assert routing[t, j] == r
    y = ops.ExpertCombine()(rows, routing)  # positional routing: no dispatch before it
    torch.testing.assert_close(y, 2 * x)


def test_out_of_range_expert_indices_are_a_clear_error_on_host() -> None:
    block = moe_block()
    x = torch.randn(3, H, dtype=DT)
    probs = torch.rand(3, 1, dtype=DT)
    for bad in (torch.tensor([[0], [4], [1]]), torch.tensor([[0], [-1], [1]])):
        with pytest.raises(ValueError, match=r"ExpertDispatch: topk_indices must lie in \[0, "
                                             r"num_experts=4\)"):
            block(x, bad, probs)


@pytest.mark.parametrize(
    "indices, probs, match",
    [
        (torch.zeros(3, 2), torch.rand(3, 2), "topk_indices must be an integer tensor"),
        (torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2), r"expected \(3, 'k'\)"),
        (torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 1), "topk_probs must be floating"),
    ],
)
def test_dispatch_input_errors(indices, probs, match) -> None:
    with pytest.raises(ValueError, match=match):
        ops.ExpertDispatch(E)(torch.randn(3, H), indices, probs)


def test_three_d_tokens_keep_their_shape() -> None:
    torch.manual_seed(5)
    block = moe_block()
    x = torch.randn(2, 3, H, dtype=DT)
    indices = torch.randint(0, E, (2, 3, 2))
    probs = torch.rand(2, 3, 2, dtype=DT)
    y = block(x, indices, probs)
    want = loop_reference(block, x.reshape(6, H), indices.reshape(6, 2), probs.reshape(6, 2))
    torch.testing.assert_close(y, want.reshape(2, 3, H), rtol=1e-12, atol=1e-12)


def test_row_scale_block_scales_tokens_before_fc1() -> None:
    """Llama 4's form: tokens · score, then an unscaled SwiGLU MLP, then the plain sum."""
    torch.manual_seed(6)
    block = te_seq.Sequential(
        ops.ExpertDispatch(E), ops.RowScale(),
        ops.GroupedLinear(E, H, 2 * FFN, bias=False, dtype=DT), ops.SwiGLU(),
        ops.GroupedLinear(E, FFN, H, bias=False, dtype=DT), ops.ExpertCombine(),
    )
    x = torch.randn(T, H, dtype=DT)
    indices, probs = routing_case("topk", k=1)
    y = block(x, indices, probs)
    fc1, fc2 = block[2], block[4]
    want = []
    for t in range(T):
        e = int(indices[t, 0])
        gate, up = ((x[t] * probs[t, 0]) @ getattr(fc1, f"weight{e}").T).chunk(2)
        want.append((F.silu(gate) * up) @ getattr(fc2, f"weight{e}").T)
    torch.testing.assert_close(y, torch.stack(want), rtol=1e-12, atol=1e-12)
    assert "GroupedMLP" in [s.name for s in block.fusion_plan().forward]


@pytest.mark.parametrize("n", [0, 1, 17])
def test_invert_permutation(n: int) -> None:
    from te_seq.kernels.routing import invert_permutation

    perm = torch.randperm(n)
    inv = invert_permutation(perm)
    assert torch.equal(inv[perm], torch.arange(n)) and torch.equal(perm[inv], torch.arange(n))


@pytest.mark.parametrize("tokens,k", [(0, 2), (1, 1), (7, 3)])
def test_combine_backward_gathers_what_the_indexed_store_wrote(tokens: int, k: int) -> None:
    """d rows[row_of_slot[t, j]] = dy[t]: the gather equals the definition's indexed store."""
    from te_seq.kernels.routing import sort_slots, unpermute_rows_backward

    _, row_of_slot = sort_slots(torch.randint(0, 3, (tokens * k,)))
    row_of_slot = row_of_slot.reshape(tokens, k)
    dy = torch.randn(tokens, 5, dtype=DT)
    expected = torch.empty(tokens * k, 5, dtype=DT)
    expected[row_of_slot.reshape(-1)] = dy.repeat_interleave(k, dim=0)
    assert torch.equal(unpermute_rows_backward(dy, row_of_slot), expected)
