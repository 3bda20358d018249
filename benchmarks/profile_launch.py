"""Host time of the CuTe DSL functionals' Python path, on the CPU, the kernels replaced by stubs.

Each functional (``te_seq.kernels.cute.grouped_mm``, ``glu_fc1_forward``, ...) checks its
operands, builds its kernel config, looks the compiled kernel up, sizes the persistent grid and
calls the kernel through TVM-FFI. Here everything up to that call runs as on the GPU, on CPU
tensors: ``stubbed_kernels()`` swaps the compile entries for ones that return a `StubKernel`
(which only records its arguments; the configs are still hashed by the same ``lru_cache``), and
makes the device checks pass (``Tensor.is_cuda``, ``available``, the SM count, the FP8
functionals' ``_device_problem``, which is therefore not timed). Nothing in
te_seq is changed; the patches live only inside the context manager.

What this does not see: the CUDA caching allocator behind ``torch.empty`` (a few µs per tensor
on the GPU, a CPU malloc here), and the TVM-FFI call itself. Rows default to 256 so that CPU
allocations stay small; H, F and E are shape Q's (H=2048, F=768, E=128).

  python benchmarks/profile_launch.py [--iters 2000] [--rows 256] [--top 15] [--only glu_fc1]

``--mlp`` times the whole fused MLP step instead (``stubbed_step``: forward + backward of
``Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)``, single grouped weights, device-style
split sizes, the cute backend) in bf16 or under an FP8 recipe, every kernel stubbed (the
quantization and offsets kernels too): µs per step, cProfile's primitive calls per step, the
aten ops one step dispatches (allocating ones and views among them) and its kernel launches
(`count_step`: what predicts the step's host time on the GPU, each allocation and aten launch
~3-10 µs there, each CuTe DSL launch ~7.6 µs through TVM-FFI plus its functional's Python:
benchmarks/launch_cost.py), and the top cumulative entries:

  python benchmarks/profile_launch.py --mlp [--fp8 ROWWISE|BLOCK|CURRENT] [--hp-wgrad]
      [--iters 300] [--top 25]

``--hp-wgrad`` builds the recipes with ``fp8_wgrad=False`` (forward and dgrad GEMMs in FP8,
the wgrads in bf16 on unquantized operands).

``--mlp --first-kernel`` times the bf16 forward alone (grad enabled, then no_grad): the host
time from the call's entry to the moment the FC1 GLU kernel's stub is called (what a single
call exposes on an idle GPU before its first heavy kernel; the offsets kernel before it is
tiny), the whole forward's, the aten ops dispatched before FC1 (on the GPU each costs host
time: a new tensor or a launch most) and cProfile's view of just that part (µs per call):

  python benchmarks/profile_launch.py --mlp --first-kernel [--iters 2000] [--top 40]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import pstats
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from te_seq.kernels import cute
from te_seq.kernels.cute import act, compile, fp8, fp8_glu, gemm, glu, launch, unit_order_kernel

try:
    from te_seq.kernels.cute.launch_plan import clear_plans
except ImportError:  # a te_seq from before launch plans (to measure the "before")
    def clear_plans() -> None:
        pass

_SMS = 132  # an H100 SXM's SM count (the grid is capped by it)
UNIT_ORDER = "unit_order"  # the stub config of ``unit_order_kernel.compile_unit_order``


@dataclass
class StubKernel:
    """A compiled kernel's stand-in: ``fn(*args)`` records the arguments of every launch."""

    config: object
    calls: list[tuple] = field(default_factory=list)
    record: bool = True
    last_ns: int = 0  # time.perf_counter_ns() at the last launch
    on_launch: Callable[[], object] | None = None  # called at each launch (--first-kernel)
    launches: int = 0  # calls of fn so far (--mlp counts them per step)

    def fn(self, *args) -> None:
        self.last_ns = time.perf_counter_ns()
        self.launches += 1
        if self.on_launch is not None:
            self.on_launch()
        if self.record:
            self.calls.append(args)


_SMS_USERS = (gemm, glu, act, fp8)  # modules that imported ``_num_sms`` by name
_AVAILABLE_USERS = (launch, glu, act, fp8_glu)  # modules that imported ``available`` by name


