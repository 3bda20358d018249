"""GroupedMLP: GroupedLinear → activation → GroupedLinear as one op (the MoE expert MLP).

Registered as the joint fusion "grouped_mlp". Shape legend: T tokens (rows, permuted by
expert), G experts, H hidden, F ffn width; FC1 maps H -> 2F for gated activations (F otherwise).
Saved for backward: x, the pre-activation h, the weights and the offsets; the activation is
recomputed from h in backward (so the fused op keeps one [T, F] tensor less than the unfused
chain, whose FC2 saves its input).

Biases go to the GEMM kernels (``grouped_mm(..., bias=)``, ``glu_fc1_forward(..., bias=)``),
which add them to the accumulator (the cute kernels in their epilogues); no [T, N] bias rows
are built (except for scale_bias on backends without a bias epilogue). Bias gradients are
``backend.group_col_sums`` of dY (FC2) and dH (FC1): one more read of each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq.core import amp, fp8
from te_seq.core.context import OperationContext
from te_seq.core.operation import BasicOperation, FusedOperation
from te_seq.fusion.matcher import same_extra_input
from te_seq.fusion.registry import NoMatch, register_fusion
from te_seq.kernels import as_rows, routed
from te_seq.kernels.backend import Backend, KernelNeed
from te_seq.kernels.bias import bias_scale_grads
from te_seq.kernels.routed import Route
from te_seq.ops.basic.activation import Activation
from te_seq.ops.basic.grouped_linear import GroupedLinear, per_expert_weights_hint
from te_seq.ops.fused import _grouped_mlp_fp8
from te_seq.ops.fused._linear_common import check_activation


@dataclass
class _Extras:
    """The call's extra inputs, by role."""

    splits: Tensor
    fc1_scales: Tensor | None
    probs: Tensor | None
    fc2_scales: Tensor | None


