"""The fused GroupedMLP under an FP8 recipe: the same quantized operands as the unfused chain.

Each GEMM quantizes exactly what the unfused GroupedLinear would (core/fp8.py: x and the
activation along K and along tokens, dy and dh along N and along tokens, the cached weights), and
every intermediate has the dtype it has between the unfused ops (h and the activation in the
GEMMs' compute dtype), so fused equals unfused bitwise on the reference backend. A gated
activation runs in the FP8 GEMMs' epilogues where `epilogue_reasons` allows it (the cute
backend's `scaled_glu_fc1_forward` / `scaled_glu_fc2_dgrad`: the same quantized operands, the
activation maths of the bf16 epilogues), else after the GEMMs. Saved: h, the offsets and
each FC's `fp8.GradOperands` (x along tokens, the weight along N: fp32 for the emulated
backward; for the native one the quantized weight and x itself, quantized along the tokens in
backward by default, core/fp8.py `DeferredTokenMajor`); the activation is recomputed from h in
backward and quantized along the tokens there.
Shape legend as in grouped_mlp.py (T tokens, G experts, H hidden, F ffn width).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from te_seq.core import amp, fp8, fp8_gemm
from te_seq.kernels import fp8_cute, fp8_quantize, fp8_torch
from te_seq.kernels.reference import LazyGroupBounds
from te_seq.ops.basic.grouped_linear import GroupedLinear


def _params(fc: GroupedLinear) -> list[Tensor]:
    return [p for _, p in fc.named_weights()]


def _gemm(fc: GroupedLinear, ctx, input_: Tensor, x: Tensor, w: Tensor, offs, bounds, scales,
          need_wgrad: bool = True, gemm=None, rows=None):
    """As GroupedLinear's forward (core/fp8_gemm.py: real FP8 or emulated; `gemm` and `rows` as
    its), + bias: (y in x's dtype, the backward's `fp8.GradOperands`)."""
    y, operands = fp8_gemm.grouped_forward(fc, ctx, input_, x, w, _params(fc), offs, bounds,
                                           need_wgrad, gemm, rows)
    bias = fc.bias_rows(offs, y.shape[0], scales, x.dtype)
    return (y if bias is None else y + bias), operands


def epilogue_reasons(mlp, backend_name: str, recipe, dtype: torch.dtype,
                     device: torch.device) -> tuple[str, str]:
    """(why FC1's FP8 GEMM does not apply the activation in its epilogue, why FC2's FP8 dgrad
    does not apply its backward): "" where it does. Static facts only (plan time too), so
    decided once per set of facts (`fp8_gemm.decided`)."""
    op = mlp.activation
    spec = op.glu_spec if op.gated else op.act
    key = ("glu epilogues", backend_name, recipe, dtype, device, spec, mlp.fc1.has_bias,
           mlp.fc1.in_features, mlp.fc2.in_features)
    return fp8_gemm.decided(key, lambda: _epilogue_reasons(mlp, backend_name, recipe, dtype,
                                                           device))


def _epilogue_reasons(mlp, backend_name: str, recipe, dtype: torch.dtype,
                      device: torch.device) -> tuple[str, str]:
    if backend_name != "cute":
        return (f"the {backend_name} backend has no FP8 epilogue kernels",) * 2
    op = mlp.activation
    if not op.gated:
        return ("non-gated activations have no FP8 epilogue kernels",) * 2
    if mlp.fc1.has_bias:
        return ("an FC1 bias has no FP8 epilogue kernel",) * 2
    hidden, ffn = mlp.fc1.in_features, mlp.fc2.in_features
    dims = [(hidden, 2 * ffn), (ffn, hidden)]
    why = fp8_gemm.forward_reason(backend_name, recipe, dtype, device, dims, True)
    if not why:
        blocks = recipe.block("input") not in (fp8_torch.ROWWISE, fp8_torch.PER_TENSOR)
        glu_reason = fp8_cute.block_glu_reason if blocks else fp8_cute.glu_reason
        why = glu_reason(op.glu_spec, hidden, ffn, device)
    if why:
        return why, why
    if recipe.rule("grad").dtype != torch.float8_e4m3fn:
        return "", f"grad format {recipe.rule('grad').fmt}: the FP8 GLU dgrad epilogue takes E4M3"
    return "", fp8_gemm.backward_reason(backend_name, recipe, dtype, device, dims, True)


def plan_note(mlp, backend_name: str, recipe, dtype: torch.dtype, device: torch.device) -> str:
    """Where the activation runs under `recipe` (the plan step's note)."""
    fc1, dgrad = epilogue_reasons(mlp, backend_name, recipe, dtype, device)
    if not fc1 and not dgrad:
        return "activation fused into the FP8 FC1 and FC2-dgrad epilogues"
    if not fc1:
        return f"activation fused into the FP8 FC1 epilogue; its backward after the GEMMs " \
               f"({dgrad})"
    return f"activation after the GEMMs ({fc1})"


def _activation(mlp, h: Tensor, probs, backend) -> Tensor:
    op = mlp.activation
    if op.gated:
        return backend.glu_forward(h, op.glu_spec, probs)
    return backend.act_forward(h, op.act)


class Launches:
    """The fused op's FP8 launches for one call signature on the cute backend (kept in the
    signature's steady record): the GEMMs, FC1's (with the activation in its epilogue, or
    plain), FC2's, FC2's dgrad (with the activation's backward, or plain) and FC1's dgrad, and
    the row quantizations of their operands x, a, dy and dh. Each is prepared by the first
    call that runs it (`fp8_cute.prepare_glu_fc1`, `prepare_scaled_grouped_mm`,
    `prepare_glu_dgrad`, `fp8_quantize.prepare_rows`; None where they prepare none: block
    scales, the torch quantizer; it then runs unprepared) and run by the signature's later
    calls. Holds no tensor."""

    __slots__ = ("fc1", "fc2", "fc2_dgrad", "fc1_dgrad", "x_rows", "a_rows", "dy_rows",
                 "dh_rows")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, _UNPREPARED)

    @staticmethod
    def for_call(ctx) -> Launches | None:
        """New (unprepared) launches for a signature's first call where its backend's FP8
        GEMMs can be prepared (cute), else None."""
        return Launches() if ctx.backend.name == "cute" else None


