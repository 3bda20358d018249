"""Activation memory under FP8 (CPU, the cute backend on a faked Hopper GPU).

With a native FP8 wgrad the forward used to keep x quantized along the tokens (token-major FP8,
padded to 128 tokens per group) besides what bf16 keeps. By default it now keeps x itself (which
bf16 keeps too) and quantizes it along the tokens when the wgrad runs
(`te_seq.config.set_fp8_token_major_input`). Both choices give the same bits; the default keeps
no byte more than bf16 per call.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_fp8_backward import NATIVE, NATIVE_IDS, _linear, _run, _stacked_grads
from test_fp8_cute import (  # noqa: F401 (fixture)
    fake_cute_gpu,
    recording_scaled_grouped_mm,
    recording_scaled_grouped_wgrad,
)
from test_fp8_torch import small_mlp

import te_seq
from te_seq import config, ops
from te_seq.core import fp8
from te_seq.kernels import fp8_wgrad


@contextlib.contextmanager
def token_major_input(enabled: bool):
    before = config.fp8_token_major_input()
    config.set_fp8_token_major_input(enabled)
    try:
        yield
    finally:
        config.set_fp8_token_major_input(before)


def _saved_storages(y: torch.Tensor) -> dict[int, int]:
    """data pointer -> bytes of every storage the autograd graph behind y saved."""
    found, seen, todo = {}, set(), [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        todo.extend(nxt for nxt, _ in fn.next_functions)
        for t in getattr(fn, "saved_tensors", ()) or ():
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                found[storage.data_ptr()] = storage.nbytes()
    return found


def _per_call_bytes(model, args, recipe) -> int:
    """Bytes of saved storages that a second identical forward allocates anew (activations),
    not those both calls share (parameters, the FP8 weight cache, the caller's input)."""
    fp8_ctx = te_seq.autocast(recipe=recipe) if recipe else contextlib.nullcontext()
    with te_seq.backend("cute"), fp8_ctx:
        first = model(*args)
        second = model(*args)
    shared = _saved_storages(first)
    return sum(n for ptr, n in _saved_storages(second).items() if ptr not in shared)


@pytest.mark.parametrize("r", NATIVE, ids=NATIVE_IDS)
def test_fused_mlp_keeps_no_more_than_bf16(fake_cute_gpu, r):  # noqa: F811
    _, _, model, splits, probs, x = small_mlp()
    args = (x, splits, probs, splits)
    bf16 = _per_call_bytes(model, args, None)
    assert _per_call_bytes(model, args, r) <= bf16
    with token_major_input(True):  # the FP8 copy of x along the tokens: one byte an element
        assert _per_call_bytes(model, args, r) >= bf16 + x.numel()


@pytest.mark.parametrize("r", NATIVE, ids=NATIVE_IDS)
def test_grouped_linear_saves_x_not_its_fp8_copy(fake_cute_gpu, r):  # noqa: F811
    op, splits, x, _ = _linear(single_grouped_weight=True)
    xi = x.clone().requires_grad_()
    with te_seq.backend("cute"), te_seq.autocast(recipe=r):
        y = te_seq.Sequential(op)(xi, splits)
    saved = _saved_storages(y)
    assert xi.untyped_storage().data_ptr() in saved
    assert not any(n == x.numel() for n in saved.values())  # no [K, P] FP8 copy of x...
    with token_major_input(True), te_seq.backend("cute"), te_seq.autocast(recipe=r):
        y = te_seq.Sequential(op)(xi, splits)
    width = fp8_wgrad.padded_width(x.shape[0], 3)
    assert x.shape[1] * width in _saved_storages(y).values()  # ...which the switch keeps


def _grads_and_wgrad_operands(make, r, enabled: bool):
    recording_scaled_grouped_wgrad.calls.clear()
    with token_major_input(enabled):
        grads = make(r)
    return grads, [tuple(t.clone() for t in call) for call in
                   recording_scaled_grouped_wgrad.calls]


def _linear_grads(r):
    op, splits, x, dy = _linear(single_grouped_weight=False)
    _, dx = _run(op, splits, x, dy, r)
    return [dx, _stacked_grads(op)]


def _mlp_grads(r):
    _, _, model, splits, probs, x = small_mlp()
    pi = probs.clone().requires_grad_()
    with te_seq.backend("cute"), te_seq.autocast(recipe=r):
        y = model(x, splits, pi, splits)
    y.backward(torch.randn_like(y))
    return [y, x.grad, pi.grad, *[p.grad for p in model.parameters()]]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


@pytest.mark.parametrize("make", [_linear_grads, _mlp_grads], ids=["linear", "mlp"])
@pytest.mark.parametrize("r", NATIVE, ids=NATIVE_IDS)
def test_deferred_token_major_input_gives_the_same_bits(fake_cute_gpu, make, r):  # noqa: F811
    (kept, kept_calls), (deferred, deferred_calls) = (
        _grads_and_wgrad_operands(make, r, enabled) for enabled in (True, False))
    assert deferred_calls and len(kept_calls) == len(deferred_calls)
    for got, want in zip(deferred, kept):
        assert torch.equal(got, want)
    for got_call, want_call in zip(deferred_calls, kept_calls):
        for got, want in zip(got_call, want_call):
            assert torch.equal(_bits(got), _bits(want))


def test_delayed_wgrad_quantizes_x_when_it_runs(fake_cute_gpu):  # noqa: F811
    """With `delay_wgrad_compute` the token-major x is made by `backward_dw()`, not before."""
    op, splits, x, dy = _linear(single_grouped_weight=True)
    delayed = ops.GroupedLinear(3, 128, 256, dtype=torch.bfloat16, single_grouped_weight=True,
                                delay_wgrad_compute=True)
    delayed.load_state_dict(op.state_dict())
    _run(op, splits, x, dy, NATIVE[0])
    made = []
    resolve = fp8.DeferredTokenMajor.resolve

    def recording(self, recipe, backend_name):
        made.append(self.x.shape)
        return resolve(self, recipe, backend_name)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8.DeferredTokenMajor, "resolve", recording)
        _run(delayed, splits, x, dy, NATIVE[0])
        assert made == []
        delayed.backward_dw()
    assert made == [x.shape]
    assert torch.equal(_stacked_grads(delayed), _stacked_grads(op))


