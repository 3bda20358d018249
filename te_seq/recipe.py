"""FP8 training recipes: how the GEMM operands of te_seq's linear ops are quantized.

Use a recipe with `te_seq.autocast(recipe=...)`. Every recipe quantizes the three operands of a
linear's three GEMMs along each GEMM's reduction dimension (y = x Wᵀ, x [T, K], W [N, K]):

    forward  y  = x Wᵀ     x along K,          W along K
    dgrad    dx = dy W     dy along N,         W along N (Wᵀ's rows)
    wgrad    dW = dyᵀ x    dy along T,         x along T  (within each expert's rows)

with one scale per block of the recipe's shape. The scale of a block (te_seq.kernels.fp8_reference
implements it exactly; the reference backend runs it as quantize -> dequantize in fp32):

    amax  = max |v| over the exact block
    scale = fp8_max / amax / 2**margin   (capped at the largest fp32; rounded down to a power of
                                          two with power_of_two_scales; 1 for an all-zero block;
                                          nan, poisoning the block, when it holds inf or nan)
    q     = fp8(clamp(v * scale, ±fp8_max)), dequantized as fp32(q) / scale

fp8_max is 448 for E4M3 and 57344 for E5M2. Forward operands are always E4M3; gradients (dy) are
E5M2 under fp8_format="HYBRID", E4M3 under "E4M3". Master weights keep their dtype; outputs have
the GEMM's usual dtype (the input's, or torch.autocast's). Quantized weights are cached across
calls until the weight changes (`cache_weights`): the cache is keyed on the Parameter's version
counter, which every in-place write through the Parameter bumps (optimizer steps, `copy_` under
`no_grad`), and on the count of torch.optim steps (fused optimizers write without bumping it);
a write through `param.data` moves neither, so code that updates weights that way must pass
`cache_weights=False` (or call `te_seq.core.fp8.clear_weight_cache(op)`).

`fp8_wgrad=False` keeps the weight gradients in high precision: dW = dyᵀ x runs on the unquantized
dy and x in the GEMM's compute dtype (the same GEMM as without a recipe), while the forward and
dgrad GEMMs stay FP8. It is more accurate, keeps no FP8 form of x or dy along the tokens (two
quantization passes per wgrad fewer), and where the wgrads are bound by writing the weight
gradients (fine-grained experts, ~256 tokens each) it is also faster. The same switch as
torchao's ROWWISE_WITH_GW_HP recipe and TransformerEngine's override_linear_precision=(False,
False, True).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from te_seq.kernels.fp8_reference import QuantBlock, ScaleRule

ROLES = ("input", "weight", "grad")  # x (and the activations), W, dy
# the recipes' blocks, made once (frozen; `block()` runs several times per FP8 call)
_PER_TENSOR, _ROWWISE = QuantBlock(None, None), QuantBlock(1, None)
_TILE_1X128, _BLOCK_128X128 = QuantBlock(1, 128), QuantBlock(128, 128)


@dataclass(frozen=True)
class Recipe:
    """Base of the FP8 recipes (frozen, hashable: plans are cached per recipe)."""

    fp8_format: str = "E4M3"
    margin: int = 0
    power_of_two_scales: bool = False
    cache_weights: bool = True
    fp8_wgrad: bool = True

    FORMATS: ClassVar[tuple[str, ...]] = ("E4M3", "HYBRID")
    # Dimensions of the weight (K and N) must be multiples of this (None: any size).
    block_multiple: ClassVar[int | None] = None

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.fp8_format not in self.FORMATS:
            raise ValueError(
                f"{name}: fp8_format must be one of {self.FORMATS}, got {self.fp8_format!r}"
            )
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"{name}: margin must be an int >= 0, got {self.margin!r}")
        for flag in ("power_of_two_scales", "cache_weights", "fp8_wgrad"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{name}: {flag} must be a bool, got {getattr(self, flag)!r}")

    def rule(self, role: str) -> ScaleRule:
        """The scale rule of operands of `role` ("input", "weight" or "grad")."""
        fmt = "E5M2" if role == "grad" and self.fp8_format == "HYBRID" else "E4M3"
        return ScaleRule(fmt, self.margin, self.power_of_two_scales)

    def block(self, role: str) -> QuantBlock:
        """The block of one scale for operands of `role`, laid out [rows, reduction]."""
        raise NotImplementedError

    def __str__(self) -> str:
        name = type(self).__name__
        return name if self.fp8_wgrad else f"{name}(fp8_wgrad=False)"


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """One scale per tensor, from the tensor's current amax (no history). Default format
    "HYBRID": E4M3 forward, E5M2 gradients. For GroupedLinear, x and dy are one tensor each (all
    experts), each expert's weight is its own tensor."""

    fp8_format: str = "HYBRID"

    def block(self, role: str) -> QuantBlock:
        return _PER_TENSOR


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """DeepSeek-V3-style blocks: 1x128 tiles along the reduction dimension for activations and
    gradients (a wgrad's tiles run along tokens, restarting at each expert's first row; the last
    tile of an expert may be partial), 128x128 blocks for weights (so W and Wᵀ share their
    blocks). E4M3 everywhere; power-of-two scales by default. in_features and out_features must
    be multiples of 128."""

    power_of_two_scales: bool = True

    FORMATS: ClassVar[tuple[str, ...]] = ("E4M3",)
    block_multiple: ClassVar[int | None] = 128

    def block(self, role: str) -> QuantBlock:
        return _BLOCK_128X128 if role == "weight" else _TILE_1X128


@dataclass(frozen=True)
class Float8RowwiseScaling(Recipe):
    """One scale per row of each GEMM operand as laid out [rows, reduction]: per token for x and
    dy in forward and dgrad, per output row of W in forward and per input column of W in dgrad,
    per (expert, channel) over the expert's tokens in wgrad. What `torch._scaled_mm` /
    `torch._scaled_grouped_mm` take on Hopper. E4M3 by default ("HYBRID": E5M2 gradients)."""

    def block(self, role: str) -> QuantBlock:
        return _ROWWISE


__all__ = [
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Float8RowwiseScaling",
    "Recipe",
]
