"""torch.compile of te_seq models on CPU: compiled equals eager (docs/design.md, "torch.compile").

Most cases compile with backend="aot_eager": dynamo and AOTAutograd trace exactly what the default
backend gets (the same graphs, the same custom ops), and the graph then runs op by op, so results
are bitwise those of eager mode in float64 on the reference backend. Inductor (the default
backend) compiles C++ for every graph (several seconds each on CI's 2 cores), so only a few cases
use it, with a rounding tolerance (its fused elementwise code rounds differently from ATen's).

Each test resets dynamo first: compiled code is cached per code object (Sequential.forward), and
a test that hit the recompile limit would silently run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from compile_helpers import CountingBackend, fresh_dynamo  # noqa: F401 (autouse)
from op_specs import SPECS, build_case, floating, leaves_of, missing_op
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import make_boxed_func

import te_seq
from te_seq import ops
from te_seq.run import compiled as te_seq_compiled

F64 = torch.float64
# Tests of what tracing gives (fullgraph, graph contents, recompiles); on older torch te_seq runs
# eagerly at a graph break, which the compiled-equals-eager tests still check.
needs_tracing = pytest.mark.skipif(
    not te_seq_compiled.TRACEABLE, reason=te_seq_compiled.UNTRACEABLE_REASON
)


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def run_with_grads(fn: Callable, x: torch.Tensor, extras: tuple, leaves: list[torch.Tensor]):
    """(outputs, grads of `leaves`) of fn(x, *extras) with a fixed random output gradient."""
    outs = fn(x, *extras)
    outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
    gen = torch.Generator().manual_seed(7)
    grads_out = [torch.randn(o.shape, generator=gen, dtype=F64).to(o.dtype) for o in outs]
    wanted = [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad(outs, wanted, grads_out, allow_unused=True)
    return [o.detach() for o in outs], list(grads)


def assert_same(a: list, b: list, exact: bool, what: str) -> None:
    assert len(a) == len(b), what
    for i, (u, v) in enumerate(zip(a, b)):
        if u is None or v is None:
            assert u is None and v is None, f"{what}[{i}]: {u} vs {v}"
        elif exact:
            assert torch.equal(u, v), f"{what}[{i}]: max diff {(u - v).abs().max()}"
        else:
            torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12, msg=f"{what}[{i}]")


# --- the op matrix ----------------------------------------------------------------------------
# Every spec of the fusible-op matrix, alone in a Sequential, in float64: compiled (aot_eager,
# graph breaks allowed) against eager, output and every gradient, bitwise. GroupedLinear also
# on the torch backend (its CPU grouped GEMM), the others have no kernel there.
MATRIX = [(spec, "reference") for spec in SPECS] + [
    (spec, "torch") for spec in SPECS if spec.op_name == "GroupedLinear"
]


@pytest.mark.slow  # ~30 s for the whole matrix on 2 cores
@pytest.mark.parametrize(
    "spec,backend", MATRIX, ids=[f"{s.name}-{b}" for s, b in MATRIX]
)
def test_every_op_compiled_equals_eager(spec, backend):
    if missing_op(spec.op_name):
        pytest.skip(f"te_seq.ops.{spec.op_name} does not exist")
    x = torch.randn(2, 5, spec.in_width, dtype=F64, requires_grad=True)
    case = build_case(spec, F64, x)
    extras = tuple(
        e.requires_grad_() if floating(e) and spec.extras_need_grad else e for e in case.extras
    )
    leaves = leaves_of(case)
    counter = CountingBackend()
    compiled = torch.compile(case.seq, backend=counter)
    with te_seq.backend(backend):
        fresh = tuple(e.clone() if floating(e) else e for e in extras)  # in-place ops write them
        eager = run_with_grads(case.seq, x, fresh, leaves)
        traced = run_with_grads(compiled, x, extras, leaves)
    # traced into a graph, or (Reshape, in-place AddExtraInput) run eagerly at a graph break
    assert counter.graphs + graph_breaks() >= 1, "dynamo never saw the run"
    assert_same(eager[0], traced[0], exact=True, what="outputs")
    assert_same(eager[1], traced[1], exact=True, what="grads")
    assert case.seq.fusion_plan() is not None


# --- the fused grouped MLP, fullgraph --------------------------------------------------------

E, H, FFN, T = 4, 16, 32, 24
SPLITS = ([6, 0, 10, 8], [1, 2, 3, 18], [24, 0, 0, 0], [0, 0, 0, 24])


def grouped_mlp(act: str = "ScaledSwiGLU", single: bool = True, bias: bool = False, **kwargs):
    act_op = getattr(ops, act)()
    width = 2 * FFN if act_op.gated else FFN
    return te_seq.Sequential(
        ops.GroupedLinear(E, H, width, bias=bias, single_grouped_weight=single, dtype=F64,
                          **kwargs),
        act_op,
        ops.GroupedLinear(E, FFN, H, bias=bias, single_grouped_weight=single, dtype=F64,
                          **kwargs),
    )


def mlp_inputs(mlp: te_seq.Sequential, splits: list[int]) -> tuple[torch.Tensor, tuple]:
    x = torch.randn(T, H, dtype=F64, requires_grad=True)
    s = torch.tensor(splits)
    scaled = mlp[1].num_extra_inputs == 1
    probs = (torch.rand(T, dtype=F64) + 0.5).requires_grad_() if scaled else None
    return x, (s, probs, s) if scaled else (s, s)


def check_mlp_fullgraph(
    mlp, backend: str, inner: str = "aot_eager", exact: bool = True, compiled_first: bool = False
):
    """Compiled vs eager on every split of SPLITS; `compiled_first`: the compiled call of each
    split runs before the eager one (an eager call between two compiled calls must not make the
    next one recompile)."""
    counter = CountingBackend(inner)
    compiled = torch.compile(mlp, backend=counter, fullgraph=True)
    with te_seq.backend(backend):
        for splits in SPLITS:
            x, extras = mlp_inputs(mlp, splits)
            leaves = [x, *[e for e in extras if floating(e)], *mlp.parameters()]
            if compiled_first:
                traced = run_with_grads(compiled, x, extras, leaves)
            eager = run_with_grads(mlp, x, extras, leaves)
            if not compiled_first:
                traced = run_with_grads(compiled, x, extras, leaves)
            assert_same(eager[0], traced[0], exact, f"outputs, splits {splits}")
            assert_same(eager[1], traced[1], exact, f"grads, splits {splits}")
    assert [s.name for s in mlp.fusion_plan().forward] == ["GroupedMLP"]
    # one graph for the forward frame, whatever the split sizes: no recompile, no break
    assert counter.graphs == 1, f"{counter.graphs} graphs for {len(SPLITS)} split sizes"
    assert graph_breaks() == 0


@needs_tracing
def test_grouped_mlp_fullgraph_no_recompile():
    check_mlp_fullgraph(grouped_mlp(), "torch")


@needs_tracing
def test_grouped_mlp_fullgraph_compiled_first_no_recompile():
    check_mlp_fullgraph(grouped_mlp(), "torch", compiled_first=True)


@needs_tracing
def test_compiled_first_call_reads_no_memo_an_eager_call_fills(monkeypatch):
    """A fresh process: the GLU spec memo is empty when the first compiled call traces, then
    the eager call fills it; the memo must not have become a guard (found on an H200: one
    recompile per new (activation, layout) pair)."""
    from te_seq.ops.basic import activation

    monkeypatch.setattr(activation, "_GLU_SPECS", {})
    check_mlp_fullgraph(grouped_mlp(), "torch", compiled_first=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,act",
    [("reference", "ScaledSwiGLU"), ("reference", "SwiGLU"), ("torch", "SwiGLU"),
     ("reference", "GELU"), ("torch", "GELU")],
)
@needs_tracing
def test_grouped_mlp_fullgraph_every_activation_kind(backend, act):
    check_mlp_fullgraph(grouped_mlp(act), backend)


@pytest.mark.slow
@needs_tracing
def test_grouped_mlp_fullgraph_per_group_weights_and_biases():
    check_mlp_fullgraph(grouped_mlp(single=False, bias=True), "torch")


@pytest.mark.slow
@needs_tracing
def test_grouped_mlp_fullgraph_inductor():
    """The default backend: TorchInductor compiles the graph around the opaque GEMM ops."""
    check_mlp_fullgraph(grouped_mlp(), "reference", inner="inductor", exact=False)


@needs_tracing
def test_grouped_mlp_graph_holds_the_custom_ops():
    """The GEMMs reach the compiler as te_seq's custom ops (opaque, with fake shapes)."""
    seen: list[str] = []

    def record(gm: torch.fx.GraphModule, example_inputs):
        def inner(fw: torch.fx.GraphModule, _inputs):
            seen.extend(str(n.target) for n in fw.graph.nodes if n.op == "call_function")
            return make_boxed_func(fw)

        return aot_autograd(fw_compiler=inner, bw_compiler=inner)(gm, example_inputs)

    mlp = grouped_mlp()
    x, extras = mlp_inputs(mlp, SPLITS[0])
    with te_seq.backend("torch"):
        torch.compile(mlp, backend=record, fullgraph=True)(x, *extras).sum().backward()
    assert any("te_seq.grouped_mm" in t for t in seen), seen
    assert any("te_seq.grouped_wgrad" in t for t in seen), seen
    assert not any("_local_scalar_dense" in t for t in seen), "a split size was read on the host"


