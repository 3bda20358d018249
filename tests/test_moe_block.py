"""The fused MoE block ("moe_block"): dispatch + grouped MLP + combine as one op.

Fused vs the same Sequential with the fusion disabled, in float64 on the reference backend:
outputs and every gradient equal (the fused op runs the same maths in the same order). Grid
axes, and why: k = 1 (the k-sum is a view), 2 and 4; routings with empty experts and all tokens
to one expert; H / F not multiples of anything; a non-contiguous x; gated activations with and
without router probabilities and a non-gated one; biases (FC2's scaled per row); main_grad and a
frozen FC1. A recording backend that routes rows natively proves the fused op hands the index
tensors to the kernels and never builds the [N, H] copy of x in forward.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from compile_helpers import fresh_dynamo  # noqa: F401 (autouse)

import te_seq
from te_seq import ops
from te_seq.fusion.matcher import Window
from te_seq.kernels import routed
from te_seq.kernels.backend import register_backend, unregister_backend
from te_seq.kernels.reference import ReferenceBackend
from te_seq.ops.fused.moe_block import MoeBlock, _build_moe_block

DT = torch.float64
E = 5


def _block(h: int, f: int, act: str = "scaled", bias: bool = False, experts: int = E,
           **linear_kw) -> te_seq.Sequential:
    activation = {"scaled": ops.ScaledSwiGLU, "swiglu": ops.SwiGLU, "srelu": ops.ScaledSReLU,
                  "gelu": ops.GELU}[act]()
    width = 2 * f if activation.gated else f
    fc2_kw = dict(linear_kw, scale_bias=bias)  # y = p·(W2 a + b2): FC2's bias scaled per row
    block = te_seq.Sequential(
        ops.ExpertDispatch(experts),
        ops.GroupedLinear(experts, h, width, bias=bias, dtype=DT, **linear_kw),
        activation,
        ops.GroupedLinear(experts, f, h, bias=bias, dtype=DT, **fc2_kw),
        ops.ExpertCombine(),
    )
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return block


def _routing(tokens: int, k: int, kind: str = "topk", experts: int = E):
    if kind == "one_expert":
        indices = torch.full((tokens, k), experts - 1, dtype=torch.int64)
    elif kind == "empty_experts":  # experts 1 and 3 get nothing
        indices = torch.stack([torch.randperm(3)[:k] * 2 for _ in range(tokens)])
    else:
        indices = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    probs = torch.softmax(torch.randn(tokens, k, dtype=DT), -1)
    return indices, probs


def _run(block, x, indices, probs):
    """Outputs then grads of x, topk_probs and every parameter (fresh leaves)."""
    x = x.detach().clone().requires_grad_()
    probs = probs.detach().clone().requires_grad_()
    for p in block.parameters():
        p.grad = None
    outs = block(x, indices, probs)
    outs = (outs,) if isinstance(outs, torch.Tensor) else outs
    gen = torch.Generator().manual_seed(11)
    torch.autograd.backward(outs, [torch.randn(o.shape, dtype=o.dtype, generator=gen)
                                   for o in outs])
    grads = [x.grad, probs.grad] + [p.grad for p in block.parameters()]
    return [o.detach() for o in outs] + grads, block.fusion_plan()


def _assert_fused_equals_unfused(block, x, indices, probs) -> te_seq.FusionPlan:
    fused, plan = _run(block, x, indices, probs)
    assert [s.name for s in plan.forward] == ["MoeBlock"], plan
    assert [s.name for s in plan.backward] == ["MoeBlock"], plan
    with te_seq.fusions_disabled("moe_block"):
        unfused, plan_off = _run(block, x, indices, probs)
    assert "MoeBlock" not in [s.name for s in plan_off.forward]
    assert len(fused) == len(unfused)
    for i, (a, b) in enumerate(zip(fused, unfused)):
        assert (a is None) == (b is None), f"tensor {i}: present on one side only"
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"tensor {i}: {m}")
    return plan


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("kind", ["topk", "empty_experts", "one_expert"])
def test_fused_equals_unfused(k: int, kind: str) -> None:
    torch.manual_seed(10 * k + len(kind))
    if kind == "empty_experts":
        k = min(k, 3)
    block = _block(h=13, f=7)  # unaligned H and F
    indices, probs = _routing(11, k, kind)
    _assert_fused_equals_unfused(block, torch.randn(11, 13, dtype=DT), indices, probs)


@pytest.mark.parametrize("act", ["scaled", "swiglu", "srelu", "gelu"])
@pytest.mark.parametrize("bias", [False, True])
def test_activations_and_biases(act: str, bias: bool) -> None:
    """Unscaled activations: the dispatch's probs go to the caller (with their gradient)."""
    torch.manual_seed(3)
    block = _block(h=8, f=6, act=act, bias=bias)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "bias" in name:
                p.copy_(torch.randn_like(p))  # non-zero biases
    indices, probs = _routing(9, 2)
    _assert_fused_equals_unfused(block, torch.randn(9, 8, dtype=DT), indices, probs)