@contextlib.contextmanager
def stubbed_kernels(record: bool = True) -> Iterator[dict[object, StubKernel]]:
    """Run the cute functionals on CPU tensors: compile entries return `StubKernel`s (cached
    per config as the real ones are; the dict yielded maps config -> stub), CPU tensors pass
    the CUDA checks, the backend reports itself available and the device has ``_SMS`` SMs."""
    stubs: dict[object, StubKernel] = {}

    def make(cfg):
        stubs[cfg] = StubKernel(cfg, record=record)
        return stubs[cfg]

    patches = {(compile, name): functools.lru_cache(maxsize=None)(make)
               for name in ("compile_gemm", "compile_glu", "compile_act")}
    # the dynamic wgrads' order-and-counter kernel (one launch before each such wgrad)
    patches[(unit_order_kernel, "compile_unit_order")] = functools.lru_cache(maxsize=None)(
        lambda: make(UNIT_ORDER))
    patches.update({(m, "_num_sms"): functools.lru_cache(maxsize=None)(lambda d: _SMS)
                    for m in _SMS_USERS})
    patches.update({(m, "available"): lambda: (True, "") for m in _AVAILABLE_USERS})
    # the FP8 device check asks for "cuda" tensors and the device's capability: not timed
    patches.update({(m, "_device_problem"): lambda tensors: "" for m in (fp8, fp8_glu)})
    saved = {key: getattr(*key) for key in patches}
    is_cuda = torch.Tensor.__dict__.get("is_cuda")
    clear_plans()  # plans made before hold real kernels; after, stubs
    try:
        for (module, name), value in patches.items():
            setattr(module, name, value)
        torch.Tensor.is_cuda = property(lambda self: True)
        yield stubs
    finally:
        clear_plans()
        for (module, name), value in saved.items():
            setattr(module, name, value)
        if is_cuda is None:
            del torch.Tensor.is_cuda
        else:
            torch.Tensor.is_cuda = is_cuda


def _rand(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _offs(rows: int, groups: int) -> torch.Tensor:
    """Cumulative row ends of ``rows`` rows split evenly (the values are never read)."""
    return torch.linspace(rows / groups, rows, groups).round().to(torch.int32)


def cases(rows: int, e: int = 128, h: int = 2048, f: int = 768) -> dict[str, Callable[[], object]]:
    """One call per functional on shape Q's widths (M = ``rows``), as the grouped MLP makes
    them: weights transposed views (the fused op's ``W.transpose(1, 2)``), SwiGLU, probs."""
    x, dy, offs = _rand(rows, h), _rand(rows, h), _offs(rows, e)
    w1 = torch.empty(e, 2 * f, h, dtype=torch.bfloat16)  # never read: no data needed
    w2 = torch.empty(e, h, f, dtype=torch.bfloat16)
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)  # [E, H, 2F], [E, F, H]
    a, hh, probs = _rand(rows, f), _rand(rows, 2 * f), torch.rand(rows)
    fp8x, fp8w = x.to(torch.float8_e4m3fn), torch.empty(e, 2 * f, h, dtype=torch.float8_e4m3fn)
    xs, ws = torch.rand(rows), torch.rand(e, 2 * f)
    return {
        "grouped_mm (fc2 fwd)": lambda: cute.grouped_mm(a, w2t, offs),
        "grouped_mm (fc1 dgrad)": lambda: cute.grouped_mm(hh, w1, offs),
        "grouped_wgrad": lambda: cute.grouped_wgrad(dy, a, offs),
        "glu_fc1_forward": lambda: cute.glu_fc1_forward(x, w1t, offs, "silu", None, probs),
        "glu_fc2_dgrad": lambda: cute.glu_fc2_dgrad(dy, w2, offs, hh, "silu", None, probs),
        "act_fc1_forward (relu)": lambda: cute.act_fc1_forward(x, w2, offs, "relu", probs),
        "scaled_grouped_mm": lambda: cute.scaled_grouped_mm(fp8x, fp8w, xs, ws, offs),
        "scaled_glu_fc1_forward": lambda: cute.scaled_glu_fc1_forward(
            fp8x, fp8w, xs, ws, offs, "silu", None, probs),
    }


