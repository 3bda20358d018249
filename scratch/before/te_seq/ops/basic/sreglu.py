"""SReGLU: y = relu(gate)² · up."""

from __future__ import annotations

from te_seq.ops.basic.activation import GatedActivation


class SReGLU(GatedActivation):
    """SReGLU: y = relu(gate)² · up.

    x [..., 2F] holds [gate, up] (first half gate), or alternating blocks of
    `glu_interleave_size` columns; y [..., F].
    """

    act = "srelu"
