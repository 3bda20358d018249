"""The GEMMs of a linear op under an FP8 recipe: real FP8 on the torch backend where PyTorch's
scaled matmuls take the recipe, the hardware and the shapes, and on the cute backend (grouped
GEMMs only) where its FP8 kernels do; emulated otherwise.

Per GEMM (x [T, K], W [N, K], dy [T, N]):

    forward  y = x Wᵀ    torch backend, CUDA sm_90+, bf16, K and N multiples of 16, per-tensor
                         or row-wise scales: `torch._scaled_mm` (BasicLinear / Linear) or
                         `torch._scaled_grouped_mm` (GroupedLinear, the fused GroupedMLP; sm_90
                         only). Cute backend, same conditions (sm_90), grouped GEMMs:
                         `cute.scaled_grouped_mm` (te_seq/kernels/fp8_cute.py), and under
                         Float8BlockScaling `cute.block_scaled_grouped_mm`. Else
                         emulated: quantize -> dequantize in fp32, fp32 GEMM.
    dgrad    dx = dy W   grouped ops whose forward is real FP8 and whose dy is E4M3 (on the
                         cute backend also "HYBRID"'s E5M2) with per-tensor or row-wise scales
                         ("native backward", `backward_reason`): the forward's kernel on dy
                         quantized along N and Wᵀ [G, K, N] quantized along N (kept in the
                         weight cache); under Float8BlockScaling (cute, E4M3 dy) the block
                         kernel on dy in 1x128 tiles and Wᵀ's 128x128 blocks. Else emulated.
    wgrad    dW = dyᵀ x  under the native backward: dy and x quantized along each group's tokens,
                         token-major (kernels/fp8_wgrad.py), `cute.scaled_grouped_wgrad` on the
                         cute backend (Float8BlockScaling: 1x128 blocks along the tokens,
                         `cute.block_scaled_grouped_wgrad`), their fp32 emulations on torch
                         (`_wgrad_kernel` decides). Else emulated on fp32 operands.
                         Under `fp8_wgrad=False`: dy and x unquantized, the backend's own
                         (high-precision) wgrad, as without a recipe.

`forward_reason` / `backward_reason` decide (static facts: backend, recipe, dtype, device,
widths); the plan step says which (`step_note`). Both paths quantize exactly the same operands
(core/fp8.py), so a real GEMM differs from the emulation only by summation order and the single
bf16 rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from te_seq.core import amp, fp8
from te_seq.kernels import cute, fp8_cute, fp8_quantize, fp8_torch, fp8_wgrad
from te_seq.recipe import Recipe


def forward_reason(backend_name: str, recipe: Recipe, dtype: torch.dtype,
                   device: torch.device, dims: list[tuple[int, int]], grouped: bool) -> str:
    """Why the forward GEMMs ((K, N) each in `dims`) under `recipe` are emulated on
    `backend_name` for `dtype` data on `device` ("" when they run in real FP8)."""
    if backend_name == "cute":
        if not grouped:  # the cute backend does not take BasicLinear / Linear under a recipe
            return "the cute backend's FP8 kernel is a grouped GEMM only"
        return fp8_cute.recipe_reason(recipe, dtype, device, dims)
    if backend_name != "torch":
        return f"the {backend_name} backend emulates FP8"
    blocks = (recipe.block("input"), recipe.block("weight"))
    formats = (recipe.rule("input").dtype, recipe.rule("weight").dtype)
    return fp8_torch.forward_reason(blocks, formats, dtype, device, dims, grouped)


def _kernel_name(backend_name: str, grouped: bool, recipe: Recipe) -> str:
    """The real FP8 forward kernel a backend runs (where `forward_reason` is "")."""
    if backend_name == "cute":
        return fp8_cute.kernel_name((recipe.block("input"), recipe.block("weight")))
    return "torch._scaled_grouped_mm" if grouped else "torch._scaled_mm"


def _scaled_grouped_mm(backend_name: str):
    """The real FP8 grouped GEMM functional of a backend (fp8_torch's / fp8_cute's
    `scaled_grouped_mm`: same operands, same maths)."""
    return fp8_cute.scaled_grouped_mm if backend_name == "cute" else fp8_torch.scaled_grouped_mm


def _gemm_shapes(op: object) -> tuple[list[tuple[int, int]], bool]:
    """((K, N) of each forward GEMM of `op`, whether they are grouped GEMMs)."""
    if hasattr(op, "fc1") and hasattr(op, "fc2"):  # the fused GroupedMLP
        return [(op.fc1.in_features, op.fc1.out_features),
                (op.fc2.in_features, op.fc2.out_features)], True
    k = getattr(op, "local_in_features", op.in_features)
    n = getattr(op, "local_out_features", op.out_features)
    return [(k, n)], hasattr(op, "num_groups")


def backward_reason(backend_name: str, recipe: Recipe, dtype: torch.dtype,
                    device: torch.device, dims: list[tuple[int, int]], grouped: bool) -> str:
    """Why the dgrad and wgrad GEMMs of a linear under `recipe` are emulated ("" when they run
    natively: a grouped op whose forward runs in real FP8 and whose gradient operand has
    per-tensor or row-wise scales, E4M3, or E5M2 ("HYBRID") on the cute backend; or, under
    block scaling on the cute backend, whose dgrad the block kernel takes: E4M3 dy in 1x128
    tiles; its wgrad then runs the block-scaled wgrad kernel, `wgrad_reason`)."""
    if not grouped:
        return "BasicLinear / Linear have no FP8 backward kernels"
    why = forward_reason(backend_name, recipe, dtype, device, dims, grouped)
    if why:
        return why
    rule, block = recipe.rule("grad"), recipe.block("grad")
    if fp8.block_scaled(recipe):  # dgrad on the block kernel: dy 1x128 along N, Wᵀ 128x128
        why = fp8_cute.forward_reason((block, recipe.block("weight")),
                                      (rule.dtype, recipe.rule("weight").dtype), dtype, device,
                                      [(n, k) for k, n in dims])
        return f"dgrad: {why}" if why else ""
    if rule.dtype != torch.float8_e4m3fn and backend_name != "cute":
        return (f"grad format {rule.fmt} ({recipe.fp8_format}): torch's FP8 kernels take E4M3 "
                f"(the cute backend's take E5M2 gradients too)")
    if block not in (fp8_torch.ROWWISE, fp8_torch.PER_TENSOR):
        return "the gradient's blocks are not per-tensor or row-wise"
    return ""


HIGH_PRECISION_WGRAD = "the recipe keeps the wgrad in high precision (fp8_wgrad=False)"


def wgrad_reason(recipe: Recipe) -> str:
    """Why the wgrad of a native FP8 backward (`backward_reason` "") does not run on FP8
    token-major operands under `recipe` ("" when it does: per-tensor or row-wise blocks, or
    block scaling's 1x128 blocks along each expert's tokens). `HIGH_PRECISION_WGRAD` under
    `fp8_wgrad=False`: unquantized operands in the compute dtype; else it is emulated."""
    if not recipe.fp8_wgrad:
        return HIGH_PRECISION_WGRAD
    dy_scaling = fp8.scaling(recipe, "grad")
    if dy_scaling.rowwise or dy_scaling.per_tensor or fp8.block_scaled(recipe):
        return ""
    return (f"no FP8 wgrad kernel for {recipe.block('grad')} blocks of dy along the tokens "
            f"(per tensor, row-wise or 1x128 only)")


def _wgrad_kernel(backend_name: str, recipe: Recipe):
    """(the FP8 wgrad functional of a backend, its name for the plan): the cute kernel on the
    cute backend (looked up at call time, so tests can replace it; the block-scaled one under
    block scaling), the fp32 emulation of the same maths elsewhere. The one place that
    decides."""
    if fp8.block_scaled(recipe):
        if backend_name == "cute":
            return cute.block_scaled_grouped_wgrad, "cute block_scaled_grouped_wgrad"
        return fp8_wgrad.block_scaled_grouped_wgrad_emulated, ""
    if backend_name == "cute":
        return cute.scaled_grouped_wgrad, "cute scaled_grouped_wgrad"
    return fp8_wgrad.scaled_grouped_wgrad_emulated, ""


def step_note(recipe: Recipe | None, backend_name: str, op: object, dtype: torch.dtype,
              device: torch.device) -> str:
    """The plan's line on how a step with FP8 GEMMs runs under `recipe` ("" without one)."""
    if recipe is None:
        return ""
    dims, grouped = _gemm_shapes(op)
    high = "" if recipe.fp8_wgrad else \
        "; wgrad in the compute dtype on unquantized operands (fp8_wgrad=False)"
    why = forward_reason(backend_name, recipe, dtype, device, dims, grouped)
    if why:
        return (f"FP8 {recipe}: GEMM operands quantized -> dequantized in fp32, fp32 GEMMs "
                f"(emulated on {backend_name}: {why}){high}")
    name = _kernel_name(backend_name, grouped, recipe)
    why_bwd = backward_reason(backend_name, recipe, dtype, device, dims, grouped)
    if why_bwd:
        what = "dgrad emulated" if high else "dgrad and wgrad emulated"
        return (f"FP8 {recipe}: forward GEMMs via {name} (real FP8, fp32 accumulation); {what} "
                f"(quantize -> dequantize, fp32 GEMMs: {why_bwd}){high}")
    if high:
        return f"FP8 {recipe}: forward and dgrad GEMMs via {name} (real FP8, fp32 accumulation)" \
            + high
    why_wgrad = wgrad_reason(recipe)
    if why_wgrad:
        return (f"FP8 {recipe}: forward and dgrad GEMMs via {name} (real FP8, fp32 "
                f"accumulation); wgrad emulated (quantize -> dequantize, fp32 GEMMs: "
                f"{why_wgrad})")
    wgrad = _wgrad_kernel(backend_name, recipe)[1]
    wgrad = (f"wgrad via {wgrad} (real FP8, fp32 accumulation)" if wgrad else
             "wgrad emulated (FP8 operands along the tokens dequantized, fp32 GEMMs)")
    return (f"FP8 {recipe}: forward and dgrad GEMMs via {name} (real FP8, fp32 "
            f"accumulation); {wgrad}")