def _rounds(fn: Callable[[], object], iters: int, count: int) -> list[float]:
    """µs per call of each of `count` rounds of ``iters`` calls (after one warm-up call)."""
    fn()
    rounds = []
    for _ in range(count):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        rounds.append((time.perf_counter() - start) / iters * 1e6)
    return rounds


def time_call(fn: Callable[[], object], iters: int) -> float:
    """Median µs per call over 5 rounds of ``iters`` calls (after one warm-up call)."""
    return sorted(_rounds(fn, iters, 5))[2]


# --- the whole fused MLP step --------------------------------------------------------------

RECIPES = {"ROWWISE": "Float8RowwiseScaling", "BLOCK": "Float8BlockScaling",
           "CURRENT": "Float8CurrentScaling"}


class _OffsetsStub(StubKernel):
    """The offsets kernel's stand-in writes what the kernel would (offs = cumsum(splits),
    ok = 1): the device-side assert after it reads ``ok``."""

    def fn(self, splits, offs, ok, rows) -> None:
        super().fn(splits, offs, ok, rows)
        _IN_STUB[0] += 1  # the kernel's own work: not host aten ops of the step (count_step)
        try:
            torch.cumsum(splits, 0, out=offs)
            ok.fill_(1)
        finally:
            _IN_STUB[0] -= 1


_IN_STUB = [0]  # > 0 while a stub writes a kernel's outputs (its aten ops are not counted)


@contextlib.contextmanager
def stubbed_step(record: bool = False) -> Iterator[dict[object, StubKernel]]:
    """`stubbed_kernels` and what a whole step on the cute backend needs beyond it on CPU
    tensors: the quantization and offsets kernels stubbed, the backend registry told the cute
    backend is available, an sm_90 capability, the FP8 kernel checks judged for a CUDA device,
    the split sizes taken as device ones (no host read of their values, one offsets launch),
    the elementwise maths uncompiled (the FP8 step with GLU epilogues runs none)."""
    from te_seq import config
    from te_seq.core import fp8_gemm
    from te_seq.kernels import backend as registry
    from te_seq.kernels import fp8_cute, fp8_torch
    from te_seq.kernels.cute import (
        block_fp8,
        block_fp8_wgrad,
        compile_quant,
        offsets,
        offsets_kernel,
        quant,
    )
    from te_seq.ops.basic import _split_sizes, grouped_linear

    with stubbed_kernels(record) as stubs:
        def make(cfg, kind=StubKernel):
            stubs[cfg] = kind(cfg, record=record)
            return stubs[cfg]

        forward_reason = fp8_cute.forward_reason
        cuda = torch.device("cuda", 0)
        patches = {
            (compile_quant, "compile_quant"): functools.lru_cache(maxsize=None)(make),
            (offsets_kernel, "compile_offsets"): functools.lru_cache(maxsize=None)(
                lambda dtype: make(("offsets", dtype), _OffsetsStub)),
            (cute, "available"): lambda: (True, ""),
            (cute, "offsets_problem"): lambda splits: "",
            (fp8_torch, "cuda_capability"): lambda device: (9, 0),
            (fp8_cute, "forward_reason"): lambda blocks, dtypes, gemm_dtype, device, dims:
                forward_reason(blocks, dtypes, gemm_dtype, cuda, dims),
            (_split_sizes, "check_host_split_values"): lambda name, splits, rows: None,
            (grouped_linear, "check_host_split_values"): lambda name, splits, rows: None,
        }
        # modules that imported the device checks by name (stubbed_kernels patches the rest)
        patches.update({(m, "_device_problem"): lambda tensors: ""
                        for m in (quant, block_fp8, block_fp8_wgrad)})
        patches.update({(m, "available"): lambda: (True, "") for m in (quant, offsets)})
        patches[(block_fp8_wgrad, "_num_sms")] = lambda index: _SMS
        saved = {key: getattr(*key) for key in patches}
        availability = dict(registry._availability)
        compile_elementwise = config.compile_elementwise()
        try:
            for (module, name), value in patches.items():
                setattr(module, name, value)
            registry._availability["cute"] = (True, "")
            config.set_compile_elementwise(False)
            fp8_gemm.clear_decisions()
            yield stubs
        finally:
            fp8_gemm.clear_decisions()
            config.set_compile_elementwise(compile_elementwise)
            registry._availability.clear()
            registry._availability.update(availability)
            for (module, name), value in saved.items():
                setattr(module, name, value)


