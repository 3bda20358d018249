"""GELU: y = gelu(x), tanh approximation by default."""

from __future__ import annotations

from te_seq.core import checks
from te_seq.ops.basic.activation import Activation

_APPROXIMATIONS = {"tanh": "gelu", "none": "gelu_erf"}


class GELU(Activation):
    """y = gelu(x); equivalent to `torch.nn.functional.gelu(x, approximate=approximate)`.

    `approximate` is "tanh" (default, as TransformerEngine) or "none" (the exact erf form).
    """

    def __init__(self, approximate: str = "tanh", *, cache_quantized_input: bool = False) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input)
        self.approximate = checks.choice(self, "approximate", approximate, tuple(_APPROXIMATIONS))
        self.act = _APPROXIMATIONS[approximate]

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