def test_non_contiguous_x_and_leading_dims() -> None:
    torch.manual_seed(4)
    block = _block(h=8, f=6)
    x = torch.randn(2, 8, 5, dtype=DT).transpose(1, 2)  # [2, 5, 8], non-contiguous
    assert not x.is_contiguous()
    indices, probs = _routing(10, 2)
    _assert_fused_equals_unfused(block, x, indices.view(2, 5, 2), probs.view(2, 5, 2))


def test_main_grad_accumulation_and_frozen_fc1() -> None:
    torch.manual_seed(5)
    results = []
    for disabled in (False, True):
        torch.manual_seed(5)
        block = _block(h=8, f=6, accumulate_into_main_grad=True)
        for p in block.parameters():
            p.main_grad = torch.ones_like(p)
        block[1].requires_grad_(False)  # frozen FC1: no wgrad, dX still flows
        indices, probs = _routing(9, 2)
        x = torch.randn(9, 8, dtype=DT, requires_grad=True)
        with te_seq.fusions_disabled("moe_block") if disabled else contextlib.nullcontext():
            y = block(x, indices, probs)
            y.backward(torch.ones_like(y))
            assert ("MoeBlock" in str(block.fusion_plan())) == (not disabled)
        results.append([x.grad] + [p.main_grad.clone() for p in block.parameters()])
        assert all(p.grad is None for p in block[3].parameters())
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(results[0][-1], torch.ones_like(results[0][-1]))  # FC2 accumulated
    assert torch.equal(results[0][1], torch.ones_like(results[0][1]))  # frozen FC1 untouched


def test_misses_for_expert_parallel_and_unbound_split_sizes(monkeypatch) -> None:
    block = _block(h=8, f=6)
    block[1].set_extra_input_channel("split_sizes", None)  # FC1 takes split sizes from the caller
    indices, probs = _routing(9, 2)
    with pytest.raises(ValueError):  # the caller gives them now: a positional slot
        block(torch.randn(9, 8, dtype=DT), indices, probs)
    splits = torch.bincount(indices.flatten(), minlength=E)
    block(torch.randn(9, 8, dtype=DT), indices, probs, splits)
    plan = block.fusion_plan()
    miss = next(m for m in plan.misses if m.fusion == "moe_block")
    assert miss.basic_op_indices == (0, 1, 2, 3, 4)
    assert "split_sizes is not bound to the ExpertDispatch's channels" in miss.reason
    assert "MoeBlock" not in [s.name for s in plan.forward]

    ep_block = _block(h=8, f=6)
    monkeypatch.setattr(ep_block[0], "expert_parallel", object())  # as if an ep_group were given
    window = Window(list(ep_block), [()] * 5, range(5))
    reason = _build_moe_block(window).reason
    assert "expert parallelism" in reason


def test_fp8_recipe_runs_unfused_moe_block() -> None:
    """MoeBlock has no FP8 GEMMs: under an FP8 recipe the matcher declines it (grouped_mlp
    then runs the middle)."""
    assert not getattr(MoeBlock, "fp8_gemms", False)


def test_plan_note_says_where_rows_are_routed() -> None:
    block = _block(h=8, f=6)
    indices, probs = _routing(9, 2)
    block(torch.randn(9, 8, dtype=DT), indices, probs)
    note = block.fusion_plan().forward[0].backend_reason
    assert "FC1 gather: a separate pass" in note and "FC2 scatter: a separate pass" in note


