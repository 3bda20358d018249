"""SiTU-GLU (soft-capped SiLU GLU): y = β1·tanh(gate/β1)·sigmoid(gate) · β2·tanh(up/β2)."""

from __future__ import annotations

from te_seq.core import checks
from te_seq.ops.basic._param_glu import ParamGatedActivation


def _positive(op, name: str, value: object) -> float:
    return checks.real_number(op, name, value, "finite and positive", lambda v: v > 0)


class SiTUGLU(ParamGatedActivation):
    """y = beta1·tanh(gate/beta1)·sigmoid(gate) · beta2·tanh(up/beta2) (Kimi K3).

    x [..., 2F] holds [gate, up] (first half gate), or alternating blocks of
    `glu_interleave_size` columns; y [..., F]. beta1, beta2 > 0 (the soft caps).
    """

    act = "situ"

    def __init__(
        self,
        *,
        beta1: float = 4.0,
        beta2: float = 25.0,
        glu_interleave_size: int | None = None,
        cache_quantized_input: bool = False,
    ) -> None:
        super().__init__(
            glu_interleave_size=glu_interleave_size, cache_quantized_input=cache_quantized_input
        )
        self.beta1 = _positive(self, "beta1", beta1)
        self.beta2 = _positive(self, "beta2", beta2)
