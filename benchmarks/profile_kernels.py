"""Where the grouped MLP's device time goes: a kernel table of one forward+backward.

Runs the same Sequential as profile_host.py (GroupedLinear -> ScaledSwiGLU -> GroupedLinear,
split sizes on the device) a few times to warm up, then profiles `--iters` forward+backward
calls with torch.profiler (CPU and CUDA) and prints, per kernel name: calls per step, device
ms per step and share; then the step's wall time, summed kernel time and launches per step.
`--fp8 ROWWISE|CURRENT|BLOCK` runs it under te_seq.autocast with that recipe (`--hp-wgrad`: its
`fp8_wgrad=False`, the wgrads in bf16); `--cpu` also prints
the host-side ops by self CPU time (where a host-bound step spends its time). `--order` also
prints one step's launches in launch order with each one's mean device time (tells apart the
six GEMMs that share a kernel name); `--peer quack` profiles QuACK's MLP (peer_quack.py, the
benchmark's peer, fresh grads) instead of te_seq's, so the two tables compare GEMM by GEMM.
`--act swiglu` runs SwiGLU without router probs; `--forward` profiles forwards under
torch.no_grad() instead (no backward follows: FC1 writes no h, QuACK stores no pre-activation).
`--grad-mode megatron` profiles the benchmark's Megatron mode (grad_modes.py: fp32 `main_grad`
buffers, the flag and Megatron's hook; te_seq with `accumulate_into_main_grad=True`, the peer's
bf16 grads added into `main_grad` by the hook) instead of fresh grads. `--gaps` also prints,
per launch position of a step, the idle time before the kernel and how much of it the GPU
spent waiting for the launch itself (the launch call ended after the previous kernel did: the
host was behind), from a trace of CUDA activity only (no per-op host recording; CUPTI's
per-launch callbacks still slow the host, so the 'late' part is an upper bound: check it with
`--feed`, kernel README section 21). `--feed` times bursts of steps without any profiler: the
host's time to queue a burst (until its last step returns) against the burst's device time
(until its last kernel ends), per step, with autograd's device threads and without them
(backward on the calling thread): where the host time per step nears the device time, the GPU
waits for launches.

  python benchmarks/profile_kernels.py --shape Q --backend cute --fp8 ROWWISE [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from collections import defaultdict

import torch
from grad_modes import GradState
from mlp_case import ACTS, make_case
from peer_quack import QuackPeer
from profile_host import build

import te_seq

RECIPES = {
    "ROWWISE": te_seq.recipe.Float8RowwiseScaling,
    "CURRENT": te_seq.recipe.Float8CurrentScaling,
    "BLOCK": te_seq.recipe.Float8BlockScaling,
}


def forward_fn(forward, recipe):
    """One forward under torch.no_grad() (no backward will run: FC1 writes no h)."""
    def step():
        with torch.no_grad(), te_seq.autocast(enabled=recipe is not None, recipe=recipe):
            forward()
    return step


def step_fn(mlp, forward, recipe):
    """One fwd+bwd with fresh gradients, as the benchmark's default mode: the weights' and the
    inputs' (x, probs) .grad set to None first, so no gradient-accumulation add runs, and dY
    made once, so no fill runs; the table then holds the MLP's own kernels only (in Megatron
    mode the wgrads add into main_grad, as they must)."""
    grad_out = []

    def step():
        mlp.zero_grad(set_to_none=True)
        for leaf in forward.inputs:
            leaf.grad = None
        with te_seq.autocast(enabled=recipe is not None, recipe=recipe):
            y = forward()
        if not grad_out:
            grad_out.append(torch.randn_like(y))
        y.backward(grad_out[0])
    return step


def step_wall(step, iters: int) -> float:
    """µs per step, `iters` steps back to back, no profiler (its per-op cost would inflate it)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def kernel_table(step, iters: int):
    """{kernel name: (calls, device µs)} summed over `iters` steps, and the wall µs per step
    (`step_wall`, measured before profiling)."""
    wall = step_wall(step, iters)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    kernel_table.cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_table.order = launch_order(kernels, iters)
    table = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        row = table[e.name]
        row[0] += 1
        row[1] += e.device_time
    return table, wall


