"""Kernel backend selection on a CPU machine, the "torch" backend's CPU path, the backend
registry, and the plan-time choice of the backend each step runs on (with a test backend)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from op_specs import randomize_params

import te_seq
from te_seq import kernels, ops
from te_seq.kernels.backend import Backend
from te_seq.kernels.reference import ReferenceBackend

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


# --- the Backend registry and the plan-time choice -------------------------------------------

class PickyBackend(ReferenceBackend):
    """A test backend: the reference maths, but its grouped GEMMs take only K and N that are
    multiples of 8 (as cute's do). It records every kernel call, so a test can tell which
    backend really ran."""

    name = "picky"
    fallback = False
    auto_priority = 100  # ahead of cute and torch
    auto_device_types = None  # "auto" considers it on CPU too

    def __init__(self) -> None:
        self.calls: list[str] = []

    def supports(self, kernel: str, **static) -> tuple[bool, str]:
        if kernel in ("grouped_mm", "grouped_wgrad"):
            bad = [f"{d.upper()}={static[d]}" for d in ("k", "n") if static[d] % 8]
            if bad:
                return False, f"{' and '.join(bad)} must be a multiple of 8"
        return super().supports(kernel, **static)

    def grouped_mm(self, a, b, offs):
        self.calls.append("grouped_mm")
        return super().grouped_mm(a, b, offs)

    def grouped_wgrad(self, grad_out, x, offs, out=None, accumulate=False):
        self.calls.append("grouped_wgrad")
        return super().grouped_wgrad(grad_out, x, offs, out=out, accumulate=accumulate)

    def glu_forward(self, x, glu, scales=None):
        self.calls.append("glu_forward")
        return super().glu_forward(x, glu, scales)


class NowhereBackend(Backend):
    name = "nowhere"

    def available(self) -> tuple[bool, str]:
        return False, "needs a device this machine lacks"


@pytest.fixture
def picky():
    backend = kernels.register_backend(PickyBackend())
    yield backend
    kernels.unregister_backend("picky")


def _grouped(k: int, n: int) -> tuple[te_seq.Sequential, tuple]:
    seq = te_seq.Sequential(ops.GroupedLinear(G, k, n))
    randomize_params(seq)
    splits = torch.tensor([4, 0, 5, 0])
    return seq, (torch.randn(T, k, requires_grad=True), splits)


def test_registering_a_backend_makes_it_selectable(picky) -> None:
    assert "picky" in kernels.backend_names()
    with te_seq.backend("picky"):
        assert te_seq.current_backend() == "picky"
    te_seq.set_backend("picky")
    assert te_seq.current_backend() == "picky"
    te_seq.set_backend("auto")
    kernels.unregister_backend("picky")
    with pytest.raises(ValueError, match="unknown backend 'picky'"):
        te_seq.set_backend("picky")
    kernels.register_backend(picky)  # for the fixture's teardown


def test_registry_refuses_duplicates_and_auto() -> None:
    with pytest.raises(ValueError, match="backend 'torch' is already registered"):
        kernels.register_backend(kernels.get_backend("torch"))

    class Auto(Backend):
        name = "auto"

    with pytest.raises(ValueError, match="a backend needs a name other than 'auto'"):
        kernels.register_backend(Auto())


@pytest.mark.parametrize("enter", ENTER, ids=["backend", "set_backend"])
def test_unavailable_registered_backend_says_why(enter) -> None:
    kernels.register_backend(NowhereBackend())
    try:
        with pytest.raises(RuntimeError, match="backend 'nowhere' is not available: needs a dev"):
            with_or_call(enter, "nowhere")
        assert te_seq.current_backend() == "auto"
    finally:
        kernels.unregister_backend("nowhere")


def test_plan_runs_the_requested_backend_where_it_supports_every_kernel(picky) -> None:
    seq, (x, splits) = _grouped(16, 8)
    with te_seq.backend("picky"):
        seq(x, splits).sum().backward()
    (step,) = seq.fusion_plan().forward
    assert (step.backend, step.backend_reason) == ("picky", "requested")
    assert sorted(set(picky.calls)) == ["grouped_mm", "grouped_wgrad"]


def test_plan_names_the_backend_that_runs_and_why_when_requested_cannot(picky) -> None:
    seq, (x, splits) = _grouped(12, 8)
    with te_seq.backend("picky"):
        seq(x, splits).sum().backward()
    plan = seq.fusion_plan()
    for step in plan.forward + plan.backward:
        assert step.backend == "reference"
        assert step.backend_reason == (
            "picky requested; runs reference: K=12 must be a multiple of 8"
        )
    assert picky.calls == []  # nothing was swapped per call: the plan's backend ran


def test_auto_passes_over_a_backend_that_cannot_run_the_op(picky) -> None:
    seq, (x, splits) = _grouped(16, 8)
    seq(x, splits)
    assert [(s.backend, s.backend_reason) for s in seq.fusion_plan().forward] == [
        ("picky", "auto: fastest available")
    ]
    seq, (x, splits) = _grouped(8, 20)
    seq(x, splits)
    (step,) = seq.fusion_plan().forward
    assert step.backend == "reference"
    assert step.backend_reason == "auto: fastest available; picky: N=20 must be a multiple of 8"


def test_registering_a_backend_invalidates_cached_plans() -> None:
    seq, (x, splits) = _grouped(16, 8)
    seq(x, splits)
    assert seq.fusion_plan().forward[0].backend == "reference"
    kernels.register_backend(PickyBackend())
    try:
        seq(x, splits)
        assert seq.fusion_plan().forward[0].backend == "picky"
    finally:
        kernels.unregister_backend("picky")
    seq(x, splits)
    assert seq.fusion_plan().forward[0].backend == "reference"


def test_unfused_activation_runs_on_the_steps_backend(picky) -> None:
    seq = te_seq.Sequential(ops.SwiGLU(), ops.Bias(F))
    x = torch.randn(T, 2 * F)
    with te_seq.backend("picky"):
        y = seq(x)
    steps = seq.fusion_plan().forward
    assert [(s.name, s.backend, s.backend_reason) for s in steps] == [
        ("SwiGLU", "picky", "requested"),
        ("Bias", "reference", "pure PyTorch op: no GPU kernel of its own"),
    ]
    assert picky.calls == ["glu_forward"]
    gate, up = x.chunk(2, -1)
    torch.testing.assert_close(y, torch.nn.functional.silu(gate) * up + seq[1].bias)


def test_fused_grouped_mlp_on_a_backend_without_epilogues(picky) -> None:
    seq = _mlp(torch.float32, ops.SwiGLU(), bias=False)
    splits = torch.tensor([4, 0, 5, 0])
    with te_seq.backend("picky"):
        got, plan = _run(seq, torch.randn(T, H), (splits, splits))
    (step,) = plan.forward
    assert step.backend == "picky"
    assert step.backend_reason == (
        "requested; activation after the GEMMs (the picky backend has no fused activation epilogue)"
    )
    assert {"grouped_mm", "grouped_wgrad", "glu_forward"} <= set(picky.calls)


def test_backend_capabilities() -> None:
    torch_backend = kernels.get_backend("torch")
    assert not torch_backend.implements("glu_fc1_forward")
    assert torch_backend.supports("glu_fc1_forward", dtype=torch.bfloat16,
                                  device=torch.device("cuda")) == (
        False, "the torch backend has no fused activation epilogue")
    assert kernels.get_backend("cute").implements("glu_fc1_forward")
    assert NowhereBackend().supports("grouped_mm") == (
        False, "the nowhere backend has no grouped_mm kernel")
    with pytest.raises(ValueError, match="unknown kernel 'conv'"):
        torch_backend.supports("conv")


CUTE_CASES = [  # (dtype, K, N, why cute declines), checked by cute's own `supports` on any machine
    (torch.float32, 64, 64, "needs bf16/fp16 operands"),
    (torch.bfloat16, 12, 64, "K=12 and N=64 must be multiples of 8"),
]


@pytest.mark.parametrize("dtype,k,n,why", CUTE_CASES, ids=["fp32", "K=12"])
def test_cute_supports_answers_from_static_facts(dtype, k, n, why) -> None:
    cute = kernels.get_backend("cute")
    for kernel in ("grouped_mm", "grouped_wgrad"):
        ok, reason = cute.supports(kernel, dtype=dtype, device=torch.device("cpu"), k=k, n=n)
        assert not ok and why in reason, (kernel, reason)
    ok, reason = cute.supports("grouped_mm", dtype=torch.bfloat16, device=torch.device("cpu"),
                               k=64, n=64)
    assert not ok and reason == "needs CUDA tensors"


def test_config_is_a_leaf_module() -> None:
    """te_seq/config.py holds plain switches and imports nothing of te_seq (no import cycles)."""
    import ast
    import pathlib

    import te_seq.config

    tree = ast.parse(pathlib.Path(te_seq.config.__file__).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.split(".")[0] == "te_seq"], imported
