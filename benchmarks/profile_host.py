"""Where the grouped MLP's host time goes: per-call host time and a cProfile breakdown.

Host time is the wall time of one call from an idle device until the call returns, its kernels
not waited for (benchmarks/_common.py: time_host). With the GPU idle, a kernel starts as soon as
it is launched, so the host time before the first kernel is what a single call pays on top of
the kernels; `--first-kernel` reports that directly, from the profiler's first kernel launch.

  python benchmarks/profile_host.py --shape Q --backend cute [--compile] [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from _common import time_host
from mlp_case import make_case

import te_seq
from te_seq import ops


def build(case, backend: str):
    s, x = case.shape, case.x
    kw = {"device": x.device, "dtype": x.dtype, "single_grouped_weight": True}
    mlp = te_seq.Sequential(
        ops.GroupedLinear(s.E, s.H, 2 * s.F, bias=False, **kw),
        ops.ScaledSwiGLU(),
        ops.GroupedLinear(s.E, s.F, s.H, bias=False, **kw),
    )
    x = case.x.detach().requires_grad_()
    probs = case.probs.detach().requires_grad_()
    args = (x, case.split_sizes, probs, case.split_sizes)

    def forward():
        with te_seq.backend(backend):
            return mlp(*args)

    return mlp, forward


def first_kernel_us(forward, device) -> float:
    """Microseconds from the call's start to its first kernel launch (profiler timestamps)."""
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("te_seq_call"):
            forward()
    events = prof.events()
    start = next(e for e in events if e.name == "te_seq_call").time_range.start
    launches = [
        e.time_range.start
        for e in events
        if "LaunchKernel" in e.name or e.name in ("cuLaunchKernelEx", "cudaLaunchKernelExC")
    ]
    return (min(launches) - start) if launches else float("nan")


def profile(fn, iters: int, top: int) -> None:
    """cProfile of `iters` calls, each from an idle device (so no launch ever waits)."""
    prof = cProfile.Profile()
    spent = 0.0
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prof.enable()
        fn()
        prof.disable()
        spent += time.perf_counter() - t0
    print(f"(profiled: {spent / iters * 1e6:.1f} us per call)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="Q")
    p.add_argument("--backend", default="cute")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) too")
    args = p.parse_args()
    device = torch.device("cuda")
    case = make_case(args.shape, device, torch.bfloat16)
    mlp, forward = build(case, args.backend)
    for _ in range(5):
        forward()
    print(mlp.fusion_plan())
    print(f"eager forward host time: {time_host(forward, args.iters, device) * 1e3:.1f} us")
    for _ in range(3):
        print(f"eager forward, first kernel after {first_kernel_us(forward, device):.1f} us")
    with torch.no_grad():
        host = time_host(forward, args.iters, device) * 1e3
    print(f"eager forward (no_grad) host time: {host:.1f} us")
    profile(forward, args.iters, args.top)
    if args.compile:
        compiled = torch.compile(mlp, fullgraph=True)
        x, splits, probs = case.x.detach().requires_grad_(), case.split_sizes, case.probs

        def forward_compiled():
            with te_seq.backend(args.backend):
                return compiled(x, splits, probs, splits)

        for _ in range(5):
            forward_compiled()
        host = time_host(forward_compiled, args.iters, device) * 1e3
        print(f"compiled forward host time: {host:.1f} us")
        profile(forward_compiled, args.iters, args.top)


if __name__ == "__main__":
    main()
