"""The matcher's subclass rule: a fusion implements the maths of the class its pattern names, so
an op whose class overrides `op_forward` / `op_backward` / `fuser_forward` / `fuser_backward`
never fuses (the plan says why) unless the overriding class declares `fusion_safe = True`.

Generated from the registry: for every registered fusion, every position of its window and
every kind of override, a user subclass swapped into a window that fuses without it must leave
the window unfused, with a `PlanMiss` naming the fusion, the indices, the subclass and the
methods, and give exactly the unfused chain's values and gradients (float64).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from test_fusions import _alternatives, _factory_for, build_window, run_with_grads

import te_seq
from te_seq import ops
from te_seq.fusion.matcher import MATHS_METHODS, fused_maths_class, overridden_maths
from te_seq.ops.basic.activation import Activation

D = torch.float64


# --- overrides a user might write ------------------------------------------------------------

def _doubling_fuser(base: type) -> type:
    """y' = 2 y, with the matching gradient (a real change of maths, through fuser_*)."""

    def fuser_forward(self, ctxs, x, **kw):
        y, outs = base.fuser_forward(self, ctxs, x, **kw)
        return 2 * y, outs

    def fuser_backward(self, ctxs, dy, **kw):
        return base.fuser_backward(self, ctxs, 2 * dy, **kw)

    return type(f"Doubled{base.__name__}", (base,), {"fuser_forward": fuser_forward,
                                                     "fuser_backward": fuser_backward})


def _doubling_op(base: type) -> type:
    """The same through op_forward / op_backward (for ops whose maths lives there)."""

    def op_forward(self, ctx, x, **kw):
        return 2 * base.op_forward(self, ctx, x, **kw)

    def op_backward(self, ctx, dy):
        return base.op_backward(self, ctx, 2 * dy)

    return type(f"OpDoubled{base.__name__}", (base,), {"op_forward": op_forward,
                                                       "op_backward": op_backward})


def _custom_gradient(base: type) -> type:
    """Backward only: a custom gradient (3 dy), e.g. a straight-through trick."""

    def fuser_backward(self, ctxs, dy, **kw):
        return base.fuser_backward(self, ctxs, 3 * dy, **kw)

    return type(f"Steep{base.__name__}", (base,), {"fuser_backward": fuser_backward})


OVERRIDES = {
    "fuser_forward+fuser_backward": (_doubling_fuser, "fuser_forward, fuser_backward"),
    "op_forward+op_backward": (_doubling_op, "op_forward, op_backward"),
    "fuser_backward_only": (_custom_gradient, "fuser_backward"),
}


def _cases() -> Iterator:
    for record in te_seq.list_fusions():
        for classes in _alternatives(record.pattern)[:2]:  # two alternatives per element
            if any(_factory_for(c) is None for c in classes):
                continue
            label = "-".join(c.__name__ for c in classes)
            for position in range(len(classes)):
                for kind in OVERRIDES:
                    yield pytest.param(record.name, classes, position, kind,
                                       id=f"{record.name}-{label}-{position}-{kind}")


@pytest.mark.parametrize("name,classes,position,kind", list(_cases()))
def test_overriding_subclass_never_fuses(name, classes, position, kind) -> None:
    run = build_window(classes)
    _, plan = run_with_grads(run)
    if not any(s.basic_op_indices == tuple(range(len(classes))) for s in plan.fused_steps):
        pytest.skip(f"{name} does not fuse this window even without a subclass")
    make, methods = OVERRIDES[kind]
    op = list(run.seq)[position]
    op.__class__ = make(type(op))  # the same op, now of a user subclass
    fused, plan = run_with_grads(run)
    indices = tuple(range(len(classes)))
    misses = [m for m in plan.misses if m.fusion == name and m.basic_op_indices == indices]
    assert misses, f"no miss for {name}:\n{plan}"
    assert f"{type(op).__name__} overrides {methods} of {type(op).__mro__[1].__name__}" in \
        misses[0].reason
    assert "fusion_safe = True" in misses[0].reason
    assert all(position not in s.basic_op_indices for s in plan.fused_steps), plan
    with te_seq.fusions_disabled():
        unfused, _ = run_with_grads(run)
    for i, (a, b) in enumerate(zip(fused, unfused, strict=True)):
        assert (a is None) == (b is None), f"tensor {i}"
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"tensor {i}: {m}")


# --- the grouped MLP with a user GroupedLinear / activation ------------------------------------