_UNPREPARED = object()  # a `Launches` slot whose GEMM has not run yet


def _kernel_for(launches: Launches | None, name: str, kernel, prepare, **options):
    """`kernel` (with `options`) for `launches`' slot `name`: its prepared launch (with
    `options`, which it was prepared with), else `kernel`, which where the slot is still
    unprepared prepares it too (`prepare` on the same arguments, after the kernel's own
    checks passed). The GEMMs' kernels have `fp8_cute.scaled_grouped_mm`'s arguments (the
    `gemm` of `fp8_gemm.grouped_forward` and `GroupedGrads.dgrad`), the quantizers
    `fp8_quantize.rows`' (their `rows`)."""
    launch = None if launches is None else getattr(launches, name)
    if launch is not None and launch is not _UNPREPARED:  # a steady call: nothing else made
        return functools.partial(launch, **options) if options else launch
    run = functools.partial(kernel, **options)
    if launch is None:
        return run

    def run_and_prepare(*args):
        out = run(*args)
        setattr(launches, name, prepare(*args, **options))
        return out

    return run_and_prepare


def _plain_kernel(launches: Launches | None, name: str):
    """`_kernel_for` of the plain FP8 GEMM (`fp8_cute.scaled_grouped_mm`) for `launches`'
    GEMM `name`, or None (the backend's own) without launches."""
    if launches is None:
        return None
    return _kernel_for(launches, name, fp8_cute.scaled_grouped_mm,
                       fp8_cute.prepare_scaled_grouped_mm)


def _row_quantizer(launches: Launches | None, name: str):
    """`_kernel_for` of the row quantization (`fp8_quantize.rows`) for `launches`' operand
    `name`, or None (the default) without launches."""
    if launches is None:
        return None
    return _kernel_for(launches, name, fp8_quantize.rows, fp8_quantize.prepare_rows)


