"""te_seq's CuTe DSL (CUTLASS Python DSL) kernels for Hopper (sm_90a): functional entry points.

Shape legend: M routed rows (tokens), E groups (experts), K reduction dim, N output dim.
``offs`` is int32 [E] of cumulative row ends on the device (``offs[e] = sum(split_sizes[:e+1])``).

Importing this package imports no cutlass and compiles nothing: each kernel config compiles on
first use (``compile.compile_gemm``, symbolic M/N/K/E, cached in memory and on disk) and
launches on torch's current stream through TVM-FFI. No function here reads ``offs`` on the
host, so every call is sync-free and CUDA-graph capturable. ``te_seq.kernels.reference``
defines the maths.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "Tiling",
    "tile_n_for",
    "default_tiling",
    "available",
    "supports",
    "supports_wgrad",
    "grouped_mm",
    "grouped_wgrad",
    "glu_fc1_forward",
    "glu_fc2_dgrad",
]

_AB_DTYPES = (torch.bfloat16, torch.float16)
_TILE_M = 128


@dataclass(frozen=True)
class Tiling:
    """CTA tile width (the tile is 128 x tile_n x 64) and cluster shape (cluster_m, cluster_n).

    cluster (2, 1): two m-tiles of one group share B by multicast; (1, 2): two n-tiles share A.
    """

    tile_n: int = 256
    cluster_mn: tuple[int, int] = (1, 2)


# Measured on one H200 (2026-11-22, benchmarks/bench_grouped_gemm.py, shapes A/B/Q/Z of DESIGN.md):
# 128x256 with a 1x2 cluster was best or within 2% of best for every GEMM; 2x1 lost 5-20% on
# varlen M (256-row cluster units waste rows of small experts), 128x128 lost up to 35% on A.
# The tile width is then narrowed where 256 would leave columns idle (``tile_n_for``).
MM_TILING = Tiling(256, (1, 2))
WGRAD_TILING = Tiling(256, (1, 2))
TILE_WIDTHS = (256, 192, 128)


def tile_n_for(n: int, cluster_n: int = 2) -> int:
    """The widest tile in ``TILE_WIDTHS`` whose cluster units cover ``n`` columns with the least
    padding: N = 768 takes 192 (two 384-column units) where 256 would compute 1024 columns."""
    return min(TILE_WIDTHS, key=lambda t: (-(-n // (t * cluster_n)) * t * cluster_n, -t))


def default_tiling(n: int, base: Tiling) -> Tiling:
    """``base`` with its tile width fitted to ``n`` columns (``tile_n_for``)."""
    return Tiling(tile_n_for(n, base.cluster_mn[1]), base.cluster_mn)


@functools.lru_cache(maxsize=None)
def available() -> tuple[bool, str]:
    """(True, "") when a CUDA device of capability >= 9.0 and the CuTe DSL (with TVM-FFI) import."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return False, f"needs compute capability >= 9.0, found {major}.{minor}"
    for module, package in (("cutlass.cute", "nvidia-cutlass-dsl"), ("tvm_ffi", "apache-tvm-ffi")):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return False, f"{package} is not importable ({exc}); pip install 'te_seq[cute]'"
    return True, ""


def _row_ok(n: int, dtype: torch.dtype) -> bool:
    """TMA needs every non-unit stride 16-byte aligned."""
    return (n * dtype.itemsize) % 16 == 0


def supports(a: Tensor, b: Tensor) -> tuple[bool, str]:
    """Whether ``grouped_mm(a, b, ...)`` can run on this backend, with the reason if not."""
    if a.dtype not in _AB_DTYPES or b.dtype != a.dtype:
        return False, f"needs bf16/fp16 operands of one dtype, got {a.dtype} and {b.dtype}"
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
        return False, f"needs a [M, K] and b [E, K, N], got {tuple(a.shape)} and {tuple(b.shape)}"
    k, n = b.shape[1], b.shape[2]
    if not (_row_ok(k, a.dtype) and _row_ok(n, a.dtype)):
        return False, f"K={k} and N={n} must be multiples of 8 (TMA rows are 16-byte aligned)"
    if not a.is_cuda or not b.is_cuda:
        return False, "needs CUDA tensors"
    return True, ""


def supports_wgrad(grad_out: Tensor, x: Tensor) -> tuple[bool, str]:
    """Whether ``grouped_wgrad(grad_out, x, ...)`` can run here, with the reason if not."""
    if x.dtype not in _AB_DTYPES or grad_out.dtype != x.dtype:
        return False, f"needs bf16/fp16 operands of one dtype, got {grad_out.dtype} and {x.dtype}"
    if grad_out.dim() != 2 or x.dim() != 2 or grad_out.shape[0] != x.shape[0]:
        return (
            False,
            f"needs grad_out [M, N] and x [M, K], got {tuple(grad_out.shape)} and {tuple(x.shape)}",
        )
    n, k = grad_out.shape[1], x.shape[1]
    if not (_row_ok(k, x.dtype) and _row_ok(n, x.dtype)):
        return False, f"K={k} and N={n} must be multiples of 8 (TMA rows are 16-byte aligned)"
    if not x.is_cuda or not grad_out.is_cuda:
        return False, "needs CUDA tensors"
    return True, ""