# Per-call decisions from static facts (backend, recipe, dtype, device, widths), made once per
# process: a call otherwise re-derives them several times (~10 µs each on the host).
_DECISIONS: dict[tuple, object] = {}


def decided(key: tuple, decide):
    """`decide()` for the static facts `key` (which fully determine it), computed once (one
    lookup per call: hashing a key of recipes and specs is a Python call per dataclass)."""
    found = _DECISIONS.get(key, _UNDECIDED)
    if found is _UNDECIDED:
        found = _DECISIONS[key] = decide()
    return found


_UNDECIDED = object()


def clear_decisions() -> None:
    """Forget the cached decisions (tests that fake a GPU or replace a kernel check), the
    quantization kernels' choices included."""
    _DECISIONS.clear()
    _ROUTES.clear()
    fp8_quantize.clear_reasons()


class GroupedRoute(NamedTuple):
    """How a grouped linear's GEMMs run under a recipe, from the static facts `grouped_route`
    reads: real FP8 forward (`forward_reason` ""), native dgrad (`backward_reason` ""), and
    whether its wgrad then runs on FP8 token-major operands (`wgrad_reason` "")."""

    forward: bool
    backward: bool
    fp8_wgrad: bool


def grouped_route(ctx, x: Tensor, w: Tensor) -> GroupedRoute:
    """The `GroupedRoute` of a grouped GEMM of x [T, K] with w [G, N, K] under ctx.recipe on
    ctx's backend: one lookup per call, decided once per (backend, recipe, dtype, device,
    (N, K)) by `forward_reason`, `backward_reason` and `wgrad_reason`."""
    recipe = ctx.recipe
    key = (ctx.backend.name, id(recipe), x.dtype, x.device, w.shape[-2:])
    found = _ROUTES.get(key)
    if found is None or found[0] is not recipe:
        if len(_ROUTES) >= 256:  # recipes made afresh in a loop: no growth
            _ROUTES.clear()
        found = _ROUTES[key] = (recipe, _grouped_route(key[0], recipe, *key[2:]))
    return found[1]


