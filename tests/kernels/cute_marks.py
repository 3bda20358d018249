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


def ptxas_usage(configs: tuple[str, ...], out_dir) -> dict[str, tuple[int, int]]:
    """{config: (registers a thread, spilled store bytes)} of `benchmarks/dump_ptx.py`'s named
    configs assembled by ptxas for sm_90a, in a fresh process (CUTE_DSL_ARCH unset: the script
    picks the architecture itself)."""
    cmd = [sys.executable, "benchmarks/dump_ptx.py", "--configs", ",".join(configs),
           "--out", str(out_dir), "--ptxas"]
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    usage = {}
    for line in proc.stdout.splitlines():
        if "spill stores" in line:
            usage[line.split()[0]] = (int(line.split("regs")[1].split()[0]),
                                      int(line.split("spill stores")[1].split()[0]))
    assert sorted(usage) == sorted(configs), proc.stdout
    return usage


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


def compile_quant_for_sm90a(kind: str, options: tuple = ((),)) -> None:
    """`compile_for_sm90a` of the quantization kernel ``kind`` for bf16 and fp16 input, with
    and without power-of-two scales, into E4M3 and E5M2, each with every entry of ``options``
    (the `QuantConfig` fields after ``fp8``)."""
    script = (
        "import torch\n"
        "from te_seq.kernels.cute.compile_quant import QuantConfig, compile_quant\n"
        "for dtype in (torch.bfloat16, torch.float16):\n"
        "    for pow2 in (False, True):\n"
        "        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):\n"
        f"            for extra in {options!r}:\n"
        f"                compile_quant(QuantConfig({kind!r}, dtype, pow2, False, fp8, *extra))\n"
        "print('ALL COMPILED')\n"
    )
    compile_for_sm90a(script, timeout=600)


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


def wgrad_operands(sizes: list[int], n: int, k: int):
    """Random bf16 (grad_out [M, n], x [M, k]) with 29 token rows past the last expert's (no
    expert's: never read) and the offsets of ``sizes``, seeded by the case."""
    torch.manual_seed(len(sizes) + n)
    m = sum(sizes) + 29
    grad_out = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return grad_out, x, offsets(sizes)


def check_wgrad(out, same_sums, grad_out, x, offs, sizes, start=None) -> None:
    """A varlen-K result ``out`` [E, N, K]: bit for bit ``same_sums`` (another schedule or
    consumer mode of the same tiles: the same sums in the same order), empty experts' blocks
    zero (without ``start``), and the float64 reference (plus ``start``, an accumulate's old
    values) within bf16 / fp32 rounding."""
    from te_seq.kernels import reference

    torch.testing.assert_close(out, same_sums, rtol=0, atol=0)
    ref = reference.grouped_wgrad(grad_out.double(), x.double(), offs)
    if start is None:
        empty = [g for g, s in enumerate(sizes) if s == 0]
        assert (out[empty] == 0).all(), "an empty expert's gradient must be written as zeros"
    else:
        ref = ref + start.double()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-2 if out.dtype == torch.bfloat16 else 2e-3)


def check_wgrad_graph_replays(tiling, extra_splits: tuple = ()) -> None:
    """``cute.grouped_wgrad`` at ``tiling`` captured in a CUDA graph (after one eager call
    with the same offs) and replayed with new split sizes written into offs: every replay
    right, empty and single-expert splits included."""
    from te_seq.kernels import cute, reference

    m, n, k = 3000, 256, 384
    grad_out = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    offs = offsets([750, 750, 750, 750])
    out = torch.empty(4, n, k, device="cuda", dtype=torch.bfloat16)
    cute.grouped_wgrad(grad_out, x, offs, out=out, tiling=tiling)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute.grouped_wgrad(grad_out, x, offs, out=out, tiling=tiling)
    for sizes in ([2900, 0, 100, 0], [0, 0, 0, 3000], [3, 1500, 1000, 497], *extra_splits):
        offs.copy_(offsets(sizes))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.grouped_wgrad(grad_out.double(), x.double(), offs)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
