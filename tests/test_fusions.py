"""Fusions: every registered fusion fused vs unfused (generated from the registry), the GroupedMLP's
declines, user fusions, the registry API, plan caching, and state_dict invariance.

For every fusion in `te_seq.list_fusions()` a window matching its pattern is built from per-class
factories (`FACTORIES`), run fused and under `te_seq.fusions_disabled(name)`, and outputs and all
gradients must agree to float64 precision; the plan must show the fused op in its phase(s).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from op_specs import activation_ops, exported_subclasses, missing_op, randomize_params

import te_seq
from te_seq import ops

# Shape legend: T rows, W the width flowing into a factory's op, FFN the hidden width of MLPs.
T, HID, FFN, GROUPS = 7, 8, 6, 3


# --- window factories: one per basic-op class a pattern may name --------------------------------

@dataclass
class Built:
    """One op of a window: the module, its output width, and its extra inputs for T rows."""

    op: torch.nn.Module
    out_width: int
    extras: Callable[[dict], tuple]  # shared -> extras (shared: the current width, tensors
    # several ops must share such as split sizes)


def _is_gated(cls: type | None) -> bool:
    return bool(cls is not None and getattr(cls, "gated", False))


def _linear_out(next_cls: type | None) -> int:
    """A GEMM feeds a gated activation 2·FFN columns, anything else FFN (HID at the window end)."""
    if next_cls is None:
        return HID
    return 2 * FFN if _is_gated(next_cls) else FFN


def _splits(shared: dict) -> torch.Tensor:
    # The same tensor object for every GroupedLinear of the window (what GroupedMLP needs).
    return shared.setdefault("splits", torch.tensor([2, 0, T - 2]))


def _rand_rows(shared: dict) -> torch.Tensor:
    return torch.rand(T, dtype=shared["dtype"]) + 0.5


def _grouped(cls, w, nxt) -> Built:
    out = _linear_out(nxt)
    return Built(cls(GROUPS, w, out, bias=True, dtype=torch.float64), out,
                 lambda shared: () if "dispatch" in shared else (_splits(shared),))


def _gated(cls, w, nxt) -> Built:
    def extras(shared: dict) -> tuple:  # after a dispatch the scales come from its channel
        return (_rand_rows(shared),) if cls.num_extra_inputs and "dispatch" not in shared else ()
    return Built(cls(), w // 2, extras)


def _dispatch_extras(shared: dict) -> tuple:
    """Top-2 routing of the T tokens over GROUPS experts (marks the window as dispatched: the
    later ops' split sizes, scales and routing map come from its channels)."""
    shared["dispatch"] = True
    indices = torch.randn(T, GROUPS).topk(2).indices
    return indices, torch.rand(T, 2, dtype=shared["dtype"]) + 0.5


def _same_width(make: Callable[[int], torch.nn.Module], extras=lambda shared: ()):
    return lambda cls, w, nxt: Built(make(w), w, extras)


FACTORIES: dict[str, Callable[[type, int, type | None], Built]] = {
    "GroupedLinear": _grouped,
    "BasicLinear": lambda cls, w, nxt: Built(cls(w, _linear_out(nxt), dtype=torch.float64),
                                             _linear_out(nxt), lambda s: ()),
    "Bias": _same_width(lambda w: ops.Bias(w, dtype=torch.float64)),
    "SwiGLU": _gated, "ScaledSwiGLU": _gated, "GEGLU": _gated, "ReGLU": _gated,
    "GELU": _same_width(lambda w: ops.GELU()),
    "ReLU": _same_width(lambda w: ops.ReLU()),
    "SiLU": _same_width(lambda w: ops.SiLU()),
    "LayerNorm": _same_width(lambda w: ops.LayerNorm(w, dtype=torch.float64)),
    "RMSNorm": _same_width(lambda w: ops.RMSNorm(w, dtype=torch.float64)),
    "Identity": _same_width(lambda w: ops.Identity()),
    "ConstantScale": _same_width(lambda w: ops.ConstantScale(0.5)),
    "Dropout": _same_width(lambda w: ops.Dropout(0.0)),
    "Reshape": _same_width(lambda w: ops.Reshape((-1, w))),
    "AddExtraInput": _same_width(lambda w: ops.AddExtraInput(),
                                 lambda shared: (torch.randn(T, shared["width"],
                                                             dtype=torch.float64),)),
    "MakeExtraOutput": _same_width(lambda w: ops.MakeExtraOutput()),
    "GLU": _gated, "QGEGLU": _gated, "SReGLU": _gated, "ClampedSwiGLU": _gated,
    "ScaledClampedQGeGLU": _gated, "SiTUGLU": _gated, "ScaledSiTUGLU": _gated,
    "QGELU": _same_width(lambda w: ops.QGELU()),
    "SReLU": _same_width(lambda w: ops.SReLU()),
    "ScaledSReLU": _same_width(lambda w: ops.ScaledSReLU(),
                               lambda shared: () if "dispatch" in shared
                               else (_rand_rows(shared),)),
    "ExpertDispatch": _same_width(lambda w: ops.ExpertDispatch(GROUPS), _dispatch_extras),
    "ExpertCombine": _same_width(lambda w: ops.ExpertCombine()),
}


def _factory_for(cls: type) -> Callable | None:
    for klass in cls.__mro__:  # a subclass of a known op uses its parent's factory
        if klass.__name__ in FACTORIES and getattr(ops, klass.__name__, None) is klass:
            return FACTORIES[klass.__name__]
    return None


def _concrete(element: type | tuple) -> tuple[type, ...]:
    """The op classes a pattern element matches: each class with a factory as it is, a base
    class without one (e.g. Activation) as every op te_seq.ops exports that derives from it."""
    classes = element if isinstance(element, tuple) else (element,)
    out: list[type] = []
    for cls in classes:
        out += [cls] if _factory_for(cls) else exported_subclasses(cls)
    return tuple(dict.fromkeys(out))


def _alternatives(pattern: tuple) -> list[tuple[type, ...]]:
    """Concrete class choices covering every alternative of every element at least once."""
    elements = [_concrete(e) for e in pattern]
    width = max(len(e) for e in elements)
    return [tuple(e[k % len(e)] for e in elements) for k in range(width)]


@dataclass
class WindowRun:
    seq: te_seq.Sequential
    x: torch.Tensor
    extras: list


def build_window(classes: tuple[type, ...]) -> WindowRun:
    shared: dict = {"dtype": torch.float64}
    built, width = [], HID
    for i, cls in enumerate(classes):
        nxt = classes[i + 1] if i + 1 < len(classes) else None
        shared["width"] = width  # the input width of this op (extras shaped like its input)
        b = _factory_for(cls)(cls, width, nxt)
        built.append((b, b.extras(shared)))
        width = b.out_width
    seq = te_seq.Sequential(*[b.op for b, _ in built])
    randomize_params(seq)
    x = torch.randn(T, HID, dtype=torch.float64)
    return WindowRun(seq, x, [e for _, extras in built for e in extras])


def run_with_grads(run: WindowRun) -> tuple[list[torch.Tensor], te_seq.FusionPlan]:
    """Outputs, then grads of x, floating extras and params (fresh leaves each call)."""
    x = run.x.clone().requires_grad_(True)
    extras = [e.clone().requires_grad_(True) if e.is_floating_point() else e for e in run.extras]
    for p in run.seq.parameters():
        p.grad = None
    outs = run.seq(x, *extras)
    outs = (outs,) if isinstance(outs, torch.Tensor) else outs
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outs]
    torch.autograd.backward(outs, grads)
    leaves = [x, *[e for e in extras if e.is_floating_point()], *run.seq.parameters()]
    return [o.detach() for o in outs] + [t.grad for t in leaves], run.seq.fusion_plan()


