"""Shared test setup: deterministic data, and no global te_seq state leaking between tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import te_seq
from te_seq.core import fp8_gemm


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` skip, with the reason, where CUDA is unavailable."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Fresh random data that is the same on every run (failures reproduce)."""
    torch.manual_seed(1234)


@pytest.fixture(autouse=True)
def _fresh_fp8_decisions() -> None:
    """FP8 per-call decisions are cached per process; tests fake GPUs and kernel checks."""
    fp8_gemm.clear_decisions()


@pytest.fixture
def tiling_env(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """``tiling_env(name, value)`` sets (None: unsets) one of the cute kernels' tiling
    variables and re-reads them (``launch.refresh_tiling_settings``); all are unset to start
    with, and re-read from the real environment afterwards."""
    from te_seq.kernels.cute import launch

    def put(name: str, value: str | None) -> None:
        assert name in launch.TILING_ENV, name
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        launch.refresh_tiling_settings()

    for name in launch.TILING_ENV:
        put(name, None)
    yield put
    monkeypatch.undo()
    launch.refresh_tiling_settings()


@pytest.fixture(autouse=True)
def _restore_te_seq_state() -> Iterator[None]:
    """Undo what a test did to the registry (user fusions, enabled flags) and the backend."""
    before = {f.name: f.enabled for f in te_seq.list_fusions()}
    backend_before = te_seq.current_backend()
    yield
    for record in te_seq.list_fusions():
        if record.name not in before:
            te_seq.unregister_fusion(record.name)
        elif before[record.name]:
            te_seq.enable_fusion(record.name)
        else:
            te_seq.disable_fusion(record.name)
    te_seq.set_backend(backend_before)


@pytest.fixture(params=["torch", "cute"])
def gpu_backend(request: pytest.FixtureRequest) -> str:
    """The GPU backends by name, each test run once per backend; skipped (with the reason)
    where a backend cannot run (no CUDA, no CuTe DSL)."""
    from te_seq.kernels.backend import backend_available

    available, reason = backend_available(request.param)
    if not available:
        pytest.skip(f"{request.param} backend unavailable: {reason}")
    return request.param
