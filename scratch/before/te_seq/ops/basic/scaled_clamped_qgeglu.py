"""ScaledClampedQGeGLU: ClampedSwiGLU's maths times one scale per row."""

from __future__ import annotations

from te_seq.ops.basic._row_scaled import RowScaled
from te_seq.ops.basic.clamped_swiglu import ClampedSwiGLU


class ScaledClampedQGeGLU(RowScaled, ClampedSwiGLU):
    """`ClampedSwiGLU`'s maths times one scale per row: y = act(gate, up) · s[:, None]; extra
    input `scales` [T] or x.shape[:-1], with a gradient ds_t = Σ_j dy_tj · act(gate, up)_tj.

    `activation_recompute_in_mlp`: recompute y in backward instead of saving it where a
    GroupedLinear follows (see te_seq.ops.basic._row_scaled).
    """

    def __init__(
        self,
        glu_interleave_size: int | None = None,
        *,
        activation_recompute_in_mlp: bool = False,
        limit: float = 7.0,
        alpha: float = 1.702,
        glu_linear_offset: float = 1.0,
        cache_quantized_input: bool = False,
    ) -> None:
        super().__init__(
            limit=limit,
            alpha=alpha,
            glu_linear_offset=glu_linear_offset,
            glu_interleave_size=glu_interleave_size,
            cache_quantized_input=cache_quantized_input,
        )
        self._set_recompute(activation_recompute_in_mlp)