class ScaledOutput(ops.GroupedLinear):
    """A user GroupedLinear that scales its output (and its gradient accordingly)."""

    def fuser_forward(self, ctxs, x, **kw):
        y, outs = super().fuser_forward(ctxs, x, **kw)
        return 0.5 * y, outs

    def fuser_backward(self, ctxs, dy, **kw):
        return super().fuser_backward(ctxs, 0.5 * dy, **kw)


class CubedSwiGLU(ops.SwiGLU):
    """A user SwiGLU with its own maths: silu(gate) · up³."""

    def op_forward(self, ctx, x):
        ctx.save_for_backward(x)
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up**3

    def op_backward(self, ctx, dy):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            gate, up = x.chunk(2, -1)
            (dx,) = torch.autograd.grad(F.silu(gate) * up**3, x, dy)
        return dx, []


def _grouped_ref(fc, x, sizes):
    return torch.cat([p @ getattr(fc, f"weight{g}").t() + getattr(fc, f"bias{g}")
                      for g, p in enumerate(x.split(sizes))])


@pytest.mark.parametrize("which", ["fc1", "activation", "fc2"])
def test_grouped_mlp_keeps_a_user_subclass_maths(which: str) -> None:
    fc1 = (ScaledOutput if which == "fc1" else ops.GroupedLinear)(3, 4, 12, dtype=D)
    act = CubedSwiGLU() if which == "activation" else ops.SwiGLU()
    fc2 = (ScaledOutput if which == "fc2" else ops.GroupedLinear)(3, 6, 4, dtype=D)
    for p in (*fc1.parameters(), *fc2.parameters()):
        torch.nn.init.normal_(p)
    seq = te_seq.Sequential(fc1, act, fc2)
    x, splits = torch.randn(7, 4, dtype=D, requires_grad=True), torch.tensor([2, 0, 5])
    y = seq(x, splits, splits)
    h = _grouped_ref(fc1, x, [2, 0, 5]) * (0.5 if which == "fc1" else 1)
    gate, up = h.chunk(2, -1)
    a = F.silu(gate) * (up**3 if which == "activation" else up)
    ref = _grouped_ref(fc2, a, [2, 0, 5]) * (0.5 if which == "fc2" else 1)
    torch.testing.assert_close(y, ref)
    [miss] = seq.fusion_plan().misses
    assert miss.fusion == "grouped_mlp" and miss.basic_op_indices == (0, 1, 2)
    name = {"fc1": "ScaledOutput", "activation": "CubedSwiGLU", "fc2": "ScaledOutput"}[which]
    assert miss.reason.startswith(f"{name} overrides ")
    (dx,) = torch.autograd.grad(y.sum(), x)
    (dx_ref,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(dx, dx_ref)


# --- the opt-in --------------------------------------------------------------------------------

class CountingSwiGLU(ops.ScaledSwiGLU):
    """Overrides the maths methods only to count calls: declares itself fusion-safe."""

    fusion_safe = True
    calls = 0

    def fuser_forward(self, *args, **kwargs):
        CountingSwiGLU.calls += 1
        return super().fuser_forward(*args, **kwargs)


class RescaledCountingSwiGLU(CountingSwiGLU):
    """Overrides the maths again without declaring it: the parent's declaration does not cover
    it."""

    def fuser_forward(self, *args, **kwargs):
        y, outs = super().fuser_forward(*args, **kwargs)
        return 3 * y, outs


class PlainSubclass(ops.ScaledSwiGLU):
    """No override: just a name of the user's."""

    note = "mine"


def _mlp_plan(act: ops.BasicOperation) -> te_seq.FusionPlan:
    seq = te_seq.Sequential(ops.GroupedLinear(2, 4, 8, dtype=D), act,
                            ops.GroupedLinear(2, 4, 4, dtype=D))
    splits = torch.tensor([3, 4])
    seq(torch.randn(7, 4, dtype=D), splits, torch.rand(7, dtype=D), splits)
    return seq.fusion_plan()


def test_fusion_safe_subclass_fuses() -> None:
    plan = _mlp_plan(CountingSwiGLU())
    assert [s.name for s in plan.forward] == ["GroupedMLP"] and plan.misses == []


def test_fusion_safe_is_not_inherited_by_a_new_override() -> None:
    plan = _mlp_plan(RescaledCountingSwiGLU())
    [miss] = [m for m in plan.misses if m.fusion == "grouped_mlp"]
    assert miss.reason.startswith("RescaledCountingSwiGLU overrides fuser_forward of ScaledSwiGLU")
    assert [s.name for s in plan.forward] == ["GroupedLinear", "RescaledCountingSwiGLU",
                                              "GroupedLinear"]


def test_subclass_without_overrides_fuses() -> None:
    plan = _mlp_plan(PlainSubclass())
    assert [s.name for s in plan.forward] == ["GroupedMLP"] and plan.misses == []


def test_builtin_hierarchy_is_trusted() -> None:
    """te_seq's own classes fuse under base-class patterns although they override their bases'
    methods (ScaledSwiGLU's fuser_forward): their maths is what the fusions implement."""
    assert fused_maths_class(ops.ScaledSwiGLU, Activation) is ops.ScaledSwiGLU
    assert overridden_maths(ops.ScaledSwiGLU, ops.ScaledSwiGLU) == []
    assert fused_maths_class(CountingSwiGLU, Activation) is ops.ScaledSwiGLU
    assert overridden_maths(RescaledCountingSwiGLU, ops.ScaledSwiGLU) == ["fuser_forward"]
    assert set(MATHS_METHODS) == {"op_forward", "op_backward", "fuser_forward", "fuser_backward"}
    assert ops.BasicOperation.fusion_safe is False


class _LoggingMixin:
    def op_forward(self, ctx, x):
        return super().op_forward(ctx, x) + 1


class MixedGELU(_LoggingMixin, ops.GELU):
    pass


def test_override_from_a_mixin_counts() -> None:
    seq = te_seq.Sequential(ops.Linear(4, 4, dtype=D), MixedGELU())
    x = torch.randn(3, 4, dtype=D)
    y = seq(x)
    torch.testing.assert_close(y, F.gelu(seq[0](x), approximate="tanh") + 1)
    reasons = [m.reason for m in seq.fusion_plan().misses]
    assert any(r.startswith("MixedGELU overrides op_forward of GELU") for r in reasons), reasons


# --- user fusions follow the same rule ---------------------------------------------------------

class Square(ops.BasicOperation):
    """y = x²."""

    def op_forward(self, ctx, x):
        ctx.save_for_backward(x)
        return x * x

    def op_backward(self, ctx, dy):
        (x,) = ctx.saved_tensors
        return 2 * x * dy, []


class Cube(Square):
    """y = x³: overrides Square's maths."""

    def op_forward(self, ctx, x):
        ctx.save_for_backward(x)
        return x * x * x

    def op_backward(self, ctx, dy):
        (x,) = ctx.saved_tensors
        return 3 * x * x * dy, []


class SquareTwice(ops.FusedOperation):
    """Square → Square as x⁴ (a user fused op that knows only Square's maths)."""

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        basic_op_ctxs[0].save_for_backward(input_)
        return input_**4, [(), ()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        (x,) = basic_op_ctxs[0].saved_tensors
        return 4 * x**3 * grad_output, [[], []], [(), ()]


@pytest.mark.parametrize("second", [Square, Cube])
@pytest.mark.parametrize("element", ["class", "tuple"])
def test_user_fusion_declines_a_subclass_that_overrides(second: type, element: str) -> None:
    pattern_el = Square if element == "class" else (ops.GELU, Square)
    te_seq.register_fusion(name="user_square_twice", phase="joint",
                           pattern=(Square, pattern_el))(SquareTwice)
    seq = te_seq.Sequential(Square(), second())
    x = torch.randn(5, dtype=D, requires_grad=True)
    y = seq(x)
    plan = seq.fusion_plan()
    if second is Square:
        assert [s.name for s in plan.forward] == ["SquareTwice"]
        torch.testing.assert_close(y, x**4)
        return
    torch.testing.assert_close(y, x**6)
    [miss] = plan.misses
    assert (miss.fusion, miss.basic_op_indices) == ("user_square_twice", (0, 1))
    assert miss.reason.startswith("Cube overrides op_forward, op_backward of Square")
    (dx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(dx, 6 * x**5)


class ForwardDoubled(ops.BasicLinear):
    """Overrides forward, as a torch.nn user would: a Sequential never calls it."""

    def forward(self, x, *extra):
        return 2 * super().forward(x, *extra)


def test_overriding_forward_is_an_error_not_a_silent_change() -> None:
    seq = te_seq.Sequential(ops.GELU(), ForwardDoubled(4, 4, dtype=D))
    with pytest.raises(TypeError, match=r"ForwardDoubled \(basic op 1\) overrides forward\(\), "
                                        r"which a te_seq.Sequential never calls: put an op's "
                                        r"maths in op_forward / op_backward"):
        seq(torch.randn(3, 4, dtype=D))