def mlp_forward(rows: int, recipe_name: str | None = None, e: int = 128, h: int = 2048,
                f: int = 768, fp8_wgrad: bool = True, per_group: bool = False,
                ) -> Callable[[], torch.Tensor]:
    """The forward of `mlp_step`'s step (the Sequential of profile_host.py: single grouped
    weights, or ``per_group`` one weight per expert, device-style split sizes, probs), inputs
    that require grad, the cute backend; ``fp8_wgrad=False`` builds the recipe with its
    high-precision wgrads."""
    import te_seq
    from te_seq import ops, recipe

    kw = {"dtype": torch.bfloat16, "single_grouped_weight": not per_group}
    mlp = te_seq.Sequential(ops.GroupedLinear(e, h, 2 * f, bias=False, **kw), ops.ScaledSwiGLU(),
                            ops.GroupedLinear(e, f, h, bias=False, **kw))
    x = _rand(rows, h).requires_grad_()
    probs = torch.rand(rows).requires_grad_()
    splits = torch.full((e,), rows // e, dtype=torch.int64)
    splits[0] += rows - int(splits.sum())
    fp8 = te_seq.autocast(recipe=getattr(recipe, recipe_name)(fp8_wgrad=fp8_wgrad)) \
        if recipe_name else contextlib.nullcontext()

    def forward() -> torch.Tensor:
        with te_seq.backend("cute"), fp8:
            return mlp(x, splits, probs, splits)

    forward.parts = (mlp, x, probs)  # for the step's backward and its grads
    return forward


def mlp_step(rows: int, recipe_name: str | None, e: int = 128, h: int = 2048, f: int = 768,
             fp8_wgrad: bool = True, per_group: bool = False) -> Callable[[], None]:
    """One fwd+bwd step of the fused grouped MLP on shape Q's widths, ``rows`` tokens, bf16
    on CPU (call it inside `stubbed_step`): the benchmark's ScaledSwiGLU with probs, fresh
    grads (the weights' ``.grad`` dropped after each step: their two [E, N, K] CPU mallocs
    cost ~0.1 ms a step, bf16 and FP8 alike; accumulating instead would add them up on the
    CPU), under ``recipe_name`` (a ``te_seq.recipe`` class name, with ``fp8_wgrad``) or in
    bf16 (None); ``per_group``: one weight parameter per expert."""
    forward = mlp_forward(rows, recipe_name, e, h, f, fp8_wgrad, per_group)
    mlp, x, probs = forward.parts
    dy = _rand(rows, h)

    def step() -> None:
        y = forward()
        y.backward(dy)
        for p in mlp.parameters():
            p.grad = None
        x.grad = probs.grad = None

    return step


def time_best(fn: Callable[[], object], iters: int) -> float:
    """Best µs per call of 7 rounds of ``iters`` calls: the least disturbed by other processes
    (a step's CPU mallocs make the median noisy on a shared machine)."""
    return min(_rounds(fn, iters, 7))


def profile_step(step: Callable[[], None], iters: int) -> tuple[float, pstats.Stats]:
    """(primitive Python calls per step, the cProfile statistics of ``iters`` steps)."""
    prof = cProfile.Profile()
    prof.runcall(lambda: [step() for _ in range(iters)])
    stats = pstats.Stats(prof)
    return stats.prim_calls / iters, stats


# aten ops that make a new tensor from nothing (those that also fill it launch a kernel too)
ALLOCATING = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros",
    "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full",
    "scalar_tensor"})


@dataclass
class StepCounts:
    """What one step dispatches on the host, the predictors of its GPU host time: aten ops
    (views, allocations and the rest, which on the GPU launch a kernel or copy), stubbed
    kernel launches (CuTe DSL: ~7.6 µs each through TVM-FFI on an H100 host, plus the
    functional's Python), and aten ops by name."""

    aten: int
    allocations: int
    views: int
    launches: int
    by_name: dict[str, int]

    def line(self) -> str:
        other = self.aten - self.allocations - self.views
        return (f"{self.aten} aten ops/step ({self.allocations} allocating, {self.views} views, "
                f"{other} other), {self.launches} kernel launches/step")


