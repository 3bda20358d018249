"""FP8 recipes (te_seq.recipe, te_seq.autocast) on the reference backend, against an independent
emulation written here: per-block loops in plain PyTorch, scales per the documented rules.

Bitwise: the reference backend quantizes -> dequantizes in fp32 and multiplies in fp32, so the
emulation (same rules, same fp32 GEMM expression) must give identical bits.
"""

from __future__ import annotations

import math

import pytest
import torch

import te_seq
from te_seq import ops, recipe
from te_seq.kernels import fp8_reference as ref

torch.set_num_threads(1)

FMT = {"E4M3": (torch.float8_e4m3fn, 448.0), "E5M2": (torch.float8_e5m2, 57344.0)}
RECIPES = [recipe.Float8CurrentScaling(), recipe.Float8BlockScaling(),
           recipe.Float8RowwiseScaling()]
IDS = ["tensor", "block", "rowwise"]


# --- the independent emulation ------------------------------------------------------------------

def emu_scale(amax: float, fmt: str, margin: int, pow2: bool) -> float | None:
    """The documented scale of one block as a Python float (None: the block becomes nan)."""
    if not math.isfinite(amax):
        return None
    if amax == 0:
        return 1.0
    fp8_max = torch.tensor(FMT[fmt][1], dtype=torch.float32)
    s = (fp8_max / torch.tensor(amax, dtype=torch.float32)) / (2.0**margin)
    s = min(s.item(), torch.finfo(torch.float32).max)
    if pow2:
        s = 2.0 ** (math.frexp(s)[1] - 1)
    return s


def emu_qdq(t, rows, cols, fmt="E4M3", margin=0, pow2=False):
    """t [R, C] quantized -> dequantized with (rows x cols)-blocks (None: whole extent)."""
    t = t.float()
    R, C = t.shape
    br, bc = rows or max(R, 1), cols or max(C, 1)
    out = torch.empty_like(t)
    dtype, fp8_max = FMT[fmt]
    for i in range(0, R, br):
        for j in range(0, C, bc):
            blk = t[i:i + br, j:j + bc]
            s = emu_scale(blk.abs().max().item(), fmt, margin, pow2)
            if s is None:
                out[i:i + br, j:j + bc] = float("nan")
                continue
            s32 = torch.tensor(s, dtype=torch.float32)
            q = (blk * s32).clamp(-fp8_max, fp8_max).to(dtype).float()
            out[i:i + br, j:j + bc] = q * (1.0 / s32)
    return out


def blocks_of(r, role):
    """(rows, cols) of one scale for operands of `role` as the docs state them."""
    if isinstance(r, recipe.Float8CurrentScaling):
        return None, None
    if isinstance(r, recipe.Float8BlockScaling):
        return (128, 128) if role == "weight" else (1, 128)
    return 1, None


def emu(r, role, t):
    fmt = "E5M2" if role == "grad" and r.fp8_format == "HYBRID" else "E4M3"
    return emu_qdq(t, *blocks_of(r, role), fmt, r.margin, r.power_of_two_scales)


def emu_tokens(r, role, t, bounds):
    """t [T, C] as a wgrad operand: quantized along T within each group (per-tensor: whole)."""
    if blocks_of(r, role) == (None, None):
        return emu(r, role, t)
    out = torch.zeros(t.shape)
    for s, e in bounds:
        if e > s:
            out[s:e] = emu(r, role, t[s:e].t()).t()
    return out


def emu_weight(r, w):
    """(W along K, W along N) for one [N, K] weight."""
    return emu(r, "weight", w), emu(r, "weight", w.t()).t()


def emu_linear(r, x, w, dy):
    """(y, dx, dW) of y = x Wᵀ under recipe r (x [T, K], W [N, K], dy [T, N])."""
    dtype = x.dtype
    wf, wd = emu_weight(r, w)
    y = (emu(r, "input", x) @ wf.t()).to(dtype)
    dx = (emu(r, "grad", dy) @ wd).to(dtype)
    bounds = [(0, x.shape[0])]
    dw = emu_tokens(r, "grad", dy, bounds).t() @ emu_tokens(r, "input", x, bounds)
    return y, dx, dw.to(w.dtype)


def emu_grouped(r, x, w, dy, bounds):
    """(y, dx, dW) of the grouped linear under r (x [T, K], w [G, N, K], dy [T, N])."""
    dtype = x.dtype
    pairs = [emu_weight(r, w_g) for w_g in w]
    xq, dyq = emu(r, "input", x), emu(r, "grad", dy)
    y = torch.zeros(x.shape[0], w.shape[1])
    dx = torch.zeros(x.shape)
    for g, (s, e) in enumerate(bounds):
        y[s:e] = xq[s:e] @ pairs[g][0].t()
        dx[s:e] = dyq[s:e] @ pairs[g][1]
    xw, dyw = emu_tokens(r, "input", x, bounds), emu_tokens(r, "grad", dy, bounds)
    dw = torch.stack([dyw[s:e].t() @ xw[s:e] for s, e in bounds])
    return y.to(dtype), dx.to(dtype), dw.to(w.dtype)


