"""What autograd's device thread costs the host per step, apart from te_seq.

A CUDA tensor's backward runs on autograd's device thread: the calling thread hands the graph
to it and sleeps until it is done. This probe times one tiny autograd.Function (one launch
forward, one backward) whose backward also runs `--work` rounds of fixed Python work, in bursts of
back-to-back steps, with the device thread (PyTorch's default) and with backward on the
calling thread (`torch.autograd.set_multithreading_enabled(False)`): the host µs per step,
the Python work's own µs as measured inside backward (a cold or slower core shows there),
and the same for the fused MLP of `profile_host.py` (shape Q, bf16 and FP8) when asked.
Run it under `taskset -c ...` to see what pinning the process to cores changes.

  python benchmarks/probe_autograd_threads.py [--work 0,1000] [--mlp] [--fp8 ROWWISE]

Measured on H200 hosts (2026-11-29, run "o"; benchmarks/README.md): the device thread cost
the tiny step 50-70 µs and the Q MLP's step 100-600 µs of host time; the fixed Python work
took 240-575 µs for the same rounds between processes on one host, so host times compare
only within one process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

_TABLE = {(i, str(i)): i for i in range(20000)}  # a working set larger than L1


def _python_work(rounds: int) -> int:
    """A fixed amount of interpreter work: dict lookups, tuples and attribute reads."""
    total = 0
    for i in range(rounds):
        key = (i % 20000, str(i % 20000))
        total += _TABLE.get(key, 0) + len(key)
    return total


class _Spin(torch.autograd.Function):
    """x * 2 forward; backward runs `rounds` of `_python_work`, then g * 2 (one launch each)."""

    rounds = 0
    spent: list[float] = []

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        t0 = time.perf_counter()
        _python_work(_Spin.rounds)
        _Spin.spent.append((time.perf_counter() - t0) * 1e6)
        return g * 2


def spin_step(rounds: int, device: str = "cuda"):
    """One probe step on `device` (on the CPU autograd has no device thread: a smoke run)."""
    x = torch.randn(1024, device=device, requires_grad=True)
    g = torch.ones(1024, device=device)
    _Spin.rounds = rounds

    def step():
        _Spin.apply(x).backward(g)
        x.grad = None
    return step


def compare(label: str, step, bursts: int = 15) -> list[tuple[bool, float, float]]:
    """Prints and returns (device thread?, host µs, wall µs) per setting of autograd's
    multithreading."""
    from profile_kernels import burst_feed

    rows = []
    for threads in (True, False):
        burst_feed(step, threads, bursts=1, burst=5)  # warm-up in this setting
        _Spin.spent.clear()
        host, wall = burst_feed(step, threads, bursts)
        inner = f", Python work {statistics.median(_Spin.spent):.1f} us" if _Spin.spent else ""
        where = "device thread " if threads else "calling thread"
        print(f"{label:40s} backward on {where}: host {host:7.1f} us/step, "
              f"wall {wall:7.1f} us/step{inner}")
        rows.append((threads, host, wall))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="0,1000",
                   help="rounds of fixed Python work in the probe's backward (~0.3 µs each)")
    p.add_argument("--mlp", action="store_true", help="also the fused MLP (profile_host.py)")
    p.add_argument("--shape", default="Q")
    p.add_argument("--fp8", default="", help="with --mlp: also this recipe (hp wgrad)")
    args = p.parse_args()
    print(f"CPUs this process may run on: {sorted(os.sched_getaffinity(0))}")
    for rounds in (int(w) for w in args.work.split(",")):
        compare(f"probe, {rounds} rounds of Python in backward", spin_step(rounds))
    if not args.mlp:
        return
    from mlp_case import make_case
    from profile_host import build
    from profile_kernels import RECIPES, step_fn
    _Spin.spent.clear()
    case = make_case(args.shape, torch.device("cuda"), torch.bfloat16)
    mlp, forward = build(case, "cute")
    compare(f"MLP {args.shape} bf16", step_fn(mlp, forward, None))
    if args.fp8:
        recipe = RECIPES[args.fp8](fp8_wgrad=False)
        compare(f"MLP {args.shape} {args.fp8} hp-wgrad", step_fn(mlp, forward, recipe))


if __name__ == "__main__":
    main()
