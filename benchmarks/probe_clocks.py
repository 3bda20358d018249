"""SM clock and board power while a grouped MLP runs back to back: does one MLP hold the
GPU's clocks better than another under the same work?

An H200 lowers its SM clock when the board nears its power limit, so two MLPs with the same
kernels' work can run at different speeds for how much power their kernels draw. This runs
each variant for `--seconds` of back-to-back fwd+bwd steps (a synchronize every `--burst`
steps, as the benchmark's bursts), after `--idle` seconds of idle GPU, while `nvidia-smi`
samples the SM clock, the power draw and the temperature every `--sample-ms`; per variant it
prints ms per step, TFLOP/s (the benchmark's 18·M·H·F per fwd+bwd; FP8 counts the same FLOPs),
the samples' median clock (MHz) and power (W) over the run (its first 0.3 s left out), and
the cycles per step at that clock (ms x GHz).

  python benchmarks/probe_clocks.py --shape Q --act swiglu [--variants cute,quack,cute:fp8]
      [--env-variant NAME:VAR=VALUE,...] [--seconds 4] [--rounds 2] [--json OUT]

An env variant NAME adds `cute:NAME` (the bf16 MLP under NAME's settings); `cute:fp8/NAME`
and `cute:fp8all/NAME` run the FP8 steps under them.

Under a power cap the cycles per step (ms x GHz) compare kernels better than their ms: two
processes, or two moments of one, that run at different clocks give the same cycles for the
same kernels, as long as the step is bound by the GPU (not by the host's launches).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import tempfile
import time

import torch
from bench_grouped_mlp import _environment, parse_env_variant
from grad_modes import GradState
from mlp_case import ACTS, make_case
from mlp_report import flops
from profile_host import build
from profile_kernels import step_fn

import te_seq

_QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu"
DENSE = 8192  # the `dense` variant: the benchmark's dense peak matmul, DENSE³ in bf16


def make_step(variant: str, case, envs: dict[str, dict[str, str]], backend: str = "cute",
              grad_mode: str = "fresh"):
    """One step of `variant`: te_seq's `cute` MLP fwd+bwd, `cute:fp8` (row-wise recipe,
    wgrads in bf16), `cute:fp8all` (row-wise, FP8 wgrads too), `quack`
    (benchmarks/peer_quack.py), `cute:NAME`, the cute MLP with the environment of
    `--env-variant NAME:...` set while it runs (its own module; `backend` for te_seq's),
    `BASE/NAME`, te_seq's variant BASE (`cute`, `cute:fp8`, `cute:fp8all`) likewise, or
    `dense`, the benchmark's dense-peak matmul. `grad_mode` "megatron": the benchmark's
    Megatron mode (grad_modes.py) for te_seq's and QuACK's MLPs."""
    ours = ("cute", "cute:fp8", "cute:fp8all")
    known = (*ours, "quack", "dense", *(f"cute:{n}" for n in envs),
             *(f"{b}/{n}" for b in ours for n in envs))
    if variant not in known:
        raise ValueError(f"probe_clocks: unknown variant {variant!r}; known: {', '.join(known)}")
    if variant == "dense":
        a, b = (torch.randn(DENSE, DENSE, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        return lambda: torch.mm(a, b)
    base, _, name = variant.rpartition("/")
    if not base and variant.partition(":")[2] in envs:
        base, name = "cute", variant.partition(":")[2]
    if base:
        step = make_step(base, case, envs, backend, grad_mode)

        def env_step():
            with _environment(envs[name]):
                step()
        return env_step
    if variant == "quack":
        from peer_quack import QuackPeer

        return QuackPeer(case, grad_mode).forward_backward
    mlp, forward = build(case, backend, main_grad=grad_mode == "megatron")
    if grad_mode == "megatron":
        GradState("megatron", list(mlp.parameters()))  # main_grad buffers, flag, hook
    recipe = (te_seq.recipe.Float8RowwiseScaling(fp8_wgrad=variant == "cute:fp8all")
              if variant in ("cute:fp8", "cute:fp8all") else None)
    return step_fn(mlp, forward, recipe)


def run_for(step, seconds: float, burst: int) -> tuple[float, float, float]:
    """(start, end) wall-clock times and ms per step of back-to-back bursts for `seconds`."""
    torch.cuda.synchronize()
    start, steps = time.time(), 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(burst):
            step()
        torch.cuda.synchronize()
        steps += burst
    ms = (time.perf_counter() - t0) / steps * 1e3
    return start, time.time(), ms


def samples_between(lines: list[str], start: float, end: float) -> list[tuple[float, float, float]]:
    """(MHz, W, °C) of the nvidia-smi samples taken between `start` and `end` (epoch s)."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) not in (4, 5):  # the fifth: slowdown reasons (smi_samples(reasons=True))
            continue
        try:
            stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            stamp += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
            values = float(parts[1]), float(parts[2]), float(parts[3])
        except ValueError:
            continue
        if start <= stamp <= end:
            out.append(values)
    return out


def window_medians(samples: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """The median (MHz, W, °C) of a window's samples (``samples_between``)."""
    return tuple(statistics.median(v[i] for v in samples) for i in range(3))


# NVML's clock event reasons (the bits of nvidia-smi's clocks_event_reasons.active)
SLOWDOWN_REASONS = {0x1: "idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                    0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal",
                    0x80: "hw_power_brake", 0x100: "display_clocks"}


def reasons_between(lines: list[str], start: float, end: float) -> str:
    """What held the clock down in the samples between `start` and `end` (lines sampled with
    ``smi_samples(reasons=True)``): each active reason with its share of the samples, e.g.
    'sw_power_cap:96%'; 'none' where no sample had one, '' where none was sampled."""
    masks = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 5 and samples_between([line], start, end):
            try:
                masks.append(int(parts[4], 16))
            except ValueError:
                continue
    named = [f"{name}:{100 * sum(bool(m & bit) for m in masks) / len(masks):.0f}%"
             for bit, name in SLOWDOWN_REASONS.items() if any(m & bit for m in masks)]
    return ",".join(named) or ("none" if masks else "")


@contextlib.contextmanager
def smi_samples(sample_ms: int, reasons: bool = False):
    """``nvidia-smi`` sampling the SM clock, power and temperature (and with ``reasons`` the
    active clock slowdown reasons) every ``sample_ms`` while the block runs; yields a list that
    holds the samples' CSV lines once the block ends (for ``samples_between``)."""
    lines: list[str] = []
    query = _QUERY + (",clocks_event_reasons.active" if reasons else "")
    with tempfile.NamedTemporaryFile("w+", suffix=".csv") as log:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}",
                                "--format=csv,noheader,nounits", f"--loop-ms={sample_ms}"],
                               stdout=log, stderr=subprocess.DEVNULL)
        try:
            yield lines
            time.sleep(0.5)
        finally:
            smi.terminate()
            smi.wait()
        log.seek(0)
        lines.extend(log.readlines())