@needs_tracing
def test_compiled_split_sizes_are_checked_when_the_graph_runs():
    """Compiled mode never reads split sizes while tracing; bad ones fail the run-time check
    (a RuntimeError on CPU data, a device-side assert on CUDA) instead of the eager ValueError."""
    mlp = grouped_mlp()
    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=True)
    x, extras = mlp_inputs(mlp, SPLITS[0])
    compiled(x, *extras)
    bad = torch.tensor([6, 0, 10, 7])  # sums to 23, the input has 24 rows
    with pytest.raises(RuntimeError, match="split_sizes must be non-negative and sum to the rows"):
        compiled(x, bad, extras[1], bad)
    with pytest.raises(ValueError, match="split_sizes sum to 23"):
        mlp(x, bad, extras[1], bad)  # eager keeps its ValueError


@needs_tracing
def test_switching_backend_recompiles():
    """The requested backend is part of the plan key, so it is a guard: a compiled model follows
    te_seq.backend(...) instead of replaying a stale plan."""
    mlp = grouped_mlp()
    counter = CountingBackend()
    compiled = torch.compile(mlp, backend=counter)
    x, extras = mlp_inputs(mlp, SPLITS[0])
    with te_seq.backend("reference"):
        compiled(x, *extras)
    assert mlp.fusion_plan().forward[0].backend == "reference"
    with te_seq.backend("torch"):
        compiled(x, *extras)
    assert mlp.fusion_plan().forward[0].backend == "torch"
    assert counter.graphs == 2