def bounds_of(splits):
    ends = torch.cumsum(splits, 0).tolist()
    return list(zip([0] + ends[:-1], ends))


# --- scale rules on crafted data ----------------------------------------------------------------

@pytest.mark.parametrize("block", [(None, None), (1, None), (1, 128), (128, 128), (3, 5)])
@pytest.mark.parametrize("pow2", [False, True])
def test_qdq_matches_emulation(block, pow2):
    t = torch.randn(131, 300) * torch.logspace(-3, 3, 300)  # partial trailing blocks, wide range
    rule = ref.ScaleRule("E4M3", 1, pow2)
    got = ref.qdq(t, ref.QuantBlock(*block), rule)
    assert torch.equal(got, emu_qdq(t, *block, "E4M3", 1, pow2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", [ref.ScaleRule("E4M3", 0, False), ref.ScaleRule("E4M3", 1, True),
                                  ref.ScaleRule("E5M2", 0, False)], ids=["e4m3", "pow2", "e5m2"])
def test_1x128_blocks_of_whole_rows_are_their_rows_quantized(dtype, rule):
    """Widths that are multiples of 128 take the row-wise path on t seen as [R·C/128, 128]:
    the same bits as the per-block formula (block maxima, expanded scales), non-finite and
    all-zero blocks included."""
    torch.manual_seed(3)
    t = (torch.randn(37, 384) * torch.logspace(-3, 3, 384)).to(dtype)
    t[1, 5], t[2, 200], t[4, 130:250] = float("nan"), float("-inf"), 0.0
    block = ref.QuantBlock(1, 128)
    assert ref.splits_rows(t, block) and not ref.splits_rows(t[:, :300], block)
    got = ref.quantize(t, block, rule)
    scale = ref.scales_from_amax(ref.block_amax(t, block), rule)  # the per-block formula
    scaled = t.float() * scale.repeat_interleave(128, 1)
    want = scaled.clamp(-rule.fp8_max, rule.fp8_max).to(rule.dtype)
    assert got.data.shape == t.shape and got.scale_inv.shape == (37, 3)
    assert torch.equal(got.data.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got.scale_inv.nan_to_num(-1.0), torch.reciprocal(scale).nan_to_num(-1.0))
    assert torch.equal(ref.qdq(t, block, rule).nan_to_num(-1.0),
                       emu_qdq(t.float(), 1, 128, rule.fmt, rule.margin,
                               rule.power_of_two).nan_to_num(-1.0))


def test_outlier_only_coarsens_its_own_tile():
    t = torch.randn(2, 256)
    t[0, 5] = 1e4
    got = ref.qdq(t, ref.QuantBlock(1, 128), ref.ScaleRule())
    scale = 448.0 / 1e4
    assert got[0, 5] == pytest.approx(1e4, rel=1e-6)  # the amax maps to fp8_max exactly
    small = (t[0, :128].abs() * scale < 2**-10) & (torch.arange(128) != 5)
    assert (got[0, :128][small] == 0).all() and small.any()  # under half the smallest subnormal: 0
    for row, cols in ((0, slice(128, 256)), (1, slice(0, 128)), (1, slice(128, 256))):
        blk = t[row, cols]
        assert (got[row, cols] - blk).abs().max() <= blk.abs().max() * 2**-4  # 3 mantissa bits


def test_zero_block_scale_is_one_and_stays_zero():
    t = torch.zeros(4, 256)
    t[:, 128:] = torch.randn(4, 128)
    q = ref.quantize(t, ref.QuantBlock(1, 128), ref.ScaleRule())
    assert torch.equal(q.scale_inv[:, 0], torch.ones(4))
    assert (q.dequantize()[:, :128] == 0).all()


def test_subnormal_inputs_get_a_finite_scale():
    t = torch.full((1, 8), 1e-40) * torch.arange(1, 9)  # fp32 subnormals
    assert (t.abs() < torch.finfo(torch.float32).tiny).all() and (t > 0).all()
    for pow2 in (False, True):
        q = ref.quantize(t, ref.QuantBlock(None, None), ref.ScaleRule(power_of_two=pow2))
        assert torch.isfinite(q.scale_inv).all()
        assert torch.isfinite(q.dequantize()).all()
        assert torch.equal(q.dequantize(), emu_qdq(t, None, None, pow2=pow2))