def test_grad_operands_round_trip_a_deferred_input():
    x, offs, w = torch.randn(5, 4), torch.tensor([2, 5], dtype=torch.int32), torch.randn(2, 4, 3)
    ops_ = fp8.GradOperands(fp8.DeferredTokenMajor(x, offs), w, torch.ones(2, 4, 1))
    loaded = fp8.GradOperands.load(ops_.tensors())
    assert isinstance(loaded.x, fp8.DeferredTokenMajor) and loaded.native
    assert loaded.x.x is x and loaded.x.offs is offs and loaded.w is w
    emulated = fp8.GradOperands.load((x, None, None, w, torch.ones(2, 4, 1)))
    assert emulated.x is x  # an fp32 operand along T stays one
    amax = torch.rand(2, 4)  # x's (group, column) maxima, where the forward made them
    with_amax = fp8.GradOperands(fp8.DeferredTokenMajor(x.bfloat16(), offs, amax), w,
                                 torch.ones(2, 4, 1))
    loaded = fp8.GradOperands.load(with_amax.tensors())
    assert isinstance(loaded.x, fp8.DeferredTokenMajor) and loaded.x.amax is amax
    data = torch.zeros(4, 256, dtype=torch.float8_e4m3fn)  # a token-major operand stays one
    token_major = fp8.GradOperands.load((data, amax, offs, w, torch.ones(2, 4, 1)))
    assert isinstance(token_major.x, fp8_wgrad.TokenMajor) and token_major.x.data is data


@pytest.mark.parametrize("r", NATIVE, ids=NATIVE_IDS)
def test_frozen_weights_keep_nothing_for_a_wgrad(fake_cute_gpu, r):  # noqa: F811
    """With the weights frozen no wgrad runs: the forward neither quantizes x along the tokens
    nor keeps x for it, and dx is what it is with trainable weights."""
    op, splits, x, dy = _linear(single_grouped_weight=True)
    _, want_dx = _run(op, splits, x, dy, r)
    calls = len(recording_scaled_grouped_wgrad.calls)
    for p in op.parameters():
        p.requires_grad_(False)
    xi = x.clone().requires_grad_()
    with te_seq.backend("cute"), te_seq.autocast(recipe=r):
        y = te_seq.Sequential(op)(xi, splits)
    assert xi.untyped_storage().data_ptr() not in _saved_storages(y)
    y.backward(dy)
    assert len(recording_scaled_grouped_wgrad.calls) == calls  # no wgrad kernel ran
    assert torch.equal(xi.grad, want_dx)
