"""The on-disk cache of compiled CuTe DSL kernels: one TVM-FFI object file per kernel config.

A kernel compiled with ``--enable-tvm-ffi`` is exported with ``export_to_c`` (a ~50 KB ``.o``)
and, in a later process, loaded with ``cutlass.cute.runtime.load_module`` instead of compiled
again (a load takes under 0.3 s, a compile 2-8 s).

File: ``<dir>/<name>-<sha256>.o``; the sha256 covers the caller's key (the kernel config), the
versions of nvidia-cutlass-dsl and apache-tvm-ffi, ``CUTE_DSL_ARCH`` (else "native" and the
GPU's compute capability), the sha256 of the kernel sources (``SOURCE_FILES``) and
``FORMAT_VERSION``, so anything that can change the binary gives a new file (old files are
never read again; delete the directory to reclaim them).
Directory: ``TE_SEQ_CACHE_DIR``, else ``$XDG_CACHE_HOME/te_seq/cute``, else
``~/.cache/te_seq/cute``. ``TE_SEQ_DISK_CACHE=0`` turns the cache off.

The cache can only cost a compile: failing to build a key, read, load or write an entry warns
once (naming the file and the error) and compiles; a file that fails to load is deleted. Only
a compile error propagates, and nothing is written then. This module imports cutlass only to
load a file, so its keys can be computed (and tested) without the DSL.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

# Bump when the file layout, the key or the export/load calls change.
FORMAT_VERSION = 1
# The sources a compiled kernel depends on (in this package): ``compile.py`` and every module it
# imports from here, directly or not, but this one (``FORMAT_VERSION`` covers it); an edit gives
# new cache keys.
SOURCE_DIR = Path(__file__).resolve().parent
SOURCE_FILES = (
    "compile.py",
    "compile_quant.py",
    "grouped_gemm.py",
    "tile_scheduler.py",
    "mainloop.py",
    "store_epilogue.py",
    "ragged.py",
    "routed.py",
    "glu_epilogue.py",
    "glu_h_loads.py",
    "glu_maths.py",
    "row_values.py",
    "act_epilogue.py",
    "bias_epilogue.py",
    "scale_epilogue.py",
    "scaled_glu.py",
    "block_glu.py",
    "quant_kernels.py",
    "span_kernels.py",
    "block_span_kernels.py",
    "row_amax_kernels.py",
    "strip_kernels.py",
    "block_scaled.py",
    "offsets_kernel.py",
    "block_wgrad.py",
    "promote.py",
    "launch.py",  # PINGPONG_TILE_WIDTHS
)
_VERSIONED_PACKAGES = ("nvidia-cutlass-dsl", "apache-tvm-ffi")
_NAME = re.compile(r"[a-z][a-z0-9_]*")


def enabled() -> bool:
    """Whether the disk cache is on (``TE_SEQ_DISK_CACHE=0`` turns it off)."""
    return os.environ.get("TE_SEQ_DISK_CACHE", "1").strip() != "0"


def cache_dir() -> Path:
    """``TE_SEQ_CACHE_DIR``, else ``$XDG_CACHE_HOME/te_seq/cute``, else ``~/.cache/te_seq/cute``."""
    if os.environ.get("TE_SEQ_CACHE_DIR"):
        return Path(os.environ["TE_SEQ_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "te_seq" / "cute"


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _target_arch() -> str:
    """``CUTE_DSL_ARCH``, else "native" and the current GPU's compute capability (a directory
    shared by machines with different GPUs then keeps one file per GPU kind)."""
    if os.environ.get("CUTE_DSL_ARCH"):
        return os.environ["CUTE_DSL_ARCH"]
    import torch

    if not torch.cuda.is_available():
        return "native"
    return "native sm_{}{}".format(*torch.cuda.get_device_capability())


def fingerprint() -> dict[str, str]:
    """Everything a cached kernel depends on besides its own config (read afresh each call)."""
    parts = {"format": str(FORMAT_VERSION), "arch": _target_arch()}
    parts.update({pkg: _package_version(pkg) for pkg in _VERSIONED_PACKAGES})
    parts.update({f"source {f}": _file_sha256(SOURCE_DIR / f) for f in SOURCE_FILES})
    return parts


def key_digest(name: str, key: tuple, env: dict[str, str] | None = None) -> str:
    """The sha256 (hex) naming a kernel's file: its name, key and ``env`` (``fingerprint()``)."""
    env = fingerprint() if env is None else env
    text = repr((name, tuple(repr(part) for part in key), sorted(env.items())))
    return hashlib.sha256(text.encode()).hexdigest()


def entry(name: str, key: tuple) -> tuple[Path, str]:
    """The file of a kernel and its exported symbol (a C identifier unique per digest)."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"kernel name {name!r} must match {_NAME.pattern}")
    digest = key_digest(name, key)
    return cache_dir() / f"{name}-{digest}.o", f"te_seq_{digest[:16]}"


def _warn(message: str) -> None:
    warnings.warn(f"te_seq disk cache: {message}", RuntimeWarning, stacklevel=2)


def _load_exported(path: Path, symbol: str) -> object:
    """Load ``symbol`` from an exported TVM-FFI object file (imports cutlass)."""
    from cutlass.cute.runtime import load_module

    return getattr(load_module(str(path), enable_tvm_ffi=True), symbol)


def _try_load(path: Path, symbol: str) -> tuple[object, float] | None:
    """The kernel stored at ``path`` and the load time, or None (missing, or deleted: broken)."""
    try:
        if not path.is_file():
            return None
        start = time.perf_counter()
        fn = _load_exported(path, symbol)
        return fn, time.perf_counter() - start
    except Exception as exc:
        _warn(f"could not load {path} ({type(exc).__name__}: {exc}); deleting it and compiling")
        _remove(path)
        return None


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _try_store(fn: object, path: Path, symbol: str) -> None:
    """Export ``fn`` to ``path`` atomically (temp file in the same directory, then rename)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp.o")
        os.close(handle)
        fn.export_to_c(tmp, function_name=symbol)
        os.chmod(tmp, 0o644)  # mkstemp made it private; compiled kernels are no secret
        os.replace(tmp, path)
    except Exception as exc:
        _warn(f"could not write {path} ({type(exc).__name__}: {exc}); the kernel stays in memory")
        if tmp is not None:
            _remove(Path(tmp))


def _timed_build(build: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    fn = build()
    return fn, time.perf_counter() - start


def load_or_compile(
    name: str, key: tuple, build: Callable[[], object]
) -> tuple[object, float, str]:
    """A TVM-FFI kernel from the disk cache, else from ``build()`` (then stored).

    ``name``: the kernel family ("gemm", "glu"); ``key``: what the compile is specialised on
    (hashed through ``repr``); ``build``: compiles it (``cute.compile(..., "--enable-tvm-ffi")``).
    Returns (kernel, seconds the load or compile took, "disk" or "compiled").
    """
    if not enabled():
        return (*_timed_build(build), "compiled")
    try:
        path, symbol = entry(name, key)
    except Exception as exc:
        _warn(f"no cache entry for {name} ({type(exc).__name__}: {exc}); compiling uncached")
        return (*_timed_build(build), "compiled")
    loaded = _try_load(path, symbol)
    if loaded is not None:
        return (*loaded, "disk")
    fn, seconds = _timed_build(build)
    _try_store(fn, path, symbol)
    return fn, seconds, "compiled"
