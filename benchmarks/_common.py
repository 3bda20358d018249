"""Benchmark plumbing shared by te_seq's benchmarks: timing, dense peak, checks, table, JSON, PNG.

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
    host_ms: float | None = None  # median host time of one call (until it returns, no sync)


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
    of one ``burst`` each (``time_once``)."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    runs: dict[str, list[float]] = {name: [] for name in names}
    for r in range(iters):
        order = names[r % len(names) :] + names[: r % len(names)] if names else []
        for name in order:
            runs[name].append(time_once(fns[name], device, burst))
    return runs


def time_host(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median host time (ms) of one call: from an idle device until the call returns, without
    waiting for its kernels (what the Python side of a training step costs per call)."""
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


def rel_err(ours: Tensor, ref: Tensor) -> float:
    """‖ours − ref‖ / ‖ref‖ in float64 (0 for empty tensors); shape mismatch is an error."""
    if ours.shape != ref.shape:
        raise ValueError(f"shape {tuple(ours.shape)} != reference shape {tuple(ref.shape)}")
    if ref.numel() == 0:
        return 0.0
    diff = torch.linalg.vector_norm((ours.double() - ref.double()).flatten())
    return (diff / torch.linalg.vector_norm(ref.double().flatten()).clamp_min(1e-30)).item()


def _cell(value: float | None, fmt: str, width: int) -> str:
    return format(value, fmt) if value is not None else "-".rjust(width)


def print_table(results: Sequence[Result], peak_tflops: float, baseline: str = "") -> None:
    """One line per result; ``vs`` = the ``baseline`` variant's time / this one's (same case)."""
    print(f"\ndense peak (measured): {peak_tflops:.1f} TFLOP/s")
    print(
        f"{'shape':5} {'mode':8} {'variant':18} {'ms':>9} {'TFLOP/s':>8} {'%peak':>6} "
        f"{'vs':>5} {'latency':>9} {'host':>8}  note"
    )
    base = {(r.shape, r.mode): r.ms for r in results if r.variant == baseline and r.ms}
    for r in results:
        ref = base.get((r.shape, r.mode))
        ratio = ref / r.ms if ref and r.ms else None
        print(
            f"{r.shape:5} {r.mode:8} {r.variant:18} {_cell(r.ms, '9.3f', 9)} "
            f"{_cell(r.tflops, '8.1f', 8)} {_cell(r.pct_peak, '6.1f', 6)} "
            f"{_cell(ratio, '5.2f', 5)} {_cell(r.latency_ms, '9.3f', 9)} "
            f"{_cell(r.host_ms, '8.3f', 8)}  {r.note}"
        )


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
