"""The fused GroupedMLP under an FP8 recipe: the same quantized operands as the unfused chain.

Each GEMM quantizes exactly what the unfused GroupedLinear would (core/fp8.py: x and the
activation along K and along tokens, dy and dh along N and along tokens, the cached weights), and
every intermediate has the dtype it has between the unfused ops (h and the activation in the
GEMMs' compute dtype), so fused equals unfused bitwise on the reference backend. The activation
always runs after the GEMMs here (no FP8 epilogue kernels yet). Saved: x along tokens, h, both
weights in their dgrad layout, the offsets; the activation is recomputed from h in backward.
Shape legend as in grouped_mlp.py (T tokens, G experts, H hidden, F ffn width).
"""

from __future__ import annotations

from torch import Tensor

from te_seq.core import amp, fp8, fp8_gemm
from te_seq.kernels.reference import group_bounds
from te_seq.ops.basic.grouped_linear import GroupedLinear


def _params(fc: GroupedLinear) -> list[Tensor]:
    return [p for _, p in fc.named_weights()]


def _gemm(fc: GroupedLinear, ctx, input_: Tensor, x: Tensor, w: Tensor, offs, bounds, scales,
          need_wgrad: bool = True):
    """As GroupedLinear's forward (core/fp8_gemm.py: real FP8 or emulated), + bias:
    (y in x's dtype, x along tokens or None, W along N)."""
    y, x_w, w_d = fp8_gemm.grouped_forward(fc, ctx, input_, x, w, _params(fc), offs, bounds,
                                           need_wgrad)
    bias = fc.bias_rows(offs, y.shape[0], scales, x.dtype)
    return (y if bias is None else y + bias), x_w, w_d


def _activation(mlp, h: Tensor, probs, backend) -> Tensor:
    op = mlp.activation
    if op.gated:
        return backend.glu_forward(h, op.glu_spec, probs)
    return backend.act_forward(h, op.act)


def forward(mlp, ctxs, input_: Tensor, x: Tensor, w1: Tensor, w2: Tensor, offs: Tensor,
            extras, extra_inputs) -> Tensor:
    """y [T, H] of the fused op under ctxs[0].recipe; fills the contexts for `backward`."""
    ctx, recipe, backend = ctxs[0], ctxs[0].recipe, ctxs[0].backend
    bounds, dtype = group_bounds(offs), x.dtype
    probs = None if extras.probs is None else extras.probs.reshape(-1)  # [T]
    fp8.check_operands(mlp.fc1, recipe, x, w1, w1.shape[-1], w1.shape[-2])
    h_like = x.new_empty(()).expand(x.shape[0], mlp.fc1.out_features)  # shape only
    mlp.activation.pre_forward_checks(h_like, extra_inputs[1])
    h, x_w, w1_d = _gemm(mlp.fc1, ctx, input_, x, w1, offs, bounds, extras.fc1_scales)  # [T, 2F]
    a = _activation(mlp, h, probs, backend)  # [T, F]
    mlp.fc2.pre_forward_checks(a, extra_inputs[2])
    # FC2's wgrad operand is recomputed from h in backward: not quantized along tokens here
    y, _, w2_d = _gemm(mlp.fc2, ctx, a, a, w2, offs, bounds, extras.fc2_scales,
                       need_wgrad=False)  # [T, H]
    if any(c.requires_grad for c in ctxs):
        ctx.save_for_backward(
            x_w, h, w1_d, w2_d, offs, extras.probs, extras.fc1_scales, extras.fc2_scales
        )
        ctx.saved = mlp.fc1.saved_record(input_, dtype)
        fc2_input = a.new_empty(()).expand(*input_.shape[:-1], mlp.fc2.in_features)
        ctxs[2].saved = mlp.fc2.saved_record(fc2_input, dtype)
    return y


def backward(mlp, ctxs, grad_output: Tensor):
    """(dx, param grads per op, extra grads per op) of `forward`, as the unfused chain's."""
    ctx1, _, ctx2 = ctxs
    recipe, backend = ctx1.recipe, ctx1.backend
    x_w, h, w1_d, w2_d, offs, probs_in, s1, s2 = ctx1.saved_tensors
    bounds, probs = group_bounds(offs), None if probs_in is None else probs_in.reshape(-1)
    dy = mlp.fc2.grad_rows(ctx2, grad_output)  # [T, H]
    dy_d, dy_w = fp8.grad_operands(recipe, dy, bounds)
    da = amp.cast(backend.grouped_mm(dy_d, w2_d, offs), h.dtype)  # [T, F], as FC2's dX
    dh, dprobs = _activation_backward(mlp, h, da, probs, backend)  # [T, 2F]
    a = _activation(mlp, h, probs, backend)  # recomputed: FC2's wgrad operand
    a_w = fp8.input_operands(recipe, a, a, bounds)[1]
    fc2_grads, ds2 = _grads(mlp.fc2, ctx2, a_w, dy, dy_w, offs, s2)
    fc1_grads, ds1, dx = [], None, None
    if ctx1.requires_grad:
        dh_d, dh_w = fp8.grad_operands(recipe, dh, bounds)
        fc1_grads, ds1 = _grads(mlp.fc1, ctx1, x_w, dh, dh_w, offs, s1)
        if ctx1.input_requires_grad:  # dX = dH W1
            dx = mlp.fc1.input_grad(ctx1, backend.grouped_mm(dh_d, w1_d, offs))
    act_extra = () if probs_in is None else (dprobs.reshape(probs_in.shape),)
    extra = [_extra(mlp.fc1, ds1), act_extra, _extra(mlp.fc2, ds2)]
    return dx, [fc1_grads, [], fc2_grads], extra


def _activation_backward(mlp, h: Tensor, da: Tensor, probs, backend):
    op = mlp.activation
    if op.gated:
        return backend.glu_backward(h, da, op.glu_spec, probs)
    return backend.act_backward(h, da, op.act), None


def _grads(fc: GroupedLinear, ctx, x_w: Tensor, dout: Tensor, dout_w: Tensor, offs, scales):
    """Bias grads from the unquantized dOut, weight grads from the quantized operands."""
    bias_grads, dscales = fc.bias_grads(dout, offs, scales)
    return fc.weight_grads(ctx, x_w, dout_w, offs) + bias_grads, dscales


def _extra(fc: GroupedLinear, dscales: Tensor | None) -> tuple:
    return (None, dscales) if fc.num_extra_inputs == 2 else (None,)


__all__ = ["backward", "forward"]
