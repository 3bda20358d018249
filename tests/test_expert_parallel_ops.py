"""The expert-parallel MoE block (ExpertDispatch / ExpertCombine with an ep_group) on 2 CPU
ranks (gloo), against the single-process block holding all experts: forward, dx, dprobs and
the local experts' weight gradients (float64, reference backend); uneven and empty expert
loads; capacity mode with its drops reported; bad configurations as clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_on_ranks

import te_seq
from te_seq import ops

F64 = torch.float64
H, F, K = 6, 5, 2  # hidden, ffn width, experts per token
E = 6  # global experts: 3 local experts per rank on 2 ranks


def close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10,
                               msg=lambda m: f"{what}: {m}")


def make_block(weights1, weights2, **dispatch_kw):
    """ExpertDispatch(E) -> GroupedLinear -> ScaledSwiGLU -> GroupedLinear -> Combine, the
    G (local) experts' weights copied from weights1 [G, 2F, H] / weights2 [G, H, F]."""
    groups = weights1.shape[0]
    fc1 = ops.GroupedLinear(groups, H, 2 * F, bias=False, dtype=F64)
    fc2 = ops.GroupedLinear(groups, F, H, bias=False, dtype=F64)
    with torch.no_grad():
        for e in range(groups):
            getattr(fc1, f"weight{e}").copy_(weights1[e])
            getattr(fc2, f"weight{e}").copy_(weights2[e])
    ep_group = dispatch_kw.get("ep_group")
    return te_seq.Sequential(ops.ExpertDispatch(E, **dispatch_kw), fc1,
                             ops.ScaledSwiGLU(), fc2, ops.ExpertCombine(ep_group=ep_group))


def global_problem(tokens, indices=None):
    """Per rank: tokens [T_r, H], top-k indices and probs, output grads; global weights.
    Same on every rank (same seed)."""
    n = len(tokens)
    xs = [torch.randn(t, H, dtype=F64) for t in tokens]
    if indices is None:
        indices = [torch.stack([torch.randperm(E)[:K] for _ in range(t)]).reshape(t, K)
                   for t in tokens]
    probs = [torch.rand(t, K, dtype=F64) + 0.1 for t in tokens]
    grads = [torch.randn(t, H, dtype=F64) for t in tokens]
    w1, w2 = torch.randn(E, 2 * F, H, dtype=F64), torch.randn(E, H, F, dtype=F64)
    assert len(indices) == n
    return xs, indices, probs, grads, w1, w2


def run(block, x, idx, p, g):
    x, p = x.clone().requires_grad_(True), p.clone().requires_grad_(True)
    out = block(x, idx, p)
    (out * g).sum().backward()
    fc1, fc2 = block[1], block[3]
    dw1 = torch.stack([getattr(fc1, f"weight{e}").grad for e in range(fc1.num_groups)])
    dw2 = torch.stack([getattr(fc2, f"weight{e}").grad for e in range(fc2.num_groups)])
    return out.detach(), x.grad, p.grad, dw1, dw2


def reference(xs, indices, probs, grads, w1, w2, keep=None):
    """The single-process block with all E experts; each rank's tokens in turn, the weight
    gradients summed over all of them (what the expert-parallel ranks together compute).
    `keep[r]` [T_r, K] masks out (token, choice) slots a capacity drop removes."""
    block = make_block(w1, w2)
    outs = []
    for r, (x, idx, p, g) in enumerate(zip(xs, indices, probs, grads)):
        p_used = p if keep is None else p * keep[r]
        x, p_used = x.clone().requires_grad_(True), p_used.detach().requires_grad_(True)
        out = block(x, idx, p_used)
        (out * g).sum().backward()
        dp = p_used.grad if keep is None else p_used.grad * keep[r]
        outs.append((out.detach(), x.grad, dp))
    fc1, fc2 = block[1], block[3]
    dw1 = torch.stack([getattr(fc1, f"weight{e}").grad for e in range(E)])
    dw2 = torch.stack([getattr(fc2, f"weight{e}").grad for e in range(E)])
    return outs, dw1, dw2


def _check_against_reference(rank, n, tokens, indices=None, capacity=None, keep_fn=None):
    xs, indices, probs, grads, w1, w2 = global_problem(tokens, indices)
    keep = None if keep_fn is None else keep_fn(indices)
    (out_ref, dx_ref, dp_ref), dw1, dw2 = (lambda o, a, b: (o[rank], a, b))(
        *reference(xs, indices, probs, grads, w1, w2, keep))
    L = E // n
    mine = slice(rank * L, (rank + 1) * L)
    block = make_block(w1[mine], w2[mine], ep_group=dist.group.WORLD, capacity=capacity)
    out, dx, dp, dw1_local, dw2_local = run(block, xs[rank], indices[rank], probs[rank],
                                           grads[rank])
    close(out, out_ref, "forward")
    close(dx, dx_ref, "dx")
    close(dp, dp_ref, "dprobs")
    close(dw1_local, dw1[mine], "dW1 of this rank's experts")
    close(dw2_local, dw2[mine], "dW2 of this rank's experts")
    assert "GroupedMLP[1, 2, 3]" in str(block.fusion_plan()), block.fusion_plan()
    return block


