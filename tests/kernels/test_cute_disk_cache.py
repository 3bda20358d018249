"""The disk cache of compiled CuTe DSL kernels (te_seq.kernels.cute.disk_cache).

What runs where:
- quick (no DSL, no GPU): the key (config, sources, arch, versions, format), and the cache's
  decisions with a fake kernel whose ``export_to_c`` writes bytes and a stubbed loader: disabled,
  unwritable directory, export raising, compile raising, a file that fails to load.
- slow (DSL, CPU: ``CUTE_DSL_ARCH=sm_90a`` in fresh processes through ``compile_for_sm90a``):
  the real ``export_to_c`` and ``load_module``. ``load_module`` works without a GPU, so a second
  process really loads the kernel from the file ("disk"); a garbage or truncated file warns, is
  recompiled and replaced; ``TE_SEQ_DISK_CACHE=0`` writes nothing.
- gpu: a kernel loaded from the cache in a fresh process computes the same output, bit for bit,
  as the freshly compiled one (launching needs the GPU).
"""

from __future__ import annotations

import json
import re
import shutil
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from cute_marks import compile_for_sm90a, gpu, needs_cute, needs_dsl, needs_tvm_ffi

from te_seq.kernels.cute import disk_cache

# ------------------------------------------------------------------ quick: the key


@dataclass(frozen=True)
class _Config:
    """Stands in for compile.GemmConfig (whose module imports cutlass): a frozen dataclass."""

    varlen: str
    dtype: torch.dtype
    tile_n: int = 256


def _digest(cfg: _Config = _Config("m", torch.bfloat16)) -> str:
    return disk_cache.key_digest("gemm", (cfg,))


def test_key_is_stable_and_names_a_c_symbol():
    path, symbol = disk_cache.entry("gemm", (_Config("m", torch.bfloat16),))
    assert _digest() == _digest()
    assert re.fullmatch(r"te_seq_[0-9a-f]{16}", symbol)
    assert path.name == f"gemm-{_digest()}.o"
    assert disk_cache.key_digest("glu", (_Config("m", torch.bfloat16),)) != _digest()


@pytest.mark.parametrize(
    "other",
    [_Config("k", torch.bfloat16), _Config("m", torch.float16), _Config("m", torch.bfloat16, 128)],
)
def test_key_changes_with_the_config(other):
    assert _digest(other) != _digest()


def test_key_changes_when_a_kernel_source_changes(tmp_path, monkeypatch):
    for name in disk_cache.SOURCE_FILES:
        shutil.copy(disk_cache.SOURCE_DIR / name, tmp_path / name)
    monkeypatch.setattr(disk_cache, "SOURCE_DIR", tmp_path)
    before = _digest()
    assert before == _digest()
    for name in disk_cache.SOURCE_FILES:
        original = (tmp_path / name).read_text()
        (tmp_path / name).write_text(original + "\n# edited\n")
        assert _digest() != before, name
        (tmp_path / name).write_text(original)
    assert _digest() == before


