"""The fused grouped MLP's forward with FC1 launched as early as it can be (only what its launch
needs runs before it; FC2's operands and checks after): values and gradients as pure-torch maths
(float64, the reference backend), per-row probs given 1-D or as a column, on the full path and on
the fuser's fast path; and, on the stubbed cute kernels of benchmarks/profile_launch.py, the
forward's launches (kernels, order, arguments) and the harness's time to the FC1 launch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import te_seq
from te_seq import ops

D = torch.float64
T, H, FF, G = 10, 4, 6, 3
SPLITS = torch.tensor([4, 0, 6])


def _mlp() -> te_seq.Sequential:
    torch.manual_seed(0)
    seq = te_seq.Sequential(ops.GroupedLinear(G, H, 2 * FF, bias=False, dtype=D,
                                              single_grouped_weight=True),
                            ops.ScaledSwiGLU(),
                            ops.GroupedLinear(G, FF, H, bias=False, dtype=D,
                                              single_grouped_weight=True))
    with torch.no_grad():
        for p in seq.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return seq


def _torch_mlp(x, probs, w1, w2):
    """y_t = (silu(gate) * up * p_t) W2_eᵀ with [gate | up] = x_t W1_eᵀ, per expert e."""
    outs, start = [], 0
    for e, n in enumerate(SPLITS.tolist()):
        h = x[start:start + n] @ w1[e].T
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) * up * probs.reshape(-1)[start:start + n, None]
        outs.append(a @ w2[e].T)
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("probs_shape", [(T,), (T, 1)])
def test_fused_forward_and_grads_match_torch_maths_on_both_paths(probs_shape):
    seq = _mlp()
    torch.manual_seed(1)
    x0 = torch.randn(T, H, dtype=D)
    p0 = torch.rand(probs_shape, dtype=D) + 0.5
    dy = torch.randn(T, H, dtype=D)
    w1, w2 = (p.detach().clone().requires_grad_() for p in seq.parameters())
    xr, pr = x0.clone().requires_grad_(), p0.clone().requires_grad_()
    ref = _torch_mlp(xr, pr, w1, w2)
    ref.backward(dy)
    for call in range(3):  # the first call takes the full path, the next ones the fast path
        x, probs = x0.clone().requires_grad_(), p0.clone().requires_grad_()
        for p in seq.parameters():
            p.grad = None
        with te_seq.backend("reference"):
            y = seq(x, SPLITS, probs, SPLITS)
        assert [s.name for s in seq.fusion_plan().forward] == ["GroupedMLP"]
        y.backward(dy)
        torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
        got = [x.grad, probs.grad, *(p.grad for p in seq.parameters())]
        for g, r in zip(got, [xr.grad, pr.grad, w1.grad, w2.grad]):
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    fuser = seq._runs[0]
    assert fuser.fast_calls == 2
    for _ in range(3):
        with torch.no_grad(), te_seq.backend("reference"):
            torch.testing.assert_close(seq(x0, SPLITS, p0, SPLITS), ref.detach(),
                                       rtol=1e-12, atol=1e-12)
    assert fuser.fast_calls == 4


# --- the stubbed cute launches (benchmarks/profile_launch.py) ------------------------------

def _harness():
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install "
                        "'te_seq[cute]')")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import profile_launch

    return profile_launch


def _facts(arg):
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, tuple(arg.shape), arg.stride(), arg.storage_offset())
    return arg


@pytest.mark.parametrize("grad", [True, False])
def test_stubbed_forward_launches_offsets_then_fc1_then_fc2(grad):
    """Kernels, order and arguments of a (second, planned) forward's launches, as they were
    before FC1 was moved forward: the offsets kernel, the FC1 GLU kernel reading its offsets,
    FC2's GEMM reading FC1's activation (without grad FC1's h operand is a: h not stored)."""
    pl = _harness()
    from te_seq.kernels.cute.compile import GemmConfig, GluConfig

    bf, i32 = torch.bfloat16, torch.int32
    with pl.stubbed_step(record=True) as stubs, torch.set_grad_enabled(grad):
        forward = pl.mlp_forward(256, None, e=8, h=256, f=128)
        forward()
        order = []
        for cfg, stub in stubs.items():
            stub.calls.clear()
            stub.on_launch = lambda cfg=cfg: order.append(cfg)
        forward()
        launches = [(cfg, stubs[cfg].calls[0]) for cfg in order]
    assert [type(c) for c, _ in launches] == [tuple, GluConfig, GemmConfig]
    assert launches[1][0].mode == "fc1"
    (_, offsets), (_, fc1), (_, fc2) = launches
    assert [_facts(a) for a in offsets] == [
        (torch.int64, (8,), (1,), 0), (i32, (8,), (1,), 0), (i32, (1,), (1,), 0), 256]
    h = (bf, (256, 256), (256, 1), 0) if grad else (bf, (256, 128), (128, 1), 0)  # no_grad: a
    assert (fc1[2] is fc1[5]) == (not grad)  # without backward FC1 stores a only
    assert [_facts(a) for a in fc1] == [
        (bf, (256, 256), (256, 1), 0), (bf, (256, 256, 8), (256, 1, 65536), 0),
        h, (i32, (8,), (1,), 0), 18, (bf, (256, 128), (128, 1), 0),
        (torch.float32, (256,), (1,), 0), (torch.float32, (8,), (1,), 0),
        (bf, (8, 8), (8, 1), 0), (bf, (8, 8), (8, 1), 0), (i32, (1,), (1,), 0)]
    assert [_facts(a) for a in fc2] == [
        (bf, (256, 128), (128, 1), 0), (bf, (256, 128, 8), (128, 1, 32768), 0),
        (bf, (256, 256), (256, 1), 0), (i32, (8,), (1,), 0), 18, (i32, (1,), (1,), 0)]
    assert fc1[3] is offsets[1] and fc2[3] is offsets[1]  # both GEMMs read those offsets
    assert fc2[0] is fc1[5]  # FC2 multiplies FC1's activation


@pytest.mark.parametrize("grad", [True, False])
def test_harness_times_the_forward_up_to_its_fc1_launch(grad):
    """Up to the FC1 launch of the call's own grad mode (without backward the h-less FC1)."""
    pl = _harness()
    with pl.stubbed_step() as stubs, torch.set_grad_enabled(grad):
        forward = pl.mlp_forward(256, None, e=8, h=256, f=128)
        forward()
        fc1 = pl.fc1_stub(stubs, store_h=grad)
        to_fc1, whole = pl.time_to_fc1(forward, fc1, 3)
        aten = pl.aten_ops_to_fc1(forward, fc1)
        stats = pl.profile_to_fc1(forward, fc1, 2)
    assert 0 < to_fc1 < whole
    assert "cumsum" in aten and "mm" not in aten  # the (stubbed) offsets kernel, no GEMM yet
    assert "_assert_async" not in aten  # the offsets' check waits until FC1 is launched
    names = {name for (_, _, name) in stats.stats}
    assert "fuser_forward" in names and "fc2_rows" not in names  # profiled up to FC1 only


@pytest.mark.parametrize("grad", [True, False])
def test_steady_forward_asserts_the_offsets_right_after_the_fc1_launch(grad):
    """A steady call issues the offsets' device-side check as the first op after FC1's launch
    (before anything of FC2), once; the signature's first call checks before FC1 as every
    other grouped op does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    pl = _harness()

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with pl.stubbed_step() as stubs, torch.set_grad_enabled(grad):
        forward = pl.mlp_forward(256, None, e=8, h=256, f=128)
        forward()  # compiles (stubs) the kernels
        fc1 = pl.fc1_stub(stubs, store_h=grad)
        for steady in (False, True):
            if not steady:  # an attribute write: the next call is a signature's first again
                for op in forward.parts[0].basic_ops():
                    op.training = op.training
            ops: list[str] = []
            fc1.on_launch = lambda ops=ops: ops.append("FC1")
            with Log():
                forward()
            fc1.on_launch = None
            at = ops.index("FC1")
            assert ops.count("_assert_async") == 1
            assert (ops.index("_assert_async") == at + 1) == steady
            assert (ops.index("_assert_async") < at) == (not steady)


@pytest.mark.parametrize("grad", [True, False])
def test_fp8_steady_forward_takes_its_prepared_offsets(grad, monkeypatch):
    """Under an FP8 recipe the signature's first call prepares the offsets' launch alone: the
    calls after it take the offsets without `GroupedLinear.offsets` and issue their
    device-side check once, after the FP8 FC1's launch; the first call checks before it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from te_seq.ops.basic.grouped_linear import GroupedLinear

    pl = _harness()
    through_op = []
    original = GroupedLinear.offsets

    def counted(self, *args, **kwargs):
        through_op.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GroupedLinear, "offsets", counted)

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with pl.stubbed_step() as stubs, torch.set_grad_enabled(grad):
        forward = pl.mlp_forward(256, "Float8RowwiseScaling", e=8, h=256, f=128,
                                 fp8_wgrad=False)
        forward()  # compiles (stubs) the kernels
        fc1 = pl.fc1_stub(stubs, store_h=grad)
        assert fc1.config.scaled  # the row-wise FP8 FC1
        for steady in (False, True, True):
            if not steady:  # an attribute write: the next call is a signature's first again
                for op in forward.parts[0].basic_ops():
                    op.training = op.training
            through_op.clear()
            ops: list[str] = []
            fc1.on_launch = lambda ops=ops: ops.append("FC1")
            with Log():
                forward()
            fc1.on_launch = None
            assert len(through_op) == (0 if steady else 1)
            assert ops.count("_assert_async") == 1
            assert (ops.index("_assert_async") > ops.index("FC1")) == steady
    assert forward.parts[0]._runs[0].fast_calls >= 2