# --- the gradient contract under compile -----------------------------------------------------


def _contract_params(mlp, flag: bool, overwrite: bool = False) -> None:
    for p in mlp.parameters():
        p.main_grad = torch.full_like(p, 0.5)
        if overwrite:
            p.overwrite_main_grad = True
        if flag:
            p.grad_added_to_main_grad = False


def _contract_run(mlp, fn, flag: bool, overwrite: bool, delayed: bool):
    torch.manual_seed(3)
    _contract_params(mlp, flag, overwrite)
    x, extras = mlp_inputs(mlp, SPLITS[0])
    fn(x, *extras).sum().backward()
    if delayed:
        assert mlp.need_backward_dw()
        mlp.backward_dw()
    state = [(p.main_grad.clone(), getattr(p, "grad_added_to_main_grad", None),
              None if p.grad is None else p.grad.shape) for p in mlp.parameters()]
    for p in mlp.parameters():
        p.grad = None
    return x.grad, state


@pytest.mark.parametrize(
    "flag,overwrite,delayed",
    [(False, False, False), (True, False, False), (False, True, False), (True, False, True)],
    ids=["accumulate", "flag_dummy", "overwrite", "delayed_flag"],
)
def test_gradient_contract_compiled_equals_eager(flag, overwrite, delayed):
    """main_grad accumulate / overwrite, the grad_added_to_main_grad flag with its dummy, and
    delayed wgrad with backward_dw(): the same main_grad, flags and .grad as eager mode."""
    mlp = grouped_mlp(accumulate_into_main_grad=True, delay_wgrad_compute=delayed)
    eager = _contract_run(mlp, mlp, flag, overwrite, delayed)
    compiled = torch.compile(mlp, backend="aot_eager")
    traced = _contract_run(mlp, compiled, flag, overwrite, delayed)
    assert torch.equal(eager[0], traced[0])
    for (g1, f1, s1), (g2, f2, s2) in zip(eager[1], traced[1]):
        assert torch.equal(g1, g2) and f1 == f2 and s1 == s2