def check_uneven_loads(rank, n):
    block = _check_against_reference(rank, n, [7, 4])
    assert block[0].capacity_stats is None  # exact mode drops nothing


def check_empty_experts_and_rank(rank, n):
    """Every token picks only experts 0 and 2 (both on rank 0): rank 1's experts get no rows,
    expert 1 none either; rank 1 also has no tokens of its own."""
    indices = [torch.tensor([[0, 2], [2, 0], [0, 2]]), torch.zeros(0, K, dtype=torch.int64)]
    _check_against_reference(rank, n, [3, 0], indices)


def check_second_step_reuses_agreement(rank, n):
    """Two calls of one block (the ranks' agreement is checked on the first only), each right."""
    xs, indices, probs, grads, w1, w2 = global_problem([5, 6])
    outs, _, _ = reference(xs, indices, probs, grads, w1, w2)
    mine = slice(rank * (E // n), (rank + 1) * (E // n))
    block = make_block(w1[mine], w2[mine], ep_group=dist.group.WORLD)
    for _ in range(2):
        close(run(block, xs[rank], indices[rank], probs[rank], grads[rank])[0], outs[rank][0],
              "forward")
    assert block[0].expert_parallel.agreed


def kept_slots(indices, capacity, num_local):
    """Per rank [T, K]: 1 for the slots the exchange keeps. Rows are sorted by global expert
    (stable in slot order); a destination rank keeps the first `capacity` rows sent to it."""
    keep = []
    for idx in indices:
        flat = idx.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        dest = flat[order] // num_local
        position = torch.zeros_like(dest)
        for d in dest.unique():
            position[dest == d] = torch.arange(int((dest == d).sum()))
        kept = torch.zeros(flat.numel(), dtype=F64)
        kept[order] = (position < capacity).to(F64)
        keep.append(kept.reshape(idx.shape))
    return keep


def check_capacity_mode_reports_drops(rank, n):
    capacity = 5
    tokens = [8, 3]  # rank 0 sends 16 rows to 2 ranks: some destination gets more than 5
    indices = [torch.tensor([[0, 1], [1, 2], [0, 2], [1, 0], [2, 3], [0, 4], [1, 5], [2, 0]]),
               torch.tensor([[3, 4], [5, 0], [4, 1]])]
    block = _check_against_reference(rank, n, tokens, indices, capacity,
                                     lambda idx: kept_slots(idx, capacity, E // n))
    keep = kept_slots(indices, capacity, E // n)
    dropped = int((keep[rank] == 0).sum())
    assert [dropped, 0][rank] == dropped and (rank == 1 or dropped > 0), dropped
    stats = block[0].capacity_stats
    assert int(stats.dropped) == dropped
    received = sum(int(((idx // (E // n) == rank).reshape(-1).to(F64) * k.reshape(-1)).sum())
                   for idx, k in zip(indices, keep))
    assert int(stats.padded) == n * capacity - received


def check_bad_configurations(rank, n):
    world = dist.group.WORLD
    with pytest.raises(ValueError, match=r"ExpertDispatch: num_experts=5 is not divisible by "
                                         r"the ep_group size 2"):
        ops.ExpertDispatch(5, ep_group=world)
    with pytest.raises(ValueError, match=r"capacity=4 needs an ep_group"):
        ops.ExpertDispatch(4, capacity=4)
    with pytest.raises(TypeError, match=r"ep_group must be a torch.distributed.ProcessGroup"):
        ops.ExpertDispatch(4, ep_group="world")
    x, idx, p = torch.randn(3, H, dtype=F64), torch.zeros(3, K, dtype=torch.int64), \
        torch.rand(3, K, dtype=F64)
    disagree = ops.ExpertDispatch([4, 8][rank], ep_group=world)
    with pytest.raises(ValueError, match=r"ranks of the group disagree on num_experts: \[4, 8\]"):
        disagree(x, idx, p)
    capacities = ops.ExpertDispatch(4, ep_group=world, capacity=[2, 3][rank])
    with pytest.raises(ValueError, match=r"disagree on capacity .*: \[2, 3\]"):
        capacities(x, idx, p)
    w1, w2 = torch.randn(E, 2 * F, H, dtype=F64), torch.randn(E, H, F, dtype=F64)
    local_dispatch_ep_combine = make_block(w1, w2)
    local_dispatch_ep_combine[4] = ops.ExpertCombine(ep_group=world)
    with pytest.raises(ValueError, match=r"ExpertCombine: ep_group is given, but the routing "
                                         r"map comes from an ExpertDispatch without"):
        local_dispatch_ep_combine(x, idx, p)


CHECKS = [check_uneven_loads, check_empty_experts_and_rank, check_second_step_reuses_agreement,
          check_capacity_mode_reports_drops, check_bad_configurations]


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(CHECKS, 2)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_on_two_ranks(results, check):
    error = results[check]
    assert error is None, error


def test_without_torch_distributed_a_group_is_an_error():
    if dist.is_initialized():
        pytest.skip("this process has a default group")
    ops.ExpertDispatch(4, ep_group=None)  # no expert parallelism needs no torch.distributed
    ops.ExpertCombine()
