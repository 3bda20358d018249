"""ActivationRecompute: a row-scaled activation → GroupedLinear pair that recomputes the
activation in backward instead of keeping it (`activation_recompute_in_mlp=True`).

Registered as the joint fusion "activation_recompute". Shape legend: T rows, G groups, F the
GroupedLinear's in_features (the activation's output width; its input is 2F wide when gated),
N its out_features. Unfused, the GroupedLinear saves its input a = act(h)·s [T, F] for its
weight gradient; fused, only the activation's input h and the scales are kept, and a is
recomputed from them in backward (one [T, F] tensor less, one elementwise pass more). The fused
grouped MLP (GroupedLinear → activation → GroupedLinear) always works this way; this fusion
covers an activation whose GroupedLinear is not part of one.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from te_seq.core import amp
from te_seq.core.operation import BasicOperation, FusedOperation
from te_seq.fusion.registry import NoMatch, register_fusion
from te_seq.kernels.backend import Backend, KernelNeed
from te_seq.ops.basic.grouped_linear import GroupedLinear
from te_seq.ops.basic.scaled_clamped_qgeglu import ScaledClampedQGeGLU
from te_seq.ops.basic.scaled_situglu import ScaledSiTUGLU
from te_seq.ops.basic.scaled_srelu import ScaledSReLU
from te_seq.ops.basic.scaled_swiglu import ScaledSwiGLU
from te_seq.ops.fused._linear_common import check_activation

ROW_SCALED = (ScaledSwiGLU, ScaledSReLU, ScaledClampedQGeGLU, ScaledSiTUGLU)


class ActivationRecompute(FusedOperation):
    """y = GroupedLinear(act(h) · s), equal to the unfused pair; a = act(h)·s is not saved."""

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        super().__init__(basic_ops)
        self.activation, self.fc = basic_ops

    def kernel_needs(self) -> list[KernelNeed]:
        k, n = self.fc.in_features, self.fc.out_features
        gemms = [KernelNeed("grouped_mm", {"k": kk, "n": nn}) for kk, nn in ((k, n), (n, k))]
        wgrad = KernelNeed("grouped_wgrad", {"k": k, "n": n})
        return [*self.activation.kernel_needs(), *gemms, wgrad]

    def _act(self, backend: Backend, h: Tensor, rows: Tensor) -> Tensor:
        op = self.activation
        if op.gated:
            return backend.glu_forward(h, op.glu_spec, rows)
        return op.scaled_forward(backend, h, rows)

    def _act_grad(self, backend: Backend, h: Tensor, da: Tensor, rows: Tensor):
        op = self.activation
        if op.gated:
            return backend.glu_backward(h, da, op.glu_spec, rows)
        return op.scaled_backward(backend, h, da, rows)

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        ctx_act, ctx_fc = basic_op_ctxs
        (scales,), fc_extra = basic_op_extra_inputs
        a = self._act(ctx_act.backend, input_, scales.reshape(input_.shape[:-1]))  # [..., F]
        self.fc.pre_forward_checks(a, fc_extra)
        x, w = self.fc.operands(ctx_fc, a.reshape(-1, self.fc.in_features))  # [T, F], [G, N, F]
        offs = self.fc.offsets(fc_extra[0], a, ctx_fc.backend)
        fc_scales = fc_extra[1] if len(fc_extra) > 1 else None
        y = ctx_fc.backend.grouped_mm(x, w.transpose(1, 2), offs)  # [T, N]
        bias = self.fc.bias_rows(offs, x.shape[0], fc_scales, x.dtype)
        y = y if bias is None else y + bias
        if ctx_act.requires_grad or ctx_fc.requires_grad:
            ctx_act.save_for_backward(input_, scales, w, offs, fc_scales)  # not a
            ctx_fc.saved = self.fc.saved_record(a.new_empty(()).expand(a.shape), x.dtype)
        return y.reshape(*a.shape[:-1], self.fc.out_features), [(), ()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx_act, ctx_fc = basic_op_ctxs
        h, scales, w, offs, fc_scales = ctx_act.saved_tensors
        rows = scales.reshape(h.shape[:-1])
        dy = self.fc.grad_rows(ctx_fc, grad_output)  # [T, N]
        a = self._act(ctx_act.backend, h, rows).reshape(-1, self.fc.in_features)  # recomputed
        a = amp.cast(a, w.dtype) if ctx_fc.autocast is not None else a
        bias_grads, dfc_scales = self.fc.bias_grads(dy, offs, fc_scales)
        fc_grads = self.fc.weight_grads(ctx_fc, a, dy, offs) + bias_grads
        da = self.fc.input_grad(ctx_fc, ctx_fc.backend.grouped_mm(dy, w, offs))  # dA = dY W
        dh, dscales = self._act_grad(ctx_act.backend, h, da, rows)
        fc_extra = (None, dfc_scales) if self.fc.num_extra_inputs == 2 else (None,)
        return dh, [[], fc_grads], [(dscales.reshape(scales.shape),), fc_extra]


@register_fusion(
    name="activation_recompute",
    phase="joint",
    pattern=(ROW_SCALED, GroupedLinear),
    builtin=True,
)
def _build_activation_recompute(window) -> ActivationRecompute | NoMatch:
    act, fc = window
    if not act.activation_recompute_in_mlp:
        return NoMatch(
            f"{type(act).__name__}: activation_recompute_in_mlp is False (the GroupedLinear "
            "keeps its input for its weight gradient)"
        )
    width = fc.in_features * (2 if act.gated else 1)
    return check_activation(act, width) or ActivationRecompute(window)
