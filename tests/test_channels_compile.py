"""Channel-joined blocks under torch.compile: traced in one graph (channel values are made inside
the autograd bridge, never passed through it), with eager's values and gradients."""

from __future__ import annotations

import pytest
import torch
from compile_helpers import fresh_dynamo  # noqa: F401 (autouse: compiled code is per code object)
from test_channels import _residual_block
from test_routing import DT, H, T, moe_block, routing_case


@pytest.mark.parametrize("which", ["moe", "residual"])
def test_compiled_block_matches_eager(which: str) -> None:
    """fullgraph=True: the whole block is one graph; outputs and gradients equal eager's."""
    torch.manual_seed(2)
    if which == "moe":
        block = moe_block()
        indices, probs = routing_case("topk")
        extras = (indices, probs)
    else:
        block, extras = _residual_block(), ()
    x = torch.randn(T, H, dtype=DT, requires_grad=True)
    eager = block(x, *extras)
    compiled = torch.compile(block, fullgraph=True, backend="eager")(x, *extras)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    got = torch.autograd.grad(compiled.sum(), [x, *block.parameters()])
    want = torch.autograd.grad(eager.sum(), [x, *block.parameters()])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_compiled_residual_through_aot_autograd() -> None:
    """The channel value's requires-grad marking (an opaque call in the graph: torch 2.11's
    dynamo cannot trace `requires_grad_()`) also survives AOTAutograd's tracing of the graph,
    the path inductor takes: eager's outputs and gradients."""
    torch.manual_seed(3)
    block = _residual_block()
    x = torch.randn(T, H, dtype=DT, requires_grad=True)
    eager = block(x)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    got = torch.autograd.grad(compiled.sum(), [x, *block.parameters()])
    want = torch.autograd.grad(eager.sum(), [x, *block.parameters()])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
