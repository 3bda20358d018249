"""Every third-party module that te_seq (or its tests) imports is declared in pyproject.toml.

A fresh install gets exactly what pyproject.toml declares. An import of an undeclared package
works on a machine where someone installed it by hand and breaks a user's install (it happened:
the disk cache used apache-tvm-ffi, which no extra declared). This walks the sources' imports
(module level and function level; relative imports and the standard library excluded), maps each
top-level module to the distribution that provides it in this environment, and checks that the
distribution is declared: te_seq's imports in `dependencies` or an extra, the tests' imports
likewise (the test extra pulls in the rest).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib (Python >= 3.11) reads pyproject.toml")

ROOT = Path(__file__).resolve().parents[1]
# Modules of this repository that tests import by name (tests/ and tests/kernels/ are on the path).
_LOCAL = {
    "te_seq", "conftest", "op_specs", "megatron_like", "cute_marks", "fuzz_chains", "fuzz_runner",
    "compile_helpers", "dist_harness", "test_distributed_ops", "test_expert_exchange", "test_fsdp",
    "test_fusions",  # its window factories and user fused op serve other tests too
    "test_routing",  # its MoE block and per-token reference serve the channel and GPU tests
    "test_channels",  # its residual block serves tests/test_channels_compile.py
    "test_hf_moe",  # its block builders serve tests/test_hf_moe_gpu.py
    "test_fp8",  # its independent FP8 emulation serves tests/test_fp8_torch.py
    "test_expert_parallel_ops",  # its rank checks run again on NCCL (test_distributed_gpu.py)
    "test_fp8_torch",  # its relative-error helper serves tests/test_fp8_cute*.py
    "test_fp8_cute",  # its faked Hopper GPU and kernel recorder serve tests/test_fp8_backward.py
    "test_fp8_glu_epilogue",  # its faked FP8 GLU kernels serve tests/test_fp8_cute_block.py
    "test_fp8_cute_block",  # its block-kernel maths serve tests/test_fp8_cute_block_gpu.py
    "test_fp8_backward",  # its recipes, cases and runner serve tests/test_fp8_memory.py
    "test_fp8_memory",  # its saved-bytes measure serves tests/test_fp8_hp_wgrad.py
    "aten_log",  # the aten-op recorder of the host-path tests
    "test_cute_quant",  # its span cast emulation serves tests/kernels/test_cute_row_amax.py
    "test_cute_block_fp8",  # its block operands and emulation serve test_cute_block_glu.py
    # benchmarks/ (tests/test_benchmark_dry_run.py puts it on the path)
    "_common", "grad_modes", "mlp_case", "mlp_measure", "mlp_report", "peers", "peer_quack",
    "bench_fp8_gemm",  # tests/test_bench_fp8_gemm.py
    "bench_grouped_mlp",  # its env variant: tests/test_benchmark_dry_run.py
    "bench_grouped_gemm",  # its QuACK GEMMs: tests/test_benchmark_dry_run.py
    "schedule_model",  # the wgrad unit schedules: tests/test_benchmark_dry_run.py
    "step_roofline",  # the per-kernel roofline: tests/test_benchmark_dry_run.py
    "profile_launch",  # its stub kernels serve tests/kernels/test_cute_launch_plan.py
    "profile_host",  # its MLP builder (Megatron mode too): tests/test_benchmark_dry_run.py
    "ncu_stalls", "ncu_target",  # the Nsight Compute helpers: tests/test_benchmark_dry_run.py
    "probe_clocks", "probe_autograd_threads",  # sustained-step probes: test_benchmark_dry_run.py
    "probe_wgrad_epilogue",  # its PTX check of the epilogue cuts: test_benchmark_dry_run.py
    "profile_kernels",  # its burst timing (host_feed): tests/test_benchmark_dry_run.py
}


# Optional modules named unlike their distribution. On a machine without them (no CuTe DSL) such
# a module passes when that distribution is declared; where it is installed, its owner is checked.
_MODULE_DISTRIBUTION = {"cutlass": "nvidia-cutlass-dsl", "tvm_ffi": "apache-tvm-ffi"}


def _normalize(name: str) -> str:
    """A distribution name as packaging compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalize(re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0])


