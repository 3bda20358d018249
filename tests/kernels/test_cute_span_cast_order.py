"""The span cast kernel's load order and registers, checked on the CPU from its PTX (sm_90a,
``benchmarks/dump_ptx.py``): the tile's 16-byte loads and the group's block-maxima loads are
all issued before the tile is converted, so the maxima's round trips overlap the tile's, and
the kernel fits in 64 registers a thread without spills (4 CTAs of 256 threads per SM). Since
2026-11-30 (run "v") the cast keeps the raw tile in registers through the scale reduction and
stages 8 KB of FP8 bytes instead of 33 KB of fp32: 62-64 registers, 4 CTAs per SM, 25-30 %
faster on an H200 than the 48-register kernel that fitted 5 (te_seq/kernels/cute/README.md,
"Whole-line stores"); capping it at 64 by launch bounds when it took 80 spilled and ran 30-50 %
slower, so the bound checked here is the one it meets without a cap. The GPU tests in
test_cute_quant.py check its outputs bit for bit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cute_marks import ROOT, needs_dsl, needs_ptxas

_CONFIGS = ("quant_span_cast", "quant_span_cast_rows")


def _dump(tmp_path: Path, ptxas: bool) -> str:
    cmd = [sys.executable, "benchmarks/dump_ptx.py", "--configs", ",".join(_CONFIGS),
           "--out", str(tmp_path)] + (["--ptxas"] if ptxas else [])
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def _loads_before_first_convert(ptx: str) -> tuple[int, int]:
    """(16-byte global loads, 4-byte fp32 global loads) that precede the first bf16 -> fp32
    conversion in ``ptx``."""
    head = ptx.split("cvt.f32.bf16", 1)[0]
    return len(re.findall(r"ld\.global\.v4\.", head)), len(re.findall(r"ld\.global\.b32", head))


@pytest.mark.slow  # DSL compiles in a subprocess
@needs_dsl
def test_span_cast_issues_the_tile_and_group_maxima_loads_before_converting(tmp_path):
    _dump(tmp_path, ptxas=False)
    for name in _CONFIGS:
        ptx = (tmp_path / f"{name}.ptx").read_text()
        vectors, words = _loads_before_first_convert(ptx)
        # the table row and the tile's 4 loads; the previous block's group, the walk's 4 block
        # maxima (and with rows the 4 rows' maxima)
        assert vectors == 5, (name, vectors)
        assert words >= 5, (name, words)


@pytest.mark.slow  # DSL compiles and ptxas in a subprocess
@needs_dsl
@needs_ptxas
def test_span_cast_fits_four_ctas_per_sm(tmp_path):
    out = _dump(tmp_path, ptxas=True)
    for name in _CONFIGS:
        line = next(x for x in out.splitlines() if x.startswith(f"{name} "))
        regs = int(re.search(r"regs\s+(\d+)", line).group(1))
        assert regs <= 64, line  # 65536 registers / (256 threads x 64) = 4 CTAs per SM
        assert "spill stores     0 B loads     0 B" in line, line