def launch_order(kernels, iters: int) -> list[tuple[str, float]]:
    """[(name, mean device µs)] per launch position within one step, in launch order; empty
    when the steps did not launch the same number of kernels."""
    kernels = sorted(kernels, key=lambda e: e.time_range.start)
    per_step, rest = divmod(len(kernels), iters)
    if rest or not per_step:
        return []
    return [(kernels[i].name, sum(e.device_time for e in kernels[i::per_step]) / iters)
            for i in range(per_step)]


def launch_gaps(step, iters: int) -> list[tuple[str, float, float]]:
    """[(kernel name, idle µs before it, of which the launch was late)] per launch position of
    one step, means over `iters` back-to-back steps (the first kernel of each step counts the
    time since the previous step's last kernel). A kernel's launch is the CUDA runtime or
    driver call with its correlation id; it was late by how long that call ended after the
    previous kernel ended (0 if before)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    launch_end = {e["args"]["correlation"]: e["ts"] + e.get("dur", 0) for e in events
                  if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in
                  e.get("args", {})}
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per_step, rest = divmod(len(kernels), iters)
    if rest or not per_step:
        return []
    sums = [[kernels[i]["name"], 0.0, 0.0] for i in range(per_step)]
    for i in range(1, len(kernels)):
        prev_end = kernels[i - 1]["ts"] + kernels[i - 1]["dur"]
        idle = max(0.0, kernels[i]["ts"] - prev_end)
        late = launch_end.get(kernels[i]["args"].get("correlation"), prev_end) - prev_end
        sums[i % per_step][1] += idle / iters
        sums[i % per_step][2] += min(idle, max(0.0, late)) / iters
    return [tuple(row) for row in sums]


def host_feed(step, bursts: int = 10, burst: int = 20) -> dict[str, tuple[float, float]]:
    """{"threads"|"calling thread": `burst_feed`}: "calling thread" runs backward without
    autograd's device threads."""
    return {label: burst_feed(step, threads, bursts, burst)
            for label, threads in (("threads", True), ("calling thread", False))}


