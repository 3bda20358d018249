"""FP8 in te_seq's ops: the recipe of the call (`te_seq.autocast`) and the GEMM operands.

`te_seq.autocast(recipe=...)` sets the recipe for te_seq calls inside it; the fuser reads it once
per call into every context (`ctx.recipe`) and into the plan key. The linear ops (BasicLinear,
GroupedLinear, the fused GroupedMLP) then take their GEMM operands from here: each operand
quantized along its GEMM's reduction dimension and dequantized in fp32
(`te_seq.kernels.fp8_reference`), so a GEMM of those operands in fp32 is exactly what an FP8
GEMM with fp32 accumulation computes up to summation order. te_seq/recipe.py states the rules.
The forward GEMM takes the quantized operands themselves (`input_quantized`,
`WeightOperands.quantized`) where a real FP8 GEMM runs (core/fp8_gemm.py).

Weights are quantized once per weight version and recipe, and cached on the op
(`cached_weights`): the key is each Parameter's identity, `_version` counter and data pointer,
so an optimizer step (an in-place write) or a new Parameter is always seen.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from te_seq import config
from te_seq.kernels import fp8_quantize, fp8_wgrad
from te_seq.kernels import fp8_reference as ref
from te_seq.recipe import Float8CurrentScaling, Recipe

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
QUANTIZED_ATTR = "_te_seq_fp8"  # on a tensor `ops.Quantize` returned: its `QuantizedInput`

# The recipe of the enclosing `te_seq.autocast` (None outside). A module global, not a
# ContextVar, like core/amp.py's state: torch.compile traces a global's read.
_ACTIVE: Recipe | None = None


def active_recipe() -> Recipe | None:
    """The recipe te_seq calls made now run under (None: no FP8)."""
    return _ACTIVE


def recipe_key() -> tuple | None:
    """The active recipe as plain values (for plan keys, which torch.compile passes around)."""
    r = _ACTIVE
    if r is None:
        return None
    return (type(r).__name__, r.fp8_format, r.margin, r.power_of_two_scales, r.cache_weights,
            r.fp8_wgrad)


class autocast:  # noqa: N801 (a context manager used like a function)
    """`with te_seq.autocast(recipe=...):` runs te_seq's linear GEMMs inside on FP8 operands.

    enabled=False runs the block without FP8 (also inside an enabled block); `recipe` defaults
    to `Float8CurrentScaling()`. Nested blocks restore the outer recipe on exit. Only te_seq
    ops read it; torch.autocast is independent and may be combined with it.
    """

    def __init__(self, enabled: bool = True, recipe: Recipe | None = None) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"te_seq.autocast: enabled must be a bool, got {enabled!r}")
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(
                "te_seq.autocast: recipe must be a te_seq.recipe recipe (Float8CurrentScaling, "
                f"Float8BlockScaling, Float8RowwiseScaling), got {type(recipe).__name__}"
            )
        self.recipe = (recipe or Float8CurrentScaling()) if enabled else None
        self.outer: list[Recipe | None] = []

    def __enter__(self) -> autocast:
        global _ACTIVE
        self.outer.append(_ACTIVE)
        _ACTIVE = self.recipe
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        _ACTIVE = self.outer.pop()


# --- checks ---------------------------------------------------------------------------------


# (id(recipe), x's dtype, W's dtype, K, N) -> recipe, of GEMMs `check_operands` passed: what
# it reads, so the next call with the same facts passes too (a refused call is never recorded:
# refused again). Keyed by the recipe's identity (hashing a recipe is a Python call), which
# the entry holds (no id reuse).
_PASSED: dict[tuple, Recipe] = {}


def check_operands(op: object, recipe: Recipe, x: Tensor, w: Tensor, k: int, n: int) -> None:
    """ValueError naming the op, the recipe and the values when `recipe` cannot quantize a GEMM
    of x [..., K] with W [.., N, K]: a dtype other than fp32/bf16/fp16, or K or N not a multiple
    of the recipe's block. Facts that passed once are not checked again (one set lookup)."""
    facts = (id(recipe), x.dtype, w.dtype, k, n)
    if _PASSED.get(facts) is recipe:
        return
    _check_operands(op, recipe, x, w, k, n)
    if len(_PASSED) >= 256:  # recipes made afresh in a loop: no growth
        _PASSED.clear()
    _PASSED[facts] = recipe