class GroupedMLP(FusedOperation):
    """y = FC2(act(FC1(x))) per expert, equal to the unfused chain of its three basic ops.
    Under an FP8 recipe its GEMMs take the unfused chain's quantized operands
    (_grouped_mlp_fp8.py)."""

    fp8_gemms = True

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        super().__init__(basic_ops)
        self.fc1, self.activation, self.fc2 = basic_ops
        self._epilogue_memo: dict = {}

    def kernel_needs(self) -> list[KernelNeed]:
        """Every GEMM of forward and backward (the activation maths runs on every backend)."""
        h, f1 = self.fc1.in_features, self.fc1.out_features  # FC1: H -> 2F (F)
        f, h2 = self.fc2.in_features, self.fc2.out_features  # FC2: F -> H
        gemms = [(h, f1), (f, h2), (h2, f), (f1, h)]  # (K, N): FC1, FC2, FC2 dgrad, FC1 dgrad
        needs = [KernelNeed("grouped_mm", {"k": k, "n": n}) for k, n in gemms]
        wgrads = [(f, h2), (h, f1)]  # (K, N) of dW2 [N=H, K=F] and dW1 [N=2F, K=H]
        return fp8.with_recipe(
            needs + [KernelNeed("grouped_wgrad", {"k": k, "n": n}) for k, n in wgrads]
        )

    def epilogue_status(
        self, backend: Backend, dtype: torch.dtype, device: torch.device
    ) -> tuple[bool, str]:
        """Whether the activation runs inside the GEMM epilogues on `backend`, and if not why.

        Decided when the plan is built (static facts only) and remembered, so each call reads
        the plan's decision instead of re-deciding."""
        # Keyed by name: under torch.compile the same backend comes wrapped (kernels.traced),
        # and the traced call must find the plan's decision without adding to the memo.
        key = (backend.name, dtype, device, self.activation.plan_facts())
        memo = self._epilogue_memo  # a plain dict attribute: dynamo reads it while tracing
        if key not in memo:
            memo[key] = self._epilogue_decision(backend, dtype, device)
        return memo[key]

    def _epilogue_decision(self, backend: Backend, dtype, device) -> tuple[bool, str]:
        op = self.activation
        # gated: the GLU kernels; non-gated (y = f(h)(·probs)): the act kernels
        fc1_kernel, dgrad_kernel = _EPILOGUE_KERNELS[op.gated]
        if not backend.implements(fc1_kernel):
            return False, f"the {backend.name} backend has no fused activation epilogue"
        if self.fc1.has_bias and not op.gated:
            return False, "an FC1 bias with a non-gated activation has no fused epilogue"
        if self.fc1.has_bias and self.fc1.scale_bias:
            return False, "an FC1 bias scaled per row (scale_bias) has no fused epilogue"
        facts = dict(hidden=self.fc1.in_features, ffn=self.fc2.in_features)
        key, spec = ("glu", op.glu_spec) if op.gated else ("act", op.act)
        facts[key] = spec
        checks = (
            ("FC1", fc1_kernel, {"bias": True} if self.fc1.has_bias else {}),
            ("FC2 dgrad", dgrad_kernel, {}),
        )
        for label, kernel, extra in checks:
            ok, why = backend.supports(kernel, dtype=dtype, device=device, **facts, **extra)
            if not ok:
                return False, f"{label}: {why}"
        return True, ""

    def plan_note(self, backend: Backend, dtype: torch.dtype, device: torch.device) -> str:
        """Whether the activation runs inside the GEMMs' epilogues or after them (and
        `per_expert_weights_hint`'s note on the linears' weights)."""
        hint = per_expert_weights_hint([self.fc1, self.fc2])
        return "; ".join(filter(None, [self._activation_note(backend, dtype, device), hint]))

    def _activation_note(self, backend: Backend, dtype: torch.dtype, device: torch.device) -> str:
        recipe = fp8.active_recipe()  # the plan is built inside the call
        if recipe is not None:
            return _grouped_mlp_fp8.plan_note(self, backend.name, recipe, dtype, device)
        fused, why = self.epilogue_status(backend, dtype, device)
        if fused:
            return "activation fused into the FC1 and FC2-dgrad epilogues"
        return f"activation after the GEMMs ({why})"

    # --- activation ---------------------------------------------------------------------------
    def _fc1_act(self, x: Tensor, w1: Tensor, offs: Tensor, extras: _Extras, probs, backend,
                 gather: Route | None = None, need_h: bool = True):
        """(h, a): FC1's pre-activation [T, 2F] and the activation [T, F] (· probs).

        One kernel where the plan fused the activation into FC1's epilogue; else the GEMM,
        then the activation. `gather`: FC1's rows are x[gather.rows] (te_seq.kernels.routed).
        `need_h` False (no backward will read h): h may be None, never written, where the
        backend's fused FC1 can skip it (`Backend.fc1_h_optional`)."""
        op = self.activation
        if self.epilogue_status(backend, x.dtype, x.device)[0]:
            w1t = w1.transpose(1, 2)
            if not op.gated:
                return routed.call(backend, "act_fc1_forward", x, w1t, offs, op.act, probs,
                                   gather=gather)
            bias = _bias(self.fc1, x.dtype)
            if bias is None and gather is None:  # the steady state's call: no routing layer
                return backend.glu_fc1_forward(x, w1t, offs, op.glu_spec, probs,
                                               **_h_option(backend, need_h))
            if bias is None:  # backends without bias support keep their plain signature
                return routed.call(backend, "glu_fc1_forward", x, w1t, offs, op.glu_spec, probs,
                                   gather=gather, **_h_option(backend, need_h))
            return routed.call(backend, "glu_fc1_forward", x, w1t, offs, op.glu_spec, probs,
                               bias=bias, gather=gather)
        h = _linear(self.fc1, x, w1, offs, extras.fc1_scales, backend, gather=gather)  # [T, 2F]
        if op.gated:
            return h, backend.glu_forward(h, op.glu_spec, probs)
        if probs is not None:  # a row-scaled elementwise activation (ScaledSReLU)
            return h, op.scaled_forward(backend, h, probs)
        return h, backend.act_forward(h, op.act)

    def _fc2_dgrad_act(self, dy: Tensor, w2: Tensor, offs: Tensor, h: Tensor, probs, backend):
        """(dh, a, dprobs): dA = dY_e W2_e through the activation's gradient, and the activation
        re-emitted for FC2's wgrad (one kernel where the plan fused the epilogue)."""
        op = self.activation
        if self.epilogue_status(backend, dy.dtype, dy.device)[0]:
            if not op.gated:
                return backend.act_fc2_dgrad(dy, w2, offs, h, op.act, probs)
            return backend.glu_fc2_dgrad(dy, w2, offs, h, op.glu_spec, probs)
        da = backend.grouped_mm(dy, w2, offs)  # [T, F]
        if op.gated:
            dh, dprobs = backend.glu_backward(h, da, op.glu_spec, probs)
            return dh, backend.glu_forward(h, op.glu_spec, probs), dprobs
        if probs is not None:  # a row-scaled elementwise activation (ScaledSReLU)
            dh, dprobs = op.scaled_backward(backend, h, da, probs)
            return dh, op.scaled_forward(backend, h, probs), dprobs
        return backend.act_backward(h, da, op.act), backend.act_forward(h, op.act), None

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
        x, w1 = self.fc1.operands(ctx, as_rows(input_, self.fc1.in_features))  # [T, H]
        inner_extra = basic_op_extra_inputs[1:]
        # Saved when any of the three ops' backward runs: with FC1 frozen and an input that needs
        # no gradient only the activation (router probs) or FC2 may need one. Else FC1 may skip
        # writing h (a forward-only call: no_grad, inference).
        with_backward = any(c.requires_grad for c in basic_op_ctxs)
        steady = ctx.steady.get(self) if ctx.signature_checked and ctx.steady else None
        if ctx.recipe is not None:
            y = self._fp8_forward(basic_op_ctxs, input_, x, w1, extras, basic_op_extra_inputs,
                                  with_backward, steady)
            return y.reshape(*input_.shape[:-1], self.fc2.out_features), [(), (), ()]
        if steady is not None:  # this signature's launches, prepared by its first call
            offs, check_offsets = steady.offsets(extras.splits)
            h, a = steady.fc1(x, w1, offs, _row_values(extras.probs))  # [T, 2F], [T, F]
            check_offsets()  # after FC1's launch: bad split sizes gave it only empty groups
        else:
            offs = self.fc1.offsets(extras.splits, input_, ctx.backend)
            # FC1 is launched before FC2's operands are made (a cast under torch.autocast):
            # only what its launch needs runs before it, the GPU starts sooner
            h, a = self.fc1_rows(ctx, x, w1, offs, extras, inner_extra, need_h=with_backward)
            if ctx.steady is not None and not ctx.signature_checked:
                self._prepare_steady(ctx, x, w1, extras, with_backward)
        w2 = self.fc2.operands(basic_op_ctxs[2], x)[1]  # w1 [G, 2F, H], w2 [G, H, F]
        y = self.fc2_rows(ctx, a, w2, offs, extras, inner_extra)
        if with_backward:
            ctx.save_for_backward(
                x, h, w1, w2, offs, extras.probs, extras.fc1_scales, extras.fc2_scales
            )
            ctx.saved = self.fc1.saved_record(input_, x.dtype)
            fc2_shape = torch.Size((*input_.shape[:-1], self.fc2.in_features))  # a's, unflattened
            basic_op_ctxs[2].saved = self.fc2.saved_record(a, x.dtype, shape=fc2_shape)
        return y.reshape(*input_.shape[:-1], self.fc2.out_features), [(), (), ()]

    def _fp8_forward(self, ctxs, input_: Tensor, x: Tensor, w1: Tensor, extras: _Extras,
                     extra_inputs, with_backward: bool, steady: _Steady | None) -> Tensor:
        """y [T, H] under ctxs[0].recipe (`_grouped_mlp_fp8.forward`). Its offsets and FP8
        GEMM launches are the ones the signature's first call prepared where the backend can
        (`_Steady` with `fp8` launches, without a bf16 FC1), the offsets' device-side check
        issued after the GEMMs' launches (bad split sizes gave them only empty groups)."""
        ctx = ctxs[0]
        if steady is not None:
            offs, check_offsets = steady.offsets(extras.splits)
            launches, offsets = steady.fp8, None
        else:
            offs, check_offsets = self.fc1.offsets(extras.splits, input_, ctx.backend), None
            offsets = _prepared_offsets(ctx, x, extras) \
                if ctx.steady is not None and not ctx.signature_checked else None
            launches = None if offsets is None else _grouped_mlp_fp8.Launches.for_call(ctx)
        w2 = self.fc2.operands(ctxs[2], x)[1]  # w1 [G, 2F, H], w2 [G, H, F]
        y = _grouped_mlp_fp8.forward(self, ctxs, input_, x, w1, w2, offs, extras, extra_inputs,
                                     with_backward, launches)
        if check_offsets is not None:
            check_offsets()
        if offsets is not None:  # kept once this first call ran (its launches prepared)
            ctx.steady[self] = _Steady(offsets, None, launches)
        return y

    def _prepare_steady(self, ctx: OperationContext, x: Tensor, w1: Tensor,
                        extras: _Extras, need_h: bool = True) -> None:
        """Keep in `ctx.steady` (this call's signature's dict) the offsets' and FC1's launches
        for the next calls of the signature, where the backend prepares both and this call
        ran them as those do: the fused GLU epilogue without bias, uncast operands of one
        grouped weight (the signature holds its strides), inner checks that read only the
        signature, the offsets kernel of device split sizes."""
        backend, op = ctx.backend, self.activation
        prepare_fc1 = getattr(backend, "prepare_glu_fc1_forward", None)
        if (prepare_fc1 is None or ctx.autocast is not None
                or not op.gated or self.fc1.has_bias or not self.fc1.single_grouped_weight
                or not op.checks_read_only_signature()
                or not self.epilogue_status(backend, x.dtype, x.device)[0]):
            return
        offsets = _prepared_offsets(ctx, x, extras)
        if offsets is not None:
            fc1 = prepare_fc1(x, w1, op.glu_spec, _row_values(extras.probs),
                              **_h_option(backend, need_h))
            ctx.steady[self] = _Steady(offsets, fc1)

    def forward_rows(self, ctx: OperationContext, x: Tensor, w1: Tensor, w2: Tensor,
                     offs: Tensor, extras: _Extras, inner_extra: Sequence[tuple],
                     gather: Route | None = None, scatter: Route | None = None,
                     need_h: bool = True):
        """(h [T, 2F], a [T, F], y [T, H]) of rows x (with `gather`: rows x[gather.rows]; with
        `scatter`: y's row r written to row scatter.rows[r]), the activation's and FC2's input
        checks included (`inner_extra`: their extra inputs as the call gave them; `need_h` as
        `_fc1_act`'s)."""
        h, a = self.fc1_rows(ctx, x, w1, offs, extras, inner_extra, gather, need_h)
        return h, a, self.fc2_rows(ctx, a, w2, offs, extras, inner_extra, scatter)

    def fc1_rows(self, ctx: OperationContext, x: Tensor, w1: Tensor, offs: Tensor,
                 extras: _Extras, inner_extra: Sequence[tuple], gather: Route | None = None,
                 need_h: bool = True):
        """(h [T, 2F], a [T, F]): `forward_rows`' FC1 and activation, the activation's input
        checks first (`need_h` as `_fc1_act`'s)."""
        probs = _row_values(extras.probs)  # [T]
        seen = ctx.signature_checked  # the inner ops' checks that read only it passed before
        if not (seen and self.activation.checks_read_only_signature()):
            rows = x.shape[0] if gather is None else gather.rows.shape[0]
            h_like = x.new_empty(()).expand(rows, self.fc1.out_features)  # shape only
            self.activation.forward_checks(h_like, inner_extra[0], seen)
        return self._fc1_act(x, w1, offs, extras, probs, ctx.backend, gather,
                             need_h)  # [T, 2F], [T, F]

    def fc2_rows(self, ctx: OperationContext, a: Tensor, w2: Tensor, offs: Tensor,
                 extras: _Extras, inner_extra: Sequence[tuple], scatter: Route | None = None):
        """y [T, H]: `forward_rows`' FC2 of the activation a, FC2's input checks first."""
        self.fc2.forward_checks(a, inner_extra[1], ctx.signature_checked)
        return _linear(self.fc2, a, w2, offs, extras.fc2_scales, ctx.backend, scatter=scatter)

    # --- backward -----------------------------------------------------------------------------
    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx1, ctx_act, ctx2 = basic_op_ctxs
        if ctx1.recipe is not None:
            steady = ctx1.steady.get(self) if ctx1.steady else None
            return _grouped_mlp_fp8.backward(self, basic_op_ctxs, grad_output,
                                             None if steady is None else steady.fp8)
        x, h, w1, w2, offs, probs_in, s1, s2 = ctx1.saved_tensors
        dy = self.fc2.grad_rows(ctx2, grad_output)  # [T, H] in the GEMMs' compute dtype
        g = self.backward_rows(basic_op_ctxs, dy, lambda: x, w2, offs, h, probs_in, (s1, s2))
        dh, dprobs, fc1_grads, ds1, fc2_grads, ds2 = g
        dx = None
        if ctx1.input_requires_grad:
            dx = self.fc1.input_grad(ctx1, ctx1.backend.grouped_mm(dh, w1, offs))  # dX = dH W1
        act_extra = () if probs_in is None else (dprobs.reshape(probs_in.shape),)
        extra = [_extra_grads(self.fc1, ds1), act_extra, _extra_grads(self.fc2, ds2)]
        return dx, [fc1_grads, [], fc2_grads], extra

    def backward_rows(self, basic_op_ctxs, dy: Tensor, x_rows, w2: Tensor, offs: Tensor,
                      h: Tensor, probs_in: Tensor | None, scales: tuple):
        """(dh, dprobs, FC1 grads, d FC1 scales, FC2 grads, d FC2 scales) from dY rows [T, H];
        `x_rows()` gives FC1's input rows when its wgrad needs them (made just then)."""
        ctx1, _, ctx2 = basic_op_ctxs
        s1, s2 = scales
        probs = None if probs_in is None else probs_in.reshape(-1)
        dh, a, dprobs = self._fc2_dgrad_act(dy, w2, offs, h, probs, ctx1.backend)  # [T, 2F], [T, F]
        backend = ctx1.backend
        fc2_grads, ds2 = self._param_grads(self.fc2, ctx2, a, dy, offs, s2, backend)
        fc1_grads, ds1 = [], None  # FC1's backward does not run: no gradient of it is needed
        if ctx1.requires_grad:
            fc1_grads, ds1 = self._param_grads(self.fc1, ctx1, x_rows(), dh, offs, s1, backend)
        return dh, dprobs, fc1_grads, ds1, fc2_grads, ds2

    def _param_grads(
        self,
        fc: GroupedLinear,
        ctx: OperationContext,
        inp: Tensor,
        dout: Tensor,
        offs: Tensor,
        scales: Tensor | None,
        backend: Backend,
    ):
        """Weight grads through the gradient contract (dW_e = dOut_eᵀ In_e), bias grads at once."""
        bias_grads, dscales = _bias_grads(fc, dout, offs, scales, backend)
        weight_grads = fc.weight_grads(ctx, inp, dout, offs)
        return weight_grads + bias_grads, dscales


