"""Basic ops: one piece of maths each, with a pure-PyTorch reference path."""

from te_seq.ops.basic.basic_linear import BasicLinear
from te_seq.ops.basic.bias import Bias
from te_seq.ops.basic.geglu import GEGLU
from te_seq.ops.basic.gelu import GELU
from te_seq.ops.basic.grouped_linear import GroupedLinear
from te_seq.ops.basic.linear import Linear
from te_seq.ops.basic.reglu import ReGLU
from te_seq.ops.basic.relu import ReLU
from te_seq.ops.basic.scaled_swiglu import ScaledSwiGLU
from te_seq.ops.basic.silu import SiLU
from te_seq.ops.basic.swiglu import SwiGLU

__all__ = [
    "GEGLU",
    "GELU",
    "BasicLinear",
    "Bias",
    "GroupedLinear",
    "Linear",
    "ReGLU",
    "ReLU",
    "ScaledSwiGLU",
    "SiLU",
    "SwiGLU",
]