def _check_operands(op: object, recipe: Recipe, x: Tensor, w: Tensor, k: int, n: int) -> None:
    name = type(op).__name__
    for label, t in (("input", x), ("weight", w)):
        if t.dtype not in _DTYPES:
            raise ValueError(
                f"{name}: recipe {recipe} quantizes float32, bfloat16 or float16 GEMM operands, "
                f"got {label} dtype {t.dtype}"
            )
    m = recipe.block_multiple
    if m is not None and (k % m or n % m):
        raise ValueError(
            f"{name}: recipe {recipe} needs in_features and out_features to be multiples of {m} "
            f"(1x{m} tiles, {m}x{m} weight blocks), got in_features={k}, out_features={n}"
        )


def check_quantizable(op: object, recipe: Recipe, x: Tensor) -> None:
    """ValueError when `recipe` cannot quantize x [..., C] as a GEMM's input (ops.Quantize)."""
    name = type(op).__name__
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name}: recipe {recipe} quantizes float32, bfloat16 or float16, got "
                         f"{x.dtype}")
    m = recipe.block_multiple
    if m is not None and x.shape[-1] % m:
        raise ValueError(f"{name}: recipe {recipe} needs the last dimension to be a multiple of "
                         f"{m} (1x{m} tiles), got {x.shape[-1]}")


# --- operands -------------------------------------------------------------------------------


class RoleScaling(NamedTuple):
    """A recipe's scaling of one operand role: its block, its rule, and whether the block is
    row-wise, one per tensor, or 1x128 tiles."""

    block: ref.QuantBlock
    rule: ref.ScaleRule
    rowwise: bool
    per_tensor: bool
    tiles: bool


# id(recipe) -> (recipe, {role: RoleScaling}): `Recipe.rule` makes a new ScaleRule on each
# call, and every hash or comparison of a recipe, a block or a rule is a Python call; the hot
# paths read them from here. Keyed by identity (the entry holds the recipe, so its id is not
# reused while the entry lives); a recipe made afresh per call misses and replaces entries.
_SCALINGS: dict[int, tuple[Recipe, dict[str, RoleScaling], bool]] = {}


def scaling(recipe: Recipe, role: str) -> RoleScaling:
    """`recipe`'s `RoleScaling` of operands of `role` ("input", "weight" or "grad"), made once
    per recipe object (the same rule object on every call)."""
    found = _SCALINGS.get(id(recipe)) or _recipe_scalings(recipe)
    return found[1][role]


def block_scaled(recipe: Recipe) -> bool:
    """Whether `recipe` quantizes x / dy in 1x128 tiles and W in 128x128 blocks (made once per
    recipe object, as `scaling`)."""
    return (_SCALINGS.get(id(recipe)) or _recipe_scalings(recipe))[2]


def _recipe_scalings(recipe: Recipe) -> tuple[Recipe, dict[str, RoleScaling], bool]:
    """`_SCALINGS`' entry of a recipe not in it yet."""
    if len(_SCALINGS) >= 64:  # recipes made afresh in a loop: no growth
        _SCALINGS.clear()
    roles = {r: _scaling(recipe, r) for r in ("input", "weight", "grad")}
    blocks = (roles["input"].block, roles["weight"].block)
    found = _SCALINGS[id(recipe)] = (recipe, roles, blocks == (ref.QuantBlock(1, 128),
                                                               ref.QuantBlock(128, 128)))
    return found


def _scaling(recipe: Recipe, role: str) -> RoleScaling:
    block = recipe.block(role)
    return RoleScaling(block, recipe.rule(role), block == ref.ROWWISE,
                       block == ref.QuantBlock(None, None), block == ref.QuantBlock(1, 128))


@dataclass(frozen=True)
class QuantizedInput:
    """What `ops.Quantize` attaches to its output: the recipe, the input as the next GEMM's
    forward operand (quantized along its last dimension, with its `transpose` along the rows for
    a wgrad over all rows), and the unquantized source (for per-expert wgrad operands)."""

    recipe: Recipe
    forward: ref.QuantizedTensor
    source: Tensor


def quantize_input(recipe: Recipe, x: Tensor) -> QuantizedInput:
    """x [..., C] quantized as a GEMM input under `recipe` (what ops.Quantize produces)."""
    rows = x.reshape(-1, x.shape[-1])
    block, rule = recipe.block("input"), recipe.rule("input")
    forward = ref.quantize(rows, block, rule)
    forward.transpose = ref.quantize(rows.t(), block, rule)
    return QuantizedInput(recipe, forward, x)


def _marker(recipe: Recipe, input_: Tensor) -> QuantizedInput | None:
    found = getattr(input_, QUANTIZED_ATTR, None)
    return found if found is not None and found.recipe == recipe else None


