"""GroupedMLP: GroupedLinear → activation → GroupedLinear as one op (the MoE expert MLP).

Registered as the joint fusion "grouped_mlp". Shape legend: T tokens (rows, permuted by
expert), G experts, H hidden, F ffn width; FC1 maps H -> 2F for gated activations (F otherwise).
Saved for backward: x, the pre-activation h, the weights and the offsets; the activation is
recomputed from h in backward (so the fused op keeps one [T, F] tensor less than the unfused
chain, whose FC2 saves its input).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq import config, kernels
from te_seq.core.context import OperationContext
from te_seq.core.operation import BasicOperation, FusedOperation
from te_seq.fusion.matcher import same_extra_input
from te_seq.fusion.registry import NoMatch, register_fusion
from te_seq.ops.basic import (
    GEGLU,
    GELU,
    ReGLU,
    ReLU,
    ScaledSwiGLU,
    SiLU,
    SwiGLU,
)
from te_seq.ops.basic.grouped_linear import GroupedLinear, GroupedLinearSaved

ACTIVATION_OPS = (SwiGLU, ScaledSwiGLU, GEGLU, ReGLU, GELU, ReLU, SiLU)


@dataclass
class _Extras:
    """The call's extra inputs, by role."""

    splits: Tensor
    fc1_scales: Tensor | None
    probs: Tensor | None
    fc2_scales: Tensor | None


class GroupedMLP(FusedOperation):
    """y = FC2(act(FC1(x))) per expert, equal to the unfused chain of its three basic ops."""

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        super().__init__(basic_ops)
        self.fc1, self.activation, self.fc2 = basic_ops

    def plan_backend(self, requested: str, device: torch.device) -> str:
        return config.grouped_backend(requested, device)

    def plan_note(self, backend: str, dtype: torch.dtype, device: torch.device) -> str:
        """Whether the activation runs inside the GEMMs' epilogues (cute) or after them."""
        op = self.activation
        if backend != "cute":
            return ""
        if not op.gated or self.fc1.has_bias:
            what = "an FC1 bias" if self.fc1.has_bias else f"non-gated {type(op).__name__}"
            return f"activation after the GEMMs ({what} has no fused epilogue)"
        x_like = torch.empty(0, self.fc1.in_features, dtype=dtype, device=device)
        w1t = self.fc1.stacked_weight().transpose(1, 2)
        ok, why = kernels.glu_epilogue_status(
            x_like, w1t, self.fc2.stacked_weight(), op.act, op.glu_interleave_size, backend
        )
        return (
            "activation fused into the FC1 and FC2-dgrad epilogues"
            if ok
            else f"activation after the GEMMs ({why})"
        )

    # --- activation ---------------------------------------------------------------------------
    def _fc1_act(self, x: Tensor, w1: Tensor, offs: Tensor, extras: _Extras, probs, backend: str):
        """(h, a): FC1's pre-activation [T, 2F] and the activation [T, F] (· probs).

        Gated activations without an FC1 bias run as one kernel on the cute backend (the
        activation in the GEMM's epilogue); the rest run the GEMM, then the activation.
        """
        op = self.activation
        if op.gated and not self.fc1.has_bias:
            w1t = w1.transpose(1, 2)  # [G, H, 2F]
            return kernels.glu_fc1_forward(
                x, w1t, offs, op.act, op.glu_interleave_size, probs, backend
            )
        h = _linear(self.fc1, x, w1, offs, extras.fc1_scales, backend)
        if op.gated:
            glu = kernels.elementwise("glu_forward", backend, h.device)
            return h, glu(h, op.act, op.glu_interleave_size, probs)
        return h, kernels.elementwise("act_forward", backend, h.device)(h, op.act)

    def _fc2_dgrad_act(self, dy: Tensor, w2: Tensor, offs: Tensor, h: Tensor, probs, backend: str):
        """(dh, a, dprobs): dA = dY_e W2_e through the activation's gradient, and the activation
        re-emitted for FC2's wgrad (one kernel on the cute backend for gated activations)."""
        op = self.activation
        if op.gated:
            return kernels.glu_fc2_dgrad(
                dy, w2, offs, h, op.act, op.glu_interleave_size, probs, backend
            )
        da = kernels.grouped_mm(dy, w2, offs, backend)  # [T, F]
        act_bwd = kernels.elementwise("act_backward", backend, h.device)
        act_fwd = kernels.elementwise("act_forward", backend, h.device)
        return act_bwd(h, da, op.act), act_fwd(h, op.act), None

    # --- forward ------------------------------------------------------------------------------
    def _unpack(self, extra_inputs) -> _Extras:
        fc1_extra, act_extra, fc2_extra = extra_inputs
        return _Extras(
            splits=fc1_extra[0],
            fc1_scales=fc1_extra[1] if len(fc1_extra) > 1 else None,
            probs=act_extra[0] if act_extra else None,
            fc2_scales=fc2_extra[1] if len(fc2_extra) > 1 else None,
        )

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        ctx = basic_op_ctxs[0]
        extras = self._unpack(basic_op_extra_inputs)
        x = input_.reshape(-1, self.fc1.in_features)  # [T, H]
        offs = self.fc1.offsets(extras.splits, input_)
        probs = None if extras.probs is None else extras.probs.reshape(-1)  # [T]
        w1, w2 = self.fc1.stacked_weight(), self.fc2.stacked_weight()  # [G, 2F, H], [G, H, F]
        h_like = x.new_empty(()).expand(x.shape[0], self.fc1.out_features)  # shape only, no memory
        self.activation.pre_forward_checks(h_like, basic_op_extra_inputs[1])
        h, a = self._fc1_act(x, w1, offs, extras, probs, ctx.backend)  # [T, 2F], [T, F]
        self.fc2.pre_forward_checks(a, basic_op_extra_inputs[2])
        y = _linear(self.fc2, a, w2, offs, extras.fc2_scales, ctx.backend)  # [T, H]
        if ctx.requires_grad:
            ctx.save_for_backward(
                x, h, w1, w2, offs, extras.probs, extras.fc1_scales, extras.fc2_scales
            )
            ctx.saved = self.fc1.saved_record(input_.shape)
            fc2_input_shape = torch.Size((*input_.shape[:-1], self.fc2.in_features))
            basic_op_ctxs[2].saved = self.fc2.saved_record(fc2_input_shape)
        return y.reshape(*input_.shape[:-1], self.fc2.out_features), [(), (), ()]

    # --- backward -----------------------------------------------------------------------------
    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx1, ctx_act, ctx2 = basic_op_ctxs
        x, h, w1, w2, offs, probs_in, s1, s2 = ctx1.saved_tensors
        probs = None if probs_in is None else probs_in.reshape(-1)
        dy = grad_output.reshape(-1, self.fc2.out_features)  # [T, H]
        dh, a, dprobs = self._fc2_dgrad_act(dy, w2, offs, h, probs, ctx1.backend)  # [T, 2F], [T, F]
        fc2_grads, ds2 = self._param_grads(self.fc2, ctx2, a, dy, offs, s2)
        fc1_grads, ds1 = self._param_grads(self.fc1, ctx1, x, dh, offs, s1)
        dx = None
        if ctx1.input_requires_grad:
            dx = kernels.grouped_mm(dh, w1, offs, ctx1.backend)  # dX = dH W1   [T, H]
            dx = dx.reshape(ctx1.saved_as(GroupedLinearSaved).input_shape)
        act_extra = () if probs_in is None else (dprobs.reshape(probs_in.shape),)
        extra = [_extra_grads(self.fc1, ds1), act_extra, _extra_grads(self.fc2, ds2)]
        return dx, [fc1_grads, [], fc2_grads], extra

    def _param_grads(
        self,
        fc: GroupedLinear,
        ctx: OperationContext,
        inp: Tensor,
        dout: Tensor,
        offs: Tensor,
        scales: Tensor | None,
    ):
        """Weight grads through the gradient contract (dW_e = dOut_eᵀ In_e), bias grads at once."""
        bias_grads, dscales = fc.bias_grads(dout, offs, scales)
        weight_grads = fc.weight_grads(ctx, inp, dout, offs)
        return weight_grads + bias_grads, dscales


