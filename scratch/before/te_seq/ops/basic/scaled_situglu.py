"""ScaledSiTUGLU: SiTUGLU's maths times one scale per row."""

from __future__ import annotations

from te_seq.ops.basic._row_scaled import RowScaled
from te_seq.ops.basic.situglu import SiTUGLU


class ScaledSiTUGLU(RowScaled, SiTUGLU):
    """`SiTUGLU`'s maths times one scale per row: y = act(gate, up) · s[:, None]; extra input
    `scales` [T] or x.shape[:-1], with a gradient ds_t = Σ_j dy_tj · act(gate, up)_tj.

    `activation_recompute_in_mlp`: recompute y in backward instead of saving it where a
    GroupedLinear follows (see te_seq.ops.basic._row_scaled).
    """

    def __init__(
        self,
        glu_interleave_size: int | None = None,
        *,
        activation_recompute_in_mlp: bool = False,
        beta1: float = 4.0,
        beta2: float = 25.0,
        cache_quantized_input: bool = False,
    ) -> None:
        super().__init__(beta1=beta1, beta2=beta2, glu_interleave_size=glu_interleave_size,
                         cache_quantized_input=cache_quantized_input)
        self._set_recompute(activation_recompute_in_mlp)
