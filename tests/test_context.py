"""OperationContext: typed fields the fuser fills (te_seq's own ops set no others), the ops'
per-call state as one frozen record in `ctx.saved`, and forward fusions leaving the same records
as the ops' own forwards (BasicLinear.save and GroupedLinear.saved_record are the one
definition of each).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from op_specs import SPECS, OpSpec, build_case, skip_if_missing

import te_seq
import te_seq.core.context
import te_seq.core.operation
import te_seq.run.fuser
from te_seq import ops
from te_seq.ops.basic.basic_linear import LinearSaved
from te_seq.ops.basic.grouped_linear import GroupedLinearSaved

D = torch.float64


@pytest.fixture
def recorded(monkeypatch) -> list[list[te_seq.core.context.OperationContext]]:
    """Every call's contexts, as the fuser made them."""
    calls: list[list] = []
    make = te_seq.run.fuser.new_contexts

    def recording(*args, **kwargs):
        ctxs = make(*args, **kwargs)
        calls.append(ctxs)
        return ctxs

    monkeypatch.setattr(te_seq.run.fuser, "new_contexts", recording)
    return calls


def test_one_context_class_wherever_it_is_imported_from() -> None:
    cls = te_seq.core.context.OperationContext
    assert ops.OperationContext is cls
    assert te_seq.core.operation.OperationContext is cls


def test_context_fields_and_defaults() -> None:
    ctx = ops.OperationContext()
    assert (ctx.requires_grad, ctx.input_requires_grad, ctx.weight_requires_grad) == (
        False, False, False)
    assert ctx.recipe is None and ctx.process_group is None and ctx.saved is None
    assert ctx.saved_tensors == () and ctx.to_save == ()
    ctx.save_for_backward(torch.ones(1), None)
    assert len(ctx.to_save) == 2


class _StrictContext(te_seq.core.context.OperationContext):
    """A context that accepts only the declared fields: what te_seq's own ops must keep to."""

    def __setattr__(self, name: str, value) -> None:
        if name not in _FIELDS:
            raise AttributeError(f"ad-hoc context attribute {name!r}: use ctx.saved")
        super().__setattr__(name, value)


_FIELDS = {f.name for f in dataclasses.fields(te_seq.core.context.OperationContext)}


@pytest.fixture
def strict_contexts(monkeypatch) -> None:
    monkeypatch.setattr(te_seq.run.fuser, "OperationContext", _StrictContext)


def test_the_strict_context_rejects_unknown_attributes() -> None:
    ctx = _StrictContext()
    ctx.saved = 1
    with pytest.raises(AttributeError, match="input_shape"):
        ctx.input_shape = (1,)


class _AdHoc(ops.BasicOperation):
    """A user op storing state as an attribute of its context (allowed, as in TE)."""

    def op_forward(self, ctx, input_):
        ctx.scale = 2.0
        return input_ * ctx.scale

    def op_backward(self, ctx, grad_output):
        return grad_output * ctx.scale, []


def test_a_user_op_may_keep_its_own_context_attributes() -> None:
    x = torch.randn(2, 3, dtype=D, requires_grad=True)
    y = te_seq.Sequential(_AdHoc())(x)
    y.sum().backward()
    torch.testing.assert_close(y, 2 * x)
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_saved_as_names_the_missing_record() -> None:
    ctx = ops.OperationContext()
    with pytest.raises(RuntimeError, match="holds NoneType, expected LinearSaved"):
        ctx.saved_as(LinearSaved)
    ctx.saved = LinearSaved(torch.Size([2, 3]), None)
    assert ctx.saved_as(LinearSaved) is ctx.saved


def test_the_fuser_fills_the_gradient_flags(recorded) -> None:
    """Frozen first op (no grad anywhere yet), then a trainable linear: only the second one's
    backward runs, and it needs wgrad but no dgrad."""
    frozen, trainable = ops.BasicLinear(3, 3, dtype=D), ops.BasicLinear(3, 2, dtype=D)
    frozen.weight.requires_grad_(False)
    te_seq.Sequential(frozen, trainable)(torch.randn(4, 3, dtype=D)).sum().backward()
    (first, second), = recorded
    assert (first.requires_grad, first.input_requires_grad, first.weight_requires_grad) == (
        False, False, False)
    assert (second.requires_grad, second.input_requires_grad, second.weight_requires_grad) == (
        True, False, True)
    assert first.saved is None  # no backward: nothing saved
    assert second.recipe is None and second.process_group is None


def _is_frozen_record(obj: object) -> bool:
    return dataclasses.is_dataclass(obj) and type(obj).__dataclass_params__.frozen


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_op_keeps_its_per_call_state_in_a_frozen_record(
    spec: OpSpec, recorded, strict_contexts
) -> None:
    x = torch.randn(5, spec.in_width, dtype=D, requires_grad=True)
    case = build_case(spec, D, x)
    out = case.seq(x, *case.extras)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])
    for ctx in recorded[-1]:
        assert ctx.saved is None or _is_frozen_record(ctx.saved), type(ctx.saved)


def _linear_chain(last: torch.nn.Module) -> te_seq.Sequential:
    return te_seq.Sequential(ops.BasicLinear(4, 6, dtype=D), ops.Bias(6, dtype=D), last)


@pytest.mark.parametrize("last, extra", [
    (ops.GELU(), ()),
    (ops.AddExtraInput(), (torch.randn(3, 6, dtype=D),)),
], ids=["linear_bias_activation", "linear_bias_add"])
def test_forward_fusions_leave_the_records_of_the_unfused_forward(
    last, extra, recorded, strict_contexts
) -> None:
    seq = _linear_chain(last)
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    seq(x, *extra)
    assert seq.fusion_plan().fused_steps
    with te_seq.fusions_disabled():
        seq(x, *extra)
    fused, unfused = recorded
    for a, b in zip(fused, unfused):
        assert type(a.saved) is type(b.saved)
        assert len(a.to_save) == len(b.to_save)
    linear_record = fused[0].saved_as(LinearSaved)
    assert linear_record.input_shape == x.shape
    assert linear_record.weights.params() == [seq[0].weight]


def test_grouped_mlp_fills_each_linear_record_through_grouped_linear(
    recorded, strict_contexts
) -> None:
    skip_if_missing("GroupedLinear")
    fc1, fc2 = ops.GroupedLinear(2, 4, 6, dtype=D), ops.GroupedLinear(2, 3, 4, dtype=D)
    seq = te_seq.Sequential(fc1, ops.SwiGLU(), fc2)
    splits = torch.tensor([2, 3])
    x = torch.randn(5, 4, dtype=D, requires_grad=True)
    seq(x, splits, splits).sum().backward()
    assert {s.name for s in seq.fusion_plan().fused_steps} == {"GroupedMLP"}
    ctx1, ctx_act, ctx2 = recorded[-1]
    assert ctx1.saved_as(GroupedLinearSaved).input_shape == x.shape
    assert ctx1.saved.weights.params() == [w for _, w in fc1.named_weights()]
    assert ctx2.saved_as(GroupedLinearSaved).weights.params() == [
        w for _, w in fc2.named_weights()]
    assert ctx2.saved.input_shape == torch.Size([5, 3])