def _along_tokens(recipe: Recipe, role: str, t: Tensor, bounds, along_k) -> Tensor:
    """t [T, C] as a wgrad operand (quantized along T within each group), fp32. Per-tensor
    scaling does not depend on the layout: that is `along_k()`, the forward operand itself.
    Under `fp8_wgrad=False`, t itself (the wgrad runs in high precision)."""
    if not recipe.fp8_wgrad:
        return t
    block = recipe.block(role)
    if block == ref.QuantBlock(None, None):
        return along_k()
    return ref.qdq_columns_per_group(t, bounds, block, recipe.rule(role))


def input_quantized(recipe: Recipe, input_: Tensor, x: Tensor, backend_name: str = "torch",
                    rows=None) -> ref.QuantizedTensor:
    """x [T, K] quantized along K as the forward GEMM's operand: as `ops.Quantize` made it when
    `input_` is its output (never quantized twice), else quantized here (by the kernels
    `fp8_quantize` picks for `backend_name`; `rows`: a quantizer with `fp8_quantize.rows`'
    arguments in its place, a prepared one, None for that one)."""
    marker = _marker(recipe, input_)
    if marker is not None:
        return marker.forward
    x_scaling = scaling(recipe, "input")
    return (rows or fp8_quantize.rows)(x, x_scaling.block, x_scaling.rule, backend_name)


def input_wgrad(recipe: Recipe, input_: Tensor, x: Tensor, bounds,
                forward: ref.QuantizedTensor) -> Tensor:
    """x along T [T, K] fp32 for the wgrad; `forward` is `input_quantized`'s result."""
    marker = _marker(recipe, input_)
    if marker is None or not recipe.fp8_wgrad:  # high precision: x itself
        return _along_tokens(recipe, "input", x, bounds, lambda: forward.dequantize())
    if len(bounds) == 1 and bounds[0] == (0, x.shape[0]):
        return marker.forward.transpose.dequantize().t()
    source = marker.source.reshape(x.shape)
    return _along_tokens(recipe, "input", source, bounds, lambda: forward.dequantize())


def input_operands(recipe: Recipe, input_: Tensor, x: Tensor, bounds) -> tuple[Tensor, Tensor]:
    """(x along K for the forward GEMM, x along T for the wgrad), both [T, K] fp32. An input
    that `ops.Quantize` made is taken as it was quantized there (never quantized twice)."""
    quantized = input_quantized(recipe, input_, x)
    forward = quantized.dequantize()
    marker = _marker(recipe, input_)
    if marker is None and recipe.block("input") == ref.QuantBlock(None, None) \
            and recipe.fp8_wgrad:
        return forward, forward  # per tensor: the wgrad operand is the forward one
    return forward, input_wgrad(recipe, input_, x, bounds, quantized)


def grad_operands(recipe: Recipe, dy: Tensor, bounds) -> tuple[Tensor, Tensor]:
    """(dy along N for the dgrad, dy along T for the wgrad), both [T, N] fp32."""
    dgrad = ref.qdq(dy, recipe.block("grad"), recipe.rule("grad"))
    return dgrad, _along_tokens(recipe, "grad", dy, bounds, lambda: dgrad)


def grad_along_tokens(recipe: Recipe, dy: Tensor, bounds, along_n: ref.QuantizedTensor
                      ) -> Tensor:
    """dy along T [T, N] fp32 for an emulated wgrad (`grad_operands`' second value), where dy's
    dgrad operand `along_n` is already quantized (per tensor: its values)."""
    return _along_tokens(recipe, "grad", dy, bounds, lambda: along_n.dequantize())


def input_token_major(recipe: Recipe, input_: Tensor, x: Tensor, offs: Tensor,
                      forward: ref.QuantizedTensor | None,
                      backend_name: str = "torch") -> fp8_wgrad.TokenMajor:
    """x [T, K] along the tokens of each group as the FP8 wgrad's operand, token-major (row-wise
    or per-tensor recipes; the values of `input_wgrad`): per tensor the forward operand
    `forward` itself laid out (None: quantized here), else quantized from x (or from an
    `ops.Quantize` source)."""
    if scaling(recipe, "input").per_tensor:
        return fp8_wgrad.token_major_from(
            forward or input_quantized(recipe, input_, x, backend_name), offs)
    marker = _marker(recipe, input_)
    source = x if marker is None else marker.source.reshape(x.shape)
    return _token_major(recipe, "input", source, offs, backend_name)