def forward(mlp, ctxs, input_: Tensor, x: Tensor, w1: Tensor, w2: Tensor, offs: Tensor,
            extras, extra_inputs, with_backward: bool = True,
            launches: Launches | None = None) -> Tensor:
    """y [T, H] of the fused op under ctxs[0].recipe; fills the contexts for `backward` where
    `with_backward` (else FC1's fused epilogue may skip writing h). `launches`: the call
    signature's FP8 GEMM launches (`Launches`; prepared here on its first call), or None."""
    ctx, recipe, backend = ctxs[0], ctxs[0].recipe, ctxs[0].backend
    bounds, dtype = LazyGroupBounds(offs), x.dtype
    probs = None if extras.probs is None else extras.probs.reshape(-1)  # [T]
    fp8.check_operands(mlp.fc1, recipe, x, w1, w1.shape[-1], w1.shape[-2])
    _activation_checks(mlp, ctx, x, extra_inputs[1])
    if not epilogue_reasons(mlp, backend.name, recipe, dtype, x.device)[0]:
        glu = _kernel_for(launches, "fc1", fp8_cute.glu_fc1, fp8_cute.prepare_glu_fc1,
                           glu=mlp.activation.glu_spec, probs=probs, store_h=with_backward)
        (h, a), ops1 = fp8_gemm.grouped_forward(mlp.fc1, ctx, input_, x, w1, _params(mlp.fc1),
                                                offs, bounds, gemm=glu,
                                                rows=_row_quantizer(launches, "x_rows"))
    else:
        h, ops1 = _gemm(mlp.fc1, ctx, input_, x, w1, offs, bounds, extras.fc1_scales,
                        gemm=_plain_kernel(launches, "fc1"),
                        rows=_row_quantizer(launches, "x_rows"))  # [T, 2F]
        a = _activation(mlp, h, probs, backend)  # [T, F]
    mlp.fc2.forward_checks(a, extra_inputs[2], ctx.signature_checked)
    # FC2's wgrad operand is recomputed from h in backward: not quantized along tokens here
    y, ops2 = _gemm(mlp.fc2, ctx, a, a, w2, offs, bounds, extras.fc2_scales,
                    need_wgrad=False, gemm=_plain_kernel(launches, "fc2"),
                    rows=_row_quantizer(launches, "a_rows"))  # [T, H]
    if with_backward:
        ctx.save_for_backward(h, offs, extras.probs, extras.fc1_scales, extras.fc2_scales,
                              *ops1.tensors(), *ops2.tensors())
        ctx.saved = mlp.fc1.saved_record(input_, dtype)
        fc2_shape = torch.Size((*input_.shape[:-1], mlp.fc2.in_features))  # a's, unflattened
        ctxs[2].saved = mlp.fc2.saved_record(a, dtype, shape=fc2_shape)
    return y


def _activation_checks(mlp, ctx, x: Tensor, extra: tuple) -> None:
    """The activation's input checks on a stand-in for h [T, 2F] (made only where they run:
    a call whose signature passed checks that read only it needs none, as in bf16)."""
    seen = ctx.signature_checked
    if not (seen and mlp.activation.checks_read_only_signature()):
        h_like = x.new_empty(()).expand(x.shape[0], mlp.fc1.out_features)  # shape only
        mlp.activation.forward_checks(h_like, extra, seen)