# --- every registered fusion, fused vs unfused ----------------------------------------------------

def _fusion_cases() -> Iterator:
    for record in te_seq.list_fusions():
        for k, classes in enumerate(_alternatives(record.pattern)):
            label = "-".join(c.__name__ for c in classes)
            yield pytest.param(record.name, classes, id=f"{record.name}-{k}-{label}")


def _fused_step(steps, indices: tuple[int, ...]):
    return next((s for s in steps if s.basic_op_indices == indices
                 and isinstance(s.op, ops.FusedOperation)), None)


@pytest.mark.parametrize("name,classes", list(_fusion_cases()))
def test_registered_fusion_matches_unfused(name: str, classes: tuple[type, ...]) -> None:
    missing = [c.__name__ for c in classes if _factory_for(c) is None]
    if missing:
        pytest.skip(f"no window factory for {missing} (add one to FACTORIES)")
    run = build_window(classes)
    fused, plan = run_with_grads(run)
    record = next(r for r in te_seq.list_fusions() if r.name == name)
    indices = tuple(range(len(classes)))
    declined = [m for m in plan.misses if m.fusion == name]
    if declined:
        pytest.skip(f"{name} declines this float64 CPU window: {declined[0].reason}")
    phases = {"joint": ("forward", "backward"), "forward": ("forward",), "backward": ("backward",)}
    for phase in phases[record.phase]:
        assert _fused_step(getattr(plan, phase), indices), f"{name} not in {phase}:\n{plan}"
    with te_seq.fusions_disabled(name):
        unfused, plan_off = run_with_grads(run)
    assert not any(m.fusion == name for m in plan_off.misses)
    for phase in ("forward", "backward"):
        steps = getattr(plan_off, phase)
        assert all(type(s.op).__name__ != type(_fused_step(getattr(plan, p), indices).op).__name__
                   for s in steps for p in phases[record.phase]), plan_off
    assert len(fused) == len(unfused)
    for i, (a, b) in enumerate(zip(fused, unfused)):
        assert (a is None) == (b is None), f"tensor {i}: grad present only on one side"
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"tensor {i}: {m}")


