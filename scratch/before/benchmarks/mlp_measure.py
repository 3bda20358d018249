"""Checking and timing of the grouped-MLP benchmark's variants (the protocol in _common.py and
benchmarks/README.md): every variant is checked against the fp32 reference first, then the ones
that agree are timed together, interleaved."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from _common import Result, rel_err, summarize, time_host, time_interleaved
from mlp_case import Case, Variant
from mlp_report import flops
from torch import Tensor

CHECK_TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def why(exc: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:240]


def free_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- checking


@dataclass
class Check:
    ok: bool
    max_rel_err: float | None
    tol: float | None
    note: str = ""
    first_call_s: float | None = None  # cold: includes compiling kernels on first use


def check_variants(
    variants: list[Variant], ref: tuple[Tensor, ...], dtype: torch.dtype
) -> dict[str, Check]:
    """Run every variant once (forward, then one forward+backward from no gradients) and compare
    y, dx, dW1, dW2 (and dprobs) with the fp32 reference; one that fails or disagrees is not
    timed."""
    checks: dict[str, Check] = {}
    for v in variants:
        tol = v.check_tol or CHECK_TOL.get(dtype, 1e-4)
        t0 = time.perf_counter()
        try:
            err = _check_once(v, ref)
        except Exception as exc:  # noqa: BLE001 - reported, not timed
            checks[v.name] = Check(False, None, tol, f"failed: {why(exc)}")
            free_memory()
            continue
        ok = err <= tol
        note = "" if ok else f"MISMATCH vs the fp32 reference: {err:.2e} > {tol}"
        checks[v.name] = Check(ok, err, tol, note, time.perf_counter() - t0)
    return checks


def _check_once(v: Variant, ref: tuple[Tensor, ...]) -> float:
    """The largest relative error of (y of forward, y, dx, dW1, dW2[, dprobs])."""
    v.reset()
    with torch.no_grad():
        y_fwd = v.forward().clone()  # a copy: CUDA-graph outputs are reused by the next call
    v.forward_backward()
    outs = (y_fwd, *v.outputs())
    if len(outs) != len(ref):
        raise RuntimeError(f"{v.name} gave {len(outs)} outputs, the reference {len(ref)}")
    if y_fwd.is_cuda:
        torch.cuda.synchronize()
    return max(rel_err(o.detach(), r) for o, r in zip(outs, ref))


# --------------------------------------------------------------------------- timing


def _mode_fn(v: Variant, mode: str) -> Callable[[], object]:
    if mode == "fwd":

        def fwd() -> object:
            with torch.no_grad():
                return v.forward()

        return fwd
    return v.forward_backward


def measure_case(
    case: Case,
    variants: list[Variant],
    checks: dict[str, Check],
    args: argparse.Namespace,
    modes: list[str],
    peak: float,
) -> list[Result]:
    results = []
    ready = [v for v in variants if checks[v.name].ok]
    for mode in modes:
        fns = {v.name: _mode_fn(v, mode) for v in ready}
        runs = _time_all(case.name, mode, fns, args, args.burst)
        latency = _time_all(case.name, mode, fns, args, 1) if args.burst > 1 else runs
        for v in variants:
            r = _result(case, mode, v, checks[v.name])
            if isinstance(runs.get(v.name), list) and runs[v.name]:
                summarize(r, runs[v.name], flops(case.shape, mode), peak)
                r.status = "ok"
                if isinstance(latency.get(v.name), list) and latency[v.name]:
                    r.latency_runs = [round(t, 5) for t in latency[v.name]]
                    r.latency_ms = sorted(latency[v.name])[len(latency[v.name]) // 2]
                if v.times_host:
                    r.host_ms = time_host(fns[v.name], args.iters, args.device)
            elif v.name in runs:
                r.note = f"timing failed: {runs[v.name]}"
            results.append(r)
            progress(r)
    return results


def _result(case: Case, mode: str, v: Variant, chk: Check) -> Result:
    r = Result(case.name, mode, v.name, "failed", max_rel_err=chk.max_rel_err)
    r.first_call_s, r.check_tol = chk.first_call_s, chk.tol
    r.is_peer, r.precision = v.is_peer, v.precision
    r.note = "; ".join(n for n in (chk.note, v.note, _plan_note(v)) if n)
    return r


def _time_all(
    shape: str,
    mode: str,
    fns: dict[str, Callable[[], object]],
    args: argparse.Namespace,
    burst: int,
) -> dict:
    """Interleaved runs of every variant, or (if that fails) of each alone to find the culprit."""
    try:
        return time_interleaved(fns, args.iters, args.warmup, args.device, burst)
    except Exception as exc:  # noqa: BLE001
        print(f"[{shape}] {mode}: interleaved timing failed ({why(exc)}); timing alone")
        return _time_each(fns, args, burst)


def _time_each(fns: dict[str, Callable[[], object]], args: argparse.Namespace, burst: int) -> dict:
    out: dict[str, object] = {}
    for name, fn in fns.items():
        try:
            runs = time_interleaved({name: fn}, args.iters, args.warmup, args.device, burst)
            out[name] = runs[name]
        except Exception as exc:  # noqa: BLE001
            out[name] = why(exc)
            free_memory()
    return out


def _plan_note(v: Variant) -> str:
    if not hasattr(v, "plan"):  # te_seq variants: the fusion plan of their last call
        return ""
    try:
        return f"plan: {v.plan()}"
    except Exception as exc:  # noqa: BLE001 - the plan is informative only
        return f"plan unavailable ({why(exc)})"


def progress(r: Result) -> None:
    if r.ms is None:
        print(f"[{r.shape}] {r.mode:18} {r.variant:22} not timed  {r.note}", flush=True)
        return
    print(
        f"[{r.shape}] {r.mode:18} {r.variant:22} {r.ms:9.3f} ms {r.tflops:8.1f} TFLOP/s "
        f"{r.pct_peak or 0:5.1f}% of peak  err {r.max_rel_err:.1e}  {r.note}",
        flush=True,
    )
