"""In-place ops never corrupt what another op saved for backward.

`AddExtraInput(in_place=True)` writes the sum into its residual only when that residual shares no
memory with the rest of the Sequential call (its input, other extra inputs, parameters): the
Sequential's input given again as the residual was saved by BasicLinear for its weight gradient,
and autograd could not see the write (the fuser hands saved tensors to autograd after its whole
forward). As a safety net, the fuser checks the version counters of every saved tensor before
handing them to autograd, so an in-place write by any op (a user op here) is a clear error.

References are plain PyTorch, out of place, in float64.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import te_seq
from te_seq import ops

D = torch.float64
FUSED = pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])


def _fusions(fused: bool):
    return contextlib.nullcontext() if fused else te_seq.fusions_disabled()


def _reference_grads(fn, leaves: list[torch.Tensor]) -> tuple[torch.Tensor, list]:
    copies = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
    out = fn(*copies)
    out.sum().backward()
    return out.detach(), [c.grad for c in copies]


@FUSED
@pytest.mark.parametrize("with_bias", [False, True])  # Linear: the linear_bias_add fusion
def test_in_place_residual_that_is_the_input_gives_the_right_weight_grad(fused, with_bias):
    lin = (ops.Linear if with_bias else ops.BasicLinear)(4, 4, dtype=D)
    seq = te_seq.Sequential(lin, ops.AddExtraInput(in_place=True))
    x = torch.randn(3, 4, dtype=D)  # needs no grad: in place would be allowed by itself
    before = x.clone()
    with _fusions(fused):
        y = seq(x, x)
    y.sum().backward()
    assert torch.equal(x, before)  # ran out of place: x was saved for dW = dYᵀ X
    params = list(lin.parameters())
    ref, ref_grads = _reference_grads(lambda *p: F.linear(before, *p) + before, params)
    torch.testing.assert_close(y, ref)
    for p, g in zip(params, ref_grads):
        torch.testing.assert_close(p.grad, g)


@FUSED
@pytest.mark.parametrize("alias", ["view", "detached", "reshaped"])
def test_in_place_residual_that_views_the_input_runs_out_of_place(fused, alias) -> None:
    lin = ops.BasicLinear(4, 4, dtype=D)
    seq = te_seq.Sequential(ops.Identity(), lin, ops.AddExtraInput(in_place=True))
    x = torch.randn(6, 4, dtype=D)
    extra = {"view": x[:], "detached": x.detach(), "reshaped": x.view(2, 3, 4).view(6, 4)}[alias]
    before = x.clone()
    with _fusions(fused):
        y = seq(x, extra)
    y.sum().backward()
    assert torch.equal(x, before)
    ref, (grad,) = _reference_grads(lambda w: F.linear(before, w) + before, [lin.weight])
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(lin.weight.grad, grad)


def test_in_place_residual_across_a_plain_module_is_not_written() -> None:
    """The input was saved by the first run; the in-place op is in the second (after a plain
    module): the whole call's input counts, not only its own run's."""
    lin = ops.BasicLinear(4, 4, dtype=D)
    seq = te_seq.Sequential(lin, torch.nn.Identity(), ops.AddExtraInput(in_place=True))
    x = torch.randn(3, 4, dtype=D)
    before = x.clone()
    y = seq(x, x)
    y.sum().backward()  # would raise autograd's in-place error had x been written
    assert torch.equal(x, before)
    torch.testing.assert_close(lin.weight.grad, torch.ones(3, 4, dtype=D).t() @ before)


@FUSED
def test_the_same_residual_given_twice_is_added_with_its_value_at_call_time(fused) -> None:
    lin1, lin2 = ops.Linear(4, 4, dtype=D), ops.Linear(4, 4, dtype=D)
    seq = te_seq.Sequential(lin1, ops.AddExtraInput(in_place=True),
                            lin2, ops.AddExtraInput(in_place=True))
    x, r = torch.randn(3, 4, dtype=D, requires_grad=True), torch.randn(3, 4, dtype=D)
    r0 = r.clone()
    with _fusions(fused):
        y = seq(x, r, r)
    torch.testing.assert_close(y, lin2(lin1(x) + r0) + r0)
    assert torch.equal(r, r0)


def test_in_place_residual_that_is_a_frozen_parameter_is_not_written() -> None:
    lin = ops.BasicLinear(4, 4, dtype=D)
    lin.weight.requires_grad_(False)
    seq = te_seq.Sequential(lin, ops.AddExtraInput(in_place=True))
    x = torch.randn(4, 4, dtype=D, requires_grad=True)
    w0 = lin.weight.detach().clone()
    y = seq(x, lin.weight.detach())
    assert torch.equal(lin.weight, w0)
    torch.testing.assert_close(y, F.linear(x, w0) + w0)


@FUSED
def test_in_place_still_writes_into_a_residual_of_its_own(fused) -> None:
    seq = te_seq.Sequential(ops.Linear(4, 4, dtype=D), ops.AddExtraInput(in_place=True))
    x, r = torch.randn(3, 4, dtype=D, requires_grad=True), torch.randn(3, 4, dtype=D)
    with _fusions(fused):
        y = seq(x, r)
    assert y.data_ptr() == r.data_ptr()


def test_make_extra_output_residual_keeps_the_input_value_under_in_place_ops() -> None:
    """MakeExtraOutput writes nothing (its residual is the input's memory); an in-place add
    later in the call, given that input, must leave the residual's value alone."""
    lin = ops.BasicLinear(4, 4, dtype=D)
    seq = te_seq.Sequential(ops.MakeExtraOutput(in_place=True), lin,
                            ops.AddExtraInput(in_place=True))
    x = torch.randn(3, 4, dtype=D)
    before = x.clone()
    y, residual = seq(x, x)
    torch.testing.assert_close(residual, before)
    torch.testing.assert_close(y, F.linear(before, lin.weight) + before)


class _UnguardedInPlaceAdd(ops.AddExtraInput):
    """A user op that writes into its residual whatever it aliases (what te_seq's op avoids)."""

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        (extra,) = basic_op_extra_inputs[0]
        self.save(basic_op_ctxs[0], input_, extra)
        return extra.add_(input_), [()]


def test_an_in_place_write_into_a_saved_tensor_is_a_clear_error() -> None:
    seq = te_seq.Sequential(ops.BasicLinear(4, 4, dtype=D), _UnguardedInPlaceAdd())
    x = torch.randn(3, 4, dtype=D)
    message = (r"BasicLinear \(op 0 of its run\): tensor 0 it saved for backward "
               r"\(shape \(3, 4\)\) was written in place later in the same forward")
    with te_seq.fusions_disabled(), pytest.raises(RuntimeError, match=message):
        seq(x, x)


def test_the_saved_tensor_check_is_silent_without_autograd() -> None:
    seq = te_seq.Sequential(ops.BasicLinear(4, 4, dtype=D), _UnguardedInPlaceAdd())
    x = torch.randn(3, 4, dtype=D)
    with torch.no_grad(), te_seq.fusions_disabled():
        seq(x, x)  # nothing is saved, nothing can be corrupted