def _linear(fc: GroupedLinear, x: Tensor, w: Tensor, offs: Tensor, scales, backend: str) -> Tensor:
    """x_e W_eᵀ (+ b_e, · s_t with scale_bias) over the experts' row blocks."""
    y = kernels.grouped_mm(x, w.transpose(1, 2), offs, backend)
    bias = fc.bias_rows(offs, x.shape[0], scales)
    return y if bias is None else y + bias


def _extra_grads(fc: GroupedLinear, dscales: Tensor | None) -> tuple:
    return (None, dscales) if fc.num_extra_inputs == 2 else (None,)


@register_fusion(
    name="grouped_mlp",
    phase="joint",
    pattern=(GroupedLinear, ACTIVATION_OPS, GroupedLinear),
    builtin=True,
)
def _build_grouped_mlp(window) -> GroupedMLP | NoMatch:
    fc1, act, fc2 = window
    if fc1.num_groups != fc2.num_groups:
        return NoMatch(f"num_groups differ: {fc1.num_groups} vs {fc2.num_groups}")
    width = fc2.in_features * (2 if act.gated else 1)
    if fc1.out_features != width:
        return NoMatch(
            f"dimensions don't chain: FC1 out_features={fc1.out_features}, {type(act).__name__} "
            f"needs {width} for FC2 in_features={fc2.in_features}"
        )
    splits1, splits2 = window.extra_inputs[0][0], window.extra_inputs[2][0]
    if not same_extra_input(splits1, splits2):
        return NoMatch(
            "the two GroupedLinear ops got different split_sizes (pass the same tensor object; "
            "two device tensors are never compared, since that would sync)"
        )
    return GroupedMLP(window)
