"""The one activation table (te_seq.kernels.activations): every activation op names an entry, the
entries' derivatives are right, the lists elsewhere derive from it, GluSpec checks its fields,
and the fusions match the Activation base class but decline what they cannot run."""

from __future__ import annotations

import re

import pytest
import torch
from op_specs import activation_ops

import te_seq
from te_seq import ops
from te_seq.fusion.matcher import Window
from te_seq.kernels.activations import ACTIVATIONS, GluSpec, activation, epilogue_activations
from te_seq.ops.basic.activation import Activation, GatedActivation


def _instances() -> list[Activation]:
    """One instance of every exported activation op (both GELU forms)."""
    out = [cls() for cls in activation_ops()]
    return out + [ops.GELU(approximate="none")]


def test_every_activation_op_names_a_table_entry() -> None:
    instances = _instances()
    assert len(instances) >= 8  # SwiGLU, ScaledSwiGLU, GEGLU, ReGLU, GELU ×2, ReLU, SiLU
    for op in instances:
        assert op.act in ACTIVATIONS, type(op).__name__


def test_every_table_entry_is_used_by_an_op() -> None:
    assert {op.act for op in _instances()} == set(ACTIVATIONS)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_table_derivative_matches_autograd(name: str) -> None:
    spec = activation(name)
    x = torch.linspace(-4, 4, 201, dtype=torch.float64).requires_grad_(True)
    (grad,) = torch.autograd.grad(spec.f(x).sum(), x)
    torch.testing.assert_close(spec.df(x.detach()), grad, rtol=1e-10, atol=1e-10)


def test_cute_lists_derive_from_the_table() -> None:
    from te_seq.kernels.cute import glu

    assert glu._ACTS == epilogue_activations() == (
        "gelu", "silu", "relu", "sigmoid", "qgelu", "srelu", "clamped_qgelu", "situ"
    )


def test_unknown_activation_name_says_which_exist() -> None:
    with pytest.raises(ValueError, match=r"unknown activation 'mish'; known: \('gelu', "):
        activation("mish")


def test_glu_spec_checks_its_fields() -> None:
    spec = GluSpec("silu", 64)
    assert (spec.act, spec.glu_interleave_size) == ("silu", 64)
    assert GluSpec("relu") == GluSpec("relu", None)
    with pytest.raises(ValueError, match="unknown activation 'mish'"):
        GluSpec("mish")
    with pytest.raises(ValueError, match="glu_interleave_size must be a positive int, got 0"):
        GluSpec("silu", 0)
    with pytest.raises(AttributeError):
        spec.act = "gelu"
    assert ops.SwiGLU(glu_interleave_size=32).glu_spec == GluSpec("silu", 32)


# --- fusions match the Activation base class -------------------------------------------------


class _SquaredReLUish(Activation):
    """A user activation that is not one of te_seq's classes but names a table entry."""

    act = "relu"


class _Mish(Activation):
    act = "mish"  # not in the table: runs nowhere, fuses nowhere

    def op_forward(self, ctx, input_):
        return input_ * torch.tanh(torch.nn.functional.softplus(input_))


class _ScaledGEGLU(GatedActivation):
    """Two extra inputs: no fused op knows what to do with them."""

    act = "gelu"
    num_extra_inputs = 2


def _build(name: str, *window_ops):
    record = next(f for f in te_seq.list_fusions() if f.name == name)
    n = len(window_ops)
    return record.build(Window(window_ops, [()] * n, tuple(range(n))))


@pytest.mark.parametrize("act, reason", [
    (_Mish(), r"_Mish: act 'mish' is not in the activation table \('gelu', "),
    (_ScaledGEGLU(), "_ScaledGEGLU takes 2 extra inputs; fused ops take none, or one per-row"),
])
def test_fusions_decline_activations_they_cannot_run(act, reason) -> None:
    d = torch.float64
    windows = {
        "linear_bias_activation": (ops.BasicLinear(4, 8, dtype=d), ops.Bias(8, dtype=d), act),
        "activation_bias_backward": (ops.Bias(8, dtype=d), act),
        "grouped_mlp": (ops.GroupedLinear(2, 4, 8 if act.gated else 4), act,
                        ops.GroupedLinear(2, 4, 4)),
    }
    for name, window in windows.items():
        result = _build(name, *window)
        assert isinstance(result, te_seq.NoMatch), name
        assert re.search(reason, result.reason), (name, result.reason)


def test_a_new_activation_class_fuses_and_matches_unfused() -> None:
    seq = te_seq.Sequential(ops.Linear(4, 6, dtype=torch.float64), _SquaredReLUish())
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    y = seq(x)
    assert [s.name for s in seq.fusion_plan().forward] == ["LinearBiasActivation"]
    assert [s.name for s in seq.fusion_plan().backward][0] == "ActivationBiasBackward"
    y.sum().backward()
    with te_seq.fusions_disabled():
        x2 = x.detach().clone().requires_grad_(True)
        y2 = seq(x2)
        y2.sum().backward()
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(x.grad, x2.grad)


def test_unfused_activation_outside_the_table_runs_its_own_maths() -> None:
    seq = te_seq.Sequential(_Mish())
    x = torch.randn(3, 4)
    torch.testing.assert_close(seq(x), torch.nn.functional.mish(x))
    assert seq.fusion_plan().forward[0].backend == "reference"
