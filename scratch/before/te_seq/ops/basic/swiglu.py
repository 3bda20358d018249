"""SwiGLU: y = silu(gate) · up (Shazeer 2020)."""

from __future__ import annotations

from te_seq.ops.basic.activation import GatedActivation


class SwiGLU(GatedActivation):
    """SwiGLU: y = silu(gate) · up (Shazeer 2020).

    Equivalent to `gate, up = x.chunk(2, -1); F.silu(gate) * up`.

    x [..., 2F] holds [gate, up] (first half gate, TransformerEngine's order), or alternating
    blocks of `glu_interleave_size` columns; y [..., F].
    """

    act = "silu"