def report(windows: list[tuple[str, float, float, float]], lines: list[str],
           mlp_flops: float) -> list[dict]:
    """Print and return one row per (variant, start, end, ms) window: its ms, TFLOP/s (the
    MLP's `mlp_flops` per step, `dense`'s matmul), and the nvidia-smi samples' median clock,
    power and temperature inside the window, with the cycles per step (ms x GHz)."""
    rows = []
    for name, start, end, ms in windows:
        got = samples_between(lines, start, end)
        if not got:
            print(f"{name:10s} {ms:7.3f} ms/step   (no nvidia-smi samples in its window)")
            continue
        mhz, watts, temp = window_medians(got)
        work = 2 * DENSE**3 if name == "dense" else mlp_flops
        why = reasons_between(lines, start, end)
        rows.append({"variant": name, "ms": ms, "tflops": work / ms / 1e9, "mhz": mhz,
                     "watts": watts, "temp_c": temp, "samples": len(got),
                     "ms_x_ghz": ms * mhz / 1e3, "slowdown": why})
        print(f"{name:10s} {ms:7.3f} ms/step  {work / ms / 1e9:5.0f} TFLOP/s  SM {mhz:6.0f} MHz  "
              f"{watts:5.0f} W  {temp:3.0f} C  {ms * mhz / 1e3:6.3f} ms·GHz  ({len(got)} samples)"
              + (f"  slowdown {why}" if why else ""))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="Q")
    p.add_argument("--act", default="swiglu", choices=ACTS)
    p.add_argument("--variants", default="cute,quack,cute:fp8")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--idle", type=float, default=2.0)
    p.add_argument("--burst", type=int, default=10)
    p.add_argument("--sample-ms", type=int, default=20)
    p.add_argument("--reasons", action="store_true",
                   help="also sample what holds the clock down (clocks_event_reasons)")
    p.add_argument("--rounds", type=int, default=2, help="each variant this many times, in turn")
    p.add_argument("--env-variant", action="append", default=[],
                   help="NAME:VAR=VALUE[,VAR=VALUE...]: adds cute:NAME (bench_grouped_mlp.py's)")
    p.add_argument("--grad-mode", default="fresh", choices=["fresh", "megatron"],
                   help="megatron: fp32 main_grad, the flag and Megatron's hook")
    p.add_argument("--json", default="")
    args = p.parse_args()
    case = make_case(args.shape, torch.device("cuda"), torch.bfloat16, act=args.act)
    envs = dict(parse_env_variant(text) for text in args.env_variant)
    names = args.variants.split(",") + [f"cute:{name}" for name in envs]
    steps = {v: make_step(v, case, envs, grad_mode=args.grad_mode) for v in names}
    for step in steps.values():  # compile and warm up outside the sampled windows
        for _ in range(5):
            step()
    windows = []
    with smi_samples(args.sample_ms, args.reasons) as lines:
        for _ in range(args.rounds):
            for name, step in steps.items():
                time.sleep(args.idle)
                start, end, ms = run_for(step, args.seconds, args.burst)
                windows.append((name, start + 0.3, end, ms))
    print(f"shape {args.shape} {args.act} grads {args.grad_mode}, bursts of {args.burst}, "
          f"{args.seconds} s each after {args.idle} s idle; nvidia-smi every {args.sample_ms} ms")
    rows = report(windows, lines, flops(case.shape, "fwd+bwd"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "act": args.act, "grad_mode": args.grad_mode,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
