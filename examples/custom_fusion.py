"""Write your own te_seq op and your own fusions, and watch the fuser use them.

Two user basic ops (op_forward/op_backward):
    ScaleShift(size): y = x · a + b     (a, b [size]; like `x * a + b`)
    Square():         y = x²            (like `x ** 2`)
Three user fusions, one per phase:
    "scale_shift_square" (joint, ScaleShift → Square): a FusedOperation with its own forward
        and backward; declines float64 weights with a reason.
    "square_scale_shift" (forward, Square → ScaleShift): y = x²·a + b in one addcmul, filling
        each op's context as its own forward would.
    "square_scale_shift_bwd" (backward, Square → ScaleShift): dx = 2x·(dy·a), computed from
        what the two ops' forwards saved.

The script prints the plans, a decline with its reason, the registry, disables and re-enables a
fusion, shows the ValueError on a duplicate name, and checks fused == unfused (values and
gradients). Exit status 1 if any check fails.

    python examples/custom_fusion.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch import Tensor

import te_seq
from te_seq.ops import BasicOperation, FusedOperation, OperationContext

# --------------------------------------------------------------------------------------------
# 1. Basic ops: maths in op_forward, gradients in op_backward.
# --------------------------------------------------------------------------------------------


class ScaleShift(BasicOperation):
    """y = x · a + b with a, b [size]; x [..., size] -> y [..., size].

    Equivalent to `x * a + b`. Gradients: dx = dy · a, da = Σ_rows dy · x, db = Σ_rows dy.
    """

    def __init__(self, size: int, *, device=None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.size = size
        factory = {"device": device, "dtype": dtype}
        self.scale = torch.nn.Parameter(torch.empty(size, **factory).uniform_(0.5, 1.5))
        self.shift = torch.nn.Parameter(torch.empty(size, **factory).uniform_(-0.5, 0.5))

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        if input_.shape[-1] != self.size:
            raise ValueError(
                f"ScaleShift: input has last dimension {input_.shape[-1]}, but size={self.size}"
            )

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        if ctx.requires_grad:
            ctx.save_for_backward(input_)  # for da
        return input_ * self.scale + self.shift

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        (x,) = ctx.saved_tensors
        return grad_output * self.scale, list(scale_shift_param_grads(grad_output, x))


def scale_shift_param_grads(dy: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """(da, db) = (Σ_rows dy · x, Σ_rows dy), each [size]."""
    size = dy.shape[-1]
    return (dy * x).reshape(-1, size).sum(0), dy.reshape(-1, size).sum(0)


class Square(BasicOperation):
    """y = x² elementwise; any shape. Equivalent to `x ** 2`; dx = 2x · dy."""

    def op_forward(self, ctx: OperationContext, input_: Tensor) -> Tensor:
        if ctx.requires_grad:
            ctx.save_for_backward(input_)
        return input_ * input_

    def op_backward(self, ctx: OperationContext, grad_output: Tensor):
        (x,) = ctx.saved_tensors
        return 2 * x * grad_output, []


# --------------------------------------------------------------------------------------------
# 2. Fused ops: own no parameters, work over the list of their basic ops' contexts.
# --------------------------------------------------------------------------------------------


class ScaleShiftSquare(FusedOperation):
    """Joint fusion of ScaleShift → Square: y = (x·a + b)², saving only x (z is recomputed)."""

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        ss, _ = self.basic_ops
        if basic_op_ctxs[0].requires_grad:
            basic_op_ctxs[0].save_for_backward(input_)  # a joint fusion may save what it likes
        z = torch.addcmul(ss.shift, input_, ss.scale)  # x·a + b
        return z * z, [(), ()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ss, _ = self.basic_ops
        (x,) = basic_op_ctxs[0].saved_tensors
        dz = 2 * torch.addcmul(ss.shift, x, ss.scale) * grad_output  # dz = 2z · dy
        da, db = scale_shift_param_grads(dz, x)
        return dz * ss.scale, [[da, db], []], [(), ()]


class SquareScaleShiftForward(FusedOperation):
    """Forward-only fusion of Square → ScaleShift: y = x²·a + b. Each context is filled exactly
    as the op's own forward fills it (Square saves x, ScaleShift saves its input x²), so the
    unfused backward, or a backward fusion, can run from them."""

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        _, ss = self.basic_ops
        sq = input_ * input_
        ss.pre_forward_checks(sq, ())  # the fuser checks only the first op's input
        if basic_op_ctxs[0].requires_grad:
            basic_op_ctxs[0].save_for_backward(input_)
            basic_op_ctxs[1].save_for_backward(sq)
        return torch.addcmul(ss.shift, sq, ss.scale), [(), ()]


class SquareScaleShiftBackward(FusedOperation):
    """Backward-only fusion of Square → ScaleShift: dx = 2x · (dy · a), da = Σ dy · x², db = Σ dy.
    Uses only what the two ops' own forwards saved."""

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        _, ss = self.basic_ops
        (x,) = basic_op_ctxs[0].saved_tensors
        (sq,) = basic_op_ctxs[1].saved_tensors
        da, db = scale_shift_param_grads(grad_output, sq)
        return 2 * x * grad_output * ss.scale, [[], [da, db]], [(), ()]


# --------------------------------------------------------------------------------------------
# 3. Registration: a pattern of op classes and a build function (fused op or NoMatch(reason)).
# --------------------------------------------------------------------------------------------

