"""Per-group weights whose main_grad buffers lie back to back in one fp32 bucket (as Megatron's
grad buffers do): the wgrad is written into the bucket as one [G, N, K] block, and the result
equals per-group float64 autograd, for accumulate and overwrite, including an empty group."""

import pytest
import torch

from te_seq import ops


def _bucket_main_grads(linear: ops.GroupedLinear) -> torch.Tensor:
    weights = [w for _, w in linear.named_weights()]
    bucket = torch.zeros(sum(w.numel() for w in weights) + 5, dtype=torch.float32)
    offset = 5  # not at the bucket's start: a view with a storage offset
    for w in weights:
        w.main_grad = bucket[offset : offset + w.numel()].view_as(w)
        offset += w.numel()
    return bucket


def _expected_wgrads(linear, x, splits, dy) -> list[torch.Tensor]:
    out, start = [], 0
    for size in splits.tolist():
        out.append(dy[start : start + size].double().t() @ x[start : start + size].double())
        start += size
    return out


@pytest.mark.parametrize("overwrite", [False, True])
def test_bucketed_main_grad_gets_every_group(overwrite):
    linear = ops.GroupedLinear(
        4, 6, 5, bias=False, accumulate_into_main_grad=True, dtype=torch.float32
    )
    _bucket_main_grads(linear)
    for _, w in linear.named_weights():
        w.overwrite_main_grad = overwrite
    splits = torch.tensor([3, 0, 7, 2])
    expected = [torch.zeros(5, 6, dtype=torch.float64) for _ in range(4)]
    for _ in range(2):  # two microbatches
        x = torch.randn(12, 6)
        dy = torch.randn(12, 5)
        linear(x, splits).backward(dy)
        step = _expected_wgrads(linear, x, splits, dy)
        expected = step if overwrite else [e + s for e, s in zip(expected, step)]
    for (name, w), exp in zip(linear.named_weights(), expected):
        assert w.grad is None, name
        torch.testing.assert_close(w.main_grad.double(), exp, rtol=1e-5, atol=1e-5)


def test_bucket_block_detection():
    from te_seq.ops.basic._grouped_params import block_of

    bucket = torch.zeros(40)
    back_to_back = [bucket[2 + 6 * i : 8 + 6 * i].view(2, 3) for i in range(3)]
    assert block_of(back_to_back).data_ptr() == back_to_back[0].data_ptr()
    gapped = [bucket[2 + 7 * i : 8 + 7 * i].view(2, 3) for i in range(3)]
    assert block_of(gapped) is None
    assert block_of([torch.zeros(2, 3), torch.zeros(2, 3)]) is None
