"""ScaledSReLU: y = relu(x)² · s, with one scale per row (router probabilities)."""

from __future__ import annotations

from te_seq.ops.basic._row_scaled import RowScaled
from te_seq.ops.basic.srelu import SReLU


class ScaledSReLU(RowScaled, SReLU):
    """y = relu(x)² · s[:, None]; x [..., N], extra input `scales` with one entry per row of x
    (shape [T] or x.shape[:-1]) -> y [..., N]. `scales` gets a gradient:
    ds_t = Σ_j dy_tj · relu(x_tj)².

    `activation_recompute_in_mlp`: recompute y in backward instead of saving it where a
    GroupedLinear follows (see te_seq.ops.basic._row_scaled).
    """

    def __init__(
        self, *, activation_recompute_in_mlp: bool = False, cache_quantized_input: bool = False
    ) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input)
        self._set_recompute(activation_recompute_in_mlp)

    def extra_repr(self) -> str:
        return "activation_recompute_in_mlp=True" if self.activation_recompute_in_mlp else ""
