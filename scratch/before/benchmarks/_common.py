"""Benchmark plumbing: timing, dense peak, copy bandwidth, relative error, JSON, PNG.

Timing protocol: every variant is warmed up, then timed round by round,
the variants interleaved (the order rotates each round), with CUDA events on the GPU and a wall
clock on the CPU (dry runs only); a variant's time is the median of its runs. A run is either a
burst of back-to-back calls between one pair of events, divided by the burst length (steady
state, as in a training loop: the host may run ahead of the GPU, so host time counts only where
it exceeds the GPU's), or one call from an idle GPU to its end (latency: the host time before the
first kernel counts in full).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor


@dataclass
class Result:
    """One (shape, mode, variant) measurement, as written to the JSON file."""

    shape: str
    mode: str  # "fwd" or "fwd+bwd"
    variant: str
    status: str = "skipped"  # "ok" (checked and timed), "failed" (error or mismatch), "skipped"
    note: str = ""  # why it was skipped or failed, or what it wasted (padding)
    ms: float | None = None  # median
    ms_p20: float | None = None
    ms_p80: float | None = None
    tflops: float | None = None
    pct_peak: float | None = None
    max_rel_err: float | None = None  # against the checking variant, over all outputs
    first_call_s: float | None = (
        None  # the checking call (forward, then forward+backward): compiles
    )
    runs: list[float] = field(default_factory=list)
    latency_ms: float | None = None  # median of single calls, each from an idle GPU
    latency_runs: list[float] = field(default_factory=list)
    host_ms: float | None = None  # te_seq: median host time of one call (until it returns)
    # grouped MLP only: what the variant is, its check, and the figures against peers and bounds
    is_peer: bool = False  # a baseline, not te_seq
    precision: str = "bf16"  # "fp8" for a peer that quantizes its GEMM operands
    check_tol: float | None = None  # the tolerance it was checked with
    vs_best_peer: float | None = None  # the best bf16 peer's time / this time
    best_peer: str | None = None
    bytes_bound_gb: float | None = None  # bytes-moved lower bound of one call
    bound_ms: float | None = None  # that bound at the measured copy bandwidth
    pct_bound: float | None = None  # 100 · bound_ms / ms


def time_once(fn: Callable[[], object], device: torch.device, burst: int = 1) -> float:
    """Milliseconds per call of ``burst`` back-to-back calls: CUDA events on the GPU (launch time
    included, one synchronisation after the burst), else wall clock."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(burst):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / burst
    t0 = time.perf_counter()
    for _ in range(burst):
        fn()
    return (time.perf_counter() - t0) * 1e3 / burst


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    iters: int,
    warmup: int,
    device: torch.device,
    burst: int = 1,
) -> dict[str, list[float]]:
    """Run times (ms per call) per variant: ``warmup`` untimed calls each, then ``iters`` rounds
    of one ``burst`` each (``time_once``), in a new order every round (seeded shuffle).

    Not a rotation: that keeps the cyclic order, so a variant always follows the same one, and
    the GPU's power state carries over between bursts. On one H200 (2026-11-25) the variant
    right after a host-bound one (per-group weights, the GPU mostly idle) ran Q's fwd+bwd up to
    10 % faster than the same module and configuration behind a GPU-bound one."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    runs: dict[str, list[float]] = {name: [] for name in names}
    rng = random.Random(0)
    for _ in range(iters):
        order = rng.sample(names, len(names))
        for name in order:
            runs[name].append(time_once(fns[name], device, burst))
    return runs


def time_host(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median host time (ms) of one call: from an idle device until the call returns, its
    kernels not waited for (what the Python side of a training step costs per call)."""
    runs = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(runs)


def summarize(result: Result, runs: Sequence[float], flops: float, peak_tflops: float) -> None:
    """Fill the timing fields of ``result`` from its runs (ms) and the FLOPs of one call."""
    ordered = sorted(runs)
    result.runs = [round(r, 5) for r in runs]
    result.ms = statistics.median(ordered)
    result.ms_p20 = ordered[int(0.2 * (len(ordered) - 1))]
    result.ms_p80 = ordered[int(0.8 * (len(ordered) - 1))]
    result.tflops = flops / (result.ms * 1e9)
    result.pct_peak = 100.0 * result.tflops / peak_tflops if peak_tflops > 0 else None


def dense_peak_tflops(device: torch.device, dtype: torch.dtype, n: int, iters: int) -> float:
    """Measured dense matmul peak: median TFLOP/s of an n×n×n product on random data."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    runs = time_interleaved({"mm": lambda: a @ b}, iters, warmup=3, device=device)["mm"]
    return 2 * n**3 / (statistics.median(runs) * 1e9)


def copy_bandwidth_gbs(device: torch.device, nbytes: int, iters: int) -> float:
    """Measured memory bandwidth: median GB/s of copying ``nbytes`` (read + write counted)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    runs = time_interleaved({"copy": lambda: dst.copy_(src)}, iters, warmup=3, device=device)
    return 2 * src.numel() * 4 / (statistics.median(runs["copy"]) * 1e6)


def rel_err(ours: Tensor, ref: Tensor, chunk: int = 1 << 24) -> float:
    """‖ours − ref‖ / ‖ref‖, summed in float64 over chunks (0 for empty tensors; no full-size
    float64 copies of multi-GB weight gradients); shape mismatch is an error."""
    if ours.shape != ref.shape:
        raise ValueError(f"shape {tuple(ours.shape)} != reference shape {tuple(ref.shape)}")
    if ref.numel() == 0:
        return 0.0
    a, b = ours.reshape(-1), ref.reshape(-1)
    diff2 = ref2 = 0.0
    for start in range(0, b.numel(), chunk):
        a_c, b_c = a[start : start + chunk].double(), b[start : start + chunk].double()
        diff2 += torch.sum((a_c - b_c) ** 2).item()
        ref2 += torch.sum(b_c**2).item()
    return (diff2 / max(ref2, 1e-60)) ** 0.5


def write_json(path: str, meta: dict[str, object], results: Sequence[Result]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "results": [asdict(r) for r in results]}
    Path(path).write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")


def write_png(path: str, results: Sequence[Result], peak_tflops: float, title: str) -> None:
    """Grouped bar chart of TFLOP/s per shape and variant, one panel per mode; skips politely."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"no PNG: matplotlib is not importable here ({exc})")
        return
    modes = sorted({r.mode for r in results}, key=lambda m: m != "fwd")
    shapes = list(dict.fromkeys(r.shape for r in results))
    variants = list(dict.fromkeys(r.variant for r in results))
    fig, axes = plt.subplots(1, max(1, len(modes)), figsize=(6 * max(1, len(modes)), 4.5))
    for ax, mode in zip(axes if len(modes) > 1 else [axes], modes):
        width = 0.8 / max(1, len(variants))
        for i, variant in enumerate(variants):
            vals = [_tflops_of(results, s, mode, variant) for s in shapes]
            ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=variant)
        ax.axhline(peak_tflops, color="k", linestyle="--", linewidth=1, label="dense peak")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{title} — {mode}")
    (axes[0] if len(modes) > 1 else axes).legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def _tflops_of(results: Sequence[Result], shape: str, mode: str, variant: str) -> float:
    for r in results:
        if (r.shape, r.mode, r.variant) == (shape, mode, variant) and r.tflops is not None:
            return r.tflops
    return 0.0