def test_fp8_subnormals_round_to_nearest_even():
    # amax 448 -> scale 1: values land on E4M3's subnormal grid (multiples of 2**-9)
    t = torch.tensor([[448.0, 2**-9, 1.5 * 2**-9, 2.5 * 2**-9, 0.4 * 2**-9]])
    got = ref.qdq(t, ref.QuantBlock(None, None), ref.ScaleRule())
    assert got.tolist() == [[448.0, 2**-9, 2 * 2**-9, 2 * 2**-9, 0.0]]


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_poisons_its_block_only(bad):
    t = torch.randn(2, 256)
    t[0, 3] = bad
    got = ref.qdq(t, ref.QuantBlock(1, 128), ref.ScaleRule())
    assert got[0, :128].isnan().all()
    assert torch.isfinite(got[0, 128:]).all() and torch.isfinite(got[1]).all()


@pytest.mark.parametrize("rule", [ref.ScaleRule(), ref.ScaleRule("E5M2", 1, True)], ids=str)
@pytest.mark.parametrize("sizes, extra", [([5, 0, 17, 1, 40], 3), ([64], 0), ([0, 0, 9], 2)])
def test_grouped_rowwise_wgrad_operand_equals_the_per_group_quantization(rule, sizes, extra):
    """The wgrad operand quantized along the rows within each group, all groups at once: bitwise
    what quantizing each group's slice on its own gives (extreme magnitudes, a zero column, a
    nan and an inf poisoning only their own (group, column) block, empty groups, rows in no
    group left zero)."""
    m = sum(sizes) + extra
    t = torch.randn(m, 24, dtype=torch.bfloat16) * torch.logspace(-30, 30, 24)
    t[0, 3], t[7, 5], t[:, 7] = float("nan"), float("inf"), 0.0
    ends = torch.tensor(sizes).cumsum(0).tolist()
    bounds = list(zip([0, *ends[:-1]], ends))
    block = ref.QuantBlock(1, None)
    got = ref.qdq_columns_per_group(t, bounds, block, rule)
    want = torch.zeros(m, 24)
    for start, end in bounds:
        if end > start:
            want[start:end] = ref.qdq(t[start:end].t(), block, rule).t()
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    assert (got[ends[-1]:] == 0).all()


def test_power_of_two_rounds_down_even_just_below_a_power():
    amax = torch.tensor([448.0 / (2**10 * (1 - 2**-23))])  # scale just below 2**10
    scale = ref.scales_from_amax(amax, ref.ScaleRule(power_of_two=True))
    assert scale.item() == 2.0**9


def test_margin_and_formats():
    t = torch.randn(4, 64)
    amax = t.abs().max()
    for margin in (0, 2):
        q = ref.quantize(t, ref.QuantBlock(None, None), ref.ScaleRule("E5M2", margin))
        assert q.data.dtype == torch.float8_e5m2
        want = (torch.tensor(57344.0) / amax) / 2.0**margin
        assert torch.equal(q.scale_inv, (1.0 / want).reshape(1, 1))
    hybrid = recipe.Float8CurrentScaling()
    assert hybrid.rule("grad").fmt == "E5M2" and hybrid.rule("input").fmt == "E4M3"
    assert recipe.Float8CurrentScaling(fp8_format="E4M3").rule("grad").fmt == "E4M3"
    assert recipe.Float8BlockScaling().rule("grad").fmt == "E4M3"


# --- every linear op under every recipe ---------------------------------------------------------