def grad_token_major(recipe: Recipe, dy: Tensor, offs: Tensor, along_n: ref.QuantizedTensor,
                     backend_name: str = "torch") -> fp8_wgrad.TokenMajor:
    """dy [T, N] along the tokens of each group, token-major (the values of `grad_operands`'
    wgrad operand); `along_n` is dy quantized for the dgrad (per tensor: the same data)."""
    if scaling(recipe, "grad").per_tensor:
        return fp8_wgrad.token_major_from(along_n, offs)
    return _token_major(recipe, "grad", dy, offs, backend_name)


def _token_major(recipe: Recipe, role: str, t: Tensor, offs: Tensor, backend_name: str
                 ) -> fp8_wgrad.TokenMajor:
    """t along each group's tokens, token-major: one scale per (group, column) (row-wise), or
    per (128-token block, column) under block scaling (1x128 blocks along the tokens)."""
    t_scaling = scaling(recipe, role)
    if t_scaling.tiles:
        return fp8_quantize.token_major_blocks(t, offs, t_scaling.rule, backend_name)
    return fp8_quantize.token_major(t, offs, t_scaling.rule, backend_name)


def input_both(recipe: Recipe, input_: Tensor, x: Tensor, offs: Tensor, backend_name: str
               ) -> tuple[ref.QuantizedTensor, fp8_wgrad.TokenMajor]:
    """(`input_quantized`, `input_token_major`) of x, made together where one pass pair can
    (row-wise blocks, no `ops.Quantize` input)."""
    if _marker(recipe, input_) is None and recipe.block("input") == ref.ROWWISE:
        return fp8_quantize.rows_and_token_major(x, offs, recipe.rule("input"), backend_name)
    forward = input_quantized(recipe, input_, x, backend_name)
    return forward, input_token_major(recipe, input_, x, offs, forward, backend_name)


def grad_both(recipe: Recipe, dy: Tensor, offs: Tensor, backend_name: str
              ) -> tuple[ref.QuantizedTensor, fp8_wgrad.TokenMajor]:
    """(`grad_quantized`, `grad_token_major`) of dy, made together where one pass pair can."""
    dy_scaling = scaling(recipe, "grad")
    if dy_scaling.rowwise:
        return fp8_quantize.rows_and_token_major(dy, offs, dy_scaling.rule, backend_name)
    along_n = grad_quantized(recipe, dy, backend_name)
    return along_n, grad_token_major(recipe, dy, offs, along_n, backend_name)


def grad_quantized(recipe: Recipe, dy: Tensor, backend_name: str = "torch",
                   rows=None) -> ref.QuantizedTensor:
    """dy [T, N] quantized along N as the dgrad GEMM's operand (`rows` as
    `input_quantized`'s)."""
    dy_scaling = scaling(recipe, "grad")
    return (rows or fp8_quantize.rows)(dy, dy_scaling.block, dy_scaling.rule, backend_name)


@dataclass
class DeferredTokenMajor:
    """x [T, K] as the forward GEMM read it, for a wgrad on token-major FP8 operands that
    quantizes it along the tokens only when it runs (`resolve`; `te_seq.config.
    set_fp8_token_major_input(False)`, the default): the forward keeps no FP8 copy of x.
    `offs` int32 [G] the group ends."""

    x: Tensor
    offs: Tensor
    amax: Tensor | None = None  # x's max |x| per (group, column) [G, K], where made in forward

    def resolve(self, recipe: Recipe, backend_name: str) -> fp8_wgrad.TokenMajor:
        """`input_token_major` of x: the bits the forward would have kept."""
        if self.amax is not None:  # one cast pass from the forward's maxima
            return fp8_quantize.token_major_from_amax(self.x, self.offs, self.amax,
                                                      scaling(recipe, "input").rule)
        return input_token_major(recipe, self.x, self.x, self.offs, None, backend_name)


def input_deferred(recipe: Recipe, input_: Tensor, x: Tensor, offs: Tensor, backend_name: str
                   ) -> tuple[ref.QuantizedTensor, DeferredTokenMajor]:
    """(`input_quantized`, x kept for its token-major form in backward): with row-wise blocks
    on the cute kernels the same read of x also yields its (group, column) maxima, so that
    backward needs one cast pass only."""
    x_scaling = scaling(recipe, "input")
    if not x_scaling.rowwise:
        return input_quantized(recipe, input_, x, backend_name), DeferredTokenMajor(x, offs)
    forward, amax = fp8_quantize.rows_keeping_group_amax(x, offs, x_scaling.rule,
                                                         backend_name)
    return forward, DeferredTokenMajor(x, offs, amax)