def backward(mlp, ctxs, grad_output: Tensor, launches: Launches | None = None):
    """(dx, param grads per op, extra grads per op) of `forward`, as the unfused chain's.
    `launches`: the call signature's FP8 GEMM launches (`Launches`; its dgrads prepared
    here on the signature's first backward), or None."""
    ctx1, _, ctx2 = ctxs
    recipe, backend = ctx1.recipe, ctx1.backend
    h, offs, probs_in, s1, s2, *operands = ctx1.saved_tensors
    ops1, ops2 = fp8.GradOperands.load(operands[:5]), fp8.GradOperands.load(operands[5:])
    bounds, probs = LazyGroupBounds(offs), None if probs_in is None else probs_in.reshape(-1)
    dy = mlp.fc2.grad_rows(ctx2, grad_output)  # [T, H]
    fc2 = fp8_gemm.GroupedGrads(ctx1, dy, ops2, offs, bounds, ctx2.weight_requires_grad,
                                rows=_row_quantizer(launches, "dy_rows"))
    dh, a, dprobs = _fc2_dgrad(mlp, ctx1, fc2, h, probs, launches)
    fc2.with_input(_fc2_wgrad_input(recipe, a, offs, bounds, fc2.native_wgrad, backend.name))
    fc2_grads, ds2 = _grads(mlp.fc2, ctx2, dy, fc2, offs, s2)
    fc1_grads, ds1, dx = [], None, None
    if ctx1.requires_grad:
        fc1 = fp8_gemm.GroupedGrads(ctx1, dh, ops1, offs, bounds, ctx1.weight_requires_grad,
                                    rows=_row_quantizer(launches, "dh_rows"))
        fc1_grads, ds1 = _grads(mlp.fc1, ctx1, dh, fc1, offs, s1)
        if ctx1.input_requires_grad:  # dX = dH W1
            dx = mlp.fc1.input_grad(ctx1, fc1.dgrad(gemm=_plain_kernel(launches,
                                                                       "fc1_dgrad")))
    act_extra = () if probs_in is None else (dprobs.reshape(probs_in.shape),)
    extra = [_extra(mlp.fc1, ds1), act_extra, _extra(mlp.fc2, ds2)]
    return dx, [fc1_grads, [], fc2_grads], extra


def _fc2_dgrad(mlp, ctx, fc2: fp8_gemm.GroupedGrads, h: Tensor, probs, launches=None):
    """(dh [T, 2F], a [T, F] recomputed for FC2's wgrad, dprobs): in FC2's FP8 dgrad epilogue
    where `epilogue_reasons` allows it, else dA = FC2's dgrad, then the activation's backward
    and forward (`launches` as `backward`'s)."""
    backend = ctx.backend
    why = epilogue_reasons(mlp, backend.name, ctx.recipe, h.dtype, h.device)[1]
    if not why and fc2.operands.native:
        glu = _kernel_for(launches, "fc2_dgrad", fp8_cute.glu_dgrad,
                           fp8_cute.prepare_glu_dgrad, h=h, glu=mlp.activation.glu_spec,
                           probs=probs)
        return fc2.dgrad(gemm=glu)
    da = amp.cast(fc2.dgrad(gemm=_plain_kernel(launches, "fc2_dgrad")), h.dtype)  # [T, F]
    dh, dprobs = _activation_backward(mlp, h, da, probs, backend)  # [T, 2F]
    return dh, _activation(mlp, h, probs, backend), dprobs


def _activation_backward(mlp, h: Tensor, da: Tensor, probs, backend):
    op = mlp.activation
    if op.gated:
        return backend.glu_backward(h, da, op.glu_spec, probs)
    return backend.act_backward(h, da, op.act), None


def _fc2_wgrad_input(recipe, a: Tensor, offs: Tensor, bounds, native: bool, backend_name: str):
    """FC2's wgrad operand from the recomputed activation a [T, F]: token-major FP8 (`native`:
    the wgrad runs in FP8), fp32 along the tokens (emulated), quantized as an unfused FC2
    would, or a itself (`fp8_wgrad=False`: the wgrad runs in high precision)."""
    if not recipe.fp8_wgrad:
        return a
    if not native:
        return fp8.input_operands(recipe, a, a, bounds)[1]
    return fp8.input_token_major(recipe, a, a, offs, None, backend_name)


def _grads(fc: GroupedLinear, ctx, dout: Tensor, gemms: fp8_gemm.GroupedGrads, offs, scales):
    """Bias grads from the unquantized dOut, weight grads from the quantized operands."""
    bias_grads, dscales = fc.bias_grads(dout, offs, scales)
    x_w, dout_w, wgrad_fn = gemms.wgrad_operands()
    return fc.weight_grads(ctx, x_w, dout_w, offs, wgrad_fn) + bias_grads, dscales


def _extra(fc: GroupedLinear, dscales: Tensor | None) -> tuple:
    return (None, dscales) if fc.num_extra_inputs == 2 else (None,)


__all__ = ["Launches", "backward", "forward"]
