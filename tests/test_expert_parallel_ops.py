"""The expert-parallel MoE block (ExpertDispatch / ExpertCombine with an ep_group) on 2 CPU
ranks (gloo), against the single-process block holding all experts: forward, dx, dprobs and
the local experts' weight gradients (float64, reference backend); uneven and empty expert
loads; capacity mode with its drops reported; bad configurations as clear errors."""

from __future__ import annotations

import contextlib

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


def run(block, x, idx, p, g, call=None):
    """(output, dx, dprobs, dW1, dW2) of one step of `block` (through `call`, e.g. its compiled
    form, where given)."""
    x, p = x.clone().requires_grad_(True), p.clone().requires_grad_(True)
    out = (call or block)(x, idx, p)
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


def check_block_uneven_loads(rank, n):
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


def _realistic_problem(device, dtype):
    """Wider experts than the float64 checks (the cute kernels' alignment: H, F multiples of
    16), 8 experts, top-2, uneven token counts per rank; same on every rank (same seed)."""
    h, f, experts, tokens = 64, 48, 8, [40, 24]
    xs = [torch.randn(t, h, device=device).to(dtype) for t in tokens]
    indices = [torch.rand(t, experts, device=device).topk(K, dim=-1).indices for t in tokens]
    probs = [(torch.rand(t, K, device=device) + 0.1).to(dtype) for t in tokens]
    grads = [torch.randn(t, h, device=device).to(dtype) for t in tokens]
    w1 = (torch.randn(experts, 2 * f, h, device=device) / h ** 0.5).to(dtype)
    w2 = (torch.randn(experts, h, f, device=device) / f ** 0.5).to(dtype)
    return xs, indices, probs, grads, w1, w2


def _grouped_block(w1, w2, experts, **dispatch_kw):
    """The MoE block with single grouped weights copied from w1 [G, 2F, H], w2 [G, H, F]."""
    groups, f2, h = w1.shape
    kw = {"bias": False, "dtype": w1.dtype, "device": w1.device, "single_grouped_weight": True}
    fc1, fc2 = ops.GroupedLinear(groups, h, f2, **kw), ops.GroupedLinear(groups, f2 // 2, h, **kw)
    with torch.no_grad():
        fc1.weight.copy_(w1)
        fc2.weight.copy_(w2)
    return te_seq.Sequential(ops.ExpertDispatch(experts, **dispatch_kw), fc1, ops.ScaledSwiGLU(),
                             fc2, ops.ExpertCombine(ep_group=dispatch_kw.get("ep_group")))


def _step(block, x, idx, p, g, recipe):
    x, p = x.clone().requires_grad_(True), p.clone().requires_grad_(True)
    with te_seq.autocast(recipe=recipe) if recipe else contextlib.nullcontext():
        out = block(x, idx, p)
    out.backward(g)
    return out.detach(), x.grad, p.grad, block[1].weight.grad, block[3].weight.grad


def _check_like_one_process(rank, n, recipe):
    """The expert-parallel block in the run's working precision (bf16 on the cute kernels
    with NCCL, float32 on the CPU) against one process holding all experts on the same
    device, fed all ranks' tokens in rank order: per row the same GEMMs (the received rows
    keep source-rank order within an expert), so the two agree to the dtype's rounding."""
    cuda = dist.get_backend() == "nccl"
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    xs, indices, probs, grads, w1, w2 = _realistic_problem(device, dtype)
    experts, local = w1.shape[0], w1.shape[0] // n
    whole = _grouped_block(w1, w2, experts)
    ref = _step(whole, torch.cat(xs), torch.cat(indices), torch.cat(probs), torch.cat(grads),
                recipe)
    mine = slice(rank * local, (rank + 1) * local)
    block = _grouped_block(w1[mine], w2[mine], experts, ep_group=dist.group.WORLD)
    got = _step(block, xs[rank], indices[rank], probs[rank], grads[rank], recipe)
    rows = slice(sum(len(x) for x in xs[:rank]), sum(len(x) for x in xs[:rank + 1]))
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5,
                                                                        "atol": 1e-5}
    for what, a, b in zip(("forward", "dx", "dprobs"), got[:3], ref[:3]):
        torch.testing.assert_close(a, b[rows], **tol, msg=lambda m, w=what: f"{w}: {m}")
    for what, a, b in zip(("dW1", "dW2"), got[3:], ref[3:]):
        torch.testing.assert_close(a, b[mine], **tol, msg=lambda m, w=what: f"{w}: {m}")
    plan = str(block.fusion_plan())
    assert "GroupedMLP[1, 2, 3]" in plan, plan
    if cuda:
        assert "[cute]" in plan, plan
    return block, got[0], (xs[rank], indices[rank], probs[rank], grads[rank])


def check_working_precision_like_one_process(rank, n):
    _check_like_one_process(rank, n, None)


def check_fp8_rowwise_like_one_process(rank, n):
    """Under FP8 (row-wise scales): every scale is per row or per (expert, column) over the
    expert's rows, which the exchange keeps together, so EP equals the one-process FP8 block."""
    block, out, inputs = _check_like_one_process(rank, n, te_seq.recipe.Float8RowwiseScaling())
    plain = _step(block, *inputs, None)[0]  # the same block outside FP8: other values
    assert not torch.equal(out, plain), "the FP8 recipe changed nothing"


def check_compiled_block_like_eager(rank, n):
    """torch.compile of the expert-parallel block (exact mode: its host sync and the plan on the
    routing map run as graph breaks) gives the eager block's output and gradients."""
    xs, indices, probs, grads, w1, w2 = global_problem([7, 4])
    mine = slice(rank * (E // n), (rank + 1) * (E // n))
    eager = run(make_block(w1[mine], w2[mine], ep_group=dist.group.WORLD), xs[rank],
                indices[rank], probs[rank], grads[rank])
    block = make_block(w1[mine], w2[mine], ep_group=dist.group.WORLD)
    got = run(block, xs[rank], indices[rank], probs[rank], grads[rank], torch.compile(block))
    for what, a, b in zip(("forward", "dx", "dprobs", "dW1", "dW2"), got, eager):
        close(a, b, f"compiled {what}")


CHECKS = [check_block_uneven_loads, check_empty_experts_and_rank,
          check_second_step_reuses_agreement, check_capacity_mode_reports_drops,
          check_bad_configurations,
          check_working_precision_like_one_process, check_fp8_rowwise_like_one_process,
          check_compiled_block_like_eager]


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