def burst_feed(step, threads: bool, bursts: int = 10, burst: int = 20) -> tuple[float, float]:
    """(host µs per step to queue a burst, µs per step until its last kernel ends), medians
    over `bursts` bursts of `burst` back-to-back steps, each from an idle device, with
    autograd's device threads on or off (`threads`); on the CPU the second is the host's."""
    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    torch.autograd.set_multithreading_enabled(threads)
    try:
        runs = []
        for _ in range(bursts):
            sync()
            t0 = time.perf_counter()
            for _ in range(burst):
                step()
            queued = time.perf_counter()
            sync()
            done = time.perf_counter()
            runs.append(((queued - t0) / burst * 1e6, (done - t0) / burst * 1e6))
    finally:
        torch.autograd.set_multithreading_enabled(True)
    runs.sort()
    return runs[len(runs) // 2]


def python_profile(step, iters: int, top: int) -> None:
    """cProfile of `iters` steps: the Python functions by own time, then by cumulative time.
    Backward runs on the calling thread here (autograd's device threads are invisible to
    cProfile), and each step starts from an idle device, so no launch waits on a full queue."""
    prof = cProfile.Profile()
    torch.autograd.set_multithreading_enabled(False)
    try:
        for _ in range(iters):
            torch.cuda.synchronize()
            prof.enable()
            step()
            prof.disable()
    finally:
        torch.autograd.set_multithreading_enabled(True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)


def step_host(step, iters: int) -> float:
    """Median host µs of one step from an idle device, its kernels not waited for."""
    runs = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        runs.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return sorted(runs)[len(runs) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="Q")
    p.add_argument("--backend", default="cute")
    p.add_argument("--fp8", default=None, choices=sorted(RECIPES))
    p.add_argument("--hp-wgrad", action="store_true",
                   help="with --fp8: the recipe's fp8_wgrad=False (wgrads in bf16)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--cpu", action="store_true", help="also the host ops by self CPU time")
    p.add_argument("--order", action="store_true", help="also one step's launches in order")
    p.add_argument("--feed", action="store_true",
                   help="also the host's queueing time per step in bursts against the device's")
    p.add_argument("--gaps", action="store_true",
                   help="also the idle time before each launch and how much the host caused")
    p.add_argument("--peer", default="", choices=["", "quack"],
                   help="profile this benchmark peer's MLP instead of te_seq's")
    p.add_argument("--act", default="scaled_swiglu", choices=ACTS,
                   help="swiglu: no router probs")
    p.add_argument("--forward", action="store_true",
                   help="forward only, under torch.no_grad() (what inference runs)")
    p.add_argument("--grad-mode", default="fresh", choices=["fresh", "megatron"],
                   help="megatron: fp32 main_grad, the flag and Megatron's hook")
    args = p.parse_args()
    case = make_case(args.shape, torch.device("cuda"), torch.bfloat16, act=args.act)
    recipe = RECIPES[args.fp8](fp8_wgrad=not args.hp_wgrad) if args.fp8 else None
    if args.peer:
        peer = QuackPeer(case, args.grad_mode)
        step = forward_fn(peer.forward, None) if args.forward else peer.forward_backward
        args.backend = args.peer
    else:
        mlp, forward = build(case, args.backend, main_grad=args.grad_mode == "megatron")
        if args.grad_mode == "megatron":
            GradState("megatron", list(mlp.parameters()))  # main_grad buffers, flag, hook
        step = forward_fn(forward, recipe) if args.forward else step_fn(mlp, forward, recipe)
    for _ in range(3):
        step()
    if not args.peer:
        with te_seq.backend(args.backend), te_seq.autocast(enabled=recipe is not None,
                                                           recipe=recipe):
            print(mlp.fusion_plan())
    table, wall = kernel_table(step, args.iters)
    total = sum(us for _, us in table.values())
    launches = sum(n for n, _ in table.values())
    what = "forward" if args.forward else "fwd+bwd"
    print(f"shape {args.shape} {args.act} backend {args.backend} fp8 {args.fp8} grads "
          f"{args.grad_mode}: wall "
          f"{wall / 1e3:.2f} ms per {what}, kernels {total / args.iters / 1e3:.2f} ms, "
          f"{launches / args.iters:.0f} launches, host {step_host(step, 20) / 1e3:.2f} ms "
          "per step from an idle device")
    if args.cpu:
        print(kernel_table.cpu)
        python_profile(step, args.iters, args.top)
    rows = sorted(table.items(), key=lambda kv: -kv[1][1])[: args.top]
    for name, (n, us) in rows:
        print(f"{n / args.iters:7.1f}x {us / args.iters / 1e3:8.3f} ms {us / total:6.1%}  "
              f"{name[:110]}")
    if args.order:
        print("launch order (one step, mean device ms):")
        for i, (name, us) in enumerate(kernel_table.order):
            print(f"{i:4d} {us / 1e3:8.3f} ms  {name[:110]}")
    if args.gaps:
        print_gaps(launch_gaps(step, max(args.iters, 10)))
    if args.feed:
        for label, (host, wall) in host_feed(step).items():
            print(f"bursts of 20, backward on {label}: host {host:.1f} us per step to queue, "
                  f"{wall:.1f} us per step until the last kernel ends")


def print_gaps(gaps: list[tuple[str, float, float]]) -> None:
    """`launch_gaps`' rows and their totals per step."""
    print("idle before each launch (one step, mean µs; 'late': the host launched it after "
          "the previous kernel ended):")
    for i, (name, idle, late) in enumerate(gaps):
        print(f"{i:4d} idle {idle:7.1f} us  late {late:7.1f} us  {name[:100]}")
    print(f"per step: idle {sum(g[1] for g in gaps):.1f} us, of which the host was late for "
          f"{sum(g[2] for g in gaps):.1f} us")


if __name__ == "__main__":
    main()
