"""Shared memory that TMA refills after the threads have read it: each reading thread fences the
async proxy (``fence.proxy.async.shared::cta``) after its reads and before the epilogue's
named barrier (id 1), after which the block's next TMA load is issued. A barrier orders only
the threads' generic accesses; without the fence a refill can land before reads the barrier
covers (the ping-pong main_grad accumulate read stale old C in about half the calls on an
H200: kernel README, section 19).

Checked on the CPU from the PTX (``benchmarks/dump_ptx.py``): the fp32 main_grad accumulate
(cooperative and ping-pong, 16-bit and FP8 row-wise operands), the GLU dgrads' h blocks
(16-bit, FP8 row-wise and block-scaled) and the non-gated dgrad's h block. The GPU tests
(test_cute_pingpong_wgrad.py, test_cute_glu.py, test_cute_act.py) check the results."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cute_marks import ROOT, needs_dsl

_CONFIGS = (
    "wgrad_fp32_acc", "wgrad_fp32_acc_pp128_1x1_dyn", "fp8_wgrad_fp32_acc",
    "fp8_wgrad_fp32_acc_pp128_2x1",
    "glu_dgrad_silu192", "glu_dgrad_silu128_pp", "fp8_glu_dgrad_silu_probs",
    "fp8_block_glu_dgrad_silu_probs", "act_dgrad_relu_probs",
)
_GENERIC_READ = re.compile(r"(ld\.shared(\.v\d)?\.[bfus]\d+|ldmatrix)\b")
_BARRIER_1 = re.compile(r"(bar|barrier)\.sync(\.aligned)?\s+1\s*,")


def unfenced_reads(ptx: str) -> list[int]:
    """Lines (0-based) of generic shared-memory reads (``ld.shared``, ``ldmatrix``) that reach
    a sync on named barrier 1 with no ``fence.proxy.async`` in between, in the text's order."""
    pending, unfenced = None, []
    for i, line in enumerate(ptx.splitlines()):
        op = line.strip()
        if _GENERIC_READ.match(op):
            pending = i if pending is None else pending
        elif op.startswith("fence.proxy.async"):
            pending = None
        elif _BARRIER_1.match(op) and pending is not None:
            unfenced.append(pending)
            pending = None
    return unfenced


def test_unfenced_reads_finds_reads_that_reach_the_barrier_unfenced():
    read = "\tld.shared.b32 \t%r1, [%r2];"
    fenced = "\n".join([read, "\tadd.f32 %r3, %r1, %r4;", "\tfence.proxy.async.shared::cta;",
                        "\tbar.sync \t1, 128;"])
    assert unfenced_reads(fenced) == []
    unfenced = "\n".join(["\tbar.sync \t1, 128;", read, "\tldmatrix.sync.aligned.m8n8.x4",
                          "\tbar.sync \t1, 256;", "\tst.shared.b32 [%r2], %r1;",
                          "\tbar.sync \t1, 128;"])
    assert unfenced_reads(unfenced) == [1]
    # other barriers (the ping-pong turns, id 0) do not count
    assert unfenced_reads("\n".join([read, "\tbar.sync \t%r300, 256;", "\tbar.sync \t0;"])) == []


@pytest.mark.slow  # DSL compiles in a subprocess
@needs_dsl
def test_epilogues_fence_their_reads_before_the_refill_barrier(tmp_path):
    cmd = [sys.executable, "benchmarks/dump_ptx.py", "--configs", ",".join(_CONFIGS),
           "--out", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for name in _CONFIGS:
        ptx = Path(tmp_path, f"{name}.ptx").read_text()
        reads = sum(1 for line in ptx.splitlines() if _GENERIC_READ.match(line.strip()))
        assert reads > 0, f"{name}: no shared-memory reads to check"
        lines = ptx.splitlines()
        assert unfenced_reads(ptx) == [], (
            f"{name}: reads reach barrier 1 without a proxy fence: "
            + "; ".join(lines[i].strip() for i in unfenced_reads(ptx)[:3])
        )
