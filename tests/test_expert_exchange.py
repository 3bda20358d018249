"""The expert-parallel exchange (te_seq.distributed.expert_exchange) on 2 CPU ranks (gloo),
against the single-process model: each rank's rows go through their global expert's weight,
wherever that expert lives. Uneven loads, empty experts, a rank that sends nothing; capacity
mode with drops and padding; bad input as clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_on_ranks

from te_seq.distributed.expert_exchange import (
    check_same_on_ranks,
    expert_combine,
    expert_dispatch,
)

F64 = torch.float64
H, HO, L = 4, 3, 3  # row width in, out; local experts per rank


def close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12,
                               msg=lambda m: f"{what}: {m}")


def global_problem(n, loads):
    """Per rank: counts [E] (given loads), rows sorted by expert, output grads; the experts'
    weights [E, H, HO]. Same on every rank (same seed)."""
    counts = [torch.tensor(c, dtype=torch.int64) for c in loads]
    xs = [torch.randn(int(c.sum()), H, dtype=F64) for c in counts]
    gs = [torch.randn(int(c.sum()), HO, dtype=F64) for c in counts]
    weights = torch.randn(n * L, H, HO, dtype=F64)
    return counts, xs, gs, weights


def expert_of_rows(counts):
    return torch.repeat_interleave(torch.arange(counts.numel()), counts)


def reference(counts, xs, gs, weights, keep=None):
    """Single process: out_s = x_s W_{expert(row)}; dx_s and dW for every expert (rows a
    capacity drop removes, `keep[s]` False, give zero output and contribute nothing)."""
    w = weights.clone().requires_grad_(True)
    outs, dxs = [], []
    for s, (c, x, g) in enumerate(zip(counts, xs, gs)):
        x = x.clone().requires_grad_(True)
        out = torch.einsum("th,tho->to", x, w[expert_of_rows(c)])
        if keep is not None:
            out = out * keep[s][:, None]
        (out * g).sum().backward()
        outs.append(out.detach()), dxs.append(x.grad)
    return outs, dxs, w.grad


def run_block(rank, n, counts, x, g, weights, capacity=None, group=None):
    """Dispatch -> each local expert's GEMM on its rows -> combine; with gradients."""
    x = x.clone().requires_grad_(True)
    w_local = weights[rank * L:(rank + 1) * L].clone().requires_grad_(True)
    rows, plan = expert_dispatch(x, counts, L, group or dist.group.WORLD, capacity=capacity)
    splits = plan.local_splits.tolist()  # the test reads them; the grouped MLP would not
    assert sum(splits) == rows.shape[0]
    y = torch.cat([part @ w_local[e] for e, part in enumerate(rows.split(splits))])
    out = expert_combine(y, plan)
    (out * g).sum().backward()
    return out.detach(), x.grad, w_local.grad, plan


def _check_exact(rank, n, loads, group=None):
    counts, xs, gs, weights = global_problem(n, loads)
    outs, dxs, dw = reference(counts, xs, gs, weights)
    out, dx, dw_local, plan = run_block(rank, n, counts[rank], xs[rank], gs[rank], weights,
                                        group=group)
    close(out, outs[rank], "combine(expert(dispatch(x)))")
    close(dx, dxs[rank], "dx")
    close(dw_local, dw[rank * L:(rank + 1) * L], "dW of this rank's experts")
    received = sum(c.reshape(n, L)[rank] for c in counts)
    assert plan.local_splits.tolist() == received.tolist()


def check_uneven_loads(rank, n):
    _check_exact(rank, n, [[3, 0, 5, 1, 0, 2], [0, 4, 1, 0, 0, 6]])


def check_empty_rank_and_experts(rank, n):
    """Rank 1 sends nothing; rank 0 sends only to rank 1's experts: rank 0 receives nothing."""
    _check_exact(rank, n, [[0, 0, 0, 2, 0, 3], [0, 0, 0, 0, 0, 0]])


def check_capacity_mode(rank, n):
    loads = [[3, 0, 2, 1, 0, 2], [0, 1, 1, 0, 0, 1]]  # rank 0 -> rank 0: 5 rows, capacity 4
    capacity = 4
    counts, xs, gs, weights = global_problem(n, loads)
    keep = []
    for c in counts:  # the first `capacity` rows per destination survive, in expert order
        dest = expert_of_rows(c) // L
        position = torch.cat([torch.arange(int((dest == d).sum())) for d in range(n)])
        keep.append((position < capacity).to(F64))
    outs, dxs, dw = reference(counts, xs, gs, weights, keep)
    out, dx, dw_local, plan = run_block(rank, n, counts[rank], xs[rank], gs[rank], weights,
                                        capacity)
    close(out, outs[rank], "capacity: forward (dropped rows are zero)")
    close(dx, dxs[rank], "capacity: dx (dropped rows get none)")
    close(dw_local, dw[rank * L:(rank + 1) * L], "capacity: dW")
    dropped = [1, 0][rank]  # rank 0 sent 5 rows to rank 0
    valid_received = [4 + 2, 3 + 1][rank]  # rank 0: 4 of its own 5, 2 from rank 1
    assert plan.stats.dropped.item() == dropped
    assert plan.stats.padded.item() == n * capacity - valid_received
    assert sum(plan.local_splits.tolist()) == n * capacity


def check_bad_input(rank, n):
    x = torch.randn(4, H, dtype=F64)
    with pytest.raises(ValueError, match=r"num_experts = 6 .*group size 2"):
        expert_dispatch(x, torch.tensor([4, 0, 0, 0]), L, dist.group.WORLD)
    with pytest.raises(ValueError, match=r"counts sum to 5 but x has 4 rows"):
        expert_dispatch(x, torch.tensor([5, 0, 0, 0, 0, 0]), L)
    check_same_on_ranks("ExpertDispatch", "num_experts", 6, None)
    with pytest.raises(ValueError, match=r"ExpertDispatch: ranks of the group disagree on "
                                         r"num_experts: \[6, 8\]"):
        check_same_on_ranks("ExpertDispatch", "num_experts", [6, 8][rank], None)


def check_expert_parallel_subgroups(rank, n):
    """4 ranks as two expert-parallel groups of 2 ({0, 1} and {2, 3}), each its own problem."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = rank // 2
    loads = [[[2, 1, 0, 0, 3, 1], [0, 0, 4, 2, 0, 1]], [[1, 1, 1, 1, 1, 1], [0, 5, 0, 0, 0, 0]]]
    for p in range(2):  # both pairs draw both problems: the same random stream everywhere
        if p == pair:
            _check_exact(rank % 2, 2, loads[p], groups[p])
        else:
            global_problem(2, loads[p])


CHECKS = [check_uneven_loads, check_empty_rank_and_experts, check_capacity_mode, check_bad_input]
CHECKS_4 = [check_expert_parallel_subgroups]


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(CHECKS, 2)


def test_on_four_ranks_in_two_groups():
    error = run_on_ranks(CHECKS_4, 4)[CHECKS_4[0].__name__]
    assert error is None, error


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_on_two_ranks(results, check):
    error = results[check]
    assert error is None, error
