"""QGELU: y = x · sigmoid(1.702 · x) (quick GELU)."""

from __future__ import annotations

from te_seq.ops.basic.activation import Activation


class QGELU(Activation):
    """y = x · sigmoid(1.702 · x) elementwise (the "quick" sigmoid approximation of GELU)."""

    act = "qgelu"