def defers_token_major(recipe: Recipe, input_: Tensor) -> bool:
    """Whether x's token-major wgrad operand is made in backward (`DeferredTokenMajor`): unless
    the config asks for it in forward, or `ops.Quantize` made x (its quantized form travels as
    an attribute of the forward's input, which backward does not see)."""
    return not config.fp8_token_major_input() and _marker(recipe, input_) is None


@dataclass
class GradOperands:
    """What one grouped GEMM's FP8 backward reads of its forward: x along the tokens (the
    wgrad's operand; None where the caller recomputes it) and W along N (the dgrad's).
    Emulated: `x` [T, K] fp32 and `w` [G, N, K] fp32, dequantized. Native (`w_scale_inv` set):
    `x` a `TokenMajor` (or a `DeferredTokenMajor`), `w` the FP8 data of Wᵀ [G, K, N] with
    `w_scale_inv` [G, K, 1] (row-wise) or [G, 1, 1] (per tensor); under block scaling `x` a
    `BlockTokenMajor` (scales per 128-token block) and `w_scale_inv` Wᵀ's 128x128 grid
    [G, ⌈K/128⌉, ⌈N/128⌉].
    `tensors()` / `load()`: as five saved tensors (None-padded)."""

    x: Tensor | fp8_wgrad.TokenMajor | DeferredTokenMajor | None
    w: Tensor
    w_scale_inv: Tensor | None = None

    @property
    def native(self) -> bool:
        return self.w_scale_inv is not None

    def tensors(self) -> tuple[Tensor | None, ...]:
        x = self.x
        if isinstance(x, DeferredTokenMajor):  # x as read, its maxima (or None), group ends
            return (x.x, x.amax, x.offs, self.w, self.w_scale_inv)
        if not isinstance(x, fp8_wgrad.TokenMajor):  # fp32 along T, or None
            return (x, None, None, self.w, self.w_scale_inv)
        return (x.data, x.scale_inv, x.offs, self.w, self.w_scale_inv)

    @classmethod
    def load(cls, tensors: tuple[Tensor | None, ...]) -> GradOperands:
        x, x_scale_inv, x_offs, w, w_scale_inv = tensors
        if w_scale_inv is None:
            return cls(x, w)
        if x_scale_inv is None:  # x fp32 along T (an emulated wgrad), None, or deferred
            return cls(x if x_offs is None else DeferredTokenMajor(x, x_offs), w, w_scale_inv)
        if x.dtype.itemsize > 1:  # deferred, with its maxima: x is not FP8 data
            return cls(DeferredTokenMajor(x, x_offs, x_scale_inv), w, w_scale_inv)
        # scales per 128-token block [P / 128, K], else per group [G, K]: P / 128 > G unless
        # there are no tokens (then both read as zeros)
        blocks = x_scale_inv.shape[0] != x_offs.shape[0]
        kind = fp8_wgrad.BlockTokenMajor if blocks else fp8_wgrad.TokenMajor
        return cls(kind(x, x_scale_inv, x_offs), w, w_scale_inv)


def _weight_pair(recipe: Recipe, w: Tensor) -> tuple[ref.QuantizedTensor, ref.QuantizedTensor]:
    """(W [N, K] quantized along K for the forward, Wᵀ [K, N] quantized along N for the
    dgrad). Per-tensor and 128x128 blocks are the same for W and Wᵀ: the dgrad operand is then
    the forward one transposed (no second quantization)."""
    block, rule = recipe.block("weight"), recipe.rule("weight")
    forward = ref.quantize(w, block, rule)
    if block.rows == block.cols:
        return forward, ref.QuantizedTensor(forward.data.t(), forward.scale_inv.t(), block, rule)
    return forward, ref.quantize(w.t(), block, rule)


def _stacked_operands(recipe: Recipe, w: Tensor, backend_name: str = "torch") -> WeightOperands:
    """`_weight_pair` of every expert of w [G, N, K], each quantized on its own, in a few
    launches for all of them (`fp8_reference.quantize_stacked`; row-wise blocks on the cute
    kernels where they apply: `fp8_quantize.stacked_weight_rows`): after each optimizer step,
    and on every replay of a CUDA graph, all G experts are quantized again."""
    block, rule = recipe.block("weight"), recipe.rule("weight")
    if block == ref.ROWWISE:
        forward, dgrad = fp8_quantize.stacked_weight_rows(w, rule, backend_name)
        return WeightOperands(None, None, stacked=True, stacked_fp8=(forward, dgrad))
    forward = ref.quantize_stacked(w, block, rule)
    if block.rows == block.cols:  # W and Wᵀ share their blocks: the dgrad operand is a view
        dgrad = ref.QuantizedTensor(forward.data.transpose(1, 2),
                                    forward.scale_inv.transpose(1, 2), block, rule)
    else:
        dgrad = ref.quantize_stacked(w.transpose(1, 2), block, rule)
    return WeightOperands(None, None, stacked=True, stacked_fp8=(forward, dgrad))