def _h_option(backend, need_h: bool) -> dict:
    """The fused FC1's keyword that skips writing h (`store_h=False`) where no backward will
    read it and the backend can skip it (`Backend.fc1_h_optional`); else none (h written)."""
    return {} if need_h or not backend.fc1_h_optional else {"store_h": False}


@dataclass(frozen=True)
class _Steady:
    """The launches before FC2 that one call signature's first call prepares for its next
    ones (`OperationContext.steady`): offsets(splits) -> (offs [G], check), and fc1(x, w1,
    offs, probs) -> (h [T, 2F], a [T, F]), equal to the backend's `group_offsets` (whose
    device-side check is `check()`, issued after FC1's launch) and `glu_fc1_forward` for
    those operands (h None where the signature runs no backward and the backend skips it).
    Under an FP8 recipe fc1 is None and `fp8` holds the FP8 GEMMs' launches
    (`_grouped_mlp_fp8.Launches`, or None where the backend prepares none)."""

    offsets: Callable[[Tensor], tuple[Tensor, Callable[[], None]]]
    fc1: Callable[..., tuple[Tensor, Tensor]] | None
    fp8: _grouped_mlp_fp8.Launches | None = None


# (FC1 kernel, FC2-dgrad kernel) with the activation in their epilogues, by `Activation.gated`
_EPILOGUE_KERNELS = {
    True: ("glu_fc1_forward", "glu_fc2_dgrad"),
    False: ("act_fc1_forward", "act_fc2_dgrad"),
}


