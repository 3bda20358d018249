"""Where the grouped MLP's host time goes: per-call host time and a cProfile breakdown.

Host time is the wall time of one call from an idle device until the call returns, its kernels
not waited for (benchmarks/_common.py: time_host). With the GPU idle, a kernel starts as soon as
it is launched, so the host time before the first kernel is what a single call pays on top of
the kernels; it is estimated as a single call's latency minus the steady-state time per call.

  python benchmarks/profile_host.py --shape Q --backend cute [--compile] [--top 30]
      [--step] [--fp8 Float8RowwiseScaling [--hp-wgrad]]

`--device cpu` measures the same Sequential's Python overhead without a GPU: tiny shape "U"
(E=4, H=32, F=24, 128 rows), float32, the "torch" backend by default, one CPU thread (kernel time
is small and steady there, so what changes is te_seq's own host time); it prints µs per forward,
per forward+backward and without grad, cProfile's primitive calls per forward, and the same
forward written as plain torch ops (the floor no wrapper can beat):

  python benchmarks/profile_host.py --device cpu [--backend reference] [--iters 2000]

`--stages` prints, instead, the inclusive host time of each layer of a forward (with `--step`,
of a forward+backward too; `--fp8 ... [--hp-wgrad]` under a recipe): te_seq's functions on
the way (`_stage_steps`: the fuser, the fused op, the FP8 GEMM and quantization calls,
torch.empty, Tensor.backward) each wrapped by a timer, µs per call and entries per call, from
an idle device each call. cProfile's own cost per call inflates every layer 2-3x on the GPU
host; these timers add ~1 µs per entry:

  python benchmarks/profile_host.py --stages --step [--fp8 Float8RowwiseScaling --hp-wgrad]

`--timeline` prints, instead, when one forward call reaches each step on its way to the first
GEMM (µs after the call starts, median of calls each from an idle device; each step is timed by a
thin wrapper, ~0.3 µs apiece): where the host time before the first kernel goes.

  python benchmarks/profile_host.py --timeline [--device cpu]

`--prepared-ab --fp8 R [--hp-wgrad]` compares, in one process on the GPU host, the FP8 MLP with
the FP8 GEMM launches its signature's first call prepares (the default) and without them
(`unprepared_fp8_launches`: every call through the FP8 functionals, as before they were
prepared), in interleaved rounds: host time of a forward and of a fresh-grads step from an idle
device, and the host and wall time per step of a burst of 20 (µs; median and best of the
rounds):

  python benchmarks/profile_host.py --prepared-ab --fp8 Float8RowwiseScaling --hp-wgrad
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import pstats
import statistics
import time

import torch
from _common import time_host
from mlp_case import make_case

import te_seq
from te_seq import ops


def build(case, backend: str, main_grad: bool = False):
    """(mlp, forward): FC1 -> ScaledSwiGLU (with the case's router probs) or SwiGLU (a case made
    with act="swiglu") -> FC2, and a no-argument forward on the case's inputs. ``main_grad``:
    the linears run with ``accumulate_into_main_grad=True`` (Megatron mode: give the weights
    their ``main_grad`` buffers, e.g. with ``grad_modes.GradState("megatron", ...)``)."""
    s, x = case.shape, case.x
    kw = {"device": x.device, "dtype": x.dtype, "single_grouped_weight": True,
          "accumulate_into_main_grad": main_grad}
    act = ops.ScaledSwiGLU() if case.uses_probs else ops.SwiGLU()
    mlp = te_seq.Sequential(
        ops.GroupedLinear(s.E, s.H, 2 * s.F, bias=False, **kw),
        act,
        ops.GroupedLinear(s.E, s.F, s.H, bias=False, **kw),
    )
    x = case.x.detach().requires_grad_()
    if case.uses_probs:
        probs = case.probs.detach().requires_grad_()
        args, leaves = (x, case.split_sizes, probs, case.split_sizes), (x, probs)
    else:
        args, leaves = (x, case.split_sizes, case.split_sizes), (x,)

    def forward():
        with te_seq.backend(backend):
            return mlp(*args)

    forward.inputs = leaves  # leaves whose .grad a step harness clears (no accumulate add)
    return mlp, forward


def exposed_host_us(forward, device, iters: int = 20) -> tuple[float, float, float]:
    """(single-call latency, steady-state device time per call, their difference) in µs.

    The latency is one call from an idle GPU until its last kernel ends (CUDA events around
    it); the device time is a burst of back-to-back calls divided by their count, so the host
    runs ahead of the GPU there. Their difference is the host time the single call exposes:
    mostly the time before its first kernel starts (the rest of its host work overlaps its
    kernels while the host stays ahead). A profiler would time this directly but adds its own
    cost to every op it records."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    latencies = []
    for _ in range(iters):
        torch.cuda.synchronize(device)
        start.record()
        forward()
        end.record()
        torch.cuda.synchronize(device)
        latencies.append(start.elapsed_time(end) * 1e3)
    start.record()
    for _ in range(iters):
        forward()
    end.record()
    torch.cuda.synchronize(device)
    latency, steady = statistics.median(latencies), start.elapsed_time(end) * 1e3 / iters
    return latency, steady, latency - steady