def _declared() -> dict[str, set[str]]:
    """Declared distributions: 'dependencies' and each extra (self-references resolved)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"dependencies": {_requirement_name(r) for r in project.get("dependencies", [])}}
    for extra, reqs in project.get("optional-dependencies", {}).items():
        groups[extra] = {_requirement_name(r) for r in reqs}
    own = _normalize(project["name"])
    for names in groups.values():
        for ref in [n for n in names if n == own]:
            names.discard(ref)
    for extra, reqs in project.get("optional-dependencies", {}).items():
        for r in reqs:
            inner = re.match(rf"\s*{re.escape(project['name'])}\[([^\]]+)\]", r)
            for name in inner.group(1).split(",") if inner else []:
                groups[extra] |= groups[name.strip()]
    return groups


def _imported_modules(folder: Path) -> dict[str, list[str]]:
    """Top-level module name -> files importing it (absolute imports only)."""
    found: dict[str, list[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], []).append(str(path.relative_to(ROOT)))
    return found


def _third_party(found: dict[str, list[str]]) -> dict[str, list[str]]:
    skip = set(sys.stdlib_module_names) | _LOCAL | {"__future__"}
    return {module: files for module, files in found.items() if module not in skip}


def _owner_of(path: Path) -> str | None:
    """The installed distribution whose RECORD lists `path`."""
    for dist in importlib.metadata.distributions():
        base = Path(dist.locate_file("")).resolve()
        if base not in path.parents:
            continue
        relative = path.relative_to(base).as_posix()
        if any(str(file) == relative for file in dist.files or []):
            return _normalize(dist.metadata["Name"])
    return None


def _distributions(module: str) -> set[str]:
    """Distributions providing `module`: by top-level name, else by the file it imports from
    (some packages live in a folder that a .pth file puts on the path, e.g. the CuTe DSL)."""
    named = importlib.metadata.packages_distributions().get(module, [])
    if named:
        return {_normalize(d) for d in named}
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return set()
    owner = _owner_of(Path(spec.origin).resolve())
    return {owner} if owner else set()


def _with_requirements(names: set[str]) -> set[str]:
    """`names` and everything they require in turn (without extras): what installing them brings,
    e.g. nvidia-cutlass-dsl brings the nvidia-cutlass-dsl-libs-core that holds `cutlass`."""
    todo, seen = list(names), set(names)
    while todo:
        try:
            requires = importlib.metadata.requires(todo.pop()) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for req in requires:
            name = _requirement_name(req)
            if "extra ==" not in req and name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def _undeclared(folder: str, allowed: set[str]) -> list[str]:
    allowed = _with_requirements(allowed)
    problems = []
    for module, files in sorted(_third_party(_imported_modules(ROOT / folder)).items()):
        dists = _distributions(module)
        where = ", ".join(sorted(set(files))[:3])
        if not dists and _normalize(_MODULE_DISTRIBUTION.get(module, module)) in allowed:
            continue  # an optional package not installed here, declared under its own name
        if not dists:
            problems.append(f"{module!r} (imported in {where}) is not installed here")
        elif not dists & allowed:
            problems.append(
                f"{module!r} (imported in {where}) comes from {sorted(dists)}, "
                f"which pyproject.toml does not declare"
            )
    return problems


def test_declared_groups_parse():
    groups = _declared()
    assert "torch" in groups["dependencies"]
    assert {"nvidia-cutlass-dsl", "apache-tvm-ffi"} <= groups["cute"]
    assert groups["cute"] <= groups["test"], "the test extra installs the cute extra"


def test_the_walk_finds_te_seqs_optional_imports():
    """The walk sees function-level imports too (the DSL is imported lazily)."""
    modules = _third_party(_imported_modules(ROOT / "te_seq"))
    assert {"torch", "cutlass", "tvm_ffi"} <= set(modules)


def test_every_te_seq_import_is_declared():
    groups = _declared()
    # the `bench` extra holds the benchmark peers (QuACK, torchao): te_seq never imports them
    allowed = set().union(*(names for extra, names in groups.items() if extra != "bench"))
    assert _undeclared("te_seq", allowed) == []


def test_te_seq_never_imports_the_benchmark_peers():
    """The peers are benchmarks/ only: te_seq works (and is measured) without them."""
    modules = set(_third_party(_imported_modules(ROOT / "te_seq")))
    assert not modules & {"quack", "torchao"}
    assert {"quack-kernels", "torchao"} <= _declared()["bench"]
    assert not _declared()["bench"] & _declared()["test"], "CI installs [test]: no peers there"


def test_every_test_import_is_declared():
    groups = _declared()
    assert _undeclared("tests", groups["dependencies"] | groups["test"]) == []


def test_an_undeclared_import_is_reported(tmp_path, monkeypatch):
    """The check can fail: a module from a distribution outside the allowed set is named."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("def f():\n    import torch\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (problem,) = _undeclared("pkg", allowed={"numpy"})
    assert "'torch'" in problem and "does not declare" in problem


def test_an_uninstalled_import_passes_only_when_declared_by_name(tmp_path, monkeypatch):
    """A module that is not installed here (an optional extra such as transformers on a machine
    without it) passes when a declared distribution has its name, and is reported otherwise."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("import not_a_real_package_xyz\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _undeclared("pkg", allowed={"not-a-real-package-xyz"}) == []
    (problem,) = _undeclared("pkg", allowed={"numpy"})
    assert "'not_a_real_package_xyz'" in problem and "not installed here" in problem


def test_an_uninstalled_module_passes_when_its_distribution_is_declared(tmp_path, monkeypatch):
    """An optional module named unlike its distribution (the CuTe DSL's `cutlass` from
    nvidia-cutlass-dsl), not installed here, passes only when that distribution is declared."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("import not_a_real_module_abc\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setitem(_MODULE_DISTRIBUTION, "not_a_real_module_abc", "real-dist-name")
    assert _undeclared("pkg", allowed={"real-dist-name"}) == []
    (problem,) = _undeclared("pkg", allowed={"not-a-real-module-abc"})
    assert "'not_a_real_module_abc'" in problem and "not installed here" in problem
