"""The distributed checks again on 2 GPUs with NCCL (marked gpu; skip with fewer than 2 GPUs):
the communication ops and tensor-parallel linears, the expert-parallel exchange (both modes),
the expert-parallel MoE block (float64 against the single-process maths; bf16 on the cute
kernels, plain and FP8, against one process holding every expert) and FSDP2, each rank on its
own GPU with it as the default device (the same check functions as the gloo tests, so the
same single-process references)."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_on_ranks
from test_distributed_ops import CHECKS as OPS_CHECKS
from test_expert_exchange import CHECKS as EXCHANGE_CHECKS
from test_expert_parallel_ops import CHECKS as EP_OPS_CHECKS
from test_fsdp import CHECKS as FSDP_CHECKS

CHECKS = [*OPS_CHECKS, *EXCHANGE_CHECKS, *EP_OPS_CHECKS, *FSDP_CHECKS]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(CHECKS, 2, timeout_s=420, backend="nccl")


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_on_two_gpus(results, check):
    error = results[check]
    assert error is None, error