def test_every_builtin_fusion_has_factories() -> None:
    for record in te_seq.list_fusions():
        if not record.builtin:
            continue
        for element in record.pattern:
            classes = _concrete(element)
            assert classes, f"built-in fusion {record.name}: no op class matches {element}"
            for cls in classes:
                assert _factory_for(cls), f"built-in fusion {record.name}: no factory for {cls}"


# --- GroupedMLP declines --------------------------------------------------------------------------

def _mlp(groups2: int = GROUPS, fc2_in: int = FFN) -> te_seq.Sequential:
    seq = te_seq.Sequential(ops.GroupedLinear(GROUPS, HID, 2 * FFN, dtype=torch.float64),
                            ops.SwiGLU(),
                            ops.GroupedLinear(groups2, fc2_in, HID, dtype=torch.float64))
    randomize_params(seq)
    return seq


def _names(steps) -> list[str]:
    return [s.name for s in steps]


def test_grouped_mlp_equal_split_tensors_fuse() -> None:
    seq = _mlp()
    x = torch.randn(T, HID, dtype=torch.float64, requires_grad=True)
    seq(x, torch.tensor([3, 0, 4]), torch.tensor([3, 0, 4])).sum().backward()
    plan = seq.fusion_plan()
    assert _names(plan.forward) == ["GroupedMLP"] and _names(plan.backward) == ["GroupedMLP"]
    assert plan.misses == []


def test_grouped_mlp_declines_different_split_values() -> None:
    seq = _mlp()
    s1, s2 = torch.tensor([3, 0, 4]), torch.tensor([1, 5, 1])
    x = torch.randn(T, HID, dtype=torch.float64)
    y = seq(x, s1, s2)
    plan = seq.fusion_plan()
    assert _names(plan.forward) == ["GroupedLinear", "SwiGLU", "GroupedLinear"]
    [miss] = plan.misses
    assert miss.fusion == "grouped_mlp" and miss.basic_op_indices == (0, 1, 2)
    assert "split_sizes" in miss.reason
    # The unfused chain honours each op's own split sizes.
    fc1, _, fc2 = seq
    h = _grouped_ref(fc1, x, s1)
    gate, up = h.chunk(2, -1)
    torch.testing.assert_close(y, _grouped_ref(fc2, torch.nn.functional.silu(gate) * up, s2))


def _grouped_ref(fc, x: torch.Tensor, splits: torch.Tensor) -> torch.Tensor:
    parts = x.split(splits.tolist())
    return torch.cat([p @ getattr(fc, f"weight{g}").t() + getattr(fc, f"bias{g}")
                      for g, p in enumerate(parts)])


def test_grouped_mlp_declines_different_num_groups() -> None:
    seq = _mlp(groups2=2)
    seq(torch.randn(T, HID, dtype=torch.float64), torch.tensor([3, 0, 4]), torch.tensor([3, 4]))
    [miss] = seq.fusion_plan().misses
    assert miss.fusion == "grouped_mlp" and "num_groups differ: 3 vs 2" in miss.reason