def _package_imports(name: str) -> set[str]:
    """Modules of the cute package that ``name`` imports (relative imports, at any depth)."""
    import ast

    tree = ast.parse((disk_cache.SOURCE_DIR / name).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            modules = [node.module] if node.module else [a.name for a in node.names]
            found.update(f"{m}.py" for m in modules)
    return found


def test_source_files_cover_every_module_a_kernel_is_built_from():
    # compile.py, compile_quant.py and what they import from the package, transitively;
    # disk_cache.py itself is versioned by FORMAT_VERSION. A new kernel module missing here
    # would let an edit to it load stale kernels from the disk cache.
    needed, todo = set(), ["compile.py", "compile_quant.py"]
    while todo:
        name = todo.pop()
        if name not in needed and name != "disk_cache.py":
            needed.add(name)
            todo.extend(_package_imports(name))
    assert needed <= set(disk_cache.SOURCE_FILES), needed - set(disk_cache.SOURCE_FILES)
    assert {"grouped_gemm.py", "glu_epilogue.py", "tile_scheduler.py"} <= needed
    assert all((disk_cache.SOURCE_DIR / f).is_file() for f in disk_cache.SOURCE_FILES)


def test_key_changes_with_arch_dsl_version_and_format(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    base = _digest()
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert _digest() != base
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    real_version = disk_cache._package_version
    monkeypatch.setattr(
        disk_cache,
        "_package_version",
        lambda pkg: "0.0.1" if pkg == "nvidia-cutlass-dsl" else real_version(pkg),
    )
    assert _digest() != base
    monkeypatch.setattr(disk_cache, "_package_version", real_version)
    assert _digest() == base
    monkeypatch.setattr(disk_cache, "FORMAT_VERSION", disk_cache.FORMAT_VERSION + 1)
    assert _digest() != base


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.delenv("TE_SEQ_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert disk_cache.cache_dir() == tmp_path / "xdg" / "te_seq" / "cute"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert disk_cache.cache_dir() == Path.home() / ".cache" / "te_seq" / "cute"
    monkeypatch.setenv("TE_SEQ_CACHE_DIR", str(tmp_path / "mine"))
    assert disk_cache.cache_dir() == tmp_path / "mine"


# ------------------------------------------------------------------ quick: fake kernels


class _FakeKernel:
    """A compiled kernel as the cache sees it: something with ``export_to_c``."""

    def __init__(self, export_error: Exception | None = None):
        self.export_error = export_error
        self.exported_to: Path | None = None

    def export_to_c(self, path: str, function_name: str) -> None:
        self.exported_to = Path(path)
        if self.export_error is not None:
            Path(path).write_bytes(b"half an object")  # as if the export died while writing
            raise self.export_error
        Path(path).write_bytes(f"object of {function_name}".encode())


class _Builds:
    """A ``build`` callable that counts its calls."""

    def __init__(self, kernel: object):
        self.kernel, self.calls = kernel, 0

    def __call__(self) -> object:
        self.calls += 1
        return self.kernel


_KEY = (_Config("m", torch.bfloat16),)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """An empty cache directory in use, and a loader that never imports cutlass here."""
    monkeypatch.setenv("TE_SEQ_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TE_SEQ_DISK_CACHE", raising=False)
    monkeypatch.setattr(disk_cache, "_load_exported", lambda path, symbol: ("loaded", symbol))
    return tmp_path / "cache"


def _files(directory: Path) -> list[Path]:
    return sorted(directory.iterdir()) if directory.exists() else []


def test_fake_round_trip_writes_once_then_loads(cache_dir):
    build = _Builds(_FakeKernel())
    fn, _, source = disk_cache.load_or_compile("gemm", _KEY, build)
    assert (fn, source, build.calls) == (build.kernel, "compiled", 1)
    path, symbol = disk_cache.entry("gemm", _KEY)
    assert _files(cache_dir) == [path]
    assert path.read_bytes() == f"object of {symbol}".encode()
    # written atomically: exported to another file of the directory, then renamed
    assert build.kernel.exported_to.parent == cache_dir
    assert build.kernel.exported_to != path and build.kernel.exported_to.suffix == ".o"
    fn, _, source = disk_cache.load_or_compile("gemm", _KEY, build)
    assert (fn, source, build.calls) == (("loaded", symbol), "disk", 1)


def test_disabled_writes_nothing(cache_dir, monkeypatch):
    monkeypatch.setenv("TE_SEQ_DISK_CACHE", "0")
    build = _Builds(_FakeKernel())
    for _ in range(2):
        assert disk_cache.load_or_compile("gemm", _KEY, build)[2] == "compiled"
    assert build.calls == 2
    assert not cache_dir.exists()


@pytest.mark.parametrize("export_works", [True, False], ids=["rewritten", "export_fails"])
def test_file_that_fails_to_load_is_deleted(cache_dir, monkeypatch, export_works):
    path, symbol = disk_cache.entry("gemm", _KEY)
    cache_dir.mkdir()
    path.write_bytes(b"garbage")

    def broken_loader(p, s):
        raise RuntimeError("not an object file")

    monkeypatch.setattr(disk_cache, "_load_exported", broken_loader)
    build = _Builds(_FakeKernel(None if export_works else RuntimeError("export broke")))
    with pytest.warns(RuntimeWarning) as record:
        fn, _, source = disk_cache.load_or_compile("gemm", _KEY, build)
    assert (fn, source, build.calls) == (build.kernel, "compiled", 1)
    messages = [str(w.message) for w in record]
    assert re.search(rf"could not load {re.escape(str(path))}.*not an object", messages[0])
    if export_works:
        assert len(messages) == 1
        assert _files(cache_dir) == [path]
        assert path.read_bytes() == f"object of {symbol}".encode()
    else:
        assert len(messages) == 2 and "could not write" in messages[1]
        assert _files(cache_dir) == []


def test_unwritable_directory_warns_and_returns_the_kernel(tmp_path, monkeypatch, cache_dir):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("TE_SEQ_CACHE_DIR", str(tmp_path / "a_file" / "cache"))
    build = _Builds(_FakeKernel())
    with pytest.warns(RuntimeWarning, match=r"could not write .*a_file.*\.o") as record:
        fn, _, source = disk_cache.load_or_compile("gemm", _KEY, build)
    assert (fn, source, len(record)) == (build.kernel, "compiled", 1)


def test_export_error_warns_and_leaves_no_file(cache_dir):
    build = _Builds(_FakeKernel(export_error=RuntimeError("export broke")))
    with pytest.warns(RuntimeWarning, match=r"could not write .*gemm-.*\.o.*export broke") as rec:
        fn, _, source = disk_cache.load_or_compile("gemm", _KEY, build)
    assert (fn, source, len(rec)) == (build.kernel, "compiled", 1)
    assert _files(cache_dir) == []  # no half-written entry, and the temp file is gone


def test_compile_error_propagates_and_writes_nothing(cache_dir):
    def failing_build():
        raise ValueError("kernel does not compile")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no warning either
        with pytest.raises(ValueError, match="kernel does not compile"):
            disk_cache.load_or_compile("gemm", _KEY, failing_build)
    assert _files(cache_dir) == []


def test_unreadable_sources_compile_uncached(cache_dir, monkeypatch, tmp_path):
    monkeypatch.setattr(disk_cache, "SOURCE_DIR", tmp_path / "missing")
    build = _Builds(_FakeKernel())
    with pytest.warns(RuntimeWarning, match=r"no cache entry for gemm .*FileNotFoundError"):
        assert disk_cache.load_or_compile("gemm", _KEY, build)[2] == "compiled"
    assert _files(cache_dir) == []


# ------------------------------------------------------------------ slow: the DSL, CPU only

# One GemmConfig through compile_gemm, twice in the process (the second after clearing the
# in-memory cache, so it goes to disk again); what happened goes to $TE_SEQ_TEST_REPORT.
_SCRIPT = textwrap.dedent(
    """
    import json, os, warnings
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import torch
    from te_seq.kernels.cute.compile import GemmConfig, compile_gemm
    cfg = GemmConfig("m", torch.bfloat16, torch.bfloat16, "k", 256, (1, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = compile_gemm(cfg)
        compile_gemm.cache_clear()
        again = compile_gemm(cfg)
    report = {
        "source": first.source,
        "seconds": first.compile_s,
        "fn": type(first.fn).__module__ + "." + type(first.fn).__name__,
        "again": again.source,
        "warnings": [str(w.message) for w in caught],
    }
    with open(os.environ["TE_SEQ_TEST_REPORT"], "w") as f:
        json.dump(report, f)
    print(report)
    print("ALL COMPILED")
    """
)

# Each run is a fresh process importing the DSL with one compile (~5-8 s): marked slow like the
# other compile-only tests (CI runs them, `-m "not slow"` quick runs skip them).


def _run(cache: Path, report: Path, script: str = _SCRIPT, **env: str) -> dict:
    """Run ``script`` through ``compile_for_sm90a`` with ``cache`` as the cache directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TE_SEQ_CACHE_DIR", str(cache))
        mp.setenv("TE_SEQ_TEST_REPORT", str(report))
        mp.delenv("TE_SEQ_DISK_CACHE", raising=False)
        for name, value in env.items():
            mp.setenv(name, value)
        compile_for_sm90a(script, timeout=600)
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[Path, dict]:
    """A cache filled by one fresh process (shared; tests work on copies)."""
    root = tmp_path_factory.mktemp("first_run")
    return root / "cache", _run(root / "cache", root / "report.json")


def _copy(first: tuple[Path, dict], tmp_path: Path) -> tuple[Path, Path]:
    cache = tmp_path / "cache"
    shutil.copytree(first[0], cache)
    (path,) = _files(cache)
    return cache, path


@pytest.mark.slow
@needs_dsl
@needs_tvm_ffi
def test_first_process_compiles_and_writes_one_file(first_run):
    cache, report = first_run
    assert report["source"] == "compiled", report
    assert report["again"] == "disk", report  # same process, in-memory cache cleared
    assert report["warnings"] == []
    (path,) = _files(cache)
    assert re.fullmatch(r"gemm-[0-9a-f]{64}\.o", path.name)
    assert path.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.slow
@needs_dsl
@needs_tvm_ffi
def test_next_process_loads_from_disk(first_run, tmp_path):
    cache, path = _copy(first_run, tmp_path)
    stored = path.read_bytes()
    report = _run(cache, tmp_path / "report.json")
    assert report["source"] == "disk", report
    assert report["fn"] == "tvm_ffi.core.Function", report  # what load_module returns
    assert report["warnings"] == []
    assert _files(cache) == [path] and path.read_bytes() == stored


@pytest.mark.slow
@needs_dsl
@needs_tvm_ffi
@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_broken_file_warns_recompiles_and_is_replaced(first_run, tmp_path, damage):
    cache, path = _copy(first_run, tmp_path)
    stored = path.read_bytes()
    broken = b"not an object file\n" * 100 if damage == "garbage" else stored[: len(stored) // 2]
    path.write_bytes(broken)
    report = _run(cache, tmp_path / "report.json")
    assert report["source"] == "compiled", report
    assert len(report["warnings"]) == 1, report
    assert f"could not load {path}" in report["warnings"][0]
    assert report["again"] == "disk", report  # the rewritten file loads
    assert _files(cache) == [path]
    assert path.read_bytes()[:4] == b"\x7fELF" and path.read_bytes() != broken


@pytest.mark.slow
@needs_dsl
@needs_tvm_ffi
def test_disabled_process_writes_nothing(tmp_path):
    cache = tmp_path / "cache"
    report = _run(cache, tmp_path / "report.json", TE_SEQ_DISK_CACHE="0")
    assert (report["source"], report["again"]) == ("compiled", "compiled"), report
    assert report["warnings"] == []
    assert not cache.exists()


# Without apache-tvm-ffi (hidden from the process: a None entry in sys.modules makes its import
# fail): kernels still compile, one warning per process says the disk cache is off and names the
# package, nothing is written, and the cute backend reports itself unavailable naming the package.
_NO_TVM_FFI_SCRIPT = "import sys\nsys.modules['tvm_ffi'] = None\n" + _SCRIPT + textwrap.dedent(
    """
    from te_seq.kernels import cute
    cute.available.cache_clear()
    import torch.cuda
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda *a: (9, 0)
    report["available"] = list(cute.available())
    with open(os.environ["TE_SEQ_TEST_REPORT"], "w") as f:
        json.dump(report, f)
    """
)


@pytest.mark.slow
@needs_dsl
def test_without_tvm_ffi_compiles_uncached_and_warns_once(tmp_path):
    cache = tmp_path / "cache"
    report = _run(cache, tmp_path / "report.json", _NO_TVM_FFI_SCRIPT)
    assert (report["source"], report["again"]) == ("compiled", "compiled"), report
    assert len(report["warnings"]) == 1, report
    assert "apache-tvm-ffi is not installed" in report["warnings"][0]
    assert "not cached on disk" in report["warnings"][0]
    assert not cache.exists()
    ok, why = report["available"]
    assert not ok and "apache-tvm-ffi" in why and "te_seq[cute]" in why, report


# ------------------------------------------------------------------ GPU: loaded kernels run

# grouped_mm once; compile_gemm then returns (from memory) the kernel grouped_mm used. The
# output goes next to the report for the next process to compare with.
_GPU_SCRIPT = textwrap.dedent(
    """
    import json, os
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import torch
    from te_seq.kernels import cute, reference
    from te_seq.kernels.cute.compile import GemmConfig, compile_gemm
    torch.manual_seed(0)
    a = torch.randn(700, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 512, 256, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([100, 100, 450, 700], device="cuda", dtype=torch.int32)
    out = cute.grouped_mm(a, w.transpose(1, 2), offs, tiling=cute.MM_TILING)
    torch.cuda.synchronize()
    used = compile_gemm(GemmConfig("m", torch.bfloat16, torch.bfloat16, "k", 256, (1, 2)))
    ref = reference.grouped_mm(a.double(), w.transpose(1, 2).double(), offs)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    report_path = os.environ["TE_SEQ_TEST_REPORT"]
    torch.save(out.cpu(), report_path + ".pt")
    with open(report_path, "w") as f:
        json.dump({"source": used.source, "rel_err": err}, f)
    print("ALL COMPILED")
    """
)


@gpu
@needs_cute
def test_kernel_loaded_from_disk_runs_like_the_compiled_one(tmp_path):
    cache = tmp_path / "cache"
    first = _run(cache, tmp_path / "first.json", _GPU_SCRIPT)
    second = _run(cache, tmp_path / "second.json", _GPU_SCRIPT)
    assert (first["source"], second["source"]) == ("compiled", "disk")
    assert first["rel_err"] < 1e-2 and second["rel_err"] < 1e-2
    out_compiled = torch.load(tmp_path / "first.json.pt")
    out_loaded = torch.load(tmp_path / "second.json.pt")
    assert torch.equal(out_compiled, out_loaded)
    assert len(_files(cache)) == 1