# --- a backend that routes rows natively, recording what its kernels get ------------------------

class RecordingRouter(ReferenceBackend):
    """The reference maths with gather_rows / scatter_rows taken natively (index_select /
    index_copy_ inside the kernel), recording each call's kernel, A rows and index kwargs."""

    name = "test_recording_router"
    fallback = False
    gather_kernels = frozenset(routed.GATHER_KERNELS)
    scatter_kernels = frozenset(routed.SCATTER_KERNELS)

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, bool, bool]] = []

    def grouped_mm(self, a, b, offs, bias=None, bias_scales=None, gather_rows=None,
                   scatter_rows=None):
        self.calls.append(("grouped_mm", a.shape[0], gather_rows is not None,
                           scatter_rows is not None))
        if gather_rows is not None:
            a = a.index_select(0, gather_rows)
        res = super().grouped_mm(a, b, offs, bias=bias, bias_scales=bias_scales)
        if scatter_rows is None:
            return res
        return torch.empty_like(res).index_copy_(0, scatter_rows, res)


@pytest.fixture
def recording_router():
    backend = register_backend(RecordingRouter())
    try:
        yield backend
    finally:
        unregister_backend(backend.name)


@pytest.mark.parametrize("k", [1, 2])
def test_native_routing_gets_index_tensors_and_no_row_copy(recording_router, k: int) -> None:
    torch.manual_seed(6)
    tokens, h = 9, 8
    block = _block(h=h, f=6)
    indices, probs = _routing(tokens, k)
    x = torch.randn(tokens, h, dtype=DT)
    with te_seq.fusions_disabled("moe_block"), te_seq.backend("reference"):
        want = _run(block, x, indices, probs)[0]
    with te_seq.backend(recording_router.name):
        got, plan = _run(block, x, indices, probs)
    assert plan.forward[0].name == "MoeBlock" and plan.forward[0].backend == recording_router.name
    note = plan.forward[0].backend_reason
    assert "FC1 gather: inside the GEMM" in note and "dX scatter: inside the GEMM" in note
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    calls = recording_router.calls
    fc1, fc2 = calls[0], calls[1]  # forward: FC1 on the tokens, FC2 scattered to slot order
    assert fc1 == ("grouped_mm", tokens, True, False), calls  # A has T rows: no [N, H] copy
    assert fc2 == ("grouped_mm", tokens * k, False, True), calls
    assert ("grouped_mm", tokens * k, False, True) in calls[2:]  # dX = dH W1 in slot order


def test_routed_helpers_check_their_index_tensors() -> None:
    backend = ReferenceBackend()
    x = torch.randn(4, 3, dtype=DT)
    w = torch.randn(1, 3, 2, dtype=DT)
    offs = torch.tensor([4])
    with pytest.raises(ValueError, match=r"MoeBlock: gather_rows must be int32 or int64, got "
                                         r"torch.float32"):
        routed.gathered(backend, "grouped_mm", x, torch.zeros(4), w, offs, op="MoeBlock")
    with pytest.raises(ValueError, match=r"scatter_rows has shape \(3,\), expected \[4\]"):
        routed.scattered_mm(backend, x, w, offs, torch.arange(3), op="MoeBlock")
    with pytest.raises(ValueError, match="takes no gather_rows"):
        routed.gathered(backend, "grouped_wgrad", x, torch.arange(4), w, offs)
    rows = torch.tensor([3, 0, 0, 2])
    got = routed.gathered(backend, "grouped_mm", x, rows, w, offs)
    torch.testing.assert_close(got, x[rows] @ w[0], rtol=0, atol=0)
    perm = torch.tensor([2, 0, 3, 1])
    out = routed.scattered_mm(backend, x, w, offs, perm)
    torch.testing.assert_close(out[perm], x @ w[0], rtol=0, atol=0)