FUSION_NAMES = ("scale_shift_square", "square_scale_shift", "square_scale_shift_bwd")


def register_fusions() -> None:
    """Register the three fusions (done in a function so importing this file registers nothing)."""

    @te_seq.register_fusion(name="scale_shift_square", phase="joint", pattern=(ScaleShift, Square))
    def _joint(window):
        if window[0].scale.dtype == torch.float64:
            return te_seq.NoMatch("ScaleShiftSquare is written for float32/bf16, got float64")
        return ScaleShiftSquare(window)

    @te_seq.register_fusion(name="square_scale_shift", phase="forward",
                            pattern=(Square, ScaleShift))
    def _forward(window):
        return SquareScaleShiftForward(window)

    @te_seq.register_fusion(name="square_scale_shift_bwd", phase="backward",
                            pattern=(Square, ScaleShift))
    def _backward(window):
        return SquareScaleShiftBackward(window)


# --------------------------------------------------------------------------------------------
# 4. The demo: plans, declines, the registry, and fused == unfused.
# --------------------------------------------------------------------------------------------


def run(model: te_seq.Sequential, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Output and gradients (input, then parameters) of one forward + backward."""
    x = x.detach().requires_grad_(True)
    y = model(x)
    grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sum(),
                                [x, *model.parameters()])
    return y.detach(), list(grads)


def check_same(title: str, model: te_seq.Sequential, x: Tensor,
               fused_steps: set[str]) -> bool:
    """Run fused (current registry) and unfused (all fusions off); print the fused run's plan;
    compare values and gradients, and the plan's fused steps with `fused_steps`."""
    y, grads = run(model, x)
    plan = model.fusion_plan()
    with te_seq.fusions_disabled():
        y_ref, grads_ref = run(model, x)
    tol = 1e-12 if x.dtype == torch.float64 else 1e-5
    errors = [(a - b).abs().max().item() for a, b in zip([y, *grads], [y_ref, *grads_ref])]
    ok = max(errors) <= tol * max(1.0, y_ref.abs().max().item())
    print(f"\n== {title} ==\n{plan}")
    print(f"fused vs unfused: max abs diff {max(errors):.2e} -> {'OK' if ok else 'MISMATCH'}")
    return expect(plan, fused_steps, title) and ok


def show_registry() -> None:
    print("\nregistered fusions (matching order):")
    for f in te_seq.list_fusions():
        pattern = ", ".join(c.__name__ if isinstance(c, type) else "|".join(k.__name__ for k in c)
                            for c in f.pattern)
        print(f"  {f.name:24s} {f.phase:8s} enabled={f.enabled!s:5s} ({pattern})")


def show_duplicate_error() -> bool:
    try:
        te_seq.register_fusion(name="scale_shift_square", phase="forward",
                               pattern=(ScaleShift, Square))(lambda window: None)
    except ValueError as err:
        print(f"\nregistering a duplicate name -> ValueError: {err}")
        return True
    print("\nregistering a duplicate name did not raise", file=sys.stderr)
    return False


def expect(plan: te_seq.FusionPlan, names: set[str], what: str) -> bool:
    fired = {s.name for s in plan.forward + plan.backward if len(s.basic_op_indices) > 1}
    if fired != names:
        print(f"{what}: expected fused steps {sorted(names)}, got {sorted(fired)}", file=sys.stderr)
        return False
    return True


def demo(make_model: Callable[[torch.dtype], te_seq.Sequential]) -> bool:
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    model, model64 = make_model(torch.float32), make_model(torch.float64)
    fwd_bwd = {"SquareScaleShiftForward", "SquareScaleShiftBackward"}
    ok = check_same("float32: joint fusion fires", model, x, {"ScaleShiftSquare"})
    ok &= check_same("float64: joint declines, forward + backward fusions fire", model64,
                     x.double(), fwd_bwd)
    model64(x.double())
    reasons = [m.reason for m in model64.fusion_plan().misses if m.fusion == "scale_shift_square"]
    ok &= bool(reasons) and all("float64" in r for r in reasons)

    show_registry()
    print("\ndisable_fusion('scale_shift_square')")
    te_seq.disable_fusion("scale_shift_square")
    ok &= check_same("float32, joint fusion disabled", model, x, fwd_bwd)
    print("\nenable_fusion('scale_shift_square')")
    te_seq.enable_fusion("scale_shift_square")
    ok &= check_same("float32, joint fusion re-enabled", model, x, {"ScaleShiftSquare"})
    with te_seq.fusions_disabled("square_scale_shift_bwd"):
        ok &= check_same("float64 inside fusions_disabled('square_scale_shift_bwd')", model64,
                         x.double(), {"SquareScaleShiftForward"})
    return show_duplicate_error() and bool(ok)


def make_model(dtype: torch.dtype) -> te_seq.Sequential:
    # Basic-op indices: 0 ScaleShift, 1 Square, 2 ScaleShift, 3 Square, 4 ScaleShift.
    return te_seq.Sequential(ScaleShift(8, dtype=dtype), Square(), ScaleShift(8, dtype=dtype),
                             te_seq.Sequential(Square(), ScaleShift(8, dtype=dtype)))


def main() -> int:
    register_fusions()
    try:
        ok = demo(make_model)
    finally:
        for name in FUSION_NAMES:
            te_seq.unregister_fusion(name)
    if not ok:
        print("\nSOME CHECKS FAILED", file=sys.stderr)
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
