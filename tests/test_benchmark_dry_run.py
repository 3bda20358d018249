"""The grouped-MLP benchmark's CPU dry run: every variant builds, agrees with the others and is
timed, so a broken benchmark is caught in CI rather than on the GPU host."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a subprocess of several seconds; CI runs it
def test_bench_grouped_mlp_dry_run(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "benchmarks/bench_grouped_mlp.py", "--dry-run", "--json", str(out),
           "--png", str(tmp_path / "bench.png")]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    timed = {(r["shape"], r["mode"], r["variant"]) for r in results if r["status"] == "ok"}
    for shape in ("T", "U"):
        for mode in ("fwd", "fwd+bwd"):
            for variant in ("grouped_mm", "loop", "te_seq:torch", "kernels:torch"):
                assert (shape, mode, variant) in timed, (shape, mode, variant, results)
    assert all(r["max_rel_err"] is None or r["max_rel_err"] < 1e-4 for r in results)
    # steady state (bursts) and single-call latency are both recorded for every timed variant
    meta = json.loads(out.read_text())["meta"]
    assert meta["burst"] == 10
    for r in results:
        if r["status"] == "ok":
            assert r["ms"] > 0 and r["latency_ms"] > 0 and len(r["latency_runs"]) == len(r["runs"])
    assert "vs" in result.stdout and "latency" in result.stdout


def test_each_timed_run_is_one_burst_of_calls():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _common import time_interleaved

    calls = []
    runs = time_interleaved(
        {"f": lambda: calls.append(1)}, iters=3, warmup=2, device=torch.device("cpu"), burst=4
    )
    assert len(runs["f"]) == 3 and len(calls) == 2 + 3 * 4


@pytest.mark.slow  # a subprocess that compiles (aot_eager: no C++ build)
def test_bench_grouped_mlp_compiled_variant_dry_run(tmp_path):
    """--compile adds te_seq through torch.compile(fullgraph=True), checked against the others
    and timed, with its latency and host time per call."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "benchmarks/bench_grouped_mlp.py", "--dry-run", "--shapes", "T",
           "--backends", "torch", "--peers", "loop", "--compile", "default",
           "--compile-backend", "aot_eager", "--json", str(out), "--png", str(tmp_path / "b.png")]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    compiled = [r for r in results if r["variant"] == "te_seq:torch:compiled"]
    assert {r["mode"] for r in compiled if r["status"] == "ok"} == {"fwd", "fwd+bwd"}, results
    assert all(r["latency_ms"] > 0 and r["host_ms"] > 0 for r in compiled)