def test_compiled_block_matches_eager() -> None:
    torch.manual_seed(8)
    block = _block(h=8, f=6)
    indices, probs = _routing(9, 2)
    x = torch.randn(9, 8, dtype=DT, requires_grad=True)
    eager = block(x, indices, probs)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x, indices, probs)
    assert "MoeBlock" in str(block.fusion_plan())
    torch.testing.assert_close(compiled, eager, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(compiled.sum(), [x, *block.parameters()])
    want = torch.autograd.grad(eager.sum(), [x, *block.parameters()])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_compiled_block_routes_rows_natively(recording_router) -> None:
    """Under torch.compile the te_seq:: custom ops carry gather_rows / scatter_rows to the
    backend's kernels: FC1 still gets the [T, H] token matrix, FC2 still scatters."""
    torch.manual_seed(9)
    tokens, k = 9, 2
    block = _block(h=8, f=6)
    indices, probs = _routing(tokens, k)
    x = torch.randn(tokens, 8, dtype=DT)
    with te_seq.backend(recording_router.name):
        eager = block(x, indices, probs)
        recording_router.calls.clear()
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x, indices, probs)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    assert ("grouped_mm", tokens, True, False) in recording_router.calls
    assert ("grouped_mm", tokens * k, False, True) in recording_router.calls


def _assert_same(fused: list, unfused: list) -> None:
    for i, (a, b) in enumerate(zip(fused, unfused, strict=True)):
        assert (a is None) == (b is None), f"tensor {i}"
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"tensor {i}: {m}")


def test_gpt_oss_layout_fc1_bias_interleaved_clamped_glu_fc2_scaled_bias() -> None:
    torch.manual_seed(12)
    block = te_seq.Sequential(
        ops.ExpertDispatch(4),
        ops.GroupedLinear(4, 8, 12, bias=True, dtype=DT),
        ops.ScaledClampedQGeGLU(glu_interleave_size=1),
        ops.GroupedLinear(4, 6, 8, bias=True, scale_bias=True, dtype=DT),
        ops.ExpertCombine(),
    )
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    indices, probs = _routing(9, 2, experts=4)
    _assert_fused_equals_unfused(block, torch.randn(9, 8, dtype=DT), indices, probs)


def test_autocast_bf16_matches_unfused() -> None:
    torch.manual_seed(13)
    block = _block(h=8, f=6).float()
    indices, probs = _routing(9, 2)
    x = torch.randn(9, 8)
    results = []
    for disabled in (False, True):
        scope = te_seq.fusions_disabled("moe_block") if disabled else contextlib.nullcontext()
        with scope, torch.autocast("cpu", dtype=torch.bfloat16):
            out, plan = _run(block, x, indices, probs.float())
        assert ("MoeBlock" in [s.name for s in plan.forward]) == (not disabled)
        assert out[0].dtype == torch.bfloat16 and out[1].dtype == torch.float32  # y, dx
        results.append(out)
    _assert_same(*results)


def test_repeated_calls_with_new_routings_reuse_the_plan() -> None:
    """The steady-state fast path (same signature, new routing values) stays exact."""
    torch.manual_seed(14)
    block = _block(h=8, f=6)
    x = torch.randn(9, 8, dtype=DT)
    for _ in range(3):
        indices, probs = _routing(9, 2)
        fused, plan = _run(block, x, indices, probs)
        assert [s.name for s in plan.forward] == ["MoeBlock"]
        with te_seq.fusions_disabled("moe_block"):
            unfused, _ = _run(block, x, indices, probs)
        _assert_same(fused, unfused)


def test_delayed_wgrad_matches_unfused() -> None:
    """delay_wgrad_compute: the wgrads (FC1's on gathered x rows) run at backward_dw()."""
    results = []
    for disabled in (False, True):
        torch.manual_seed(15)
        block = _block(h=8, f=6, delay_wgrad_compute=True)
        indices, probs = _routing(9, 2)
        x = torch.randn(9, 8, dtype=DT, requires_grad=True)
        scope = te_seq.fusions_disabled("moe_block") if disabled else contextlib.nullcontext()
        with scope:
            y = block(x, indices, probs)
            y.backward(torch.randn_like(y))
        assert all(p.grad is None for p in block.parameters())  # nothing before backward_dw
        block[1].backward_dw()
        block[3].backward_dw()
        results.append([x.grad] + [p.grad for p in block.parameters()])
    _assert_same(*results)