def test_grouped_mlp_declines_dims_that_dont_chain() -> None:
    seq = _mlp(fc2_in=FFN + 1)
    splits = torch.tensor([3, 0, 4])
    # The unfused chain runs and fails at FC2's input check, naming the op and both sizes.
    match = rf"GroupedLinear: input has last dimension {FFN}.*in_features={FFN + 1}"
    with pytest.raises(ValueError, match=match):
        seq(torch.randn(T, HID, dtype=torch.float64), splits, splits)
    record = next(r for r in te_seq.list_fusions() if r.name == "grouped_mlp")
    from te_seq.fusion.matcher import Window

    result = record.build(Window(list(seq), [(splits,), (), (splits,)], (0, 1, 2)))
    assert isinstance(result, te_seq.NoMatch) and "don't chain" in result.reason
    assert f"in_features={FFN + 1}" in result.reason


# --- user fusions ---------------------------------------------------------------------------------

class ChainFused(ops.FusedOperation):
    """A user fused op that runs its basic ops' own forward/backward (counts the calls)."""

    calls: list[str]

    def __init__(self, basic_ops) -> None:
        super().__init__(basic_ops)
        self.calls = []

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        self.calls.append("forward")
        x, outs = input_, []
        for i, (op, ctx) in enumerate(zip(self.basic_ops, basic_op_ctxs)):
            if i:
                op.pre_forward_checks(x, basic_op_extra_inputs[i])
            x, out = op.fuser_forward([ctx], x, basic_op_extra_inputs=[basic_op_extra_inputs[i]],
                                      basic_op_kwargs=[basic_op_kwargs[i]])
            outs.append(out[0])
        return x, outs

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        self.calls.append("backward")
        n = len(self.basic_ops)
        pgrads, egrads, dy = [None] * n, [None] * n, grad_output
        for i in reversed(range(n)):
            dy, pg, eg = self.basic_ops[i].fuser_backward(
                [basic_op_ctxs[i]], dy,
                basic_op_grad_extra_outputs=[basic_op_grad_extra_outputs[i]])
            pgrads[i], egrads[i] = pg[0], eg[0]
        return dy, pgrads, egrads


class UserJoint(ChainFused):
    pass


class UserForward(ChainFused):
    pass


class UserBackward(ChainFused):
    pass


USER_CLASSES = {"joint": UserJoint, "forward": UserForward, "backward": UserBackward}


@pytest.fixture
def user_fusions() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        if any(r.name == name for r in te_seq.list_fusions()):
            te_seq.unregister_fusion(name)


def _register(names: list[str], name: str, phase: str, pattern, build=None) -> list:
    built: list = []

    def default_build(window):
        built.append(USER_CLASSES[phase](window))
        return built[-1]

    te_seq.register_fusion(name=name, phase=phase, pattern=pattern)(build or default_build)
    names.append(name)
    return built


@pytest.mark.parametrize("phase", ["joint", "forward", "backward"])
def test_user_fusion_fires_and_matches_unfused(phase: str, user_fusions) -> None:
    built = _register(user_fusions, f"user_{phase}", phase, (ops.BasicLinear, ops.Bias, ops.GELU))
    run = build_window((ops.BasicLinear, ops.Bias, ops.GELU))
    fused, plan = run_with_grads(run)
    want = {"joint": ("forward", "backward"), "forward": ("forward",), "backward": ("backward",)}
    for where in ("forward", "backward"):
        names = _names(getattr(plan, where))
        assert (USER_CLASSES[phase].__name__ in names) == (where in want[phase]), plan
    assert built and built[-1].calls == list(want[phase])
    with te_seq.fusions_disabled(f"user_{phase}"):
        unfused, _ = run_with_grads(run)
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_user_fusion_is_tried_before_builtin(user_fusions) -> None:
    pattern = (ops.GroupedLinear, ops.SwiGLU, ops.GroupedLinear)
    _register(user_fusions, "user_mlp", "joint", pattern)
    seq, splits = _mlp(), torch.tensor([3, 0, 4])
    x = torch.randn(T, HID, dtype=torch.float64, requires_grad=True)
    seq(x, splits, splits).sum().backward()
    assert _names(seq.fusion_plan().forward) == ["UserJoint"]
    assert _names(seq.fusion_plan().backward) == ["UserJoint"]
    order = [r.name for r in te_seq.list_fusions()]
    assert order.index("user_mlp") < order.index("grouped_mlp")


def test_user_decline_reason_shows_and_builtin_takes_over(user_fusions) -> None:
    pattern = (ops.GroupedLinear, ops.SwiGLU, ops.GroupedLinear)
    _register(user_fusions, "user_picky", "joint", pattern,
              build=lambda window: te_seq.NoMatch(f"picky: indices {window.basic_op_indices}"))
    seq, splits = _mlp(), torch.tensor([3, 0, 4])
    seq(torch.randn(T, HID, dtype=torch.float64), splits, splits)
    plan = seq.fusion_plan()
    assert _names(plan.forward) == ["GroupedMLP"]
    [miss] = plan.misses
    assert (miss.fusion, miss.basic_op_indices, miss.reason) == (
        "user_picky", (0, 1, 2), "picky: indices (0, 1, 2)")
    assert "picky" in str(plan)


