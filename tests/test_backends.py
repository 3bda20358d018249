"""Kernel backend selection (API.md §6) on a CPU machine, and the "torch" backend's CPU path."""

from __future__ import annotations

import contextlib

import pytest
import torch
from op_specs import randomize_params

import te_seq
from te_seq import ops

# Shape legend: T rows, H hidden, F ffn, G groups.
T, H, F, G = 9, 16, 8, 4
ENTER = [te_seq.backend, te_seq.set_backend]  # both ways of choosing a backend


def _torch_backend_or_skip() -> None:
    from te_seq.kernels import torch_backend

    ok, reason = torch_backend.available()
    if not ok:
        pytest.skip(f"torch backend unavailable: {reason}")


def test_backend_context_manager_and_set_backend() -> None:
    assert te_seq.current_backend() == "auto"
    with te_seq.backend("reference"):
        assert te_seq.current_backend() == "reference"
        with te_seq.backend("auto"):
            assert te_seq.current_backend() == "auto"
        assert te_seq.current_backend() == "reference"
    assert te_seq.current_backend() == "auto"
    te_seq.set_backend("reference")
    assert te_seq.current_backend() == "reference"
    with te_seq.backend("auto"):
        assert te_seq.current_backend() == "auto"
    assert te_seq.current_backend() == "reference"  # the conftest fixture restores "auto"


@pytest.mark.parametrize("enter", ENTER, ids=["backend", "set_backend"])
def test_unknown_backend_is_a_value_error(enter) -> None:
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'; choose one of \('auto', "):
        with_or_call(enter, "tpu")
    assert te_seq.current_backend() == "auto"


def with_or_call(enter, name: str) -> None:
    result = enter(name)
    if result is not None:  # a context manager: errors come on entering it
        with result:
            pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's refusal")
@pytest.mark.parametrize("enter", ENTER, ids=["backend", "set_backend"])
def test_cute_backend_on_cpu_only_machine_says_why(enter) -> None:
    with pytest.raises(RuntimeError, match=r"backend 'cute' is not available: .*CUDA"):
        with_or_call(enter, "cute")
    assert te_seq.current_backend() == "auto"


def _mlp(dtype: torch.dtype, act, bias: bool) -> te_seq.Sequential:
    width = 2 * F if act.gated else F
    seq = te_seq.Sequential(ops.GroupedLinear(G, H, width, bias=bias, dtype=dtype), act,
                            ops.GroupedLinear(G, F, H, bias=bias, dtype=dtype))
    randomize_params(seq)
    return seq


def _run(seq, x, extras):
    x = x.clone().requires_grad_(True)
    for p in seq.parameters():
        p.grad = None
    y = seq(x, *extras)
    y.backward(torch.ones_like(y) * 0.5 + torch.arange(y.shape[-1], dtype=y.dtype) / y.shape[-1])
    return [y.detach(), x.grad, *[p.grad for p in seq.parameters()]], seq.fusion_plan()


def test_auto_on_cpu_plans_reference() -> None:
    seq = _mlp(torch.float64, ops.SwiGLU(), bias=True)
    splits = torch.tensor([4, 0, 5, 0])
    _, plan = _run(seq, torch.randn(T, H, dtype=torch.float64), (splits, splits))
    assert [(s.name, s.backend) for s in plan.forward] == [("GroupedMLP", "reference")]
    assert [(s.name, s.backend) for s in plan.backward] == [("GroupedMLP", "reference")]
    with te_seq.fusions_disabled():
        _, plan = _run(seq, torch.randn(T, H, dtype=torch.float64), (splits, splits))
    assert {s.backend for s in plan.forward + plan.backward} == {"reference"}


TORCH_CASES = [  # (dtype, tolerance): float32 takes torch._grouped_mm's CPU kernel, float64 the
    (torch.float32, 1e-5),  # exact tiled path; both must equal the reference
    (torch.float64, 1e-12),
]


@pytest.mark.parametrize("dtype,tol", TORCH_CASES, ids=["float32", "float64"])
@pytest.mark.parametrize("fused", [True, False], ids=["GroupedMLP", "unfused"])
@pytest.mark.parametrize("act", ["ScaledSwiGLU", "GELU"])  # gated with probs, and plain
def test_torch_backend_matches_reference(dtype, tol, fused: bool, act: str) -> None:
    _torch_backend_or_skip()
    seq = _mlp(dtype, getattr(ops, act)(), bias=True)
    splits = torch.tensor([4, 0, 5, 0])  # empty groups, unaligned sizes
    probs = (torch.rand(T, dtype=dtype) + 0.5,) if act == "ScaledSwiGLU" else ()
    extras = (splits, *probs, splits)
    x = torch.randn(T, H, dtype=dtype)
    with te_seq.fusions_disabled() if not fused else contextlib.nullcontext():
        expected, ref_plan = _run(seq, x, extras)
        with te_seq.backend("torch"):
            got, plan = _run(seq, x, extras)
    assert plan is not ref_plan
    grouped = {"GroupedMLP", "GroupedLinear"}
    for step in plan.forward + plan.backward:
        assert step.backend == ("torch" if step.name in grouped else "reference"), step
    assert any(s.name == ("GroupedMLP" if fused else "GroupedLinear") for s in plan.forward)
    for i, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"tensor {i}: {m}")


def test_torch_backend_grouped_linear_single_grouped_weight() -> None:
    _torch_backend_or_skip()
    seq = te_seq.Sequential(ops.GroupedLinear(G, H, F, single_grouped_weight=True,
                                              single_grouped_bias=True))
    randomize_params(seq)
    splits = torch.tensor([0, 3, 6, 0])
    x = torch.randn(T, H)
    expected, _ = _run(seq, x, (splits,))
    with te_seq.backend("torch"):
        got, plan = _run(seq, x, (splits,))
    assert [(s.name, s.backend) for s in plan.forward] == [("GroupedLinear", "torch")]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
