"""LinearBiasAdd: BasicLinear → Bias → AddExtraInput, forward as one op (addmm into the residual).

Registered as the forward fusion "linear_bias_add". Shape legend: T tokens (rows),
K in_features, N out_features.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from te_seq.core import amp
from te_seq.core.operation import BasicOperation, FusedOperation
from te_seq.fusion.registry import NoMatch, register_fusion
from te_seq.kernels import as_rows
from te_seq.ops.basic.add_extra_input import AddExtraInput
from te_seq.ops.basic.basic_linear import BasicLinear
from te_seq.ops.basic.bias import Bias
from te_seq.ops.fused._linear_common import check_linear_bias, shape_proxy


class LinearBiasAdd(FusedOperation):
    """y = r + x Wᵀ + b: x [..., K], W [N, K], b [N], the residual r (AddExtraInput's `extra`)
    [..., N] -> y [..., N].

    Equivalent to the unfused chain `torch.nn.functional.linear(x, W, b) + r`. When r has y's
    shape and dtype the GEMM accumulates straight onto it (`torch.addmm(r, X, Wᵀ)`), and with
    AddExtraInput(in_place=True) into r's own memory (under the same rule as the basic op); a
    broadcast r falls back to the unfused maths. Forward only: each basic op's context is filled
    as its own forward would.
    """

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        super().__init__(basic_ops)
        self.linear, self.bias, self.add = basic_ops

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        linear_ctx, _, add_ctx = basic_op_ctxs
        (extra,) = basic_op_extra_inputs[2]
        n = self.linear.out_features
        x, w = self.linear.operands(linear_ctx, as_rows(input_, self.linear.in_features))
        out_shape = (*input_.shape[:-1], n)
        proxy = shape_proxy(out_shape, x)  # stands for x Wᵀ + b, which is never materialised
        self.add.pre_forward_checks(proxy, (extra,))
        self.linear.save(linear_ctx, x, input_.shape, w, input_.dtype)
        AddExtraInput.save(add_ctx, proxy, extra)
        return self._residual_gemm(add_ctx, x, w, extra, proxy), [(), (), ()]

    def _residual_gemm(
        self, add_ctx, x: Tensor, w: Tensor, extra: Tensor, proxy: Tensor
    ) -> Tensor:
        """r + X Wᵀ + b  [..., N] (x [T, K], W [N, K] in the compute dtype), in r's memory when
        allowed."""
        w_t, b, n = w.t(), amp.cast(self.bias.bias, x.dtype), self.linear.out_features
        # addmm_ needs r in X's dtype (a wider r, e.g. fp64 beside fp32, promotes as the unfused
        # in-place add does, but out of place here) and must not read what it writes.
        if self.add.writes_in_place(add_ctx, proxy, extra) and extra.is_contiguous() \
                and extra.dtype == x.dtype and not _same_storage(extra, x):
            extra.view(-1, n).addmm_(x, w_t).add_(b)  # R += X Wᵀ; R += b   [T, N]
            return extra
        if extra.shape == proxy.shape and extra.dtype == proxy.dtype:
            y = torch.addmm(extra.reshape(-1, n), x, w_t).add_(b)  # Y = R + X Wᵀ + b   [T, N]
            return y.reshape(proxy.shape)
        return self.add.add(add_ctx, torch.addmm(b, x, w_t).reshape(proxy.shape), extra)


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@register_fusion(name="linear_bias_add", phase="forward",
                 pattern=(BasicLinear, Bias, AddExtraInput), builtin=True)
def _build_linear_bias_add(window) -> LinearBiasAdd | NoMatch:
    linear, bias, _ = window
    return check_linear_bias(linear, bias) or LinearBiasAdd(window)