# (backend, id(recipe), dtype, device, (N, K)) -> (recipe, GroupedRoute): keyed by the
# recipe's identity (hashing a recipe is a Python call), which the entry holds (no id reuse)
_ROUTES: dict[tuple, tuple[Recipe, GroupedRoute]] = {}


def _grouped_route(backend_name: str, recipe: Recipe, dtype: torch.dtype, device: torch.device,
                   nk: tuple[int, int]) -> GroupedRoute:
    facts = (backend_name, recipe, dtype, device, [(nk[1], nk[0])], True)
    if forward_reason(*facts):
        return GroupedRoute(False, False, False)
    native_backward = not backward_reason(*facts)
    return GroupedRoute(True, native_backward, native_backward and not wgrad_reason(recipe))


def _runs_native(ctx, x: Tensor, w: Tensor, grouped: bool) -> bool:
    facts = (ctx.backend.name, ctx.recipe, x.dtype, x.device, [(w.shape[-1], w.shape[-2])],
             grouped)
    return decided(("forward", *facts[:4], w.shape[-2:], grouped),
                   lambda: not forward_reason(*facts))


def linear_forward(op, ctx, input_: Tensor, x: Tensor, w: Tensor, params: list[Tensor],
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """y = Q(x) Q(W)ᵀ under ctx.recipe: (y [T, N] in x's dtype, x along T [T, K] fp32 for the
    wgrad, W along N [N, K] fp32 for the dgrad). x [T, K] is the GEMM input in its compute
    dtype, `input_` the op's input (an `ops.Quantize` output is not quantized again)."""
    recipe, bounds = ctx.recipe, [(0, x.shape[0])]
    fp8.check_operands(op, recipe, x, w, w.shape[-1], w.shape[-2])
    weights = fp8.cached_weights(op, recipe, w, params)
    if not _runs_native(ctx, x, w, grouped=False):
        x_fwd, x_wgrad = fp8.input_operands(recipe, input_, x, bounds)
        return (x_fwd @ weights.forward.t()).to(x.dtype), x_wgrad, weights.dgrad
    x_q = fp8.input_quantized(recipe, input_, x)
    y = fp8_torch.scaled_mm(x_q, weights.quantized[0], x.dtype)
    return y, fp8.input_wgrad(recipe, input_, x, bounds, x_q), weights.dgrad


def grouped_forward(
    op, ctx, input_: Tensor, x: Tensor, w: Tensor, params: list[Tensor], offs: Tensor,
    bounds: list[tuple[int, int]], need_wgrad: bool = True, gemm=None,
    rows=None,
) -> tuple[Tensor, fp8.GradOperands]:
    """Rows of group g: y = Q(x) Q(W_g)ᵀ under ctx.recipe, without bias: (y [T, N] in x's
    dtype, what the backward reads: x along T (None unless `need_wgrad`) and W along N, in
    fp32 for the emulated backward, FP8 for the native one; see `fp8.GradOperands`). `offs`
    [G] group ends, `bounds` their (start, end) rows. `gemm` (real FP8 only): a kernel with
    `fp8_cute.scaled_grouped_mm`'s arguments in place of the backend's (a fused epilogue:
    `fp8_cute.glu_fc1`); its result is returned as y. `rows` (real FP8 only): the quantizer
    of x where only its forward form is made (`fp8.input_quantized`'s)."""
    recipe = ctx.recipe
    need_wgrad = need_wgrad and ctx.weight_requires_grad  # frozen weights, no_grad: no wgrad
    fp8.check_operands(op, recipe, x, w, w.shape[-1], w.shape[-2])
    weights = fp8.cached_weights(op, recipe, w, params, ctx.backend.name)
    route = grouped_route(ctx, x, w)
    if not route.forward:
        x_fwd, x_wgrad = fp8.input_operands(recipe, input_, x, bounds)
        y = ctx.backend.grouped_mm(x_fwd, weights.forward.transpose(1, 2), offs)
        return amp.cast(y, x.dtype), fp8.GradOperands(x_wgrad if need_wgrad else None,
                                                      weights.dgrad)
    native_backward = route.backward
    token_major = need_wgrad and route.fp8_wgrad
    if token_major and not fp8.defers_token_major(recipe, input_):
        x_q, x_tm = fp8.input_both(recipe, input_, x, offs, ctx.backend.name)  # one pass pair
    elif token_major:  # x itself kept for a token-major operand made in backward (default)
        x_q, x_tm = fp8.input_deferred(recipe, input_, x, offs, ctx.backend.name)
    else:
        x_q, x_tm = fp8.input_quantized(recipe, input_, x, ctx.backend.name, rows), None
    w_data, w_scale_inv = weights.fp8
    y = (gemm or _scaled_grouped_mm(ctx.backend.name))(x_q, w_data, w_scale_inv, offs, x.dtype)
    if token_major:
        return y, fp8.GradOperands(x_tm, *weights.dgrad_fp8)
    # an emulated wgrad (with a native dgrad under block scaling) reads x along T in fp32
    x_wgrad = fp8.input_wgrad(recipe, input_, x, bounds, x_q) if need_wgrad else None
    return y, fp8.GradOperands(x_wgrad, *(weights.dgrad_fp8 if native_backward
                                          else (weights.dgrad,)))


class GroupedGrads:
    """The dgrad and wgrad GEMMs of one grouped linear's FP8 backward, from dY [T, N] (in the
    forward GEMM's compute dtype) and the forward's `fp8.GradOperands`; `backend_name` the
    step's backend. Native: dY quantized along N (the dgrad's operand) and along the tokens,
    token-major (the wgrad's), real FP8 GEMMs. Emulated: the fp32 operands of
    `fp8.grad_operands` on the backend's grouped GEMMs."""

    def __init__(self, ctx, dy: Tensor, operands: fp8.GradOperands, offs: Tensor,
                 bounds: list[tuple[int, int]], need_wgrad: bool = True,
                 rows=None):
        self.ctx, self.dy, self.operands, self.offs = ctx, dy, operands, offs
        recipe, self.dy_tm, self.dy_w = ctx.recipe, None, None
        # the wgrad runs on FP8 token-major operands (else on fp32 ones: `wgrad_reason`)
        self.native_wgrad = operands.native and not wgrad_reason(recipe)
        if self.native_wgrad and need_wgrad:  # both forms of dy in one pass pair if possible
            self.dy_q, self.dy_tm = fp8.grad_both(recipe, dy, offs, ctx.backend.name)
        elif operands.native:  # `rows`: the quantizer of dy's dgrad form (`grad_quantized`'s)
            self.dy_q = fp8.grad_quantized(recipe, dy, ctx.backend.name, rows)
            if need_wgrad and not self.native_wgrad:
                self.dy_w = fp8.grad_along_tokens(recipe, dy, bounds, self.dy_q)
        else:
            self.dy_d, self.dy_w = fp8.grad_operands(recipe, dy, bounds)

    def dgrad(self, gemm=None) -> Tensor:
        """dX [T, K] = dY_g W_g per group, in dY's dtype. `gemm` (native only): a kernel with
        `fp8_cute.scaled_grouped_mm`'s arguments in place of the backend's (a fused epilogue:
        `fp8_cute.glu_dgrad`); its result is returned."""
        ops = self.operands
        if not ops.native:
            return amp.cast(self.ctx.backend.grouped_mm(self.dy_d, ops.w, self.offs),
                            self.dy.dtype)
        gemm = gemm or _scaled_grouped_mm(self.ctx.backend.name)
        return gemm(self.dy_q, ops.w, ops.w_scale_inv, self.offs, self.dy.dtype)

    def with_input(self, x_w: Tensor | fp8_wgrad.TokenMajor) -> GroupedGrads:
        """Sets the wgrad's x operand where the forward saved none (the fused MLP recomputes
        its activation): `fp8.input_token_major`'s or `fp8.input_operands`' form."""
        self.operands = fp8.GradOperands(x_w, self.operands.w, self.operands.w_scale_inv)
        return self

    def wgrad_operands(self) -> tuple[Tensor | None, Tensor | None, object]:
        """(x, dy, wgrad_fn) for `GroupedLinear.weight_grads`: the fp32 operands (emulated), or
        None, None and `wgrad_fn(out, accumulate)` running the FP8 wgrad into `out` [G, N, K]
        (native)."""
        if not self.native_wgrad:
            return self.operands.x, self.dy_w, None
        recipe, dy, offs, dy_q, x_tm = self.ctx.recipe, self.dy, self.offs, self.dy_q, \
            self.operands.x
        backend_name, made = self.ctx.backend.name, self.dy_tm
        kernel = _wgrad_kernel(backend_name, recipe)[0]

        def wgrad_fn(out: Tensor, accumulate: bool) -> Tensor:
            # made with dy's dgrad operand, else only now that dW is computed
            dy_tm = made if made is not None else \
                fp8.grad_token_major(recipe, dy, offs, dy_q, backend_name)
            x_tm_now = x_tm.resolve(recipe, backend_name) \
                if isinstance(x_tm, fp8.DeferredTokenMajor) else x_tm
            operands = (dy_tm.data, x_tm_now.data, dy_tm.scale_inv, x_tm_now.scale_inv,
                        dy_tm.offs)
            if out.dtype in (torch.bfloat16, torch.float32) and out.is_contiguous():
                return kernel(*operands, out=out, accumulate=accumulate)
            # fp16 weights or a strided buffer: one fp32 result, then one rounding into out
            result = kernel(*operands, out=torch.empty(out.shape, dtype=torch.float32,
                                                       device=out.device))
            return out.add_(result) if accumulate else out.copy_(result)

        return None, None, wgrad_fn
