"""`fp8_wgrad=False`: FP8 forward and dgrad GEMMs, the weight gradients in high precision.

The recipes' switch (te_seq/recipe.py) keeps dW = dyᵀ x on the unquantized operands in the
compute dtype, the GEMM a step without a recipe runs, while the forward and dgrad GEMMs stay the
recipe's: y and dx are the bits of the all-FP8 run. Checked on the emulating backend (CPU) and
on the cute backend's native FP8 path with a faked Hopper GPU (tests/test_fp8_cute.py's
fixture): no FP8 wgrad kernel, no quantization along the tokens, nothing kept beyond bf16's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_fp8 import IDS, RECIPES, _mlp, _rand, _run_mlp, bounds_of
from test_fp8_backward import NATIVE, NATIVE_IDS, _linear, _run, _stacked_grads
from test_fp8_cute import (  # noqa: F401 (fixture)
    fake_cute_gpu,
    recording_scaled_grouped_mm,
    recording_scaled_grouped_wgrad,
)
from test_fp8_memory import _per_call_bytes
from test_fp8_torch import small_mlp

import te_seq
from te_seq import ops, recipe
from te_seq.core import fp8
from te_seq.kernels import cute, fp8_quantize, torch_backend

# what makes an FP8 wgrad operand along the tokens (none of it may run under the switch)
TOKEN_MAJOR = ("token_major", "token_major_blocks", "rows_and_token_major",
               "rows_keeping_group_amax", "token_major_from_amax")


def high(r: recipe.Recipe) -> recipe.Recipe:
    return dataclasses.replace(r, fp8_wgrad=False)


def _refuse_token_major(mp: pytest.MonkeyPatch) -> None:
    """Every quantization along the tokens fails the test if it runs."""
    for name in TOKEN_MAJOR:
        def refuse(*args, _name=name, **kwargs):
            raise AssertionError(f"fp8_quantize.{_name} ran under fp8_wgrad=False")
        mp.setattr(fp8_quantize, name, refuse)


@pytest.fixture
def no_token_major(monkeypatch):
    _refuse_token_major(monkeypatch)


@pytest.fixture
def bf16_wgrad(monkeypatch):
    """cute's 16-bit wgrad kernel (CUDA only) as the torch backend's, its operands recorded."""
    calls = []

    def recording(dy, x, offs, out=None, accumulate=False, **kw):
        calls.append((dy.dtype, x.dtype))
        return torch_backend.grouped_wgrad(dy, x, offs, out=out, accumulate=accumulate)

    monkeypatch.setattr(cute, "grouped_wgrad", recording)
    return calls


def test_switch_is_checked_shown_and_keyed():
    with pytest.raises(TypeError, match="Float8RowwiseScaling: fp8_wgrad must be a bool"):
        recipe.Float8RowwiseScaling(fp8_wgrad=1)
    r = recipe.Float8RowwiseScaling()
    assert high(r) != r and str(high(r)) == "Float8RowwiseScaling(fp8_wgrad=False)"
    assert str(r) == "Float8RowwiseScaling"
    keys = []
    for each in (r, high(r)):
        with te_seq.autocast(recipe=each):
            keys.append(fp8.recipe_key())
    assert keys[0] != keys[1]  # plans and fast-path signatures tell them apart


def _grouped_run(r, backend="torch"):
    torch.manual_seed(11)
    op = ops.GroupedLinear(3, 128, 256, bias=False, dtype=torch.float32,
                           single_grouped_weight=True)
    splits = torch.tensor([37, 0, 91])
    x, dy = _rand(128, 128), _rand(128, 256)
    xi = x.clone().requires_grad_()
    with te_seq.backend(backend), te_seq.autocast(recipe=r):
        y = te_seq.Sequential(op)(xi, splits)
    y.backward(dy)
    return y.detach(), xi.grad, op.weight.grad, x, dy, bounds_of(splits)


@pytest.mark.parametrize("r", RECIPES, ids=IDS)
def test_grouped_linear_wgrad_on_unquantized_operands(r):
    y8, dx8, dw8, *_ = _grouped_run(r)
    y, dx, dw, x, dy, bounds = _grouped_run(high(r))
    assert torch.equal(y, y8) and torch.equal(dx, dx8)  # forward and dgrad: the recipe's
    want = torch.stack([dy[s:e].double().t() @ x[s:e].double() for s, e in bounds])
    hp_err = (dw.double() - want).abs().max()
    fp8_err = (dw8.double() - want).abs().max()
    assert hp_err < 1e-4 < fp8_err / 100  # fp32 rounding only, against FP8's quantization


@pytest.mark.parametrize("r", RECIPES, ids=IDS)
def test_fused_mlp_equals_unfused_and_keeps_fp8_forward(r):
    model = _mlp(torch.bfloat16)
    splits = torch.tensor([60, 0, 140])
    x, dy = _rand(200, 128, dtype=torch.bfloat16), _rand(200, 128, dtype=torch.bfloat16)
    probs = torch.rand(200).to(torch.bfloat16)
    fused = _run_mlp(model, high(r), x, splits, probs, dy)
    assert "fp8_wgrad=False" in str(model.fusion_plan())
    with te_seq.fusions_disabled("grouped_mlp"):
        unfused = _run_mlp(model, high(r), x, splits, probs, dy)
    for got, want in zip(fused[:3] + tuple(fused[3]), unfused[:3] + tuple(unfused[3])):
        assert torch.equal(got, want)
    all_fp8 = _run_mlp(model, r, x, splits, probs, dy)
    for got, want in zip(fused[:3], all_fp8[:3]):  # y, dx, d(probs): FP8 GEMMs as before
        assert torch.equal(got, want)
    changed = [not torch.equal(g, w) for g, w in zip(fused[3], all_fp8[3])]
    assert changed == [True, False, True] * 2  # per expert of FC1, FC2; expert 1 has no rows


@pytest.mark.parametrize("r", NATIVE, ids=NATIVE_IDS)
def test_native_linear_runs_the_high_precision_wgrad(fake_cute_gpu, no_token_major,  # noqa: F811
                                                    bf16_wgrad, r):
    op, splits, x, dy = _linear(single_grouped_weight=True)
    plain = ops.GroupedLinear(3, 128, 256, dtype=torch.bfloat16, single_grouped_weight=True)
    plain.load_state_dict(op.state_dict())
    model, dx = _run(op, splits, x, dy, high(r))
    assert recording_scaled_grouped_wgrad.calls == []  # no FP8 wgrad kernel...
    assert bf16_wgrad == [(torch.bfloat16, torch.bfloat16)]  # ...but the 16-bit one
    assert "fp8_wgrad=False" in str(model.fusion_plan())
    forward_calls = len(recording_scaled_grouped_mm.calls)
    assert forward_calls == 2  # the forward and the dgrad are FP8 GEMMs
    xi = x.clone().requires_grad_()
    with te_seq.backend("cute"):  # no recipe: the same wgrad GEMM on the same dy and x
        te_seq.Sequential(plain)(xi, splits).backward(dy)
    assert torch.equal(_stacked_grads(op), _stacked_grads(plain))


@pytest.mark.parametrize("r", NATIVE, ids=NATIVE_IDS)
def test_native_mlp_keeps_fp8_bits_and_no_more_than_bf16(fake_cute_gpu, bf16_wgrad,  # noqa: F811
                                                        r):
    _, _, model, splits, probs, x = small_mlp()
    pi = probs.clone().requires_grad_()
    dy = torch.randn(x.shape, dtype=x.dtype)
    all_fp8 = _mlp_step(model, r, x, splits, pi, dy)
    assert recording_scaled_grouped_wgrad.calls != []
    with pytest.MonkeyPatch.context() as mp:
        _refuse_token_major(mp)
        hp = _mlp_step(model, high(r), x, splits, pi, dy)
    assert recording_scaled_grouped_wgrad.calls == [] and len(bf16_wgrad) == 2
    for got, want in zip(hp[:3], all_fp8[:3]):  # y, dx, d(probs)
        assert torch.equal(got, want)
    changed = [not torch.equal(g, w) for g, w in zip(hp[3], all_fp8[3])]
    assert changed == [True, False, True] * 2  # per expert of FC1, FC2; expert 1 has no rows
    args = (x, splits, probs, splits)
    assert _per_call_bytes(model, args, high(r)) <= _per_call_bytes(model, args, None)


def _mlp_step(model, r, x, splits, probs, dy):
    recording_scaled_grouped_wgrad.calls.clear()
    x.grad = probs.grad = None
    with te_seq.backend("cute"), te_seq.autocast(recipe=r):
        y = model(x, splits, probs, splits)
    y.backward(dy)
    grads = [p.grad.clone() for name, p in model.named_parameters() if "weight" in name]
    model.zero_grad(set_to_none=True)
    return y.detach(), x.grad.clone(), probs.grad.clone(), grads


@pytest.mark.parametrize("r", RECIPES, ids=IDS)
@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed"])
def test_basic_linear_wgrad_on_unquantized_operands(r, delay):
    """BasicLinear (emulated FP8): y and dx as under the all-FP8 recipe, dW = dyᵀ x of the
    unquantized operands, also when computed later by backward_dw()."""
    results = []
    for each in (r, high(r)):
        torch.manual_seed(4)
        op = ops.BasicLinear(128, 256, delay_wgrad_compute=delay)
        x, dy = _rand(9, 128).requires_grad_(), _rand(9, 256)
        with te_seq.autocast(recipe=each):
            y = te_seq.Sequential(op)(x)
        y.backward(dy)
        if delay:
            op.backward_dw()
        results.append((y.detach(), x.grad, op.weight.grad, x.detach(), dy))
    (y8, dx8, dw8, _, _), (y, dx, dw, x, dy) = results
    assert torch.equal(y, y8) and torch.equal(dx, dx8)
    want = dy.double().t() @ x.double()
    assert (dw.double() - want).abs().max() < 1e-4 < (dw8.double() - want).abs().max() / 100


@pytest.mark.parametrize("r", RECIPES, ids=IDS)
def test_main_grad_accumulates_the_high_precision_wgrad(r):
    """Megatron-style fp32 main_grad: += dyᵀ x of the unquantized bf16 operands (what the same
    op adds without a recipe), nothing left in .grad."""
    results = []
    for each in (high(r), None):
        torch.manual_seed(6)
        op = ops.GroupedLinear(2, 128, 128, bias=False, dtype=torch.bfloat16,
                               accumulate_into_main_grad=True)
        for _, w in op.named_weights():
            w.main_grad = torch.randn(128, 128)  # fp32 buffers, accumulated into
        splits = torch.tensor([100, 60])
        x, dy = _rand(160, 128, dtype=torch.bfloat16), _rand(160, 128, dtype=torch.bfloat16)
        with te_seq.autocast(enabled=each is not None, recipe=each):
            y = te_seq.Sequential(op)(x.requires_grad_(), splits)
        y.backward(dy)
        results.append([w.main_grad.clone() for _, w in op.named_weights()])
        assert all(w.grad is None or (w.grad == 0).all() for _, w in op.named_weights())
    for got, want in zip(*results):
        assert torch.equal(got, want)