@functools.lru_cache(maxsize=None)
def _num_sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _row_major(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 and t.stride(0) == t.shape[1] else t.contiguous()


def _b_view(b: Tensor) -> tuple[Tensor, str]:
    """b [E, K, N] as the kernel's (N, K, E) view and its major ("k": K contiguous, else "n")."""
    el = 8  # 16 bytes of bf16/fp16
    if b.stride(1) == 1 and b.stride(2) % el == 0 and b.stride(0) % el == 0:
        return b.permute(2, 1, 0), "k"
    if b.stride(2) != 1 or b.stride(1) % el or b.stride(0) % el:
        b = b.contiguous()
    return b.permute(2, 1, 0), "n"


def _check_offs(offs: Tensor, groups: int, device: torch.device) -> Tensor:
    if offs.dim() != 1 or offs.shape[0] != groups:
        raise ValueError(f"offs must be 1-D of length {groups}, got shape {tuple(offs.shape)}")
    if offs.device != device:
        raise ValueError(f"offs must be on {device}, got {offs.device}")
    return (
        offs
        if offs.dtype == torch.int32 and offs.is_contiguous()
        else offs.to(torch.int32).contiguous()
    )


def grouped_mm(
    a: Tensor, b: Tensor, offs: Tensor, out: Tensor | None = None, *, tiling: Tiling | None = None
) -> Tensor:
    """Varlen-M grouped GEMM: ``out[rows of e] = a[rows of e] @ b[e]`` (fp32 accumulate).

    a: [M, K], b: [E, K, N] (either major: ``W.transpose(1, 2)`` or ``W``), offs: int32 [E]
    -> out: [M, N] in ``a.dtype``. Rows past ``offs[-1]`` are written as zeros, as in
    ``reference.grouped_mm``. Raises ValueError when ``supports(a, b)`` is False.
    """
    ok, why = supports(a, b)
    if not ok:
        raise ValueError(f"cute grouped_mm: a {tuple(a.shape)}, b {tuple(b.shape)}: {why}")
    from .compile import GemmConfig, compile_gemm

    rows, groups, n = a.shape[0], b.shape[0], b.shape[2]
    offs = _check_offs(offs, groups, a.device)
    if out is None:
        out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    elif out.shape != (rows, n) or out.dtype != a.dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous [{rows}, {n}] {a.dtype} tensor, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    if rows == 0:
        return out
    a = _row_major(a)
    b_view, b_major = _b_view(b)
    t = tiling or default_tiling(n, MM_TILING)
    kernel = compile_gemm(GemmConfig("m", a.dtype, a.dtype, b_major, t.tile_n, t.cluster_mn)).fn
    cm, cn = t.cluster_mn
    block_m = _TILE_M * cm
    # Grid from M and E only: no group (nor the virtual one past offs[-1]) has more m-units than
    # its rows allow, so the units are at most (M + (E + 1)(block_m - 1)) / block_m per n-unit.
    units = (rows + (groups + 1) * (block_m - 1)) // block_m * -(-n // (t.tile_n * cn))
    clusters = max(1, min(units, _num_sms(a.device.index or 0) // (cm * cn)))
    kernel(a, b_view, out, offs, clusters)
    return out


def grouped_wgrad(
    grad_out: Tensor,
    x: Tensor,
    offs: Tensor,
    out: Tensor | None = None,
    accumulate: bool = False,
    *,
    tiling: Tiling | None = None,
) -> Tensor:
    """Varlen-K grouped GEMM: ``out[e] = grad_out[rows of e]ᵀ @ x[rows of e]`` -> [E, N, K].

    A new tensor in ``x.dtype``, or written into (``accumulate=True``: added to) ``out``, a
    contiguous [E, N, K] buffer in float32 (``main_grad``) or the operands' dtype.
    """
    ok, why = supports_wgrad(grad_out, x)
    if not ok:
        raise ValueError(
            f"cute grouped_wgrad: grad_out {tuple(grad_out.shape)}, x {tuple(x.shape)}: {why}"
        )
    from .compile import GemmConfig, compile_gemm

    rows, n, k = x.shape[0], grad_out.shape[1], x.shape[1]
    groups = offs.shape[0]
    offs = _check_offs(offs, groups, x.device)
    if out is None:
        out, accumulate = torch.empty(groups, n, k, dtype=x.dtype, device=x.device), False
    if out.shape != (groups, n, k) or out.dtype not in (torch.float32, x.dtype):
        raise ValueError(
            f"out must be [{groups}, {n}, {k}] in float32 or {x.dtype}, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    if not out.is_contiguous():
        tmp = torch.empty_like(out, memory_format=torch.contiguous_format)
        result = grouped_wgrad(grad_out, x, offs, tmp, tiling=tiling)
        return out.add_(result) if accumulate else out.copy_(result)
    if rows == 0:
        return out if accumulate else out.zero_()
    grad_out, x = _row_major(grad_out), _row_major(x)
    t = tiling or default_tiling(k, WGRAD_TILING)
    kernel = compile_gemm(
        GemmConfig("k", x.dtype, out.dtype, "n", t.tile_n, t.cluster_mn, accumulate)
    ).fn
    cm, cn = t.cluster_mn
    units = groups * -(-n // (_TILE_M * cm)) * -(-k // (t.tile_n * cn))
    clusters = max(1, min(units, _num_sms(x.device.index or 0) // (cm * cn)))
    kernel(grad_out.t(), x.t(), out.permute(1, 2, 0), offs, clusters)
    return out


# Fused GLU steps of the grouped MLP (each with a ``.supports(x, w, act, interleave)``); imported
# last because they use the helpers above. They import no cutlass until first called.
from .glu import glu_fc1_forward, glu_fc2_dgrad  # noqa: E402