def _step_launches_during(stubs, call) -> dict:
    """{kernel config: the facts of each launch of it} of the GEMMs and the operands' row
    quantizations that ``call()`` makes (the weights' quantization, once per weight version,
    left out)."""
    from te_seq.kernels.cute.compile import GemmConfig, GluConfig
    from te_seq.kernels.cute.compile_quant import QuantConfig

    def kept(cfg) -> bool:
        return isinstance(cfg, (GemmConfig, GluConfig)) or \
            (isinstance(cfg, QuantConfig) and cfg.kind == "rows")

    before = {cfg: len(stub.calls) for cfg, stub in stubs.items()}
    call()
    return {repr(cfg): [[_facts(a) for a in args] for args in stub.calls[before.get(cfg, 0):]]
            for cfg, stub in stubs.items() if kept(cfg) and len(stub.calls) > before.get(cfg, 0)}


@pytest.mark.parametrize("recipe", ["Float8RowwiseScaling", "Float8CurrentScaling",
                                    "Float8BlockScaling"])
@pytest.mark.parametrize("grad", [True, False])
def test_fp8_steady_calls_launch_the_gemms_their_first_call_prepared(recipe, grad, monkeypatch):
    """Row-wise and per-tensor scales: the calls after a signature's first one launch the four
    FP8 GEMMs (FC1 with the activation in its epilogue, FC2, FC2's dgrad (with the
    activation's backward where dy is E4M3; per-tensor's default HYBRID format has E5M2
    gradients: the plain dgrad, then the activation's backward), FC1's dgrad) as that first
    call prepared them (no call through `fp8_cute.glu_fc1`, `glu_dgrad` or
    `scaled_grouped_mm`), and under row-wise scales the row quantizations of x, a, dy and dh
    too (none through `fp8_quantize.rows`; per-tensor scales quantize with torch ops), with
    the first call's arguments; every GEMM and row-quantization launch of the step is the
    same. Block scales prepare none: every call goes through the functionals, launching the
    same."""
    from te_seq.kernels import fp8_cute, fp8_quantize

    pl = _harness()
    through = []
    for module, name in ((fp8_cute, "glu_fc1"), (fp8_cute, "glu_dgrad"),
                         (fp8_cute, "scaled_grouped_mm"), (fp8_quantize, "rows")):
        original = getattr(module, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            through.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    prepares = recipe != "Float8BlockScaling"
    fused_dgrad = recipe != "Float8CurrentScaling"  # E4M3 gradients
    with pl.stubbed_step(record=True) as stubs, torch.set_grad_enabled(grad):
        forward = pl.mlp_forward(256, recipe, e=8, h=256, f=128, fp8_wgrad=False)
        mlp, x, probs = forward.parts
        dy = torch.randn(256, 256, dtype=torch.bfloat16)

        def step():
            y = forward()
            if grad:
                y.backward(dy)
                mlp.zero_grad(set_to_none=True)

        facts = []
        for call in range(3):
            through.clear()
            facts.append(_step_launches_during(stubs, step))
            gemms = ["glu_fc1", "scaled_grouped_mm"] + ["rows"] * 2
            if grad:
                gemms += ["glu_dgrad" if fused_dgrad else "scaled_grouped_mm",
                          "scaled_grouped_mm"] + ["rows"] * 2
            unprepared = [] if recipe == "Float8RowwiseScaling" else \
                [g for g in gemms if g == "rows" or not prepares]
            assert sorted(through) == sorted(gemms if call == 0 else unprepared)
    assert facts[0] == facts[1] == facts[2]
    row_kernels = 0 if recipe == "Float8CurrentScaling" else (4 if grad else 2)
    assert sum(len(calls) for calls in facts[0].values()) == (6 if grad else 2) + row_kernels
    assert mlp._runs[0].fast_calls == 2


def test_the_host_profiler_can_run_the_fp8_mlp_without_prepared_launches(monkeypatch):
    """`profile_host.unprepared_fp8_launches` (its --prepared-ab): inside it every call goes
    through the FP8 functionals, after it the steady calls launch prepared ones again."""
    from te_seq.kernels import fp8_cute
    from te_seq.ops.fused import _grouped_mlp_fp8

    pl = _harness()
    import profile_host

    through = []
    original = fp8_cute.glu_fc1
    monkeypatch.setattr(fp8_cute, "glu_fc1",
                        lambda *a, **k: through.append(1) or original(*a, **k))
    for_call = _grouped_mlp_fp8.Launches.for_call
    with pl.stubbed_step(), torch.no_grad():
        forward = pl.mlp_forward(256, "Float8RowwiseScaling", e=8, h=256, f=128)
        mlp = forward.parts[0]
        for _ in range(2):
            forward()
        through.clear()
        forward()
        assert through == []  # steady: prepared
        with profile_host.unprepared_fp8_launches(mlp):
            for _ in range(3):
                forward()
            assert len(through) == 3
        through.clear()
        forward()  # a signature's first call again: prepares
        forward()
        assert len(through) == 1
    assert _grouped_mlp_fp8.Launches.for_call == for_call


def test_a_prepared_row_quantization_follows_a_new_input_layout(monkeypatch):
    """The input's strides are not part of a call signature: a steady call whose x is laid out
    anew (same shape and values, column-major) quantizes it through `fp8_quantize.rows`, not
    the prepared launch, and the row kernel reads a row-major copy of it; a, laid out as
    before, takes its prepared launch."""
    from te_seq.kernels import fp8_quantize
    from te_seq.kernels.cute.compile_quant import QuantConfig

    pl = _harness()
    strides = []
    original = fp8_quantize.rows
    monkeypatch.setattr(fp8_quantize, "rows",
                        lambda t, *a: strides.append(t.stride()) or original(t, *a))
    with pl.stubbed_step(record=True) as stubs, torch.no_grad():
        forward = pl.mlp_forward(256, "Float8RowwiseScaling", e=8, h=256, f=128)
        x = forward.parts[1]
        forward()
        forward()
        strides.clear()
        x.data = x.data.t().contiguous().t()  # [T, H] with T contiguous
        forward()
        (row_kernel,) = [s for c, s in stubs.items()
                         if isinstance(c, QuantConfig) and c.kind == "rows"]
        quantized_x = next(args[0] for args in reversed(row_kernel.calls)
                           if args[0].shape == x.shape)
    assert strides == [(1, 256)]
    assert quantized_x.stride() == (256, 1) and torch.equal(quantized_x, x)
    assert forward.parts[0]._runs[0].fast_calls == 2


def test_a_rowwise_launch_runs_unprepared_where_the_operands_strides_changed():
    """`fp8_cute`'s prepared row-wise launch checks the FP8 data's strides on each call: the
    ones it was prepared for launch it, others go through the unprepared functional."""
    from te_seq.kernels import fp8_cute
    from te_seq.kernels.fp8_reference import ROWWISE, QuantizedTensor, ScaleRule

    calls = []
    launch = fp8_cute._RowwiseLaunch(lambda *a: calls.append("prepared"),
                                     lambda *a: calls.append("unprepared"),
                                     QuantizedTensor(torch.zeros(4, 32), torch.ones(4, 1),
                                                     ROWWISE, ScaleRule("E4M3")),
                                     torch.zeros(2, 16, 32))
    rule = ScaleRule("E4M3")
    same = QuantizedTensor(torch.zeros(4, 32), torch.ones(4, 1), ROWWISE, rule)
    strided = QuantizedTensor(torch.zeros(32, 4).t(), torch.ones(4, 1), ROWWISE, rule)
    offs, w, ws = torch.tensor([1, 4]), torch.zeros(2, 16, 32), torch.ones(2, 16, 1)
    launch(same, w, ws, offs, torch.bfloat16)
    launch(strided, w, ws, offs, torch.bfloat16)
    launch(same, torch.zeros(2, 32, 16).transpose(1, 2), ws, offs, torch.bfloat16)
    assert calls == ["prepared", "unprepared", "unprepared"]


def _fc1_facts(stubs):
    """The last FC1 launch's arguments as facts (tensors: dtype, shape, strides, offset)."""
    from te_seq.kernels.cute.compile import GluConfig

    fc1 = [s for c, s in stubs.items() if isinstance(c, GluConfig) and c.mode == "fc1"]
    return [_facts(a) for a in max(fc1, key=lambda s: s.last_ns).calls[-1]]


def test_steady_calls_launch_as_the_first_call_without_the_backend_call(monkeypatch):
    """The calls after a signature's first one launch the offsets and FC1 kernels it prepared
    (no call through the backend's glu_fc1_forward) with the same arguments; new weight
    strides (through .data, the same Parameter) are a new signature, prepared anew."""
    pl = _harness()
    from te_seq.kernels.cute_backend import CuteBackend

    through_backend = []
    original = CuteBackend.glu_fc1_forward

    def counted(self, *args, **kwargs):
        through_backend.append(args[1].stride())  # w1t's strides
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CuteBackend, "glu_fc1_forward", counted)
    with pl.stubbed_step(record=True) as stubs:
        forward = pl.mlp_forward(256, None, e=8, h=256, f=128)
        facts = []
        for _ in range(3):
            forward()
            facts.append(_fc1_facts(stubs))
        assert facts[0] == facts[1] == facts[2] and len(through_backend) == 1
        mlp = forward.parts[0]
        weight = mlp[0].weight
        with torch.no_grad():  # the same values, H-major rows: new strides, same shape
            weight.data = weight.data.transpose(1, 2).contiguous().transpose(1, 2)
        forward()
        forward()
        assert len(through_backend) == 2 and through_backend[1] != through_backend[0]
        fuser = mlp._runs[0]
        assert fuser.fast_calls == 3
    assert _fc1_facts(stubs)[1] != facts[0][1]  # B's view follows the new layout