def test_joint_fusions_are_matched_before_forward(user_fusions) -> None:
    _register(user_fusions, "user_fc1_act", "forward", (ops.GroupedLinear, ops.SwiGLU))
    seq, splits = _mlp(), torch.tensor([3, 0, 4])
    x = torch.randn(T, HID, dtype=torch.float64)
    seq(x, splits, splits)
    assert _names(seq.fusion_plan().forward) == ["GroupedMLP"]
    with te_seq.fusions_disabled("grouped_mlp"):
        seq(x, splits, splits)
    assert _names(seq.fusion_plan().forward) == ["UserForward", "GroupedLinear"]


def test_window_exposes_extra_inputs_and_indices(user_fusions) -> None:
    seen = []

    def build(window):
        seen.append((tuple(type(o).__name__ for o in window), window.extra_inputs,
                     window.basic_op_indices))
        return te_seq.NoMatch("just looking")

    _register(user_fusions, "user_peek", "forward", (ops.SwiGLU, ops.GroupedLinear), build=build)
    seq, splits = _mlp(), torch.tensor([3, 0, 4])
    with te_seq.fusions_disabled("grouped_mlp"):
        seq(torch.randn(T, HID, dtype=torch.float64), splits, splits)
    [(names, extra, indices)] = seen
    assert names == ("SwiGLU", "GroupedLinear") and indices == (1, 2)
    assert extra[0] == () and extra[1][0] is splits


def test_build_returning_wrong_type_is_a_type_error(user_fusions) -> None:
    _register(user_fusions, "user_bad", "forward", (ops.GELU,), build=lambda window: 42)
    seq = te_seq.Sequential(ops.GELU())
    with pytest.raises(TypeError, match="fusion 'user_bad' returned int"):
        seq(torch.randn(3, 4))


# --- registry API ---------------------------------------------------------------------------------

def test_list_fusions_records() -> None:
    records = {r.name: r for r in te_seq.list_fusions()}
    mlp = records["grouped_mlp"]
    assert mlp.phase == "joint" and mlp.enabled
    assert mlp.pattern[0] is ops.GroupedLinear and mlp.pattern[2] is ops.GroupedLinear
    assert set(_concrete(mlp.pattern[1])) == {ops.SwiGLU, ops.ScaledSwiGLU, ops.GEGLU, ops.ReGLU,
                                              ops.GELU, ops.ReLU, ops.SiLU, ops.GLU, ops.QGELU,
                                              ops.QGEGLU, ops.SReLU, ops.SReGLU, ops.ScaledSReLU,
                                              ops.ClampedSwiGLU, ops.ScaledClampedQGeGLU,
                                              ops.SiTUGLU, ops.ScaledSiTUGLU}
    assert set(_concrete(mlp.pattern[1])) == set(activation_ops())


def test_disable_enable_and_context_manager() -> None:
    enabled = lambda: {r.name: r.enabled for r in te_seq.list_fusions()}  # noqa: E731
    te_seq.disable_fusion("grouped_mlp")
    assert enabled()["grouped_mlp"] is False
    te_seq.enable_fusion("grouped_mlp")
    assert enabled()["grouped_mlp"] is True
    with te_seq.fusions_disabled("grouped_mlp"):
        assert enabled()["grouped_mlp"] is False
    assert enabled()["grouped_mlp"] is True
    with te_seq.fusions_disabled():
        assert not any(enabled().values())
    assert all(enabled().values())
    te_seq.disable_fusion("grouped_mlp")
    with te_seq.fusions_disabled():
        pass
    assert enabled()["grouped_mlp"] is False, "fusions_disabled must restore the previous state"


def _never(window):
    raise AssertionError("a rejected registration must never be built")