def _rand(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("r", RECIPES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_emulation(r, dtype, with_bias):
    torch.manual_seed(1)
    op = ops.Linear(128, 256, bias=with_bias, dtype=dtype) if with_bias else \
        ops.BasicLinear(128, 256, dtype=dtype)
    if with_bias:
        torch.nn.init.normal_(op.bias)
    model = te_seq.Sequential(op)
    x = _rand(3, 5, 128, dtype=dtype).requires_grad_()
    dy = _rand(3, 5, 256, dtype=dtype)
    with te_seq.autocast(recipe=r):
        y = model(x)
    y.backward(dy)
    want_y, want_dx, want_dw = emu_linear(r, x.detach().reshape(-1, 128), op.weight.detach(),
                                          dy.reshape(-1, 256))
    if with_bias:
        want_y = want_y + op.bias.detach()
    assert y.dtype == dtype and op.weight.grad.dtype == dtype
    assert torch.equal(y.reshape(-1, 256), want_y)
    assert torch.equal(x.grad.reshape(-1, 128), want_dx)
    assert torch.equal(op.weight.grad, want_dw)


def _grouped(dtype, bias=False, **kw):
    torch.manual_seed(2)
    op = ops.GroupedLinear(3, 128, 256, bias=bias, dtype=dtype, **kw)
    return op


@pytest.mark.parametrize("r", RECIPES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_matches_emulation(r, dtype):
    op = _grouped(dtype)
    splits = torch.tensor([130, 0, 7])  # a partial 1x128 tile along tokens, an empty group
    x = _rand(137, 128, dtype=dtype).requires_grad_()
    dy = _rand(137, 256, dtype=dtype)
    with te_seq.autocast(recipe=r):
        y = te_seq.Sequential(op)(x, splits)
    y.backward(dy)
    w = op.stacked_weight().detach()
    want_y, want_dx, want_dw = emu_grouped(r, x.detach(), w, dy, bounds_of(splits))
    assert torch.equal(y, want_y)
    assert torch.equal(x.grad, want_dx)
    got_dw = torch.stack([op.get_parameter(f"weight{g}").grad for g in range(3)])
    assert torch.equal(got_dw, want_dw)


def _mlp(dtype, bias=False):
    torch.manual_seed(3)
    fc1 = ops.GroupedLinear(3, 128, 512, bias=bias, dtype=dtype)
    fc2 = ops.GroupedLinear(3, 256, 128, bias=bias, dtype=dtype)
    if bias:
        for fc in (fc1, fc2):
            for _, b in fc.named_biases():
                torch.nn.init.normal_(b)
    return te_seq.Sequential(fc1, ops.ScaledSwiGLU(), fc2)


def _run_mlp(model, r, x, splits, probs, dy):
    x = x.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    with te_seq.autocast(recipe=r):
        y = model(x, splits, probs, splits)
    y.backward(dy)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return y.detach(), x.grad, probs.grad, grads


@pytest.mark.parametrize("r", RECIPES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_mlp_equals_unfused_under_recipe(r, dtype, bias):
    model = _mlp(dtype, bias)
    splits = torch.tensor([60, 0, 140])
    x, dy = _rand(200, 128, dtype=dtype), _rand(200, 128, dtype=dtype)
    probs = torch.rand(200).to(dtype)
    fused = _run_mlp(model, r, x, splits, probs, dy)
    assert model.fusion_plan().forward[0].name == "GroupedMLP"
    with te_seq.fusions_disabled("grouped_mlp"):
        unfused = _run_mlp(model, r, x, splits, probs, dy)
        assert model.fusion_plan().forward[0].name == "GroupedLinear"
    for got, want in zip(fused[:3] + tuple(fused[3]), unfused[:3] + tuple(unfused[3])):
        assert torch.equal(got, want)


@pytest.mark.parametrize("r", RECIPES, ids=IDS)
def test_fused_mlp_matches_emulation(r):
    model = _mlp(torch.float32)
    fc1, act, fc2 = model
    splits = torch.tensor([60, 0, 140])
    bounds = bounds_of(splits)
    x, dy, probs = _rand(200, 128), _rand(200, 128), torch.rand(200)
    y, dx, _, grads = _run_mlp(model, r, x, splits, probs, dy)
    h, _, _ = emu_grouped(r, x, fc1.stacked_weight().detach(), torch.zeros(200, 512), bounds)
    gate, up = h.chunk(2, dim=-1)
    a = torch.nn.functional.silu(gate) * up * probs[:, None]
    want_y, da, dw2 = emu_grouped(r, a, fc2.stacked_weight().detach(), dy, bounds)
    assert torch.equal(y, want_y)
    assert torch.equal(torch.stack(grads[3:]), dw2)
    assert torch.isfinite(dx).all() and dx.abs().sum() > 0


# --- weights: master dtype, cache, gradient contract --------------------------------------------

def _count_weight_quantizations(monkeypatch):
    calls = []
    real = te_seq.core.fp8._weight_pair

    def counting(r, w):
        calls.append(tuple(w.shape))
        return real(r, w)

    monkeypatch.setattr(te_seq.core.fp8, "_weight_pair", counting)
    return calls


@pytest.mark.parametrize("r", RECIPES, ids=IDS)
def test_weight_cache_reused_then_invalidated_by_optimizer_step(r, monkeypatch):
    calls = _count_weight_quantizations(monkeypatch)
    op = ops.BasicLinear(128, 128)
    model = te_seq.Sequential(op)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = _rand(4, 128)
    with te_seq.autocast(recipe=r):
        model(x).sum().backward()
        model(x).sum().backward()  # a second microbatch: the same weight, quantized once
        assert len(calls) == 1
        opt.step()
        y = model(x)
    assert len(calls) == 2  # the step bumped the weight's version
    want = emu_linear(r, x, op.weight.detach(), torch.zeros(4, 128))[0]
    assert torch.equal(y, want)


@pytest.mark.parametrize("optimizer", ["adamw-fused", "adamw-foreach", "sgd-fused"])
def test_weight_cache_invalidated_by_a_fused_optimizer_step(optimizer, monkeypatch):
    """torch.optim's fused optimizers write the weights in their own kernel without moving
    the version counter (adamw-fused, sgd-fused: checked below); the cache still sees the step
    (a global optimizer step hook), so the next call quantizes the updated weight."""
    calls = _count_weight_quantizations(monkeypatch)
    r = recipe.Float8RowwiseScaling()
    op = ops.BasicLinear(128, 128)
    model = te_seq.Sequential(op)
    kind, mode = optimizer.split("-")
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.SGD
    opt = cls(model.parameters(), lr=0.5, **{mode: True})
    x = _rand(4, 128)
    with te_seq.autocast(recipe=r):
        model(x).sum().backward()
        version = op.weight._version
        before = op.weight.detach().clone()
        opt.step()
        y = model(x)
    assert not torch.equal(op.weight, before), "the step did not move the weight"
    if mode == "fused":
        assert op.weight._version == version, "the fused step moved the version: test too weak"
    assert len(calls) == 2
    assert torch.equal(y, emu_linear(r, x, op.weight.detach(), torch.zeros(4, 128))[0])


def test_weight_cache_sees_in_place_copy_and_new_parameter(monkeypatch):
    calls = _count_weight_quantizations(monkeypatch)
    r = recipe.Float8RowwiseScaling()
    op = ops.BasicLinear(128, 128)
    model = te_seq.Sequential(op)
    x = _rand(4, 128)
    with te_seq.autocast(recipe=r):
        model(x)
        with torch.no_grad():
            op.weight.copy_(torch.randn(128, 128))
        y1 = model(x)
        op.weight = torch.nn.Parameter(torch.randn(128, 128))
        y2 = model(x)
        model(x)
    assert len(calls) == 3
    assert torch.equal(y2, emu_linear(r, x, op.weight.detach(), torch.zeros(4, 128))[0])
    assert not torch.equal(y1, y2)


def test_cache_weights_false_quantizes_every_call(monkeypatch):
    calls = _count_weight_quantizations(monkeypatch)
    model = te_seq.Sequential(ops.BasicLinear(128, 128))
    with te_seq.autocast(recipe=recipe.Float8CurrentScaling(cache_weights=False)):
        model(_rand(2, 128))
        model(_rand(2, 128))
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r", RECIPES, ids=IDS)
def test_stacked_weights_quantize_like_each_expert(r, dtype):
    """All experts at once (fp8_reference.quantize_stacked) give each expert's own quantization
    bit for bit, forward and dgrad operands, with a nan in one expert, an all-zero expert and
    experts of very different magnitudes (each must keep its own scales)."""
    torch.manual_seed(0)
    w = torch.randn(5, 256, 384) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 2.0])[:, None, None]
    w[2, 7, 100] = float("nan")
    w[3] = 0.0
    w = w.to(dtype)
    got = te_seq.core.fp8._stacked_operands(r, w)
    pairs = [te_seq.core.fp8._weight_pair(r, m) for m in w.unbind(0)]
    for got_q, want_q in zip(got.quantized + got.dgrad_quantized,
                             [p[0] for p in pairs] + [p[1] for p in pairs]):
        assert torch.equal(got_q.data.view(torch.uint8), want_q.data.view(torch.uint8))
        assert torch.equal(got_q.scale_inv.nan_to_num(-1), want_q.scale_inv.nan_to_num(-1))
    data, scale_inv = got.fp8
    assert torch.equal(data.view(torch.uint8),
                       torch.stack([p[0].data for p in pairs]).view(torch.uint8))
    assert torch.equal(scale_inv.nan_to_num(-1), torch.stack([p[0].scale_inv for p in pairs])
                       .nan_to_num(-1))
    data, scale_inv = got.dgrad_fp8
    assert data.is_contiguous() and scale_inv.is_contiguous()
    assert torch.equal(data.view(torch.uint8),
                       torch.stack([p[1].data for p in pairs]).view(torch.uint8))
    assert torch.equal(scale_inv.nan_to_num(-1), torch.stack([p[1].scale_inv for p in pairs])
                       .nan_to_num(-1))


def test_weight_cache_unused_while_a_cuda_graph_captures(monkeypatch):
    """Under capture the weights are quantized inside the graph (a replay after an optimizer
    step must see the new weights) and the graph's outputs are never cached for eager calls."""
    calls = _count_weight_quantizations(monkeypatch)
    model = te_seq.Sequential(ops.BasicLinear(128, 128))
    x = _rand(2, 128)
    with te_seq.autocast(recipe=recipe.Float8RowwiseScaling()):
        model(x)  # warm: cached
        monkeypatch.setattr(te_seq.core.fp8, "_capturing", lambda device: True)
        model(x)
        model(x)
        assert len(calls) == 3  # quantized on each "captured" call, the cache not read
        monkeypatch.setattr(te_seq.core.fp8, "_capturing", lambda device: False)
        model(x)
    assert len(calls) == 3  # the eager cache still holds the pre-capture entry


def test_weight_cache_asks_cuda_about_capture_only_for_cuda_weights(monkeypatch):
    """CPU weights never query the CUDA runtime (each query costs host time on every call)."""
    def no_query(*args):
        raise AssertionError("torch.cuda queried for CPU weights")

    monkeypatch.setattr(torch.cuda, "is_available", no_query)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", no_query)
    with te_seq.autocast(recipe=recipe.Float8RowwiseScaling()):
        te_seq.Sequential(ops.BasicLinear(128, 128))(_rand(2, 128))


@pytest.mark.parametrize("r", RECIPES, ids=IDS)
def test_main_grad_accumulates_fp8_wgrad(r):
    op = ops.GroupedLinear(2, 128, 128, bias=False, dtype=torch.bfloat16,
                           accumulate_into_main_grad=True)
    mains = []
    for _, w in op.named_weights():
        w.main_grad = torch.randn(128, 128)  # fp32 buffers, accumulated into
        mains.append(w.main_grad.clone())
    splits = torch.tensor([100, 60])
    x, dy = _rand(160, 128, dtype=torch.bfloat16), _rand(160, 128, dtype=torch.bfloat16)
    with te_seq.autocast(recipe=r):
        y = te_seq.Sequential(op)(x.requires_grad_(), splits)
    y.backward(dy)
    bounds = bounds_of(splits)
    xw, dyw = emu_tokens(r, "input", x.detach(), bounds), emu_tokens(r, "grad", dy, bounds)
    for g, ((_, w), (s, e)) in enumerate(zip(op.named_weights(), bounds)):
        want = mains[g] + dyw[s:e].t() @ xw[s:e]
        assert torch.allclose(w.main_grad, want, rtol=1e-6, atol=1e-4)
        assert w.grad is None or (w.grad == 0).all()
        assert w.dtype == torch.bfloat16  # master weights keep their dtype


# --- the plan, autocast and Quantize ------------------------------------------------------------

def test_plan_records_recipe_and_is_keyed_on_it():
    model = te_seq.Sequential(ops.BasicLinear(128, 128))
    x = _rand(2, 128)
    model(x)
    assert model.fusion_plan().forward[0].recipe is None
    for r in RECIPES:
        with te_seq.autocast(recipe=r):
            y = model(x)
        step = model.fusion_plan().forward[0]
        assert step.recipe == r and f"fp8={r}" in str(step) and "FP8" in step.backend_reason
        assert torch.equal(y, emu_linear(r, x, model[0].weight.detach(), torch.zeros(2, 128))[0])
    with te_seq.autocast(recipe=RECIPES[0]), te_seq.autocast(enabled=False):
        assert torch.equal(model(x), x @ model[0].weight.detach().t())
        assert model.fusion_plan().forward[0].recipe is None
    assert torch.equal(model(x), x @ model[0].weight.detach().t())  # outside: nothing changes


def test_linear_fusions_decline_under_recipe():
    model = te_seq.Sequential(ops.Linear(128, 256), ops.SwiGLU())
    x = _rand(4, 128)
    model(x)
    assert model.fusion_plan().forward[0].name == "LinearBiasActivation"
    r = recipe.Float8RowwiseScaling()
    with te_seq.autocast(recipe=r):
        y = model(x)
    plan = model.fusion_plan()
    assert [s.name for s in plan.forward] == ["BasicLinear", "Bias", "SwiGLU"]
    assert any("FP8" in m.reason and m.fusion == "linear_bias_activation" for m in plan.misses)
    h = emu_linear(r, x, model[0].weight.detach(), torch.zeros(4, 256))[0] + model[0].bias
    gate, up = h.chunk(2, dim=-1)
    assert torch.equal(y, torch.nn.functional.silu(gate) * up)


def test_torch_autocast_and_recipe_together():
    model = te_seq.Sequential(ops.BasicLinear(128, 128))
    x = _rand(4, 128)
    r = recipe.Float8BlockScaling()
    with torch.autocast("cpu", dtype=torch.bfloat16), te_seq.autocast(recipe=r):
        y = model(x)
    assert y.dtype == torch.bfloat16
    w = model[0].weight.detach().to(torch.bfloat16)
    assert torch.equal(y, (emu(r, "input", x.to(torch.bfloat16)) @ emu(r, "weight", w).t())
                       .to(torch.bfloat16))


def test_quantize_op_is_not_quantized_twice(monkeypatch):
    # Quantizing the same values again with the same blocks is (nearly always) idempotent, so
    # values cannot tell a second quantization: the count of quantizations does.
    r = recipe.Float8CurrentScaling()
    model = te_seq.Sequential(ops.Quantize(), ops.BasicLinear(128, 128, dtype=torch.bfloat16))
    torch.manual_seed(5)
    x = _rand(6, 128, dtype=torch.bfloat16).requires_grad_()
    dy = _rand(6, 128, dtype=torch.bfloat16)
    calls = []
    real = ref.quantize  # qdq quantizes through it too
    monkeypatch.setattr(ref, "quantize", lambda *a: calls.append(a[1]) or real(*a))
    with te_seq.autocast(recipe=r):
        y = model(x)
    y.backward(dy)
    # Quantize: x and its transpose; the weight once (per-tensor: its dgrad layout is the
    # same); dy once; x never again.
    assert len(calls) == 4
    calls.clear()
    with te_seq.autocast(recipe=r):  # without Quantize, the linear quantizes x itself: counted
        te_seq.Sequential(model[1])(x)
    assert len(calls) == 1
    w = model[1].weight.detach()
    want, want_dx, want_dw = emu_linear(r, x.detach(), w, dy)
    assert torch.equal(y, want)
    assert torch.equal(x.grad, want_dx) and torch.equal(model[1].weight.grad, want_dw)
    assert "quantizes for the next GEMM" in model.fusion_plan().forward[0].backend_reason


def test_quantize_outside_autocast_is_identity():
    x = _rand(3, 128)
    assert torch.equal(te_seq.Sequential(ops.Quantize())(x), x)


def test_quantize_then_grouped_linear_uses_the_source_for_wgrad():
    r = recipe.Float8BlockScaling()
    op = _grouped(torch.float32)
    model = te_seq.Sequential(ops.Quantize(), op)
    splits = torch.tensor([130, 0, 7])
    x = _rand(137, 128).requires_grad_()
    dy = _rand(137, 256)
    with te_seq.autocast(recipe=r):
        y = model(x, splits)
    y.backward(dy)
    want_y, want_dx, want_dw = emu_grouped(r, x.detach(), op.stacked_weight().detach(), dy,
                                           bounds_of(splits))
    assert torch.equal(y, want_y) and torch.equal(x.grad, want_dx)
    assert torch.equal(torch.stack([p.grad for _, p in op.named_weights()]), want_dw)


# --- errors -------------------------------------------------------------------------------------

def test_block_recipe_needs_multiples_of_128():
    model = te_seq.Sequential(ops.BasicLinear(96, 128))
    with te_seq.autocast(recipe=recipe.Float8BlockScaling()):
        with pytest.raises(ValueError, match=r"BasicLinear.*Float8BlockScaling.*in_features=96"):
            model(_rand(2, 96))
    with te_seq.autocast(recipe=recipe.Float8RowwiseScaling()):
        model(_rand(2, 96))  # rowwise and per-tensor take any size
    grouped = te_seq.Sequential(ops.GroupedLinear(2, 128, 200))
    with te_seq.autocast(recipe=recipe.Float8BlockScaling()):
        with pytest.raises(ValueError, match=r"GroupedLinear.*out_features=200"):
            grouped(_rand(4, 128), torch.tensor([2, 2]))
        with pytest.raises(ValueError, match=r"Quantize.*Float8BlockScaling.*100"):
            te_seq.Sequential(ops.Quantize())(_rand(2, 100))


def test_float64_is_an_error_under_a_recipe():
    model = te_seq.Sequential(ops.BasicLinear(128, 128, dtype=torch.float64))
    with te_seq.autocast(recipe=recipe.Float8CurrentScaling()):
        with pytest.raises(ValueError, match=r"BasicLinear.*Float8CurrentScaling.*float64"):
            model(_rand(2, 128, dtype=torch.float64))


def test_recipe_and_autocast_argument_errors():
    with pytest.raises(ValueError, match=r"Float8BlockScaling: fp8_format.*'HYBRID'"):
        recipe.Float8BlockScaling(fp8_format="HYBRID")
    with pytest.raises(ValueError, match=r"Float8CurrentScaling: fp8_format.*'E5M3'"):
        recipe.Float8CurrentScaling(fp8_format="E5M3")
    with pytest.raises(ValueError, match=r"margin must be an int >= 0, got -1"):
        recipe.Float8RowwiseScaling(margin=-1)
    with pytest.raises(TypeError, match=r"power_of_two_scales must be a bool"):
        recipe.Float8RowwiseScaling(power_of_two_scales=1)
    with pytest.raises(TypeError, match=r"te_seq.autocast: recipe must be.*got str"):
        te_seq.autocast(recipe="block")
    with pytest.raises(TypeError, match=r"enabled must be a bool"):
        te_seq.autocast(enabled=None)
    with pytest.raises(dataclasses_frozen_error()):
        recipe.Float8BlockScaling().margin = 1  # type: ignore[misc]


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_cute_declines_fp8_with_a_reason(monkeypatch):
    from te_seq.kernels import fp8_torch
    from te_seq.kernels.cute_backend import CuteBackend

    # block scaling runs on sm_90 (tests/test_fp8_cute_block.py); an sm_80 GPU declines it
    monkeypatch.setattr(fp8_torch, "cuda_capability", lambda device: (8, 0))
    r = recipe.Float8BlockScaling()
    ok, why = CuteBackend().supports("grouped_mm", k=128, n=128, dtype=torch.bfloat16,
                                     device=torch.device("cuda"), recipe=r)
    assert not ok and "no FP8 kernels" in why and "Float8BlockScaling" in why
    assert "needs sm_90" in why and "sm_80" in why


# --- GPU: the torch backend (real FP8 forward GEMMs where it can) agrees with the reference ------

@pytest.mark.gpu
@pytest.mark.parametrize("r", RECIPES, ids=IDS)
def test_torch_backend_fp8_matches_reference_on_gpu(r):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    results = {}
    for name in ("reference", "torch"):
        model = _mlp(torch.bfloat16).cuda()
        splits = torch.tensor([60, 0, 140], device="cuda")
        x = torch.randn(200, 128, device="cuda", dtype=torch.bfloat16)
        with te_seq.backend(name), te_seq.autocast(recipe=r):
            y = model(x, splits, torch.rand(200, device="cuda", dtype=torch.bfloat16), splits)
        step = model.fusion_plan().forward[0]
        assert step.backend == name and step.recipe == r
        results[name] = y.float()
    torch.testing.assert_close(results["torch"], results["reference"], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_cute_falls_back_under_a_recipe_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _mlp(torch.bfloat16).cuda()
    splits = torch.tensor([64, 64, 72], device="cuda")
    x = torch.randn(200, 128, device="cuda", dtype=torch.bfloat16)
    with te_seq.autocast(recipe=recipe.Float8BlockScaling()):
        model(x, splits, torch.rand(200, device="cuda", dtype=torch.bfloat16), splits)
    step = model.fusion_plan().forward[0]
    assert step.backend != "cute"


@pytest.mark.parametrize("r", RECIPES, ids=IDS)
def test_delayed_wgrad_under_recipe(r):
    op = ops.BasicLinear(128, 128, delay_wgrad_compute=True)
    x, dy = _rand(5, 128), _rand(5, 128)
    with te_seq.autocast(recipe=r):
        y = te_seq.Sequential(op)(x.requires_grad_())
    y.backward(dy)
    assert op.weight.grad is None and op.need_backward_dw()
    op.backward_dw()  # runs after the autocast block: the forward's recipe is what counts
    want_y, want_dx, want_dw = emu_linear(r, x.detach(), op.weight.detach(), dy)
    assert torch.equal(y, want_y) and torch.equal(op.weight.grad, want_dw)
    # dX's fp32 GEMM reads W in another layout than the emulation's: CPUs with other SIMD
    # kernels sum it in another order (a few ulps), so it is compared to fp32 rounding
    torch.testing.assert_close(x.grad, want_dx, rtol=1e-6, atol=1e-6)


def test_backward_outside_the_block_uses_the_forward_recipe():
    r = recipe.Float8RowwiseScaling()
    op = ops.BasicLinear(128, 64)
    x, dy = _rand(5, 128).requires_grad_(), _rand(5, 64)
    with te_seq.autocast(recipe=r):
        y = te_seq.Sequential(op)(x)
    with te_seq.autocast(recipe=recipe.Float8CurrentScaling()):
        y.backward(dy)  # another recipe active now: backward still follows its forward's
    want_y, want_dx, want_dw = emu_linear(r, x.detach(), op.weight.detach(), dy)
    assert torch.equal(x.grad, want_dx) and torch.equal(op.weight.grad, want_dw)


def test_torch_compile_runs_fp8_eagerly_and_follows_the_recipe():
    from te_seq.run import compiled

    if not compiled.TRACEABLE:
        pytest.skip("te_seq traces only from torch 2.13 on")
    torch._dynamo.reset()
    model = te_seq.Sequential(ops.BasicLinear(128, 128))
    step = torch.compile(model)
    x = _rand(4, 128)
    try:
        for r in (RECIPES[1], RECIPES[2], None):
            with te_seq.autocast(enabled=r is not None, recipe=r):
                y = step(x)
            want = x @ model[0].weight.detach().t() if r is None else \
                emu_linear(r, x, model[0].weight.detach(), torch.zeros(4, 128))[0]
            assert torch.equal(y, want)
            assert model.fusion_plan().forward[0].recipe == r
    finally:
        torch._dynamo.reset()
