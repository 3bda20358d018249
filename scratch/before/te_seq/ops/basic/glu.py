"""GLU: y = sigmoid(gate) · up (Dauphin et al. 2016)."""

from __future__ import annotations

from te_seq.ops.basic.activation import GatedActivation


class GLU(GatedActivation):
    """GLU: y = sigmoid(gate) · up.

    x [..., 2F] holds [gate, up] (first half gate, TransformerEngine's order; note that
    `torch.nn.functional.glu` gates with the second half: this op equals
    `F.glu(torch.cat([up, gate], -1))`), or alternating blocks of `glu_interleave_size`
    columns; y [..., F].
    """

    act = "sigmoid"