def _prepared_offsets(ctx: OperationContext, x: Tensor, extras: _Extras) -> Callable | None:
    """The offsets' launch prepared for the later calls of ctx's signature
    (`Backend.prepare_group_offsets`: the offsets kernel of device split sizes), or None where
    the backend prepares none."""
    prepare = getattr(ctx.backend, "prepare_group_offsets", None)
    return None if prepare is None else prepare(extras.splits, x.shape[0], x.device)


def _row_values(values: Tensor | None) -> Tensor | None:
    """Per-row values (probs) as one column [T]: `values.reshape(-1)`, the tensor itself when
    it is 1-D already (a view is a torch call more before the FC1 launch)."""
    if values is None or values.dim() == 1:
        return values
    return values.reshape(-1)


def _bias(fc: GroupedLinear, dtype: torch.dtype) -> Tensor | None:
    """The [G, N] bias in the GEMMs' compute dtype (None without bias)."""
    bias = fc.stacked_bias()
    return None if bias is None else amp.cast(bias, dtype)


def _linear(fc: GroupedLinear, x: Tensor, w: Tensor, offs: Tensor, scales, backend,
            gather: Route | None = None, scatter: Route | None = None) -> Tensor:
    """x_e W_eᵀ (+ b_e, · s_t with scale_bias) over the experts' row blocks, the bias added by
    the GEMM kernel; `gather` / `scatter`: routed rows (te_seq.kernels.routed.mm)."""
    bias = _bias(fc, x.dtype)
    if bias is None:  # backends without bias support keep their plain signature
        return routed.mm(backend, x, w.transpose(1, 2), offs, gather=gather, scatter=scatter)
    bias_scales = scales.reshape(-1) if fc.scale_bias else None
    return routed.mm(backend, x, w.transpose(1, 2), offs, gather=gather, scatter=scatter,
                     bias=bias, bias_scales=bias_scales)


