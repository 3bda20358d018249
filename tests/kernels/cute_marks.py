"""Shared by the cute kernel tests: whether the DSL is installed, whether the cute backend can
run here (and why not), and the pytest marks built from that."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_DSL = importlib.util.find_spec("cutlass") is not None
HAS_TVM_FFI = importlib.util.find_spec("tvm_ffi") is not None
_INSTALL = "pip install 'te_seq[cute]'"
# Tests that need an optional package skip with a reason naming it (and run where it is present).
needs_dsl = pytest.mark.skipif(
    not HAS_DSL, reason=f"nvidia-cutlass-dsl is not installed ({_INSTALL})"
)
needs_tvm_ffi = pytest.mark.skipif(
    not HAS_TVM_FFI, reason=f"apache-tvm-ffi is not installed ({_INSTALL})"
)
# benchmarks/dump_ptx.py --ptxas finds the same ptxas ($PTXAS, PATH, a CUDA toolkit)
HAS_PTXAS = bool(
    os.environ.get("PTXAS") or shutil.which("ptxas")
    or list(Path("/usr/local").glob("cuda*/bin/ptxas"))
)
needs_ptxas = pytest.mark.skipif(not HAS_PTXAS, reason="no ptxas (a CUDA toolkit) to assemble PTX")


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


def offsets(sizes: list[int]) -> torch.Tensor:
    """int32 cumulative ends of ``sizes`` on the GPU (the kernels' ``offs``)."""
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-relative error of ``out`` against ``ref`` (a NaN in ``out`` fails: unwritten)."""
    assert not torch.isnan(out).any(), "output has NaN (unwritten elements?)"
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poison(*shapes_dtypes) -> None:
    """Fill the caching allocator's next blocks of these sizes with NaN (outputs: torch.empty)."""
    held = [torch.full(s, float("nan"), dtype=d, device="cuda") for s, d in shapes_dtypes]
    del held
