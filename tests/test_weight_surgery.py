"""Weight surgery behaves as on torch.nn modules: reassigning and tying weights of the composite
`Linear`, `load_state_dict(..., assign=True)`, `copy.deepcopy` (GroupedLinear's weight block
included, then tying the copy to the original), and copies or pickles of an op whose delayed
wgrad is still pending.

Each test compares against plain PyTorch maths on the Parameters that should be in use, in
float64 (any difference is a stale Parameter, not rounding), fused and with fusions disabled.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F

import te_seq
from te_seq import ops

D = torch.float64
K, N, G = 4, 3, 3
FUSED = pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])


def _fusions(fused: bool):
    return contextlib.nullcontext() if fused else te_seq.fusions_disabled()


def _param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape, dtype=D))


def _gelu(t: torch.Tensor) -> torch.Tensor:
    return F.gelu(t, approximate="tanh")  # te_seq's GELU default, as TransformerEngine's


def _x(rows: int = 5, width: int = K) -> torch.Tensor:
    return torch.randn(rows, width, dtype=D, requires_grad=True)


# --- Linear: reassignment, load_state_dict(assign=True), bias=None, tying --------------------


@FUSED
@pytest.mark.parametrize("activation", [None, ops.GELU])  # GELU: the linear+bias+act fusion
def test_reassigned_linear_weight_and_bias_are_used_and_get_grads(fused, activation) -> None:
    lin = ops.Linear(K, N, dtype=D)
    seq = te_seq.Sequential(lin, *([activation()] if activation else []))
    x = _x()
    seq(x)  # a forward before the surgery: nothing may be cached from it
    old_w, old_b = lin.weight, lin.bias
    lin.weight, lin.bias = _param(N, K), _param(N)
    with _fusions(fused):
        y = seq(x)
    y.sum().backward()
    act = _gelu if activation else (lambda t: t)
    w_ref, b_ref = lin.weight.detach().requires_grad_(), lin.bias.detach().requires_grad_()
    act(F.linear(x.detach(), w_ref, b_ref)).sum().backward()
    torch.testing.assert_close(y, act(F.linear(x, w_ref, b_ref)))
    torch.testing.assert_close(lin.weight.grad, w_ref.grad)
    torch.testing.assert_close(lin.bias.grad, b_ref.grad)
    assert old_w.grad is None and old_b.grad is None
    assert [n for n, _ in seq.named_parameters()] == ["0.weight", "0.bias"]


@FUSED
def test_linear_load_state_dict_assign_takes_the_new_parameters(fused) -> None:
    lin, source = ops.Linear(K, N, dtype=D), ops.Linear(K, N, dtype=D)
    with torch.no_grad():
        source.bias.normal_()
    lin.load_state_dict(source.state_dict(), assign=True)
    assert lin.weight is not source.weight  # assign wraps the loaded tensors in new Parameters
    x = _x()
    with _fusions(fused):
        y = te_seq.Sequential(lin)(x)
    y.sum().backward()
    torch.testing.assert_close(y, F.linear(x, source.weight, source.bias))
    assert lin.weight.grad is not None and lin.bias.grad is not None
    assert source.weight.grad is None
    assert lin.basic_ops()[0].weight is lin.weight and lin.basic_ops()[1].bias is lin.bias


def test_linear_load_state_dict_assign_from_meta() -> None:
    source = ops.Linear(K, N, dtype=D)
    lin = ops.Linear(K, N, device="meta", dtype=D)
    lin.load_state_dict(source.state_dict(), assign=True)
    x = _x()
    lin(x).sum().backward()
    assert not lin.weight.is_meta and lin.weight.grad is not None


@FUSED
def test_linear_bias_none_runs_without_bias_and_a_new_bias_brings_it_back(fused) -> None:
    lin = ops.Linear(K, N, dtype=D)
    with torch.no_grad():
        lin.bias.normal_()  # non-zero, so a stale bias would show
    seq = te_seq.Sequential(lin, ops.GELU())
    x = _x()
    seq(x)
    lin.bias = None
    with _fusions(fused):
        y = seq(x)
    torch.testing.assert_close(y, _gelu(F.linear(x, lin.weight)))
    assert [s.name for s in seq.fusion_plan().forward] == ["BasicLinear", "GELU"]
    assert list(lin.state_dict()) == ["weight"]
    lin.bias = _param(N)
    with _fusions(fused):
        y = seq(x)
    torch.testing.assert_close(y, _gelu(F.linear(x, lin.weight, lin.bias)))


def test_linear_built_without_bias_accepts_one_later() -> None:
    lin = ops.Linear(K, N, bias=False, dtype=D)
    lin.bias = _param(N)
    x = _x()
    y = lin(x)
    y.sum().backward()
    torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias))
    assert lin.bias.grad is not None and lin.basic_ops()[1].bias is lin.bias


@pytest.mark.parametrize(("name", "value", "match"), [
    ("weight", lambda: _param(N, K + 1), r"Linear: weight has shape \(3, 5\), expected \(3, 4\)"),
    ("bias", lambda: _param(N + 1), r"Linear: bias has shape \(4,\), expected \(3,\)"),
    ("weight", lambda: None, r"Linear: weight is None"),
])
def test_linear_rejects_a_reassigned_parameter_of_the_wrong_shape(name, value, match) -> None:
    lin = ops.Linear(K, N, dtype=D)
    setattr(lin, name, value())
    with pytest.raises(ValueError, match=match):
        lin(_x())


@FUSED
def test_tied_linear_weights_match_torch(fused) -> None:
    lin1, lin2 = ops.Linear(K, K, dtype=D), ops.Linear(K, K, dtype=D)
    lin2.weight = lin1.weight
    seq = te_seq.Sequential(lin1, ops.ReLU(), lin2)
    ref1, ref2 = torch.nn.Linear(K, K, dtype=D), torch.nn.Linear(K, K, dtype=D)
    with torch.no_grad():
        ref1.weight.copy_(lin1.weight)
        ref1.bias.copy_(lin1.bias)
        ref2.bias.copy_(lin2.bias)
    ref2.weight = ref1.weight
    x = _x()
    with _fusions(fused):
        y = seq(x)
    y.sum().backward()
    ref = ref2(torch.relu(ref1(x.detach())))
    ref.sum().backward()
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(lin1.weight.grad, ref1.weight.grad)  # both uses accumulated
    assert len(list(seq.parameters())) == 3


def test_tied_linear_weights_with_delayed_wgrad_accumulate_both_uses() -> None:
    lin1 = ops.Linear(K, K, dtype=D, delay_wgrad_compute=True)
    lin2 = ops.Linear(K, K, dtype=D, delay_wgrad_compute=True)
    lin2.weight = lin1.weight
    seq = te_seq.Sequential(lin1, lin2)
    x = _x()
    seq(x).sum().backward()
    assert lin1.weight.grad is None
    seq.backward_dw()
    w = lin1.weight.detach().requires_grad_()
    F.linear(F.linear(x.detach(), w, lin1.bias.detach()), w, lin2.bias.detach()).sum().backward()
    torch.testing.assert_close(lin1.weight.grad, w.grad)


def test_deepcopy_of_a_linear_is_independent() -> None:
    lin = ops.Linear(K, N, dtype=D)
    twin = copy.deepcopy(lin)
    assert twin.basic_ops()[0].weight is twin.weight and twin.weight is not lin.weight
    with torch.no_grad():
        twin.weight.mul_(2)
    x = _x()
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    torch.testing.assert_close(twin(x), F.linear(x, twin.weight, twin.bias))


# --- GroupedLinear: deepcopy keeps an independent block; tying the copy to the original -------


def _grouped(**kwargs) -> ops.GroupedLinear:
    op = ops.GroupedLinear(G, K, N, dtype=D, **kwargs)
    with torch.no_grad():
        for p in op.parameters():
            p.normal_()
    return op


def _grouped_ref(op: ops.GroupedLinear, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
    weights = [w for _, w in op.named_weights()]
    biases = [b for _, b in op.named_biases()]
    if op.single_grouped_weight:
        weights = list(weights[0].unbind(0))
    if op.single_grouped_bias:
        biases = list(biases[0].unbind(0))
    rows = x.split(splits)
    return torch.cat([F.linear(r, weights[g], biases[g] if biases else None)
                      for g, r in enumerate(rows)])


SPLITS = [2, 0, 3]


@pytest.mark.parametrize("kwargs", [{}, {"bias": False}, {"single_grouped_weight": True}])
def test_deepcopy_of_grouped_linear_is_independent_with_its_own_block(kwargs) -> None:
    op = _grouped(**kwargs)
    twin = copy.deepcopy(op)
    if not op.single_grouped_weight:
        block = twin.stacked_weight()
        assert block.data_ptr() != op.stacked_weight().data_ptr()
        for g, (_, w) in enumerate(twin.named_weights()):
            assert w.data_ptr() == block[g].data_ptr()  # the copy's Parameters view its block
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(-1)
    x, splits = _x(), torch.tensor(SPLITS)
    y_op, y_twin = op(x, splits), twin(x, splits)
    torch.testing.assert_close(y_op, _grouped_ref(op, x, SPLITS))
    torch.testing.assert_close(y_twin, _grouped_ref(twin, x, SPLITS))
    y_twin.sum().backward()
    assert all(p.grad is not None for p in twin.parameters())
    assert all(p.grad is None for p in op.parameters())


@FUSED
def test_deepcopy_of_grouped_linear_then_tied_to_the_original_uses_the_tied_weights(fused):
    op = _grouped()
    twin = copy.deepcopy(op)
    for name, param in op.named_parameters():
        setattr(twin, name, param)
    with torch.no_grad():  # changed after tying: a stale private block would not see it
        for p in op.parameters():
            p.add_(1.0)
    x, splits = _x(), torch.tensor(SPLITS)
    with _fusions(fused):
        y = te_seq.Sequential(twin)(x, splits)
    torch.testing.assert_close(y, _grouped_ref(op, x, SPLITS))
    y.sum().backward()
    assert all(p.grad is not None for p in op.parameters())


def test_deepcopy_of_a_grouped_mlp_sequential_runs_fused_on_its_own_weights() -> None:
    seq = te_seq.Sequential(ops.GroupedLinear(G, K, 4, bias=False, dtype=D), ops.SwiGLU(),
                            ops.GroupedLinear(G, 2, K, bias=False, dtype=D))
    x, splits = _x(), torch.tensor(SPLITS)
    y = seq(x, splits, splits)
    twin = copy.deepcopy(seq)
    torch.testing.assert_close(twin(x, splits, splits), y)
    assert [s.name for s in twin.fusion_plan().forward] == ["GroupedMLP"]
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2)
    torch.testing.assert_close(seq(x, splits, splits), y)  # the original is untouched


# --- delayed wgrad pending: deepcopy and pickling ----------------------------------------------


def _delayed(kind: str) -> tuple[torch.nn.Module, tuple]:
    splits = torch.tensor(SPLITS)
    if kind == "BasicLinear":
        return ops.BasicLinear(K, N, dtype=D, delay_wgrad_compute=True), ()
    if kind == "Linear":
        return ops.Linear(K, N, dtype=D, delay_wgrad_compute=True), ()
    if kind == "GroupedLinear":
        return ops.GroupedLinear(G, K, N, dtype=D, delay_wgrad_compute=True), (splits,)
    seq = te_seq.Sequential(
        ops.GroupedLinear(G, K, 4, bias=False, dtype=D, delay_wgrad_compute=True), ops.SwiGLU(),
        ops.GroupedLinear(G, 2, K, bias=False, dtype=D, delay_wgrad_compute=True))
    return seq, (splits, splits)


DELAYED_KINDS = ["BasicLinear", "Linear", "GroupedLinear", "GroupedMLP"]


def _weights(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for n, p in module.named_parameters() if "weight" in n]


@pytest.mark.parametrize("kind", DELAYED_KINDS)
def test_deepcopy_with_a_pending_wgrad_copies_no_pending_work(kind) -> None:
    module, extras = _delayed(kind)
    x = _x()
    module(x, *extras).sum().backward()
    assert module.need_backward_dw()
    twin = copy.deepcopy(module)
    assert not twin.need_backward_dw()  # the pending wgrad stays with the original
    twin.backward_dw()  # nothing to run: writes nowhere
    assert all(p.grad is None for p in _weights(module) + _weights(twin))
    module.backward_dw()
    assert all(p.grad is not None for p in _weights(module))
    assert all(p.grad is None for p in _weights(twin))
    twin(x, *extras).sum().backward()  # the copy has its own queue and works
    twin.backward_dw()
    for a, b in zip(_weights(twin), _weights(module)):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("kind", DELAYED_KINDS)
def test_pickling_with_a_pending_wgrad_says_to_run_backward_dw(kind) -> None:
    module, extras = _delayed(kind)
    module(_x(), *extras).sum().backward()
    with pytest.raises(RuntimeError, match=r"run backward_dw\(\) first"):
        pickle.dumps(module)
    with pytest.raises(RuntimeError, match=r"delayed weight gradient\(s\) pending"):
        torch.save(module, io.BytesIO())
    module.backward_dw()
    twin = pickle.loads(pickle.dumps(module))
    assert not twin.need_backward_dw()
    assert all(op.delay_wgrad_compute for op in _weighted_ops(twin))


def _weighted_ops(module: torch.nn.Module) -> list:
    return [op for op in getattr(module, "basic_ops", lambda: [module])()
            if hasattr(op, "delay_wgrad_compute")]


@pytest.mark.parametrize("kind", DELAYED_KINDS)
def test_pickle_and_torch_save_round_trip_a_working_op(kind) -> None:
    module, extras = _delayed(kind)
    x = _x()
    y = module(x, *extras)
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    for twin in (pickle.loads(pickle.dumps(module)), torch.load(buffer, weights_only=False)):
        torch.testing.assert_close(twin(x, *extras), y)
        twin(x, *extras).sum().backward()
        twin.backward_dw()
        assert all(p.grad is not None for p in _weights(twin))
        for op in _weighted_ops(twin):
            if isinstance(op, ops.GroupedLinear):  # the block survives the round trip
                block = op.stacked_weight()
                assert all(w.data_ptr() == block[g].data_ptr()
                           for g, (_, w) in enumerate(op.named_weights()))
