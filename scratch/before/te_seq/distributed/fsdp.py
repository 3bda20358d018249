"""FSDP2 (`torch.distributed.fsdp.fully_shard`) and te_seq: what works, checked where it can be.

FSDP2 gathers a module's parameters in a forward pre-hook of the module it wrapped and shards
them again after. Inside a `te_seq.Sequential`, only the Sequential's own forward runs: the ops
it holds (`Linear`, `BasicLinear`, ...) are flattened into fusion runs and their `forward` is
never called, so their hooks never fire. Wrap the Sequential (or a module around it), not the
ops inside it; an op whose parameter is still a sharded DTensor when a plan is built is a
TypeError saying so (instead of a mixed Tensor/DTensor error deep in a GEMM).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist


def _dtensor_type() -> type | None:
    if not dist.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def check_not_sharded(op_name: str, params: Iterable[object]) -> None:
    """Raise if a parameter is a DTensor (fully_shard applied to the op, not its Sequential)."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return
    for p in params:
        if isinstance(p, dtensor):
            raise TypeError(
                f"{op_name}: a parameter is a sharded DTensor {tuple(p.shape)} at forward: "
                "fully_shard was applied to an op inside a te_seq.Sequential, whose forward "
                "the Sequential never calls (so FSDP never gathers it). Apply fully_shard to "
                "the te_seq.Sequential (or a module that contains it) instead"
            )
