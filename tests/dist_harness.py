"""Run check functions on n CPU processes joined by a gloo process group, with bounded time.

`run_on_ranks(checks, world_size)` spawns the ranks once (a fresh free port), runs every check
on every rank in order, and returns per check the first error any rank raised (None: passed on
every rank). A check is a module-level function `check(rank, world_size)` (spawned processes
import it by name). A rank that hangs in a collective is cut by the group's timeout and the
whole job by `timeout_s`: a broken check fails its test, never hangs the suite.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GROUP_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, checks: Sequence[Callable], out_dir: str,
            backend: str):
    torch.set_num_threads(1)  # the ranks share the machine's few cores
    if backend == "nccl":  # one GPU per rank; the checks' tensors are made there
        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    results = {}
    try:
        for check in checks:
            torch.manual_seed(1234)  # every rank draws the same global data
            try:
                check(rank, world_size)
                results[check.__name__] = None
            except Exception:  # noqa: BLE001 - reported to the parent, per check
                results[check.__name__] = f"rank {rank}: {traceback.format_exc()}"
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run_on_ranks(checks: Sequence[Callable], world_size: int, timeout_s: float = 240,
                 backend: str = "gloo") -> dict[str, str | None]:
    """{check name: None or the first rank's error}; a check no rank finished reports that.
    backend "nccl": rank r runs on GPU r with it as the default device. Check names must be
    distinct (results are keyed by them)."""
    names = [check.__name__ for check in checks]
    clashes = sorted({name for name in names if names.count(name) > 1})
    if clashes:
        raise ValueError(f"run_on_ranks: check names must be distinct, repeated: {clashes}")
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.spawn(_worker, args=(world_size, free_port(), list(checks), out_dir, backend),
                       nprocs=world_size, join=False)
        _join(ctx, timeout_s)
        per_rank = []
        for rank in range(world_size):
            path = Path(out_dir, f"rank{rank}.json")
            per_rank.append(json.loads(path.read_text()) if path.exists() else {})
    results = {}
    for check in checks:
        errors = [r.get(check.__name__, f"not finished (timeout {timeout_s} s or a crash)")
                  for r in per_rank]
        results[check.__name__] = next((e for e in errors if e is not None), None)
    return results


def _join(ctx: mp.ProcessContext, timeout_s: float) -> None:
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while not ctx.join(timeout=1.0):
            if datetime.datetime.now() > deadline:
                break
    except mp.ProcessException:
        pass  # a rank crashed outside a check: its unfinished checks report it
    for process in ctx.processes:
        if process.is_alive():
            os.kill(process.pid, 9)  # only the processes this harness started
            process.join()
