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


CHECKS = [check_fully_shard_trains_like_unsharded,
          check_fully_shard_inside_sequential_is_an_error]


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(CHECKS, 2)


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_on_two_ranks(results, check):
    error = results[check]
    assert error is None, error
