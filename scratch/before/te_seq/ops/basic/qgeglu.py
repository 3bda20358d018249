"""QGEGLU: y = qgelu(gate) · up, qgelu(x) = x · sigmoid(1.702 · x)."""

from __future__ import annotations

from te_seq.ops.basic.activation import GatedActivation


class QGEGLU(GatedActivation):
    """QGEGLU: y = qgelu(gate) · up, qgelu(x) = x · sigmoid(1.702 · x).

    x [..., 2F] holds [gate, up] (first half gate), or alternating blocks of
    `glu_interleave_size` columns; y [..., F].
    """

    act = "qgelu"