def count_step(step: Callable[[], None], stubs: dict[object, StubKernel]) -> StepCounts:
    """`StepCounts` of one call of ``step`` (inside `stubbed_step`): a TorchDispatchMode sees
    every aten op the step dispatches (the backward's too: CPU autograd runs on this thread),
    except those a stub runs to write its kernel's outputs. Not used while timing."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    names: Counter[str] = Counter()
    views = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not _IN_STUB[0]:
                names[func.overloadpacket.__name__] += 1
                views[0] += func.is_view
            return func(*args, **(kwargs or {}))

    before = sum(s.launches for s in stubs.values())
    with Count():
        step()
    launches = sum(s.launches for s in stubs.values()) - before
    allocations = sum(n for name, n in names.items() if name in ALLOCATING)
    return StepCounts(sum(names.values()), allocations, views[0], launches, dict(names))


def main_mlp(args) -> None:
    """``--mlp``: the whole step, bf16 and under the recipes ``--fp8`` names. bf16, the
    row-wise and the block recipe are timed (the block recipe's activation runs as torch ops
    after its GEMMs, computing on the CPU here: part of its µs is that maths); per-tensor
    scaling quantizes with torch ops (seconds a step on the CPU), so only its Python calls and
    dispatches are counted."""
    names = [None] + [RECIPES[n] for n in args.fp8.split(",") if n]
    with stubbed_step() as stubs:
        for name in names:
            step = mlp_step(args.rows, name, fp8_wgrad=not (name and args.hp_wgrad),
                            per_group=args.per_group)
            step()
            launches = len(stubs)
            timed = name in (None, RECIPES["ROWWISE"], RECIPES["BLOCK"])
            us = f"{time_best(step, args.iters):8.1f} µs/step" if timed else "(not timed)".rjust(16)
            calls, stats = profile_step(step, max(args.iters // 10, 1) if timed else 2)
            counts = count_step(step, stubs)
            label = f"{name}(fp8_wgrad=False)" if name and args.hp_wgrad else name or "bf16"
            label += ", per group" if args.per_group else ""
            print(f"{label:22s} {us}  {calls:6.0f} calls/step  "
                  f"({launches} kernel configs so far)")
            print(f"{'':22s} {counts.line()}")
            if args.top:
                ranked = sorted(counts.by_name.items(), key=lambda kv: (-kv[1], kv[0]))
                print("aten ops/step: " + ", ".join(f"{n} {k}" for k, n in ranked))
                stats.sort_stats("cumulative").print_stats(args.top)


# --- time to the first heavy kernel (the FC1 GLU GEMM) of the forward -----------------------

def fc1_stub(stubs: dict[object, StubKernel], store_h: bool = True) -> StubKernel:
    """The stub of the forward's FC1 GLU kernel (a `GluConfig` of mode "fc1"): the h-writing
    one (a forward with backward) or, ``store_h=False``, the h-less one (without backward)."""
    from te_seq.kernels.cute.compile import GluConfig

    found = [s for c, s in stubs.items()
             if isinstance(c, GluConfig) and c.mode == "fc1" and c.store_h == store_h]
    if len(found) != 1:
        raise RuntimeError(f"expected one FC1 GLU kernel config with store_h={store_h}, "
                           f"found {len(found)}")
    return found[0]


def time_to_fc1(forward: Callable[[], object], fc1: StubKernel, iters: int
                ) -> tuple[float, float]:
    """(µs from the call's entry to the FC1 launch, µs of the whole forward): the best of
    ``iters`` calls each (the least disturbed ones; the two bests may come from two calls)."""
    to_fc1, whole = [], []
    for _ in range(iters):
        start = time.perf_counter_ns()
        y = forward()
        end = time.perf_counter_ns()
        del y  # freed outside the timed span, as the step would free it after backward
        to_fc1.append(fc1.last_ns - start)
        whole.append(end - start)
    return min(to_fc1) / 1e3, min(whole) / 1e3


def profile_to_fc1(forward: Callable[[], object], fc1: StubKernel, iters: int) -> pstats.Stats:
    """cProfile of the forward from its entry until the FC1 launch only (the stub stops it)."""
    prof = cProfile.Profile()
    fc1.on_launch = prof.disable
    try:
        for _ in range(iters):
            prof.enable()
            forward()
            prof.disable()  # a no-op: the FC1 launch disabled it
    finally:
        fc1.on_launch = None
    return pstats.Stats(prof)


def aten_ops_to_fc1(forward: Callable[[], object], fc1: StubKernel) -> list[str]:
    """The aten ops one forward dispatches before its FC1 launch, in order (on the GPU each
    costs host time, a new tensor or a kernel launch most)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []
            self.at_fc1: int | None = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    with Log() as log:
        fc1.on_launch = lambda: setattr(log, "at_fc1", log.at_fc1 or len(log.ops))
        try:
            forward()
        finally:
            fc1.on_launch = None
    return log.ops[: log.at_fc1]


def print_per_call(stats: pstats.Stats, calls: int, top: int) -> None:
    """cProfile's top ``top`` entries by cumulative time, in µs and calls per forward."""
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:top]
    print(f"{'calls':>6s} {'own µs':>7s} {'cum µs':>7s}  function")
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in rows:
        where = f"{path.rsplit('/te_seq/', 1)[-1].rsplit('/', 1)[-1]}:{line}" if line else ""
        print(f"{ncalls / calls:6.1f} {tottime / calls * 1e6:7.2f} {cumtime / calls * 1e6:7.2f}"
              f"  {where}({name})")


