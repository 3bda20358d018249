"""GEGLU: y = gelu(gate, approximate="tanh") · up."""

from __future__ import annotations

from te_seq.ops.basic.activation import GatedActivation


class GEGLU(GatedActivation):
    """GEGLU: y = gelu(gate, approximate="tanh") · up.

    x [..., 2F] holds [gate, up] (first half gate, TransformerEngine's order), or alternating
    blocks of `glu_interleave_size` columns; y [..., F].
    """

    act = "gelu"