def test_a_copy_after_steady_calls_starts_afresh():
    """deepcopy of a Sequential whose fuser holds prepared launches: the copy's fuser holds
    none (it decides on its first call), the original keeps its own."""
    import copy

    pl = _harness()
    with pl.stubbed_step():
        forward = pl.mlp_forward(256, None, e=8, h=256, f=128)
        forward()
        forward()
        mlp = forward.parts[0]
        twin = copy.deepcopy(mlp)
    assert mlp._runs[0]._fast is not None and twin._runs[0]._fast is None
    steady = mlp._runs[0]._fast.templates[0]["steady"]
    assert len(steady) == 1  # the grouped MLP's launches


@pytest.mark.parametrize("recipe", [None, "Float8RowwiseScaling"])
def test_a_forward_without_backward_launches_fc1_without_h(recipe):
    """A call whose backward never runs (no_grad here; the fast path's signature holds grad
    mode) launches FC1's h-less kernel (`store_h=False`: a passed as its h operand, nothing
    stored through it); calls with grad keep the h-writing one, also when the two alternate
    (each change of signature takes the full path; a repeated one the fast path)."""
    pl = _harness()
    from te_seq.kernels.cute.compile import GluConfig

    with pl.stubbed_step(record=True) as stubs:
        forward = pl.mlp_forward(256, recipe, e=8, h=256, f=128)
        for grad in (True, False, True, False, False):
            with torch.set_grad_enabled(grad):
                forward()
    fc1 = {cfg.store_h: stub for cfg, stub in stubs.items()
           if isinstance(cfg, GluConfig) and cfg.mode == "fc1"}
    assert set(fc1) == {True, False}
    assert all(cfg.scaled == (recipe is not None) for cfg in stubs if isinstance(cfg, GluConfig))
    assert len(fc1[True].calls) == 2 and len(fc1[False].calls) == 3
    for args in fc1[False].calls:  # (x, b, c, offs, clusters, a, ...)
        assert args[2] is args[5] and args[5].shape == (256, 128)
    for args in fc1[True].calls:
        assert args[2].shape == (256, 256) and args[5].shape == (256, 128)
    assert forward.parts[0]._runs[0].fast_calls == 1  # the last call: no_grad's steady FC1



