"""Host cost of one kernel launch on the GPU: a CuTe DSL kernel through TVM-FFI against aten.

Each entry is the host time of one call, kernels not waited for: ``--calls`` calls back to back
(fewer than the launch queue holds, so the host never waits on the GPU), timed with
``perf_counter_ns``, median over ``--reps`` repetitions with a sync between them. Problems are
tiny (one 128-row group) so the GPU drains the queue between repetitions.

What it separates:
- aten: ``torch.empty``, a small ``add_`` launch, ``torch.cuda.current_stream()``;
- the compiled grouped GEMM called directly with the arguments ``grouped_mm`` passes it
  (torch tensors converted by TVM-FFI per call), and with the tensors converted once beforehand
  (``tvm_ffi.from_dlpack``): their difference is the conversion of the tensor arguments;
- the functionals (``grouped_mm``, ``group_offsets``): checks, plan lookup, output, launch.

  python benchmarks/launch_cost.py [--calls 200] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def host_us(fn: Callable[[], object], calls: int, reps: int) -> float:
    """Median over ``reps`` of the mean host µs per call of ``calls`` back-to-back calls."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter_ns() - t0) / calls / 1e3)
    torch.cuda.synchronize()
    return statistics.median(per_call)


def environment() -> list[str]:
    import tvm_ffi
    from tvm_ffi import _optional_torch_c_dlpack as addon

    return [
        f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"apache-tvm-ffi {tvm_ffi.__version__}",
        f"torch.Tensor.__dlpack_c_exchange_api__: "
        f"{hasattr(torch.Tensor, '__dlpack_c_exchange_api__')}, "
        f"tvm-ffi torch addon library loaded: {getattr(addon, '_LIB', None) is not None}",
    ]


def gemm_cases(k: int = 256, n: int = 256) -> dict[str, Callable[[], object]]:
    """The grouped GEMM's calls: functional, raw compiled kernel, raw with pre-converted tensors."""
    import tvm_ffi

    from te_seq.kernels.cute import gemm
    from te_seq.kernels.cute.launch import b_view, no_route

    dev = torch.device("cuda")
    a = torch.randn(128, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(1, n, k, device=dev, dtype=torch.bfloat16)
    b = w.transpose(1, 2)
    offs = torch.tensor([128], dtype=torch.int32, device=dev)
    out = torch.empty(128, n, device=dev, dtype=torch.bfloat16)
    gemm.grouped_mm(a, b, offs, out)
    (plan,) = gemm._MM_PLANS._plans.values()
    args = (a, b_view(b, plan.b_copy), out, offs, plan.clusters, no_route(dev))
    converted = tuple(tvm_ffi.from_dlpack(t) if isinstance(t, torch.Tensor) else t for t in args)
    kernel = plan.kernel
    return {
        "grouped_mm functional (out given)": lambda: gemm.grouped_mm(a, b, offs, out),
        "grouped_mm functional (out allocated)": lambda: gemm.grouped_mm(a, b, offs),
        "compiled GEMM, torch tensors": lambda: kernel(*args),
        "compiled GEMM, tensors converted once": lambda: kernel(*converted),
        "tvm_ffi.from_dlpack of 5 tensors": lambda: [tvm_ffi.from_dlpack(t) for t in args[:4]],
    }


def offsets_cases() -> dict[str, Callable[[], object]]:
    from te_seq.kernels.cute.offsets import group_offsets

    splits = torch.full((128,), 1, dtype=torch.int64, device="cuda")
    return {"group_offsets functional": lambda: group_offsets(splits, 128)}


def aten_cases() -> dict[str, Callable[[], object]]:
    x = torch.randn(128, 256, device="cuda")
    return {
        "torch.empty [128, 256]": lambda: torch.empty(128, 256, device="cuda"),
        "x.add_(1) (one aten launch)": lambda: x.add_(1),
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "x.permute(1, 0) (a view)": lambda: x.permute(1, 0),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    for line in environment():
        print(line)
    cases = {**aten_cases(), **offsets_cases(), **gemm_cases()}
    for name, fn in cases.items():
        print(f"{host_us(fn, args.calls, args.reps):8.2f} µs  {name}", flush=True)


if __name__ == "__main__":
    main()
