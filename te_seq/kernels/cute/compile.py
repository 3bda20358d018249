"""Compiling the CuTe DSL grouped GEMM: one compile per static config, token dims symbolic.

Imports cutlass; only ``te_seq.kernels.cute``'s functionals import this module, lazily.
Set ``CUTE_DSL_ARCH=sm_90a`` before the first ``import cutlass`` to compile without a GPU.

Compiled kernels are cached in memory and, with TVM-FFI, on disk as shared libraries
(``export_to_c`` + ``gcc -shared``, loaded back with ``load_module``) under ``cache_dir()``, keyed on
the config, the kernel source, the DSL version and the runtime libraries. Any failure of the disk
cache falls back to compiling (measured on CPU, 2026-11-22: compile 2 s, export + link 0.45 s,
load 3 ms).
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from .grouped_gemm import GroupedGemmKernel

_DTYPES = {
    torch.bfloat16: cutlass.BFloat16,
    torch.float16: cutlass.Float16,
    torch.float32: cutlass.Float32,
}


@dataclass(frozen=True)
class GemmConfig:
    """Everything a compiled kernel is specialised on (no sizes: M, N, K, E are symbolic).

    varlen: "m" (grouped_mm) or "k" (grouped_wgrad). b_major: "k" or "n" (varlen "m" only).
    """

    varlen: str
    ab_dtype: torch.dtype
    c_dtype: torch.dtype
    b_major: str = "k"
    tile_n: int = 256
    cluster_mn: tuple[int, int] = (1, 2)
    accumulate: bool = False


@dataclass
class CompiledGemm:
    """A compiled kernel and how long its compile took (seconds)."""

    fn: object
    compile_s: float


def _fake_args(cfg: GemmConfig) -> tuple:
    """Fake tensors in the kernel's (mode-major) views; sizes symbolic, inner dims 16-byte aligned."""
    ab = _DTYPES[cfg.ab_dtype]
    c = _DTYPES[cfg.c_dtype]
    rows = cute.sym_int32()
    groups = cute.sym_int32()
    div = 16 * 8 // ab.width
    offs = make_fake_compact_tensor(cutlass.Int32, (groups,), assumed_align=4)
    if cfg.varlen == "m":
        k, n = cute.sym_int32(divisibility=div), cute.sym_int32(divisibility=div)
        a = make_fake_compact_tensor(ab, (rows, k), stride_order=(1, 0), assumed_align=16)
        s1, s2 = cute.sym_int64(divisibility=div), cute.sym_int64(divisibility=div)
        b_stride = (s1, 1, s2) if cfg.b_major == "k" else (1, s1, s2)
        b = make_fake_tensor(ab, (n, k, groups), stride=b_stride, assumed_align=16)
        out = make_fake_compact_tensor(c, (rows, n), stride_order=(1, 0), assumed_align=16)
    else:
        n_out, k_in = cute.sym_int32(divisibility=div), cute.sym_int32(divisibility=div)
        a = make_fake_compact_tensor(ab, (n_out, rows), stride_order=(0, 1), assumed_align=16)
        b = make_fake_compact_tensor(ab, (k_in, rows), stride_order=(0, 1), assumed_align=16)
        out = make_fake_compact_tensor(c, (n_out, k_in, groups), stride_order=(1, 0, 2), assumed_align=16)
    return a, b, out, offs, cutlass.Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True)


def tvm_ffi_available() -> bool:
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return True


_CACHE_DIR: list[Path | None] = [Path.home() / ".cache" / "te_seq" / "cute"]


def set_cache_dir(path: str | os.PathLike | None) -> None:
    """Where compiled kernels are kept on disk; ``None`` turns the disk cache off."""
    _CACHE_DIR[0] = None if path is None else Path(path)


def cache_dir() -> Path | None:
    return _CACHE_DIR[0]


def _cache_path(cfg: GemmConfig) -> Path | None:
    root = cache_dir()
    if root is None or not tvm_ffi_available():
        return None
    h = hashlib.sha256(repr(cfg).encode())
    h.update(Path(__file__).with_name("grouped_gemm.py").read_bytes())
    h.update(cutlass.__version__.encode() if hasattr(cutlass, "__version__") else b"")
    h.update(repr(cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)).encode())
    h.update(os.environ.get("CUTE_DSL_ARCH", "").encode())
    return root / f"grouped_gemm_{cfg.varlen}_{h.hexdigest()[:24]}.so"


def _save(fn, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
        fn.export_to_c(str(obj), function_name="grouped_gemm")
        libs = cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)
        subprocess.run(["gcc", "-shared", "-o", str(lib), str(obj), *libs], check=True, capture_output=True)
        os.replace(lib, path)  # atomic: concurrent processes see a whole file or none


@functools.lru_cache(maxsize=None)
def compile_gemm(cfg: GemmConfig) -> CompiledGemm:
    """The grouped GEMM for ``cfg``: from memory, else from the disk cache, else compiled."""
    start = time.perf_counter()
    path = _cache_path(cfg)
    if path is not None and path.exists():
        try:
            mod = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
            return CompiledGemm(mod.grouped_gemm, time.perf_counter() - start)
        except Exception as exc:  # a stale or foreign file: recompile
            warnings.warn(f"te_seq cute: ignoring cached kernel {path}: {exc}", stacklevel=2)
    kernel = GroupedGemmKernel(
        cfg.varlen, (128, cfg.tile_n), cfg.cluster_mn, accumulate=cfg.accumulate
    )
    options = "--enable-tvm-ffi" if tvm_ffi_available() else ""
    fn = cute.compile(kernel, *_fake_args(cfg), options=options)
    compiled = CompiledGemm(fn, time.perf_counter() - start)
    if path is not None:
        try:
            _save(fn, path)
        except Exception as exc:  # no compiler, read-only disk...: memory cache only
            warnings.warn(f"te_seq cute: kernel not cached on disk: {exc}", stacklevel=2)
    return compiled
