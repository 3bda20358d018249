"""Shared by the cute kernel tests: whether the DSL is installed, whether the cute backend can
run here (and why not), and the pytest marks built from that."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

HAS_DSL = importlib.util.find_spec("cutlass") is not None


def _cute_ready() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    from te_seq.kernels import cute

    return cute.available()


READY, WHY = _cute_ready()
gpu = pytest.mark.gpu
needs_cute = pytest.mark.skipif(not READY, reason=WHY or "cute backend unavailable")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compile_for_sm90a(script: str, timeout: int) -> None:
    """Run a compile-only script in a fresh process with CUTE_DSL_ARCH=sm_90a (read once at
    `import cutlass`, so never in this process) and check it compiled every config. Without a
    cache directory chosen by the caller (``TE_SEQ_CACHE_DIR``, as the disk-cache tests do) the
    disk cache is off, so every config really compiles."""
    env = dict(
        os.environ,
        CUTE_DSL_ARCH="sm_90a",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    if "TE_SEQ_CACHE_DIR" not in os.environ:
        env["TE_SEQ_DISK_CACHE"] = "0"
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ALL COMPILED" in proc.stdout