def _unstack(q: ref.QuantizedTensor) -> list[ref.QuantizedTensor]:
    return [ref.QuantizedTensor(d, s, q.block, q.rule)
            for d, s in zip(q.data.unbind(0), q.scale_inv.unbind(0))]


class WeightOperands:
    """A weight's FP8 operands, one `QuantizedTensor` per [N, K] matrix (one for a 2-D W, G for
    [G, N, K]): `quantized` (W along K for the forward) and `dgrad_quantized` (Wᵀ [K, N] along
    N for the dgrad). The fp32 and the stacked forms are made on first use only, and so are
    the per-matrix lists of a weight quantized all at once (`stacked_fp8`: the native GEMMs
    read the stacked form; G views and records per form cost ~1 ms of host time at G=128)."""

    def __init__(self, quantized: list[ref.QuantizedTensor] | None,
                 dgrad_quantized: list[ref.QuantizedTensor] | None, stacked: bool,
                 stacked_fp8: tuple[ref.QuantizedTensor, ref.QuantizedTensor] | None = None):
        self._lists, self.stacked = (quantized, dgrad_quantized), stacked
        self._stacked_fp8 = stacked_fp8  # (W, Wᵀ) of all experts, [G, ...], when made at once

    @functools.cached_property
    def quantized(self) -> list[ref.QuantizedTensor]:
        found = self._lists[0]
        return _unstack(self._stacked_fp8[0]) if found is None else found

    @functools.cached_property
    def dgrad_quantized(self) -> list[ref.QuantizedTensor]:
        found = self._lists[1]
        return _unstack(self._stacked_fp8[1]) if found is None else found

    def _stack(self, values: list[Tensor]) -> Tensor:
        return torch.stack(values) if self.stacked else values[0]

    @functools.cached_property
    def forward(self) -> Tensor:
        """W along K dequantized, fp32, W's shape (what an emulated forward GEMM reads)."""
        return self._stack([q.dequantize() for q in self.quantized])

    @functools.cached_property
    def dgrad(self) -> Tensor:
        """W along N dequantized, fp32, W's shape (what an emulated dgrad GEMM reads)."""
        return self._stack([q.dequantize().t() for q in self.dgrad_quantized])

    @functools.cached_property
    def fp8(self) -> tuple[Tensor, Tensor]:
        """(data [G, N, K] FP8, scale_inv [G, Nb, Kb] fp32) of a stacked weight."""
        if self._stacked_fp8 is not None:
            q = self._stacked_fp8[0]
            return q.data, _flat_rows_view(q.scale_inv)
        return (torch.stack([q.data for q in self.quantized]),
                _flat_rows_view(torch.stack([q.scale_inv for q in self.quantized])))

    @functools.cached_property
    def dgrad_fp8(self) -> tuple[Tensor, Tensor]:
        """(data [G, K, N] FP8, scale_inv [G, K, 1] row-wise or [G, 1, 1] per tensor) of a
        stacked weight: the dgrad GEMM's second operand, Wᵀ along N."""
        if self._stacked_fp8 is not None:  # as made where N is contiguous, else contiguous
            q = self._stacked_fp8[1]
            data = q.data if q.data.stride(-1) == 1 else q.data.contiguous()
            return data, _flat_rows_view(q.scale_inv.contiguous())
        return (torch.stack([q.data for q in self.dgrad_quantized]),
                _flat_rows_view(torch.stack([q.scale_inv for q in self.dgrad_quantized])))


def _flat_rows_view(scale_inv: Tensor) -> Tensor:
    """Row-wise scales [G, N, 1] as a view of a contiguous [G, N] tensor (the same values):
    the grouped kernels' operand, which `fp8_cute.row_scales` then takes without a view op on
    every call (made once per weight version). Other scales (per tensor, blocks) as given.
    `detach` makes the [G, N] tensor an alias of its own (not a view), so that it is the
    `_base` of the [G, N, 1] view."""
    if scale_inv.dim() != 3 or scale_inv.shape[-1] != 1 or scale_inv.shape[1] == 1:
        return scale_inv
    return scale_inv.reshape(scale_inv.shape[:2]).contiguous().detach()[..., None]


