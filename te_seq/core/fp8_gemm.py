"""The forward GEMM of a linear op under an FP8 recipe: real FP8 on the torch backend where
PyTorch's scaled matmuls take the recipe, the hardware and the shapes, and on the cute backend
(grouped GEMMs only) where its FP8 kernel does; emulated otherwise.

Per GEMM (x [T, K], W [N, K], dy [T, N]):

    forward  y = x Wᵀ    torch backend, CUDA sm_90+, bf16, K and N multiples of 16, per-tensor
                         or row-wise scales: `torch._scaled_mm` (BasicLinear / Linear) or
                         `torch._scaled_grouped_mm` (GroupedLinear, the fused GroupedMLP; sm_90
                         only). Cute backend, same conditions (sm_90), grouped GEMMs:
                         `cute.scaled_grouped_mm` (te_seq/kernels/fp8_cute.py). Else
                         emulated: quantize -> dequantize in fp32, fp32 GEMM.
    dgrad    dx = dy W   emulated everywhere (its operands would need W re-laid out K-major
                         per call and E5M2 dy under "HYBRID", which the grouped kernel refuses)
    wgrad    dW = dyᵀ x  emulated everywhere (operands quantized along tokens per expert: no
                         varlen-K FP8 kernel with row-wise scales along K on sm_90)

`forward_reason` decides (static facts: backend, recipe, dtype, device, widths); the plan step
says which (`step_note`). Both paths quantize exactly the same operands (core/fp8.py), so the
real GEMM differs from the emulation only by summation order and the single bf16 rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_seq.core import amp, fp8
from te_seq.kernels import fp8_cute, fp8_torch
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


def _kernel_name(backend_name: str, grouped: bool) -> str:
    """The real FP8 forward kernel a backend runs (where `forward_reason` is "")."""
    if backend_name == "cute":
        return "cute scaled_grouped_mm"
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


def step_note(recipe: Recipe | None, backend_name: str, op: object, dtype: torch.dtype,
              device: torch.device) -> str:
    """The plan's line on how a step with FP8 GEMMs runs under `recipe` ("" without one)."""
    if recipe is None:
        return ""
    dims, grouped = _gemm_shapes(op)
    why = forward_reason(backend_name, recipe, dtype, device, dims, grouped)
    if why:
        return (f"FP8 {recipe}: GEMM operands quantized -> dequantized in fp32, fp32 GEMMs "
                f"(emulated on {backend_name}: {why})")
    name = _kernel_name(backend_name, grouped)
    return (f"FP8 {recipe}: forward GEMMs via {name} (real FP8, fp32 accumulation); dgrad and "
            f"wgrad emulated (quantize -> dequantize, fp32 GEMMs)")


def _runs_native(ctx, x: Tensor, w: Tensor, grouped: bool) -> bool:
    dims = [(w.shape[-1], w.shape[-2])]
    return not forward_reason(ctx.backend.name, ctx.recipe, x.dtype, x.device, dims, grouped)


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
    bounds: list[tuple[int, int]], need_wgrad: bool = True,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Rows of group g: y = Q(x) Q(W_g)ᵀ under ctx.recipe, without bias: (y [T, N] in x's
    dtype, x along T [T, K] fp32 for the wgrad (None unless `need_wgrad`), W along N
    [G, N, K] fp32 for the dgrad). `offs` [G] group ends, `bounds` their (start, end) rows."""
    recipe = ctx.recipe
    fp8.check_operands(op, recipe, x, w, w.shape[-1], w.shape[-2])
    weights = fp8.cached_weights(op, recipe, w, params)
    if not _runs_native(ctx, x, w, grouped=True):
        x_fwd, x_wgrad = fp8.input_operands(recipe, input_, x, bounds)
        y = ctx.backend.grouped_mm(x_fwd, weights.forward.transpose(1, 2), offs)
        return amp.cast(y, x.dtype), x_wgrad, weights.dgrad
    x_q = fp8.input_quantized(recipe, input_, x)
    w_data, w_scale_inv = weights.fp8
    y = _scaled_grouped_mm(ctx.backend.name)(x_q, w_data, w_scale_inv, offs, x.dtype)
    x_wgrad = fp8.input_wgrad(recipe, input_, x, bounds, x_q) if need_wgrad else None
    return y, x_wgrad, weights.dgrad
