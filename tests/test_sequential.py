"""te_seq.Sequential's container API (README, "Quickstart"): structure, plain modules,
nesting, extra inputs and outputs, the plan object, state_dict, dtype/mode changes, saved-tensor
hooks."""

from __future__ import annotations

import pytest
import torch
from op_specs import randomize_params, skip_if_missing

import te_seq
from te_seq import ops

# Shape legend: T rows, H hidden, F ffn, G groups.
T, H, F, G = 7, 8, 6, 3
f64 = torch.float64


def _mlp_ops(scale_bias: bool = False) -> list[torch.nn.Module]:
    bias = scale_bias
    return [ops.GroupedLinear(G, H, 2 * F, bias=bias, scale_bias=scale_bias, dtype=torch.float64),
            ops.ScaledSwiGLU(),
            ops.GroupedLinear(G, F, H, bias=bias, scale_bias=scale_bias, dtype=torch.float64)]


def _x(requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(T, H, dtype=torch.float64, requires_grad=requires_grad)


def _splits() -> torch.Tensor:
    return torch.tensor([3, 0, 4])


def _probs() -> torch.Tensor:
    return torch.rand(T, dtype=torch.float64) + 0.5


def _names(steps) -> list[tuple[str, tuple[int, ...]]]:
    return [(s.name, s.basic_op_indices) for s in steps]


# --- container API --------------------------------------------------------------------------------

def test_indexing_len_iteration_and_slicing() -> None:
    a, b, c = ops.BasicLinear(H, H, dtype=f64), ops.GELU(), ops.Bias(H, dtype=f64)
    seq = te_seq.Sequential(a, b, c)
    assert len(seq) == 3 and seq[0] is a and seq[-1] is c and list(seq) == [a, b, c]
    tail = seq[1:]
    assert isinstance(tail, te_seq.Sequential) and list(tail) == [b, c]
    x = _x()
    torch.testing.assert_close(tail(x), torch.nn.functional.gelu(x, approximate="tanh") + c.bias)


def test_append_extend_insert_change_the_plan() -> None:
    seq = te_seq.Sequential(ops.GroupedLinear(G, H, 2 * F, bias=False, dtype=torch.float64))
    seq(_x(), _splits())
    assert _names(seq.fusion_plan().forward) == [("GroupedLinear", (0,))]
    seq.append(ops.SwiGLU())
    seq.extend([ops.GroupedLinear(G, F, H, bias=False, dtype=torch.float64)])
    assert len(seq) == 3
    seq(_x(), _splits(), _splits())
    assert _names(seq.fusion_plan().forward) == [("GroupedMLP", (0, 1, 2))]
    seq.insert(0, ops.Bias(H, dtype=torch.float64))
    assert isinstance(seq[0], ops.Bias) and len(seq) == 4
    seq(_x(), _splits(), _splits())
    assert _names(seq.fusion_plan().forward) == [("Bias", (0,)), ("GroupedMLP", (1, 2, 3))]


def test_state_dict_round_trip() -> None:
    src = te_seq.Sequential(*_mlp_ops(scale_bias=True))
    randomize_params(src)
    dst = te_seq.Sequential(*_mlp_ops(scale_bias=True))
    assert list(src.state_dict()) == [
        *(f"0.weight{g}" for g in range(G)), *(f"0.bias{g}" for g in range(G)),
        *(f"2.weight{g}" for g in range(G)), *(f"2.bias{g}" for g in range(G))]
    dst.load_state_dict(src.state_dict())
    extras = (_splits(), _probs(), _probs(), _splits(), _probs())
    x = _x()
    torch.testing.assert_close(dst(x, *extras), src(x, *extras), rtol=0, atol=0)


def test_to_dtype_and_train_eval() -> None:
    seq = te_seq.Sequential(ops.Linear(H, H, dtype=torch.float64), ops.GELU())
    seq.to(torch.float32)
    assert all(p.dtype == torch.float32 for p in seq.parameters())
    y = seq(torch.randn(T, H))
    assert y.dtype == torch.float32
    seq.eval()
    assert not seq.training and not seq[1].training
    seq.train()
    assert seq.training and seq[1].training


def test_linear_state_dict_keys() -> None:
    assert list(ops.Linear(H, F).state_dict()) == ["weight", "bias"]
    assert list(ops.Linear(H, F, bias=False).state_dict()) == ["weight"]
    assert list(te_seq.Sequential(ops.Linear(H, F)).state_dict()) == ["0.weight", "0.bias"]


def test_linear_is_basic_linear_then_bias_in_the_plan() -> None:
    lin = ops.Linear(H, F, dtype=torch.float64)
    randomize_params(lin)
    seq = te_seq.Sequential(lin)
    x = _x()
    with te_seq.fusions_disabled():
        y = seq(x)
    assert [s.name for s in seq.fusion_plan().forward][:2] == ["BasicLinear", "Bias"]
    torch.testing.assert_close(y, torch.nn.functional.linear(x, lin.weight, lin.bias))
    torch.testing.assert_close(lin(x), y)  # Linear also runs on its own


# --- plain modules and nesting --------------------------------------------------------------------

def test_plain_modules_split_windows_and_are_not_in_the_plan() -> None:
    fc1, act, fc2 = _mlp_ops()
    tanh = torch.nn.Tanh()
    seq = te_seq.Sequential(ops.BasicLinear(H, H, dtype=torch.float64), tanh, fc1, act,
                            torch.nn.Identity(), fc2)
    x, s, p = _x(True), _splits(), _probs()
    y = seq(x, s, p, s)
    y.sum().backward()
    plan = seq.fusion_plan()
    assert _names(plan.forward) == [("BasicLinear", (0,)), ("GroupedLinear", (1,)),
                                    ("ScaledSwiGLU", (2,)), ("GroupedLinear", (3,))]
    assert _names(plan.backward) == list(reversed(_names(plan.forward)))
    assert plan.misses == []  # the window was split, so grouped_mlp never matched
    assert x.grad is not None


def test_nested_sequentials_are_flattened() -> None:
    fc1, act, fc2 = _mlp_ops()
    head = ops.BasicLinear(H, H, dtype=torch.float64)
    seq = te_seq.Sequential(head, te_seq.Sequential(fc1, te_seq.Sequential(act)), fc2)
    x, s, p = _x(True), _splits(), _probs()
    y = seq(x, s, p, s)
    y.sum().backward()
    plan = seq.fusion_plan()
    assert _names(plan.forward) == [("BasicLinear", (0,)), ("GroupedMLP", (1, 2, 3))]
    assert _names(plan.backward) == [("GroupedMLP", (1, 2, 3)), ("BasicLinear", (0,))]
    flat = te_seq.Sequential(head, fc1, act, fc2)
    torch.testing.assert_close(flat(x, s, p, s), y)


def test_fusion_plan_is_printable() -> None:
    seq = te_seq.Sequential(*_mlp_ops())
    seq(_x(True), _splits(), _probs(), _splits())
    text = str(seq.fusion_plan())
    assert "GroupedMLP" in text and "reference" in text


# --- extra inputs and outputs ---------------------------------------------------------------------

def test_extra_inputs_are_consumed_in_basic_op_order() -> None:
    """GroupedLinear(split_sizes, scales) → ScaledSwiGLU(scales) → GroupedLinear(split_sizes,
    scales): six extra inputs, in that order."""
    seq = te_seq.Sequential(*_mlp_ops(scale_bias=True))
    randomize_params(seq)
    fc1, _, fc2 = seq
    x, s, s1, p, s2 = _x(), _splits(), _probs(), _probs(), _probs()
    y = seq(x, s, s1, p, s, s2)

    def grouped(fc, inp, scales):
        parts, rows = [], 0
        for g, n in enumerate(s.tolist()):
            w, b = getattr(fc, f"weight{g}"), getattr(fc, f"bias{g}")
            parts.append(inp[rows:rows + n] @ w.t() + scales[rows:rows + n, None] * b)
            rows += n
        return torch.cat(parts)

    gate, up = grouped(fc1, x, s1).chunk(2, -1)
    expected = grouped(fc2, torch.nn.functional.silu(gate) * up * p[:, None], s2)
    torch.testing.assert_close(y, expected)


def test_returns_output_alone_or_a_tuple_with_extra_outputs() -> None:
    seq = te_seq.Sequential(ops.GELU())
    assert isinstance(seq(_x()), torch.Tensor)
    skip_if_missing("MakeExtraOutput")
    lin = ops.BasicLinear(H, H, dtype=torch.float64)
    seq = te_seq.Sequential(ops.MakeExtraOutput(), lin, ops.ConstantScale(2.0)
                            if hasattr(ops, "ConstantScale") else ops.GELU(), ops.MakeExtraOutput())
    x = _x(True)
    out = seq(x)
    assert isinstance(out, tuple) and len(out) == 3
    y, first, second = out
    torch.testing.assert_close(first, x)  # extra outputs in basic-op order
    torch.testing.assert_close(second, y)
    (y.sum() + 3 * first.sum() + 5 * second.sum()).backward()
    assert x.grad is not None


# --- the plan object ------------------------------------------------------------------------------

def test_fusion_plan_is_none_before_any_forward() -> None:
    assert te_seq.Sequential(*_mlp_ops()).fusion_plan() is None


def test_plan_backward_is_empty_without_autograd() -> None:
    seq = te_seq.Sequential(*_mlp_ops())
    with torch.no_grad():
        seq(_x(True), _splits(), _probs(), _splits())
    plan = seq.fusion_plan()
    assert _names(plan.forward) == [("GroupedMLP", (0, 1, 2))] and plan.backward == []
    for p in seq.parameters():
        p.requires_grad_(False)
    seq(_x(False), _splits(), _probs(), _splits())  # grad mode on, but nothing needs a grad
    assert seq.fusion_plan().backward == []
    seq(_x(True), _splits(), _probs(), _splits())
    assert _names(seq.fusion_plan().backward) == [("GroupedMLP", (0, 1, 2))]


# --- saved tensors go through autograd's saved-tensor hooks ---------------------------------------

@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_saved_tensors_pass_through_saved_tensor_hooks(fused: bool) -> None:
    seq = te_seq.Sequential(*_mlp_ops())
    randomize_params(seq)
    x, s, p = _x(True), _splits(), _probs()
    counts = {"pack": 0, "unpack": 0}

    def pack(t: torch.Tensor):
        counts["pack"] += 1
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        counts["unpack"] += 1
        return t

    def run():
        if fused:
            return seq(x, s, p, s)
        with te_seq.fusions_disabled():
            return seq(x, s, p, s)

    expected = torch.autograd.grad(run().sum(), [x, *seq.parameters()])
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = run()
    assert counts["pack"] >= 3, counts  # x, weights, offsets (at least) were saved through hooks
    got = torch.autograd.grad(y.sum(), [x, *seq.parameters()])
    assert counts["unpack"] >= 3, counts
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.autograd.graph.save_on_cpu():
        y = run()
    for a, b in zip(torch.autograd.grad(y.sum(), [x, *seq.parameters()]), expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
