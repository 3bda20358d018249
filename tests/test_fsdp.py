"""FSDP2: a te_seq Sequential wrapped by `torch.distributed.fsdp.fully_shard` trains with the
same losses and weights as the unsharded model (2 CPU ranks, gloo); fully_shard applied to an
op inside a Sequential is a clear error."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_on_ranks

import te_seq
from te_seq import ops

fsdp = pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed.fsdp")

F64 = torch.float64
ROWS, H, FFN, STEPS, LR = 8, 8, 16, 3, 0.05


def make_model():
    """Same weights on every rank and in the reference (same seed)."""
    torch.manual_seed(7)
    return te_seq.Sequential(ops.RMSNorm(H, dtype=F64), ops.Linear(H, FFN, dtype=F64),
                             ops.GELU(), ops.Linear(FFN, H, dtype=F64))


def train(model, batches, loss_of):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, target in batches:
        opt.zero_grad()
        loss = loss_of(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def check_fully_shard_trains_like_unsharded(rank, n):
    batches = [(torch.randn(n * ROWS, H, dtype=F64), torch.randn(n * ROWS, H, dtype=F64))
               for _ in range(STEPS)]
    mse = torch.nn.functional.mse_loss
    reference = make_model()
    ref_losses = train(reference, batches, mse)  # the whole batch on one process

    model = make_model()
    fsdp.fully_shard(model)  # gradients are averaged over the ranks: each takes an equal share
    mine = [(x.chunk(n)[rank], t.chunk(n)[rank]) for x, t in batches]
    losses = train(model, mine, mse)
    for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
        dist.all_reduce(loss)
        torch.testing.assert_close(loss / n, ref, rtol=1e-12, atol=1e-12,
                                   msg=lambda m, s=step: f"loss of step {s}: {m}")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-12, atol=1e-12,
                                   msg=lambda m, k=name: f"{k} after training: {m}")


def check_fully_shard_inside_sequential_is_an_error(rank, n):
    model = make_model()
    fsdp.fully_shard(model[1])  # a Linear inside the Sequential: its forward never runs
    with pytest.raises(TypeError, match=r"BasicLinear: a parameter is a sharded DTensor .*"
                                        r"fully_shard to the te_seq.Sequential"):
        model(torch.randn(ROWS, H, dtype=F64))


def check_fully_shard_over_tensor_parallel(rank, n):
    """2-D: FSDP2 over a data-parallel mesh dim, tensor parallelism (column then row Linear)
    over the other, 2 x 2 ranks: the same losses and weights as one process."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    batches = [(torch.randn(2 * ROWS, H, dtype=F64), torch.randn(2 * ROWS, H, dtype=F64))
               for _ in range(STEPS)]
    mse = torch.nn.functional.mse_loss
    reference = make_model()
    ref_losses = train(reference, batches, mse)

    kw = dict(tensor_parallel_group=mesh["tp"].get_group(), dtype=F64)
    model = te_seq.Sequential(ops.RMSNorm(H, dtype=F64),
                              ops.Linear(H, FFN, tensor_parallel_mode="column", **kw), ops.GELU(),
                              ops.Linear(FFN, H, tensor_parallel_mode="row", **kw))
    shard = _tp_shards(tp, n // 2)
    with torch.no_grad():
        for p, q in zip(model.parameters(), make_model().parameters()):
            p.copy_(shard(p, q))
    fsdp.fully_shard(model, mesh=mesh["dp"])
    losses = train(model, [(x.chunk(2)[dp], t.chunk(2)[dp]) for x, t in batches], mse)
    for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
        dist.all_reduce(loss, group=mesh["dp"].get_group())
        torch.testing.assert_close(loss / 2, ref, rtol=1e-12, atol=1e-12,
                                   msg=lambda m, s=step: f"loss of step {s}: {m}")
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), shard(p, q.detach()), rtol=1e-12,
                                   atol=1e-12, msg=lambda m, k=name: f"{k} after training: {m}")


def _tp_shards(tp, size):
    """This tensor-parallel rank's block of a global parameter q, for the local parameter p."""
    def shard(p, q):
        for dim in range(q.dim()):
            if p.shape[dim] != q.shape[dim]:
                return q.chunk(size, dim=dim)[tp]
        return q
    return shard


CHECKS = [check_fully_shard_trains_like_unsharded,
          check_fully_shard_inside_sequential_is_an_error]
CHECKS_4 = [check_fully_shard_over_tensor_parallel]


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(CHECKS, 2)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_on_two_ranks(results, check):
    error = results[check]
    assert error is None, error


def test_on_four_ranks_with_tensor_parallelism():
    error = run_on_ranks(CHECKS_4, 4)[CHECKS_4[0].__name__]
    assert error is None, error