def main_first_kernel(args) -> None:
    """``--mlp --first-kernel``: the bf16 forward's host time to its FC1 GLU launch, grad
    enabled and under no_grad, the whole forward's, and cProfile's view of the part before."""
    with stubbed_step() as stubs:
        forward = mlp_forward(args.rows)
        step = mlp_step(args.rows, None)
        step()
        for label, grad in (("forward", True), ("forward, no_grad", False)):
            with torch.set_grad_enabled(grad):
                forward()
                fc1 = fc1_stub(stubs, store_h=grad)  # without backward FC1 writes no h
                to_fc1, whole = time_to_fc1(forward, fc1, args.iters)
                stats = profile_to_fc1(forward, fc1, max(args.iters // 10, 1))
                aten = aten_ops_to_fc1(forward, fc1)
            profiled = max(args.iters // 10, 1)
            print(f"{label:18s} to FC1 launch {to_fc1:7.1f} µs  whole {whole:7.1f} µs  "
                  f"{stats.prim_calls / profiled:5.0f} Python calls, {len(aten)} aten ops "
                  f"before FC1: {' '.join(aten)}")
            if args.top:
                print_per_call(stats, profiled, args.top)
        print(f"{'fwd+bwd':18s} {time_best(step, max(args.iters // 10, 1)):7.1f} µs/step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=None, help="default 2000 (--mlp: 300)")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--top", type=int, default=0, help="cProfile rows per functional (0: none)")
    p.add_argument("--only", default="", help="time only functionals whose name contains this")
    p.add_argument("--mlp", action="store_true", help="the whole fused MLP step (fwd+bwd)")
    p.add_argument("--first-kernel", action="store_true", help="with --mlp: the bf16 "
                   "forward's host time to its FC1 GLU launch (grad and no_grad)")
    p.add_argument("--fp8", default="ROWWISE", help=f"with --mlp: recipes after bf16, "
                   f"comma-separated, of {sorted(RECIPES)} ('' for bf16 only)")
    p.add_argument("--per-group", action="store_true", help="with --mlp: one weight "
                   "parameter per expert (single_grouped_weight=False, GroupedLinear's default)")
    p.add_argument("--hp-wgrad", action="store_true", help="with --mlp: the --fp8 recipes "
                   "with fp8_wgrad=False (high-precision wgrads)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.mlp and args.first_kernel:
        args.iters = args.iters or 2000
        main_first_kernel(args)
        return
    if args.mlp:
        args.iters = args.iters or 300
        main_mlp(args)
        return
    args.iters = args.iters or 2000
    with stubbed_kernels(record=False):
        for name, fn in cases(args.rows).items():
            if args.only not in name:
                continue
            print(f"{name:26s} {time_call(fn, args.iters):7.1f} µs/call")
            if args.top:
                prof = cProfile.Profile()
                prof.runcall(lambda fn=fn: [fn() for _ in range(args.iters)])
                pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
