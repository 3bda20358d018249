"""LayerNorm / RMSNorm over more than the last dimension (`normalized_shape` a tuple, as torch):
the same outputs and gradients as torch's modules, parameters of that shape, and a mismatched
trailing shape named in the error."""

from __future__ import annotations

import pytest
import torch

from te_seq import ops

D = torch.float64


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 4), [5]], ids=str)
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_matches_torch_module(kind: str, shape) -> None:
    ours = getattr(ops, kind)(shape, eps=1e-3, dtype=D)
    theirs = getattr(torch.nn, kind)(shape, eps=1e-3, dtype=D)
    with torch.no_grad():
        for p in (*ours.parameters(), *theirs.parameters()):
            p.copy_(torch.randn(p.shape, dtype=D, generator=torch.Generator().manual_seed(1)))
    count = len(list(theirs.parameters()))
    assert [p.shape for p in ours.parameters()] == [torch.Size(shape)] * count
    x = torch.randn(2, 3, *shape, dtype=D) * 3 + 1
    outs, grads = [], []
    for module in (ours, theirs):
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        y.backward(torch.sin(torch.arange(y.numel(), dtype=D)).reshape(y.shape))
        outs.append(y.detach())
        grads.append([xi.grad, *[p.grad for p in module.parameters()]])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_normalized_shape_keeps_its_form() -> None:
    assert ops.LayerNorm(8).normalized_shape == 8
    assert ops.LayerNorm([8]).normalized_shape == 8
    assert ops.RMSNorm([2, 4]).normalized_shape == (2, 4)
    assert "(2, 4), eps=1e-05" in repr(ops.RMSNorm((2, 4)))


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_mismatched_trailing_shape_names_op_and_sizes(kind: str) -> None:
    op = getattr(ops, kind)((2, 4), dtype=D)
    match = (rf"{kind}: input has trailing dimensions \(4, 2\) \(shape \(3, 4, 2\)\), "
             r"but normalized_shape=\(2, 4\)")
    with pytest.raises(ValueError, match=match):
        op(torch.randn(3, 4, 2, dtype=D))
    with pytest.raises(ValueError, match=rf"{kind}: input has trailing dimensions \(8,\)"):
        op(torch.randn(8, dtype=D))  # fewer dims than normalized_shape
