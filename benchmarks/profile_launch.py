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
from te_seq.kernels.cute import act, compile, fp8, fp8_glu, gemm, glu, launch

try:
    from te_seq.kernels.cute.launch_plan import clear_plans
except ImportError:  # a te_seq from before launch plans (to measure the "before")
    def clear_plans() -> None:
        pass

_SMS = 132  # an H100 SXM's SM count (the grid is capped by it)


@dataclass
class StubKernel:
    """A compiled kernel's stand-in: ``fn(*args)`` records the arguments of every launch."""

    config: object
    calls: list[tuple] = field(default_factory=list)
    record: bool = True

    def fn(self, *args) -> None:
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


def time_call(fn: Callable[[], object], iters: int) -> float:
    """Median µs per call over 5 rounds of ``iters`` calls (after one warm-up call)."""
    fn()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        rounds.append((time.perf_counter() - start) / iters * 1e6)
    return sorted(rounds)[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--top", type=int, default=0, help="cProfile rows per functional (0: none)")
    p.add_argument("--only", default="", help="time only functionals whose name contains this")
    args = p.parse_args()
    torch.set_num_threads(1)
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
