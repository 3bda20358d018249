"""Extra-tensor channels: one op's extra output feeds a later op's extra input in a Sequential.

Each rule of te_seq/run/channels.py has a test that fails if it breaks: binding to the nearest
earlier publisher, defaults only where published, explicit bindings without a publisher, which
extra outputs reach the caller, channels across a plain module (two autograd bridges), and the
grouped MLP's "same split sizes" decided by the binding.
"""

from __future__ import annotations

import pytest
import torch
from test_routing import DT, FFN, H, T, loop_reference, moe_block, routing_case

import te_seq
from te_seq import ops


def _residual_block(to_caller: bool = False, plain_between: bool = False) -> te_seq.Sequential:
    """y = W x + x with the residual carried by a channel (no caller argument)."""
    torch.manual_seed(0)
    keep = ops.MakeExtraOutput().set_extra_output_channel(
        0, "residual", output_to_caller=to_caller)
    modules = [keep, ops.BasicLinear(H, H, dtype=DT)]
    if plain_between:
        modules.append(torch.nn.Tanh())
    modules.append(ops.AddExtraInput().set_extra_input_channel("extra", "residual"))
    return te_seq.Sequential(*modules)


@pytest.mark.parametrize("plain_between", [False, True], ids=["one_run", "across_runs"])
def test_a_channel_replaces_the_caller_round_trip(plain_between: bool) -> None:
    block = _residual_block(plain_between=plain_between)
    x = torch.randn(5, H, dtype=DT, requires_grad=True)
    y = block(x)
    assert isinstance(y, torch.Tensor)  # the residual went through the channel only
    w = block[1].weight
    h = x @ w.T
    want = (torch.tanh(h) if plain_between else h) + x
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, w], dy)
    ref = torch.autograd.grad(want, [x, w], dy)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_output_to_caller_returns_the_published_tensor_too() -> None:
    block = _residual_block(to_caller=True)
    x = torch.randn(4, H, dtype=DT, requires_grad=True)
    y, residual = block(x)
    torch.testing.assert_close(residual, x)
    # The gradient of the returned copy adds to the channel's.
    (y.sum() + 3 * residual.sum()).backward()
    want = torch.ones(4, H, dtype=DT) @ block[1].weight + 1 + 3
    torch.testing.assert_close(x.grad, want, rtol=1e-12, atol=1e-12)


def test_an_explicit_subscription_needs_an_earlier_publisher() -> None:
    add = ops.AddExtraInput().set_extra_input_channel(0, "nowhere")
    block = te_seq.Sequential(ops.Identity(), add)
    with pytest.raises(ValueError, match=r"AddExtraInput \(basic op 1\): extra input 0 is bound "
                                         r"to channel 'nowhere', but no earlier op"):
        block(torch.randn(2, H))


def test_a_publisher_after_the_subscriber_does_not_feed_it() -> None:
    add = ops.AddExtraInput().set_extra_input_channel(0, "late")
    keep = ops.MakeExtraOutput().set_extra_output_channel(0, "late")
    with pytest.raises(ValueError, match="no earlier op in the Sequential publishes it"):
        te_seq.Sequential(add, keep)(torch.randn(2, H), torch.randn(2, H))


def test_an_explicit_publication_nobody_reads_is_dropped() -> None:
    keep = ops.MakeExtraOutput().set_extra_output_channel(0, "unread")
    out = te_seq.Sequential(keep)(torch.randn(2, H))
    assert isinstance(out, torch.Tensor)


def test_defaults_nobody_reads_reach_the_caller() -> None:
    """Dispatch publishes probs by default; with an unscaled SwiGLU nobody takes them, so the
    caller gets them (rule 3), while split_sizes and routing stay inside."""
    block = moe_block(scaled=False)
    indices, probs = routing_case("topk")
    out = block(torch.randn(T, H, dtype=DT), indices, probs)
    assert isinstance(out, tuple) and len(out) == 2
    y, row_probs = out
    assert y.shape == (T, H) and row_probs.shape == (T * 2,)


def test_two_blocks_in_one_sequential_each_read_their_own_dispatch() -> None:
    torch.manual_seed(1)
    first, second = moe_block(), moe_block()
    both = te_seq.Sequential(first, second)  # nested: flattened, the later dispatch shadows
    x = torch.randn(T, H, dtype=DT)
    i1, p1 = routing_case("topk")
    i2, p2 = routing_case("empty_experts", k=1)
    y = both(x, i1, p1, i2, p2)
    want = loop_reference(second, loop_reference(first, x, i1, p1), i2, p2)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    names = [s.name for s in both.fusion_plan().forward]
    assert names.count("MoeBlock") == 2, names  # each block fused with its own dispatch


def test_unbinding_a_default_makes_the_slot_positional_and_the_plan_says_why() -> None:
    block = moe_block()
    block[3].set_extra_input_channel("split_sizes", None)
    indices, probs = routing_case("topk")
    x = torch.randn(T, H, dtype=DT)
    splits = torch.bincount(indices.reshape(-1), minlength=4)
    y = block(x, indices, probs, splits)  # FC2's split sizes now come from the caller
    torch.testing.assert_close(y, loop_reference(block, x, indices, probs), rtol=1e-12, atol=1e-12)
    plan = block.fusion_plan()
    assert not {"GroupedMLP", "MoeBlock"} & {s.name for s in plan.forward}
    miss = next(m for m in plan.misses if m.fusion == "grouped_mlp")
    assert "different split_sizes" in miss.reason
    miss = next(m for m in plan.misses if m.fusion == "moe_block")
    assert "(FC2) split_sizes is not bound" in miss.reason
    # Binding it again re-resolves the structure: fused, and the caller passes two inputs.
    block[3].set_extra_input_channel("split_sizes", "split_sizes")
    block(x, indices, probs)
    assert "MoeBlock" in [s.name for s in block.fusion_plan().forward]


def test_positional_extra_inputs_are_unchanged_without_publishers() -> None:
    mlp = te_seq.Sequential(
        ops.GroupedLinear(2, H, 2 * FFN, bias=False, dtype=DT), ops.ScaledSwiGLU(),
        ops.GroupedLinear(2, FFN, H, bias=False, dtype=DT),
    )
    splits = torch.tensor([3, 2])
    y = mlp(torch.randn(5, H, dtype=DT), splits, torch.rand(5, dtype=DT), splits)
    assert y.shape == (5, H)
    with pytest.raises(ValueError, match=r"ScaledSwiGLU \(basic op 1\) expects 1 extra input"):
        mlp(torch.randn(5, H, dtype=DT), splits)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: ops.AddExtraInput().set_extra_input_channel("nope", "c"), ValueError,
         r"AddExtraInput: no extra input named 'nope' \(it has \('extra',\)\)"),
        (lambda: ops.AddExtraInput().set_extra_input_channel(1, "c"), ValueError,
         r"extra input slot must be in \[0, 1\), got 1"),
        (lambda: ops.MakeExtraOutput().set_extra_output_channel(0, ""), TypeError,
         "channel must be a non-empty str or None"),
        (lambda: ops.MakeExtraOutput().set_extra_output_channel(0, "c", output_to_caller=1),
         TypeError, "output_to_caller must be a bool"),
    ],
)
def test_binding_argument_errors(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call()