def cached_weights(
    op: torch.nn.Module, recipe: Recipe, w: Tensor, params: list[Tensor],
    backend_name: str = "torch",
) -> WeightOperands:
    """W [N, K] (or [G, N, K]: each expert's weight quantized on its own) as FP8 operands,
    cached on `op` until a Parameter in `params` changes. `backend_name` picks the
    quantization kernels (the same bits on every backend).

    While a CUDA graph is being captured the cache is neither read nor written: the graph must
    hold the quantization kernels (a replay after an optimizer step then quantizes the weights
    it reads), and its outputs live in the graph's memory, which later replays overwrite.
    Except where `te_seq.make_graphed_callables` gave the op a weight graph
    (`capture_weight_graphs`): then every call, captured or not, reads that graph's operands,
    re-quantized in place (the graph replayed) when a Parameter changed."""
    capturing = _capturing(w.device)
    base = (
        recipe,
        backend_name,  # the kernels' layouts differ (the cute dgrad form is a strided view)
        w.dtype,
        tuple(w.shape),
    )
    graphed = op.__dict__.get("_fp8_weight_graph")
    if graphed is not None and graphed.base == base:
        return graphed.current()
    key = (*base, _versions(params))
    cache = op.__dict__.get("_fp8_weight_cache")
    if cache is not None and cache[0] == key and not capturing:
        return cache[1]
    weights = _weight_operands(recipe, w, backend_name)
    if recipe.cache_weights and not torch.compiler.is_compiling() and not capturing:
        _watch_optimizer_steps()
        op.__dict__["_fp8_weight_cache"] = (key, weights)
        # what a weight graph would quantize (`capture_weight_graphs`); by weak reference, so
        # that a replaced Parameter is not kept alive by it
        op.__dict__["_fp8_weight_source"] = (recipe, backend_name,
                                             [weakref.ref(p) for p in params])
    return weights


def _weight_operands(recipe: Recipe, w: Tensor, backend_name: str) -> WeightOperands:
    if w.dim() == 3:
        return _stacked_operands(recipe, w, backend_name)
    forward, dgrad = _weight_pair(recipe, w)
    return WeightOperands([forward], [dgrad], stacked=False)


class _WeightGraph:
    """A CUDA graph that quantizes an op's weight Parameters into static operands, replayed
    when one of them changes version (`current`): the forward graphs of
    `make_graphed_callables` read those operands instead of quantizing on every replay."""

    def __init__(self, base: tuple, params: list[Tensor], graph, weights: WeightOperands):
        self.base, self.params, self.graph, self.weights = base, params, graph, weights
        self.data_ptrs = [p.data_ptr() for p in params]
        self.versions: tuple | None = _versions(params)  # None: replay on the next use

    def current(self) -> WeightOperands:
        versions = _versions(self.params)
        if versions != self.versions:
            for p, ptr in zip(self.params, self.data_ptrs):
                if p.data_ptr() != ptr:
                    raise RuntimeError(
                        f"a weight {tuple(p.shape)} of a graphed module was replaced by new "
                        "memory after make_graphed_callables captured its FP8 weight graph "
                        "(the graphs read the old memory): update weights in place (optimizer "
                        "steps, `copy_`), or capture again"
                    )
            if _capturing(self.params[0].device):
                raise RuntimeError("a weight changed while a CUDA graph was being captured")
            self.graph.replay()
            self.versions = versions
        return self.weights


def _graph_weight_input(key: tuple, params: list[Tensor]):
    """What the weight graph quantizes: the Parameter itself, or the experts' Parameters
    stacked, where that is the tensor the eager calls quantized (same dtype and shape; no cast);
    None where it is not."""
    dtype, shape = key[2:4]
    if any(p.dtype != dtype or not p.is_contiguous() for p in params):
        return None
    if len(params) == 1 and tuple(params[0].shape) == shape:
        return lambda: params[0].detach()
    if len(params) > 1 and shape == (len(params), *params[0].shape):
        return lambda: torch.stack([p.detach() for p in params])
    return None