def _bias_grads(fc: GroupedLinear, dout: Tensor, offs: Tensor, scales, backend: Backend):
    """(grads of the bias parameters, grad of the scales): db_e = Σ_{t in e} dOut_t (· s_t) by
    one segmented column sum, ds_t = dOut_t · b_e(t) with scale_bias."""
    if not fc.has_bias:
        return [], None
    row_scales = scales.reshape(-1) if fc.scale_bias else None
    sums = backend.group_col_sums(dout, offs, row_scales)  # [G, N] fp32 (fp64)
    sums = sums.to(fc.named_biases()[0][1].dtype)
    grads = [sums] if fc.single_grouped_bias else list(sums.unbind(0))
    dscales = None
    if row_scales is not None:
        dscales = bias_scale_grads(dout, fc.stacked_bias(), offs).to(scales.dtype)
        dscales = dscales.reshape(scales.shape)
    return grads, dscales


def _extra_grads(fc: GroupedLinear, dscales: Tensor | None) -> tuple:
    return (None, dscales) if fc.num_extra_inputs == 2 else (None,)


@register_fusion(
    name="grouped_mlp",
    phase="joint",
    pattern=(GroupedLinear, Activation, GroupedLinear),
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
    declined = check_activation(act, fc1.out_features)
    if declined:
        return declined
    splits1, splits2 = window.extra_inputs[0][0], window.extra_inputs[2][0]
    if not same_extra_input(splits1, splits2):
        return NoMatch(
            "the two GroupedLinear ops got different split_sizes (bind both to the same "
            "channel, e.g. an ExpertDispatch's 'split_sizes', or pass the same tensor object; "
            "two device tensors are never compared, since that would sync)"
        )
    return GroupedMLP(window)