def test_delayed_wgrad_compiled_adds_to_grad():
    mlp = grouped_mlp(delay_wgrad_compute=True)
    compiled = torch.compile(mlp, backend="aot_eager")
    x, extras = mlp_inputs(mlp, SPLITS[0])
    mlp(x, *extras).sum().backward()
    mlp.backward_dw()
    eager = [p.grad.clone() for p in mlp.parameters()]
    for p in mlp.parameters():
        p.grad = None
    compiled(x, *extras).sum().backward()
    assert all(p.grad is None for p in mlp.parameters())
    mlp.backward_dw()
    assert all(torch.equal(p.grad, g) for p, g in zip(mlp.parameters(), eager))


# --- models around te_seq: plain modules, user fusions, a model containing a Sequential -------


class Block(torch.nn.Module):
    """A model containing a te_seq Sequential between plain PyTorch layers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(H, dtype=F64)
        self.mlp = grouped_mlp()
        self.out = torch.nn.Linear(H, H, dtype=F64)

    def forward(self, x, splits, probs):
        return self.out(self.mlp(self.norm(x), splits, probs, splits)) + x


@needs_tracing
def test_model_containing_a_sequential_fullgraph():
    block = Block()
    counter = CountingBackend()
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    for splits in SPLITS[:2]:
        x, (s, probs, _) = mlp_inputs(block.mlp, splits)
        leaves = [x, probs, *block.parameters()]
        eager = run_with_grads(block, x, (s, probs), leaves)
        traced = run_with_grads(compiled, x, (s, probs), leaves)
        assert_same(eager[0], traced[0], True, "outputs")
        assert_same(eager[1], traced[1], True, "grads")
    assert counter.graphs == 1


@needs_tracing
def test_plain_modules_between_te_seq_ops():
    seq = te_seq.Sequential(
        ops.Linear(H, 2 * H, dtype=F64),
        torch.nn.Tanh(),
        ops.GELU(),
        torch.nn.Dropout(0.0),
        ops.LayerNorm(2 * H, dtype=F64),
        ops.Linear(2 * H, H, dtype=F64),
    )
    x = torch.randn(3, 4, H, dtype=F64, requires_grad=True)
    leaves = [x, *seq.parameters()]
    eager = run_with_grads(seq, x, (), leaves)
    traced = run_with_grads(torch.compile(seq, backend="aot_eager", fullgraph=True), x, (), leaves)
    assert_same(eager[0], traced[0], True, "outputs")
    assert_same(eager[1], traced[1], True, "grads")
    assert graph_breaks() == 0


class Square(ops.BasicOperation):
    """y = x², a user op (not traced: it runs eagerly at a graph break)."""

    def op_forward(self, ctx, input_):
        if ctx.requires_grad:
            ctx.save_for_backward(input_)
        return input_ * input_

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        return 2 * x * grad_output, []


class ScaleSquare(ops.FusedOperation):
    """ConstantScale → Square as one op: y = (c·x)²."""

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        scale = self.basic_ops[0].scale
        if basic_op_ctxs[0].requires_grad:
            basic_op_ctxs[0].save_for_backward(input_)
        return (scale * input_) ** 2, [(), ()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        (x,) = basic_op_ctxs[0].saved_tensors
        scale = self.basic_ops[0].scale
        return 2 * scale * scale * x * grad_output, [[], []], [(), ()]


def test_user_ops_and_fusions_run_eagerly_at_a_graph_break():
    te_seq.register_fusion(name="test_scale_square", phase="joint",
                           pattern=(ops.ConstantScale, Square))(ScaleSquare)
    seq = te_seq.Sequential(
        ops.Linear(H, H, dtype=F64), torch.nn.ReLU(), ops.ConstantScale(0.5), Square()
    )
    x = torch.randn(5, H, dtype=F64, requires_grad=True)
    leaves = [x, *seq.parameters()]
    eager = run_with_grads(seq, x, (), leaves)
    traced = run_with_grads(torch.compile(seq, backend="aot_eager"), x, (), leaves)
    assert_same(eager[0], traced[0], True, "outputs")
    assert_same(eager[1], traced[1], True, "grads")
    assert "ScaleSquare" in [s.name for s in seq.fusion_plan().forward]
    assert graph_breaks() >= 1


@needs_tracing
def test_no_grad_and_eval_compile():
    mlp = grouped_mlp()
    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=True)
    x, extras = mlp_inputs(mlp, SPLITS[0])
    with torch.no_grad():
        assert torch.equal(compiled(x, *extras), mlp(x, *extras))
    assert mlp.fusion_plan().backward == []

