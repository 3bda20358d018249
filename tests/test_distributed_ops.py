"""AllGather / ReduceScatter / AllReduce and the tensor-parallel BasicLinear / Linear, on 2 and
4 CPU ranks (gloo), against the single-process model: forward, input and weight gradients.

Each rank draws the same global data (same seed) and takes its shard; float64 throughout, so
the comparisons are exact up to summation order. The ranks are spawned once per world size
(module-scoped fixture) and run every check in one job.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_harness import run_on_ranks

import te_seq
from te_seq import ops
from te_seq.ops.basic import _tensor_parallel as tp_module

F64 = torch.float64
S, B, H, FFN = 8, 3, 8, 16  # tokens (first dim, divisible by 4), batch, hidden, ffn


def close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12,
                               msg=lambda m: f"{what}: {m}")


def run_seq(module, x, dy):
    """y = module(x), and x.grad after backward of <y, dy>."""
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad


def block(t, rank, n, dim=0):
    return t.chunk(n, dim=dim)[rank]


# --- communication ops -------------------------------------------------------------------


def check_all_gather(rank, n):
    xs = torch.randn(n, S, B, H, dtype=F64)  # rank r holds xs[r]
    dys = torch.randn(n, n * S, B, H, dtype=F64)  # each rank's own gradient of the output
    y, dx = run_seq(te_seq.Sequential(ops.AllGather(None)), xs[rank], dys[rank])
    close(y, xs.reshape(n * S, B, H), "AllGather forward")
    close(dx, block(dys.sum(0), rank, n), "AllGather backward = reduce-scatter")


def check_reduce_scatter(rank, n):
    xs = torch.randn(n, n * S, B, H, dtype=F64)
    dys = torch.randn(n, S, B, H, dtype=F64)
    y, dx = run_seq(ops.ReduceScatter(dist.group.WORLD), xs[rank], dys[rank])
    close(y, block(xs.sum(0), rank, n), "ReduceScatter forward")
    close(dx, dys.reshape(n * S, B, H), "ReduceScatter backward = all-gather")


def check_all_reduce(rank, n):
    xs = torch.randn(n, S, H, dtype=F64)
    dy = torch.randn(S, H, dtype=F64)  # the replicated consumer's gradient, same on every rank
    y, dx = run_seq(ops.AllReduce(), xs[rank], dy)
    close(y, xs.sum(0), "AllReduce forward")
    close(dx, dy, "AllReduce backward = identity")


def check_chain_adjoint(rank, n):
    """ReduceScatter then AllGather in one Sequential (one fused run): y = sum over ranks."""
    xs = torch.randn(n, n * S, H, dtype=F64)
    dys = torch.randn(n, n * S, H, dtype=F64)
    seq = te_seq.Sequential(ops.ReduceScatter(), ops.Identity(), ops.AllGather())
    y, dx = run_seq(seq, xs[rank], dys[rank])
    close(y, xs.sum(0), "ReduceScatter -> AllGather forward")
    close(dx, dys.sum(0), "ReduceScatter -> AllGather backward")


def check_reduce_scatter_indivisible(rank, n):
    x = torch.randn(n * S + 1, H, dtype=F64)
    with pytest.raises(ValueError, match=rf"ReduceScatter: .*{n * S + 1}.*group size {n}"):
        ops.ReduceScatter()(x)


# --- tensor-parallel linears -------------------------------------------------------------


def mlp_reference(x, w1, b1, w2, b2, dy):
    """The single-process MLP y = gelu(x W1ᵀ + b1) W2ᵀ + b2: y and every gradient."""
    leaves = [t.clone().requires_grad_(True) for t in (x, w1, b1, w2, b2)]
    x, w1, b1, w2, b2 = leaves
    y = F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves]


def tp_mlp(rank, n, sequence_parallel, params):
    """Column Linear -> GELU -> row Linear, with this rank's shards of the global params."""
    w1, b1, w2, b2 = params
    kw = dict(tensor_parallel_group=dist.group.WORLD, sequence_parallel=sequence_parallel,
              dtype=F64)
    fc1 = ops.Linear(H, FFN, tensor_parallel_mode="column", **kw)
    fc2 = ops.Linear(FFN, H, tensor_parallel_mode="row", **kw)
    with torch.no_grad():
        fc1.weight.copy_(block(w1, rank, n)), fc1.bias.copy_(block(b1, rank, n))
        fc2.weight.copy_(block(w2, rank, n, dim=1)), fc2.bias.copy_(b2)
    return te_seq.Sequential(fc1, ops.GELU(), fc2), fc1, fc2