def capture_weight_graphs(module: torch.nn.Module, pool_factory) -> list[_WeightGraph]:
    """Give each op of `module` whose FP8 weight operands are cached (made eagerly, e.g. by the
    warm-up of `make_graphed_callables`) a weight graph (`_WeightGraph`): the same quantization
    captured in a memory pool of its own (`pool_factory()`: no other graph's replay writes the
    operands it holds), so graphs captured afterwards read its operands and no longer hold the
    quantization kernels. Only where the eager calls quantized the Parameter itself or the
    experts' Parameters stacked (`_graph_weight_input`). The graph is replayed once, so the
    operands hold the current weights. Returns them all, an earlier capture's included
    (`_WeightGraph.current()` before each replay of a graph that reads them)."""
    made = []
    for op in module.modules():
        existing = op.__dict__.get("_fp8_weight_graph")
        if existing is not None:  # from an earlier capture: the new graphs read it too
            made.append(existing)
            continue
        source = op.__dict__.get("_fp8_weight_source")
        cache = op.__dict__.get("_fp8_weight_cache")
        if source is None or cache is None:
            continue
        recipe, backend_name, refs = source
        params = [ref() for ref in refs]
        key, eager = cache
        if any(p is None for p in params):
            continue
        weight = _graph_weight_input(key, params)
        if weight is None or key[-1] != _versions(params):
            continue
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool_factory()):
            weights = _weight_operands(recipe, weight(), backend_name)
            for name in _used_properties(eager):  # as the eager calls read them
                getattr(weights, name)
        graph.replay()
        made.append(_WeightGraph(key[:4], list(params), graph, weights))
        op.__dict__["_fp8_weight_graph"] = made[-1]
        del op.__dict__["_fp8_weight_cache"]
    return made


def _used_properties(weights: WeightOperands) -> list[str]:
    """The lazily made forms of `weights` that calls have read (`functools.cached_property`
    stores them in the instance dict): a weight graph makes the same ones, so that no form is
    first made inside another graph (whose memory later replays overwrite)."""
    return [name for name, value in vars(type(weights)).items()
            if isinstance(value, functools.cached_property) and name in weights.__dict__]


def refresh_weight_graphs(module: torch.nn.Module) -> None:
    """Re-quantize (replay) the weight graphs of `module`'s ops whose Parameter changed."""
    for op in module.modules():
        graphed = op.__dict__.get("_fp8_weight_graph")
        if graphed is not None:
            graphed.current()


def _versions(params: list[Tensor]) -> tuple:
    """What a cached weight form depends on: the count of optimizer steps taken (torch.optim's
    fused optimizers write the Parameters without moving their version counters), then each
    Parameter's (identity, version counter, data pointer) (one weight, the usual case, without
    a generator's frames)."""
    if len(params) == 1:
        p = params[0]
        return (_OPTIMIZER_STEPS, (id(p), p._version, p.data_ptr()))
    return (_OPTIMIZER_STEPS, *[(id(p), p._version, p.data_ptr()) for p in params])


# Optimizer steps taken since the first weight was cached: every `torch.optim.Optimizer.step()`
# (a subclass's too) moves it, through a global step hook registered with that first cache
# entry, so a step that writes the weights without a version counter seeing it (`fused=True`,
# which writes them in its own kernel) still re-quantizes them. Not seen: a step captured in a
# CUDA graph and replayed, and writes through `param.data` (`clear_weight_cache`).
_OPTIMIZER_STEPS = 0
_STEP_HOOK = None


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _OPTIMIZER_STEPS
    _OPTIMIZER_STEPS += 1


def _watch_optimizer_steps() -> None:
    global _STEP_HOOK
    if _STEP_HOOK is None:
        _STEP_HOOK = register_optimizer_step_post_hook(_count_optimizer_step)


def _capturing(device: torch.device) -> bool:
    """Whether `device`'s current CUDA stream is capturing a graph (asked only for a CUDA
    device: no `torch.cuda.is_available()` query, ~2 µs, on every call)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def clear_weight_cache(op: torch.nn.Module) -> None:
    """Drop `op`'s cached quantized weights (they are recomputed on the next FP8 call). A
    weight graph stays (the graphs captured with it read its operands) and is replayed on the
    next use."""
    for name in ("_fp8_weight_cache", "_fp8_weight_source"):
        op.__dict__.pop(name, None)
    graphed = op.__dict__.get("_fp8_weight_graph")
    if graphed is not None:
        graphed.versions = None


def with_recipe(needs: list, grouped: bool = True) -> list:
    """An op's kernel needs (`KernelNeed`s) with the active recipe as a fact (unchanged outside
    te_seq.autocast): backends without FP8 kernels decline them in `supports`. Plans are built
    inside the call, so the active recipe is the call's (and the plan key holds it). `grouped`
    (a fact too): whether the op's forward is a grouped GEMM (False: BasicLinear / Linear)."""
    recipe = active_recipe()
    if recipe is None:
        return needs
    return [type(n)(n.kernel, {**n.facts, "recipe": recipe, "grouped": grouped}) for n in needs]


