"""SReLU: y = relu(x)² (squared ReLU, Primer, So et al. 2021)."""

from __future__ import annotations

from te_seq.ops.basic.activation import Activation


class SReLU(Activation):
    """y = relu(x)² elementwise; dy/dx = 2·relu(x)."""

    act = "srelu"
