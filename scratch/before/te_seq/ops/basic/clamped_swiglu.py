"""GPT-OSS's clamped SwiGLU: y = qgelu_α(min(gate, limit)) · (clamp(up, ±limit) + offset)."""

from __future__ import annotations

from te_seq.core import checks
from te_seq.ops.basic._param_glu import ParamGatedActivation


class ClampedSwiGLU(ParamGatedActivation):
    """y = g · sigmoid(alpha · g) · (clamp(up, -limit, limit) + glu_linear_offset), g =
    min(gate, limit) (GPT-OSS's SwiGLU with limit=7.0, alpha=1.702, offset 1).

    Gradients as TransformerEngine's: the gate's passes where gate <= limit, the up's where
    -limit <= up <= limit. x [..., 2F] holds [gate, up] (first half gate), or alternating
    blocks of `glu_interleave_size` columns (GPT-OSS's own layout, alternating single columns,
    is `glu_interleave_size=1`); y [..., F].
    """

    act = "clamped_qgelu"

    def __init__(
        self,
        *,
        limit: float = 7.0,
        alpha: float = 1.702,
        glu_linear_offset: float = 1.0,
        glu_interleave_size: int | None = None,
        cache_quantized_input: bool = False,
    ) -> None:
        super().__init__(
            glu_interleave_size=glu_interleave_size, cache_quantized_input=cache_quantized_input
        )
        self.limit = checks.real_number(self, "limit", limit, "positive", lambda v: v > 0)
        self.alpha = checks.real_number(self, "alpha", alpha, "a finite number")
        self.glu_linear_offset = checks.real_number(
            self, "glu_linear_offset", glu_linear_offset, "a finite number"
        )