def profile(fn, iters: int, top: int) -> None:
    """cProfile of `iters` calls, each from an idle device (so no launch ever waits)."""
    prof = cProfile.Profile()
    spent = 0.0
    for _ in range(iters):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        prof.enable()
        fn()
        prof.disable()
        spent += time.perf_counter() - t0
    print(f"(profiled: {spent / iters * 1e6:.1f} us per call)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)


def primitive_calls(fn, iters: int = 50) -> float:
    """Python function calls (cProfile's primitive calls) per call of `fn`."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    return pstats.Stats(prof).prim_calls / iters


def plain_torch_forward(case):
    """The same forward as plain torch ops (offsets, two torch._grouped_mm, the scaled SwiGLU)."""
    x = case.x.detach().requires_grad_()
    w1 = case.w1.detach().requires_grad_()
    w2 = case.w2.detach().requires_grad_()
    probs = case.probs.detach().requires_grad_()

    def forward():
        offs = torch.cumsum(case.split_sizes, 0, dtype=torch.int32)
        gate, up = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up * probs[:, None]
        return torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)

    return forward


# (label, owner, attribute): the steps a forward call passes before its first GEMM is launched
def _timeline_steps():
    from te_seq.kernels import cute
    from te_seq.ops.fused import grouped_mlp
    from te_seq.run import fuser, sequential

    return [("Sequential.forward", sequential.Sequential, "forward"),
            ("Fuser.run_eager", fuser.Fuser, "run_eager"),
            ("call_signature", fuser.fast_path, "call_signature"),
            ("FastEntry.contexts", fuser.fast_path.FastEntry, "contexts"),
            ("Fuser._run", fuser.Fuser, "_run"),
            ("_Call", fuser, "_Call"),
            ("_FuserFunction.apply", fuser._FuserFunction, "apply"),
            ("autograd forward", fuser, "_run_forward"),
            ("_forward_step", fuser, "_forward_step"),
            ("_step_contexts", fuser, "_step_contexts"),
            ("GroupedMLP.fuser_forward", grouped_mlp.GroupedMLP, "fuser_forward"),
            ("GroupedLinear.operands (FC1's, then FC2's)", grouped_mlp.GroupedLinear,
             "operands"),
            ("GroupedLinear.offsets", grouped_mlp.GroupedLinear, "offsets"),
            ("fc1_rows (first call of a signature)", grouped_mlp.GroupedMLP, "fc1_rows"),
            ("offsets kernel", cute, "group_offsets"),
            ("offsets assert", torch, "_assert_async"),
            ("fc2_rows", grouped_mlp.GroupedMLP, "fc2_rows")]


@contextlib.contextmanager
def _wrapped(steps, wrap):
    """Each (label, owner, attribute) of `steps` replaced by ``wrap(label, original)`` inside
    the block; the originals back after (an inherited one by deleting the shadowing wrapper)."""
    restore = [(owner, name, owner.__dict__.get(name)) for _, owner, name in steps]
    for label, owner, name in steps:
        setattr(owner, name, wrap(label, getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, original in restore:
            if original is None:  # inherited: the wrapper shadowed it
                delattr(owner, name)
            else:
                setattr(owner, name, original)


@contextlib.contextmanager
def _stamped_steps(mlp, marks: list):
    """`_timeline_steps` and the grouped MLP's prepared offsets and FC1 launches wrapped so
    that each appends (label, ns) to `marks` on entry and return; the originals back after.
    An attribute write to each op makes the next call take the full path, which prepares the
    steady launches anew (wrapped)."""
    from te_seq.ops.fused import grouped_mlp

    def stamped(label, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            marks.append((label, time.perf_counter_ns()))
            out = fn(*args, **kwargs)
            marks.append((label + " returned", time.perf_counter_ns()))
            return out
        return run

    steady = grouped_mlp._Steady
    grouped_mlp._Steady = lambda offsets, fc1, fp8=None: steady(
        stamped("offsets (prepared)", offsets),
        None if fc1 is None else stamped("FC1 (prepared launch)", fc1), fp8)
    _new_signature(mlp)  # the next call prepares its launches again
    try:
        with _wrapped(_timeline_steps(), stamped):
            yield
    finally:
        grouped_mlp._Steady = steady


# (label, owner, attribute): the layers of a fused-MLP step, bf16 and FP8, whose inclusive host
# time `stage_times` reports (plain functions and methods: the cute functionals are objects)
def _stage_steps():
    from te_seq.core import fp8, fp8_gemm
    from te_seq.kernels import fp8_cute, fp8_quantize
    from te_seq.ops.basic.grouped_linear import GroupedLinear
    from te_seq.ops.fused import _grouped_mlp_fp8 as mlp_fp8
    from te_seq.ops.fused.grouped_mlp import GroupedMLP
    from te_seq.run import fuser, sequential

    return [("Tensor.backward", torch.Tensor, "backward"),
            ("Sequential.forward", sequential.Sequential, "forward"),
            ("call_signature", fuser.fast_path, "call_signature"),
            ("fuser._run_backward", fuser, "_run_backward"),
            ("GroupedMLP.fuser_forward", GroupedMLP, "fuser_forward"),
            ("GroupedMLP.fuser_backward", GroupedMLP, "fuser_backward"),
            ("GroupedLinear.offsets", GroupedLinear, "offsets"),
            ("GroupedLinear.saved_record", GroupedLinear, "saved_record"),
            ("GroupedLinear.weight_grads", GroupedLinear, "weight_grads"),
            ("FP8 forward (_grouped_mlp_fp8)", mlp_fp8, "forward"),
            ("FP8 backward (_grouped_mlp_fp8)", mlp_fp8, "backward"),
            ("fp8_gemm.grouped_forward", fp8_gemm, "grouped_forward"),
            ("GroupedGrads() (dY quantized)", fp8_gemm.GroupedGrads, "__init__"),
            ("GroupedGrads.dgrad", fp8_gemm.GroupedGrads, "dgrad"),
            ("fp8.cached_weights", fp8, "cached_weights"),
            ("fp8_quantize.rows", fp8_quantize, "rows"),
            ("fp8_cute.glu_fc1", fp8_cute, "glu_fc1"),
            ("fp8_cute.glu_dgrad", fp8_cute, "glu_dgrad"),
            ("fp8_cute.scaled_grouped_mm", fp8_cute, "scaled_grouped_mm"),
            ("prepared FP8 GEMM launch", fp8_cute._RowwiseLaunch, "__call__"),
            ("torch.empty", torch, "empty"),
            ("torch._assert_async", torch, "_assert_async")]


def stage_times(fn, device, iters: int) -> dict[str, tuple[float, float]]:
    """{label: (inclusive µs per call of `fn`, entries per call)} for each `_stage_steps`
    layer that `iters` calls of `fn`, each from an idle device, entered (after 3 warm-up
    calls). A stage inside another counts in both; each timer adds ~1 µs to its callers. What
    cProfile cannot give on the GPU host: its own cost per Python call inflates every layer
    2-3x there (the run "s" data, benchmarks/README.md)."""
    totals: dict[str, int] = {}
    counts: dict[str, int] = {}

    def timed(label, fn_):
        @functools.wraps(fn_)
        def run(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return fn_(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0) + time.perf_counter_ns() - t0
                counts[label] = counts.get(label, 0) + 1
        return run

    with _wrapped(_stage_steps(), timed):
        for _ in range(3):
            fn()
        totals.clear()
        counts.clear()
        for _ in range(iters):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            fn()
    return {label: (totals[label] / iters / 1e3, counts[label] / iters) for label in totals}


def print_stages(title: str, fn, device, iters: int) -> None:
    """`stage_times` of `fn`, slowest first, under `title` (with fn's unwrapped host time)."""
    host = time_host(fn, iters, device) * 1e3
    print(f"{title}: host {host:.1f} us per call unwrapped; inclusive us per call (entries):")
    for label, (us, entries) in sorted(stage_times(fn, device, iters).items(),
                                       key=lambda kv: -kv[1][0]):
        print(f"  {label:34s} {us:8.1f} us  x{entries:g}")


def timeline(mlp, forward, device, iters: int) -> None:
    """Median µs after the call starts at which a forward call enters and leaves each step of
    `_timeline_steps` (steps it does not take are left out)."""
    marks: list[tuple[str, int]] = []
    runs: dict[str, list[float]] = {}
    with _stamped_steps(mlp, marks):
        for _ in range(3):  # the first call of the signature prepares the steady launches
            forward()
        for _ in range(iters):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            marks.clear()
            t0 = time.perf_counter_ns()
            forward()
            marks.append(("call returned", time.perf_counter_ns()))
            for label, t in marks:
                runs.setdefault(label, []).append((t - t0) / 1e3)
    for label, times in sorted(runs.items(), key=lambda kv: statistics.median(kv[1])):
        print(f"{statistics.median(times):8.1f} us  {label}")


@contextlib.contextmanager
def unprepared_fp8_launches(mlp):
    """Inside the block the fused MLP prepares no FP8 GEMM launch (each call goes through the
    FP8 functionals); `mlp`'s next call, inside and after, is a signature's first again."""
    from te_seq.ops.fused import _grouped_mlp_fp8

    for_call = _grouped_mlp_fp8.Launches.__dict__["for_call"]
    _grouped_mlp_fp8.Launches.for_call = staticmethod(lambda ctx: None)
    _new_signature(mlp)
    try:
        yield
    finally:
        _grouped_mlp_fp8.Launches.for_call = for_call
        _new_signature(mlp)


def _new_signature(mlp) -> None:
    for op in mlp.basic_ops():
        op.training = op.training  # a new op state: the next call takes the full path


def _burst_us(fn, device, calls: int = 20) -> tuple[float, float]:
    """(host µs per call while queueing `calls` back-to-back calls, wall µs per call)."""
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    queued = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize(device)
    return queued, (time.perf_counter() - t0) / calls * 1e6


def prepared_ab(mlp, forward, step, device, rounds: int = 6, iters: int = 50) -> None:
    """Print `--prepared-ab`'s table: prepared FP8 launches against none, interleaved."""
    found: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for mode in ("prepared", "unprepared"):
            context = unprepared_fp8_launches(mlp) if mode == "unprepared" \
                else contextlib.nullcontext()
            with context:
                for _ in range(3):  # the signature's first call prepares (or not)
                    step()
                times = found.setdefault(mode, {})
                times.setdefault("forward", []).append(time_host(forward, iters, device) * 1e3)
                times.setdefault("step", []).append(time_host(step, iters, device) * 1e3)
                queued, wall = _burst_us(step, device)
                times.setdefault("burst host", []).append(queued)
                times.setdefault("burst wall", []).append(wall)
    for mode, times in found.items():
        print(f"{mode:10s} " + "  ".join(
            f"{name} {statistics.median(v):.1f} ({min(v):.1f})" for name, v in times.items()))


def main_cpu(args) -> None:
    """The CPU proxy of the host time (module docstring)."""
    torch.set_num_threads(1)  # one thread: steady kernel times on a shared machine
    device = torch.device("cpu")
    case = make_case(args.shape, device, torch.float32)
    mlp, forward = build(case, args.backend)

    def forward_backward():
        forward().sum().backward()

    for _ in range(20):
        forward_backward()
    print(mlp.fusion_plan())
    best = {}
    for _ in range(5):  # the best of 5 medians: the least disturbed by other processes
        for name, fn in (("forward", forward), ("forward+backward", forward_backward)):
            best[name] = min(best.get(name, 1e9), time_host(fn, args.iters, device) * 1e3)
        with torch.no_grad():
            best["forward (no_grad)"] = min(best.get("forward (no_grad)", 1e9),
                                            time_host(forward, args.iters, device) * 1e3)
        plain = plain_torch_forward(case)
        best["plain torch forward"] = min(best.get("plain torch forward", 1e9),
                                          time_host(plain, args.iters, device) * 1e3)
    for name, us in best.items():
        print(f"{name:24s} {us:8.1f} us")
    print(f"calls per forward: {primitive_calls(forward):.0f}, "
          f"per forward+backward: {primitive_calls(forward_backward):.0f}")
    profile(forward, args.iters, args.top)


def fresh_step(forward, leaves):
    """A forward+backward step with fresh grads (the benchmark's default grad mode): the
    `leaves`' .grad dropped first, then forward().backward(dy) with one fixed random dy."""
    dy = torch.randn_like(forward())

    def step():
        for t in leaves:
            t.grad = None
        forward().backward(dy)

    return step


def _under_recipe(forward, recipe):
    def fp8_forward():
        with te_seq.autocast(recipe=recipe):
            return forward()

    return fp8_forward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--shape", default=None, help='default "Q" on cuda, "U" on cpu')
    p.add_argument("--backend", default=None, help='default "cute" on cuda, "torch" on cpu')
    p.add_argument("--iters", type=int, default=None, help="default 200 on cuda, 2000 on cpu")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) too")
    p.add_argument("--step", action="store_true", help="forward+backward too (cuda)")
    p.add_argument("--fp8", default="", help="a te_seq.recipe class name, e.g. "
                   "Float8RowwiseScaling: the forward under te_seq.autocast (cuda)")
    p.add_argument("--timeline", action="store_true",
                   help="when the forward reaches each step before its first GEMM (see above)")
    p.add_argument("--hp-wgrad", action="store_true",
                   help="with --fp8: the recipe with fp8_wgrad=False")
    p.add_argument("--prepared-ab", action="store_true",
                   help="with --fp8: prepared FP8 launches against none, one process (cuda)")
    p.add_argument("--stages", action="store_true",
                   help="inclusive host time of each layer of the forward (with --step: and "
                        "of the step) instead (see above)")
    args = p.parse_args()
    cpu = args.device == "cpu"
    args.shape = args.shape or ("U" if cpu else "Q")
    args.backend = args.backend or ("torch" if cpu else "cute")
    args.iters = args.iters or (2000 if cpu else 200)
    if cpu and args.timeline:
        case = make_case(args.shape, torch.device("cpu"), torch.float32)
        timeline(*build(case, args.backend), case.x.device, args.iters)
        return
    if cpu and args.stages:
        case = make_case(args.shape, torch.device("cpu"), torch.float32)
        mlp, forward = build(case, args.backend)
        print_stages("forward+backward", fresh_step(forward, [*mlp.parameters(),
                                                              *forward.inputs]),
                     case.x.device, args.iters)
        return
    if cpu:
        main_cpu(args)
        return
    main_cuda(args)


def main_cuda(args) -> None:
    """Host time, exposed host time and cProfile of the forward (and step) on the GPU."""
    device = torch.device("cuda")
    case = make_case(args.shape, device, torch.bfloat16)
    mlp, forward = build(case, args.backend)
    leaves = [*mlp.parameters(), *forward.inputs]
    if args.fp8:
        options = {"fp8_wgrad": False} if args.hp_wgrad else {}
        forward = _under_recipe(forward, getattr(te_seq.recipe, args.fp8)(**options))
    for _ in range(5):
        forward()
    if args.prepared_ab:
        print(f"{torch.cuda.get_device_name(device)}, shape {args.shape}, {args.fp8}"
              f"{' (fp8_wgrad=False)' if args.hp_wgrad else ''}: µs, median (best) of rounds")
        prepared_ab(mlp, forward, fresh_step(forward, leaves), device)
        return
    if args.stages:
        print_stages("eager forward", forward, device, args.iters)
        if args.step:
            print_stages("eager forward+backward", fresh_step(forward, leaves), device,
                         args.iters)
        return
    if args.timeline:  # the unwrapped host time around it: what the wrappers add
        for _ in range(2):
            print(f"host time {time_host(forward, args.iters, device) * 1e3:.1f} us")
            timeline(mlp, forward, device, args.iters)
        print(f"host time {time_host(forward, args.iters, device) * 1e3:.1f} us")
        return
    print(mlp.fusion_plan())
    print(f"eager forward host time: {time_host(forward, args.iters, device) * 1e3:.1f} us")
    latency, steady, exposed = exposed_host_us(forward, device)
    print(f"eager forward: latency {latency:.1f} us from an idle GPU, {steady:.1f} us per call "
          f"back to back, exposed host time {exposed:.1f} us")
    with torch.no_grad():
        host = time_host(forward, args.iters, device) * 1e3
    print(f"eager forward (no_grad) host time: {host:.1f} us")
    profile(forward, args.iters, args.top)
    if args.step:
        step = fresh_step(forward, leaves)
        host = time_host(step, args.iters, device) * 1e3
        print(f"eager forward+backward host time: {host:.1f} us")
        profile(step, args.iters, args.top)
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