def _check_tp_mlp(rank, n, sequence_parallel):
    x, dy = torch.randn(S, B, H, dtype=F64), torch.randn(S, B, H, dtype=F64)
    params = (torch.randn(FFN, H, dtype=F64), torch.randn(FFN, dtype=F64),
              torch.randn(H, FFN, dtype=F64), torch.randn(H, dtype=F64))
    y_ref, (dx_ref, dw1, db1, dw2, db2) = mlp_reference(x, *params, dy)
    seq, fc1, fc2 = tp_mlp(rank, n, sequence_parallel, params)
    assert fc1.weight.shape == (FFN // n, H) and fc2.weight.shape == (H, FFN // n)
    shard = (lambda t: block(t, rank, n)) if sequence_parallel else (lambda t: t)
    y, dx = run_seq(seq, shard(x), shard(dy))
    close(y, shard(y_ref), "TP MLP forward")
    close(dx, shard(dx_ref), "TP MLP dx")
    close(fc1.weight.grad, block(dw1, rank, n), "column dW")
    close(fc1.bias.grad, block(db1, rank, n), "column db")
    close(fc2.weight.grad, block(dw2, rank, n, dim=1), "row dW")
    db2_local = fc2.bias.grad.clone()
    if sequence_parallel:  # a partial gradient per rank, summed as for norm weights
        assert fc2.bias.sequence_parallel is True
        dist.all_reduce(db2_local)
    close(db2_local, db2, "row db")


def check_tp_mlp(rank, n):
    _check_tp_mlp(rank, n, sequence_parallel=False)


def check_tp_mlp_sequence_parallel(rank, n):
    _check_tp_mlp(rank, n, sequence_parallel=True)


def _linear_shards(rank, n, mode, sequence_parallel):
    """This rank's cut of the linear's global input [S, H] and output [S, FFN]."""
    col = mode == "column"

    def input_(t):  # column: all tokens (its block under SP); row: its block of in-features
        if col:
            return block(t, rank, n) if sequence_parallel else t
        return block(t, rank, n, dim=1)

    def output(t):  # column: its block of out-features; row: all (its tokens under SP)
        if col:
            return block(t, rank, n, dim=1)
        return block(t, rank, n) if sequence_parallel else t

    return input_, output


def _check_basic_linear(rank, n, mode, sequence_parallel):
    """BasicLinear (no bias of its own) between fusion candidates: MakeExtraOutput before it (a
    backward fusion with it) and Bias + AddExtraInput after it (a forward fusion) must decline
    and leave the collectives in place; forward, dx, dW and db against the global maths."""
    col, what = mode == "column", f"BasicLinear {mode} sequence_parallel={sequence_parallel}"
    input_, output = _linear_shards(rank, n, mode, sequence_parallel)
    x, w, b = torch.randn(S, H, dtype=F64), torch.randn(FFN, H, dtype=F64), torch.randn(FFN)
    b, res = b.to(F64), torch.randn(S, FFN, dtype=F64)
    lin = ops.BasicLinear(H, FFN, tensor_parallel_mode=mode, sequence_parallel=sequence_parallel,
                          dtype=F64)
    bias = ops.Bias(FFN // n if col else FFN, dtype=F64)
    with torch.no_grad():
        lin.weight.copy_(block(w, rank, n, dim=0 if col else 1))
        bias.bias.copy_(block(b, rank, n) if col else b)
    x_in = input_(x).clone().requires_grad_(True)
    y, r = te_seq.Sequential(ops.MakeExtraOutput(), lin, bias, ops.AddExtraInput())(
        x_in, output(res))
    close(y, output(x @ w.t() + b + res), f"{what}: forward")
    g_y, g_r = torch.randn(S, FFN, dtype=F64), torch.randn(S, H, dtype=F64)
    torch.autograd.backward([y, r], [output(g_y), input_(g_r)])
    close(x_in.grad, input_(g_y @ w + g_r), f"{what}: dx")
    close(lin.weight.grad, block(g_y.t() @ x, rank, n, dim=0 if col else 1), f"{what}: dW")
    if not (mode == "row" and sequence_parallel):  # else a partial sum per rank
        close(bias.bias.grad, output(g_y).sum(0), f"{what}: db")


def check_basic_linear_modes(rank, n):
    for mode in ("column", "row"):
        for sequence_parallel in (False, True):
            _check_basic_linear(rank, n, mode, sequence_parallel)


def check_tp_validation(rank, n):
    bad = 2 * n + 1
    with pytest.raises(ValueError, match=rf"BasicLinear: .*out_features={bad} .*{n} ranks"):
        ops.BasicLinear(4, bad, tensor_parallel_mode="column")
    with pytest.raises(ValueError, match=rf"Linear: .*in_features={bad} .*divisible by {n}"):
        ops.Linear(bad, 4, tensor_parallel_mode="row")
    row = ops.BasicLinear(H, 4, tensor_parallel_mode="row", dtype=F64)
    with pytest.raises(ValueError, match=rf"BasicLinear: .*local_in_features.*{H // n}"):
        row(torch.randn(2, H, dtype=F64))
    row_sp = ops.BasicLinear(H, 4, tensor_parallel_mode="row", sequence_parallel=True, dtype=F64)
    with pytest.raises(ValueError, match=rf"BasicLinear: .*token.*{n + 1}.*group size {n}"):
        row_sp(torch.randn(n + 1, H // n, dtype=F64))


def check_tp_subgroups(rank, n):
    """Column TP on pairs of ranks (a group of one rank means no parallelism)."""
    singles = [dist.new_group([r]) for r in range(n)]
    lone = ops.BasicLinear(H, FFN, tensor_parallel_mode="column",
                           tensor_parallel_group=singles[rank])
    assert lone.tensor_parallel_mode is None and lone.weight.shape == (FFN, H)
    pairs = [dist.new_group([r, r + 1]) for r in range(0, n, 2)]
    pair, local = pairs[rank // 2], rank % 2
    x, w, dy = (torch.randn(S, H, dtype=F64), torch.randn(FFN, H, dtype=F64),
                torch.randn(S, FFN, dtype=F64))
    lin = ops.BasicLinear(H, FFN, tensor_parallel_mode="column", tensor_parallel_group=pair,
                          sequence_parallel=True, dtype=F64)
    with torch.no_grad():
        lin.weight.copy_(block(w, local, 2))
    y, dx = run_seq(lin, block(x, local, 2), block(dy, local, 2, dim=1))
    close(y, block(x @ w.t(), local, 2, dim=1), "column TP on a pair: forward")
    close(dx, block(dy @ w, local, 2), "column TP on a pair: dx (summed over the pair)")


def _overlap_run(rank, n, mode, overlap):
    """A sequence-parallel linear + GELU ([S, B, width] in): outputs and gradients."""
    torch.manual_seed(5)
    lin = ops.Linear(H if mode == "column" else FFN, FFN if mode == "column" else H,
                     tensor_parallel_mode=mode, sequence_parallel=True, dtype=F64)
    seq = te_seq.Sequential(lin, ops.GELU())
    rows = S // n if mode == "column" else S
    x = torch.randn(n * S, B, lin.weight.shape[1], dtype=F64)[rank * rows:(rank + 1) * rows]
    x = x.clone().requires_grad_(True)
    te_seq.config.set_tensor_parallel_overlap(overlap)
    try:
        y = seq(x)
    finally:
        te_seq.config.set_tensor_parallel_overlap(True)
    y.backward(torch.randn_like(y))
    return [y.detach(), x.grad, lin.weight.grad, lin.bias.grad]


def check_overlap(rank, n):
    """The forward overlap of the sequence-parallel collectives with the GEMM (on by default)
    gives the values of the collective-then-GEMM path."""
    for mode in ("column", "row"):
        spy = "all_gather_matmul" if mode == "column" else "matmul_reduce_scatter"
        real = getattr(tp_module, spy)
        used = []
        setattr(tp_module, spy, lambda *a, **k: used.append(1) or real(*a, **k))
        try:
            overlapped = _overlap_run(rank, n, mode, overlap=True)
            assert used, f"{mode}: the overlapped path did not run"
            used.clear()
            plain = _overlap_run(rank, n, mode, overlap=False)
            assert not used, f"{mode}: the overlapped path ran while switched off"
        finally:
            setattr(tp_module, spy, real)
        for i, (a, b) in enumerate(zip(overlapped, plain)):
            close(a, b, f"{mode}: overlapped vs not, tensor {i}")


def check_deepcopy_shares_the_group(rank, n):
    """copy.deepcopy of a model with tensor-parallel linears and communication ops works (the
    copy communicates on the same group) and computes the same."""
    group = dist.new_group(list(range(n)))
    seq = te_seq.Sequential(ops.AllGather(group), ops.Linear(H, FFN, tensor_parallel_mode="column",
                                                             tensor_parallel_group=group,
                                                             dtype=F64))
    twin = copy.deepcopy(seq)
    assert twin[0].process_group is group and twin[1]._linear.tensor_parallel_group is group
    x = torch.randn(S, H, dtype=F64)
    close(twin(x), seq(x), "deep copy")
    with pytest.raises(ValueError, match=r"sequence_parallel needs an input with a token dim"):
        ops.BasicLinear(H, FFN, tensor_parallel_mode="column", sequence_parallel=True)(
            torch.randn(H))


def check_column_sequence_parallel_saves_local_rows(rank, n):
    """Column + sequence parallel saves this rank's [S, H] input rows, not the gathered
    [n*S, H] (gathered again in backward), on both forward paths."""
    for overlap in (True, False):
        lin = ops.BasicLinear(H, FFN, tensor_parallel_mode="column", sequence_parallel=True,
                              dtype=F64)
        shapes = []

        def pack(t, shapes=shapes):
            shapes.append(tuple(t.shape))
            return t

        x = torch.randn(S, H, dtype=F64, requires_grad=True)
        te_seq.config.set_tensor_parallel_overlap(overlap)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = lin(x)
        finally:
            te_seq.config.set_tensor_parallel_overlap(True)
        assert (S, H) in shapes and (n * S, H) not in shapes, (overlap, shapes)
        y.sum().backward()
        assert lin.weight.grad.shape == (FFN // n, H)


CHECKS = [
    check_all_gather, check_reduce_scatter, check_all_reduce, check_chain_adjoint,
    check_reduce_scatter_indivisible, check_tp_mlp, check_tp_mlp_sequence_parallel,
    check_basic_linear_modes, check_tp_validation, check_tp_subgroups, check_overlap,
    check_deepcopy_shares_the_group, check_column_sequence_parallel_saves_local_rows,
]


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def results(request):
    return run_on_ranks(CHECKS, request.param)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_on_ranks(results, check):
    error = results[check]
    assert error is None, error


# --- errors that need no process group ---------------------------------------------------


def test_tensor_parallel_mode_unknown():
    with pytest.raises(ValueError, match=r"BasicLinear: tensor_parallel_mode must be None, "
                                         r"'column' or 'row', got 'diagonal'"):
        ops.BasicLinear(4, 4, tensor_parallel_mode="diagonal")


def test_tensor_parallel_needs_initialized_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"Linear: torch.distributed is not initialized"):
        ops.Linear(4, 4, tensor_parallel_mode="column")
    with pytest.raises(RuntimeError, match=r"AllGather: torch.distributed is not initialized"):
        ops.AllGather()(torch.randn(2, 3))


def test_sequence_parallel_or_group_without_mode():
    with pytest.raises(ValueError, match=r"BasicLinear: .*need a tensor_parallel_mode"):
        ops.BasicLinear(4, 4, sequence_parallel=True)
    with pytest.raises(TypeError, match=r"AllReduce: process_group must be"):
        ops.AllReduce("world")


def test_non_parallel_linear_unchanged():
    lin = ops.BasicLinear(4, 6)
    assert lin.tensor_parallel_mode is None and lin.local_out_features == 6
    assert lin.weight.shape == (6, 4)


def test_the_rank_harness_refuses_repeated_check_names():
    """Results are keyed by check name: a repeated name could hide one check's failure behind
    the other's pass, so the harness refuses it before starting any rank."""
    with pytest.raises(ValueError, match=r"check names must be distinct, repeated: "
                                         r"\['check_all_gather'\]"):
        run_on_ranks([check_all_gather, check_all_gather], 2)
