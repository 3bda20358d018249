"""The grouped FP8 kernels' row-wise scales without view ops (te_seq/kernels/fp8_cute.py
`row_scales`, core/fp8.py's weight cache): where x's and W's scales are `t[..., None]` views of
contiguous tensors, those tensors are the operands (no aten op dispatched), the same values and
layout as `fp8_torch.rowwise_scales`; anything else takes `rowwise_scales` itself."""

from __future__ import annotations

import torch
from aten_log import AtenLog

from te_seq import recipe
from te_seq.core import fp8
from te_seq.kernels import fp8_cute, fp8_torch
from te_seq.kernels import fp8_reference as ref

G, N, K, M = 3, 32, 64, 10
E4M3 = ref.ScaleRule("E4M3")


def _weights(r) -> fp8.WeightOperands:
    torch.manual_seed(0)
    op = torch.nn.Module()
    return fp8.cached_weights(op, r, torch.randn(G, N, K, dtype=torch.bfloat16), [])


def _rows_quantized() -> ref.QuantizedTensor:
    """x [M, K] row-wise as the cute quantizers return it: scale_inv a [M, 1] view of [M]."""
    q = ref.quantize(torch.randn(M, K), ref.ROWWISE, E4M3)
    return ref.QuantizedTensor(q.data, q.scale_inv.reshape(M).clone()[:, None], q.block, q.rule)


def _same(got: tuple, want: tuple) -> bool:
    return all(torch.equal(a, b) and a.shape == b.shape and a.stride() == b.stride()
               and a.is_contiguous() for a, b in zip(got, want))


def test_weight_cache_keeps_row_scales_as_views_of_contiguous_tensors():
    weights = _weights(recipe.Float8RowwiseScaling())
    for data, scale_inv in (weights.fp8, weights.dgrad_fp8):
        base = scale_inv._base
        assert scale_inv.shape == (*data.shape[:2], 1) and base is not None
        assert base.is_contiguous() and base.shape == data.shape[:2]
        assert torch.equal(scale_inv[..., 0], base)
    stacked = weights._stacked_fp8[0].scale_inv  # the quantized values, unchanged
    assert torch.equal(weights.fp8[1], stacked)


def test_row_scales_dispatch_no_op_and_equal_rowwise_scales():
    weights, x = _weights(recipe.Float8RowwiseScaling()), _rows_quantized()
    w_scale_inv = weights.fp8[1]
    want = fp8_torch.rowwise_scales(x, w_scale_inv, N)
    with AtenLog() as ops:
        got = fp8_cute.row_scales(x, w_scale_inv, N)
    assert ops.names == [] and _same(got, want)
    assert got[0] is x.scale_inv._base and got[1] is w_scale_inv._base


def test_row_scales_fall_back_to_rowwise_scales():
    """Per-tensor scales ([1, 1], [G, 1, 1]), and [M, 1] scales that view no [M] tensor, take
    `rowwise_scales` (a view or a repeated copy): same result."""
    per_tensor = _weights(recipe.Float8CurrentScaling()).fp8[1]
    rows = ref.quantize(torch.randn(M, K), ref.ROWWISE, E4M3)  # scale_inv [M, 1], no view
    x_tensor = ref.quantize(torch.randn(M, K), ref.QuantBlock(None, None), E4M3)
    row_w = _weights(recipe.Float8RowwiseScaling()).fp8[1]
    for x, w in ((rows, row_w), (x_tensor, row_w), (_rows_quantized(), per_tensor)):
        with AtenLog() as ops:
            got = fp8_cute.row_scales(x, w, N)
        assert ops.names, "expected rowwise_scales' ops"
        assert _same(got, fp8_torch.rowwise_scales(x, w, N))