def test_keep_h_setting_makes_a_forward_without_backward_write_h(tiling_env):
    """``TE_SEQ_FC1_KEEP_H=1`` (a tiling setting, to compare both in one process): a no_grad
    forward launches the h-writing kernel with an h of its own."""
    pl = _harness()
    from te_seq.kernels.cute.compile import GluConfig

    tiling_env("TE_SEQ_FC1_KEEP_H", "1")
    with pl.stubbed_step(record=True) as stubs, torch.no_grad():
        forward = pl.mlp_forward(256, None, e=8, h=256, f=128)
        forward()
        forward()
    fc1 = [(cfg, stub) for cfg, stub in stubs.items()
           if isinstance(cfg, GluConfig) and cfg.mode == "fc1"]
    assert len(fc1) == 1 and fc1[0][0].store_h
    for args in fc1[0][1].calls:
        assert args[2] is not args[5] and args[2].shape == (256, 256)


def test_frozen_weights_and_inputs_skip_h_until_something_needs_a_gradient():
    """With grad enabled but every parameter and input frozen no backward runs: FC1 skips h.
    Unfreezing FC2's weight alone needs h again (its wgrad reads a, re-emitted from h)."""
    pl = _harness()
    from te_seq.kernels.cute.compile import GluConfig

    with pl.stubbed_step(record=True) as stubs:
        forward = pl.mlp_forward(256, None, e=8, h=256, f=128)
        mlp, x, probs = forward.parts
        for t in (*mlp.parameters(), x, probs):
            t.requires_grad_(False)
        assert not forward().requires_grad
        mlp[2].weight.requires_grad_(True)
        forward().sum().backward()
        assert mlp[2].weight.grad is not None
    fc1 = {cfg.store_h: stub for cfg, stub in stubs.items()
           if isinstance(cfg, GluConfig) and cfg.mode == "fc1"}
    assert len(fc1[False].calls) == 1 and len(fc1[True].calls) == 1


