"""ReLU: y = max(x, 0)."""

from __future__ import annotations

from te_seq.ops.basic.activation import Activation


class ReLU(Activation):
    """y = max(x, 0); equivalent to `torch.relu(x)` (gradient 0 at x = 0)."""

    act = "relu"
