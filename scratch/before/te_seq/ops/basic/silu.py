"""SiLU: y = x · sigmoid(x)."""

from __future__ import annotations

from te_seq.ops.basic.activation import Activation


class SiLU(Activation):
    """y = x · sigmoid(x); equivalent to `torch.nn.functional.silu(x)`."""

    act = "silu"