# (grad mode on, parameters trainable, router probs need a gradient) -> a backward runs
_MOE_CASES = {
    "training": (True, True, False, True),
    "no_grad": (False, True, False, False),
    "frozen": (True, False, False, False),  # grad on, nothing needs a gradient
    "frozen_probs_grad": (True, False, True, True),  # the probs' gradient reads h
}


@pytest.mark.parametrize("case", list(_MOE_CASES))
def test_moe_block_without_backward_launches_its_gathered_fc1_without_h(case):
    """The MoE block (dispatch -> grouped MLP -> combine) gathers FC1's rows in the kernel's
    loads; without a backward (no_grad, or every parameter and input frozen) it launches that
    kernel h-less (a as its h operand), with one (training, or only the router probs needing
    a gradient) the h-writing kernel."""
    pl = _harness()
    from te_seq.kernels.cute.compile import GluConfig

    grad, trainable, probs_grad, backward = _MOE_CASES[case]
    e, h, f, t, k = 8, 256, 128, 96, 2
    kw = {"dtype": torch.bfloat16}
    with pl.stubbed_step(record=True) as stubs, torch.set_grad_enabled(grad):
        block = te_seq.Sequential(ops.ExpertDispatch(e),
                                  ops.GroupedLinear(e, h, 2 * f, bias=False, **kw),
                                  ops.ScaledSwiGLU(),
                                  ops.GroupedLinear(e, f, h, bias=False, **kw),
                                  ops.ExpertCombine())
        block.requires_grad_(trainable)
        x = torch.randn(t, h, dtype=torch.bfloat16)
        probs, indices = torch.softmax(torch.randn(t, e), -1).topk(k)
        probs = probs.bfloat16().requires_grad_(probs_grad)
        with te_seq.backend("cute"):
            y = block(x, indices, probs)
    assert y.requires_grad == backward
    assert [s.name for s in block.fusion_plan().forward] == ["MoeBlock"]
    fc1 = [(cfg, stub) for cfg, stub in stubs.items()
           if isinstance(cfg, GluConfig) and cfg.mode == "fc1"]
    assert len(fc1) == 1
    cfg, stub = fc1[0]
    assert cfg.route == "gather" and cfg.store_h == backward
    (args,) = stub.calls  # (x [T, H], b, c, offs, clusters, a [T k, F], ...)
    assert args[0].shape == (t, h) and args[5].shape == (t * k, f)
    assert (args[2] is args[5]) == (not backward)