def test_registry_errors(user_fusions) -> None:
    _register(user_fusions, "user_dup", "forward", (ops.GELU,))
    with pytest.raises(ValueError, match="'user_dup' is already registered"):
        te_seq.register_fusion(name="user_dup", phase="forward", pattern=(ops.ReLU,))(_never)
    with pytest.raises(ValueError, match="'grouped_mlp' is already registered"):
        te_seq.register_fusion(name="grouped_mlp", phase="joint", pattern=(ops.ReLU,))(_never)
    with pytest.raises(ValueError, match=r"phase must be one of .*got 'sideways'"):
        te_seq.register_fusion(name="user_x", phase="sideways", pattern=(ops.ReLU,))(_never)
    with pytest.raises(ValueError, match="pattern is empty"):
        te_seq.register_fusion(name="user_x", phase="forward", pattern=())(_never)
    for call in (te_seq.disable_fusion, te_seq.enable_fusion, te_seq.unregister_fusion):
        with pytest.raises(ValueError, match="no fusion named 'nope' is registered"):
            call("nope")
    with pytest.raises(ValueError, match="no fusion named 'nope'"):
        with te_seq.fusions_disabled("nope"):
            pass


# --- plan caching ---------------------------------------------------------------------------------

def _cached_mlp():
    seq, splits = _mlp(), torch.tensor([3, 0, 4])
    x = torch.randn(T, HID, dtype=torch.float64, requires_grad=True)
    seq(x, splits, splits)
    return seq, x, splits


def test_plan_is_reused_when_nothing_changes() -> None:
    seq, x, splits = _cached_mlp()
    first = seq.fusion_plan()
    seq(x, splits, splits)
    assert seq.fusion_plan() is first
    x2 = torch.randn_like(x).requires_grad_(True)
    seq(x2, torch.tensor([3, 0, 4]), torch.tensor([3, 0, 4]))  # new data, equal split values
    assert seq.fusion_plan() is first


@pytest.mark.parametrize("change", ["disable_fusion", "dtype", "requires_grad", "eval", "backend",
                                    "glu_layout", "different_splits"])
def test_plan_is_rebuilt_when_its_key_changes(change: str) -> None:
    seq, x, splits = _cached_mlp()
    first = seq.fusion_plan()
    if change == "disable_fusion":
        te_seq.disable_fusion("grouped_mlp")
        seq(x, splits, splits)
        assert _names(seq.fusion_plan().forward) == ["GroupedLinear", "SwiGLU", "GroupedLinear"]
    elif change == "dtype":
        seq.to(torch.float32)
        seq(x.detach().float(), splits, splits)
    elif change == "requires_grad":
        seq(x.detach(), splits, splits)
    elif change == "eval":
        seq.eval()
        seq(x, splits, splits)
    elif change == "backend":
        if not te_seq.kernels.backend_available("torch")[0]:
            pytest.skip("torch backend unavailable")
        with te_seq.backend("torch"):
            seq(x, splits, splits)
        assert {s.backend for s in seq.fusion_plan().forward} == {"torch"}
    elif change == "glu_layout":  # an op setting the plan reads (fusion checks, kernel support)
        seq[1].glu_interleave_size = 3
        seq(x, splits, splits)
    else:
        seq(x, splits, torch.tensor([1, 5, 1]))
        assert _names(seq.fusion_plan().forward) == ["GroupedLinear", "SwiGLU", "GroupedLinear"]
    assert seq.fusion_plan() is not first
    if change in ("disable_fusion", "different_splits"):
        return
    assert _names(seq.fusion_plan().forward) == ["GroupedMLP"]


# --- parameters and state_dict --------------------------------------------------------------------

def test_state_dict_identical_with_and_without_fusion() -> None:
    seq, x, splits = _cached_mlp()
    before = {k: v.clone() for k, v in seq.state_dict().items()}
    names_before = [n for n, _ in seq.named_parameters()]
    seq(x, splits, splits).sum().backward()
    assert _names(seq.fusion_plan().forward) == ["GroupedMLP"]
    fused_state = seq.state_dict()
    with te_seq.fusions_disabled():
        seq(x, splits, splits)
        unfused_state = seq.state_dict()
    for state in (fused_state, unfused_state):
        assert list(state) == list(before)
        for k in before:
            assert torch.equal(state[k], before[k])
    assert [n for n, _ in seq.named_parameters()] == names_before


def test_fused_ops_own_no_parameters() -> None:
    seq, x, splits = _cached_mlp()
    [step] = seq.fusion_plan().forward
    assert isinstance(step.op, ops.FusedOperation)
    assert list(step.op.parameters()) == [] and list(step.op.children()) == []
    assert step.op.state_dict() == {}


def test_missing_op_helper_reports_existing_ops() -> None:
    assert not missing_op("GroupedLinear") and missing_op("NoSuchOp")
