"""Basic ops: one piece of maths each, with a pure-PyTorch reference path."""

from te_seq.ops.basic.add_extra_input import AddExtraInput
from te_seq.ops.basic.all_gather import AllGather
from te_seq.ops.basic.all_reduce import AllReduce
from te_seq.ops.basic.basic_linear import BasicLinear
from te_seq.ops.basic.bias import Bias
from te_seq.ops.basic.clamped_swiglu import ClampedSwiGLU
from te_seq.ops.basic.constant_scale import ConstantScale
from te_seq.ops.basic.dropout import Dropout
from te_seq.ops.basic.expert_combine import ExpertCombine
from te_seq.ops.basic.expert_dispatch import ExpertDispatch
from te_seq.ops.basic.geglu import GEGLU
from te_seq.ops.basic.gelu import GELU
from te_seq.ops.basic.glu import GLU
from te_seq.ops.basic.grouped_linear import GroupedLinear
from te_seq.ops.basic.identity import Identity
from te_seq.ops.basic.l2_normalization import L2Normalization
from te_seq.ops.basic.layer_norm import LayerNorm
from te_seq.ops.basic.linear import Linear
from te_seq.ops.basic.make_extra_output import MakeExtraOutput
from te_seq.ops.basic.qgeglu import QGEGLU
from te_seq.ops.basic.qgelu import QGELU
from te_seq.ops.basic.quantize import Quantize
from te_seq.ops.basic.reduce_scatter import ReduceScatter
from te_seq.ops.basic.reglu import ReGLU
from te_seq.ops.basic.relu import ReLU
from te_seq.ops.basic.reshape import Reshape
from te_seq.ops.basic.rms_norm import RMSNorm
from te_seq.ops.basic.row_scale import RowScale
from te_seq.ops.basic.scaled_clamped_qgeglu import ScaledClampedQGeGLU
from te_seq.ops.basic.scaled_situglu import ScaledSiTUGLU
from te_seq.ops.basic.scaled_srelu import ScaledSReLU
from te_seq.ops.basic.scaled_swiglu import ScaledSwiGLU
from te_seq.ops.basic.silu import SiLU
from te_seq.ops.basic.situglu import SiTUGLU
from te_seq.ops.basic.sreglu import SReGLU
from te_seq.ops.basic.srelu import SReLU
from te_seq.ops.basic.swiglu import SwiGLU

__all__ = [
    "AddExtraInput",
    "AllGather",
    "AllReduce",
    "BasicLinear",
    "Bias",
    "ConstantScale",
    "Dropout",
    "ExpertCombine",
    "ExpertDispatch",
    "GEGLU",
    "GELU",
    "GroupedLinear",
    "Identity",
    "LayerNorm",
    "Linear",
    "MakeExtraOutput",
    "Quantize",
    "RMSNorm",
    "ReGLU",
    "ReduceScatter",
    "ReLU",
    "Reshape",
    "RowScale",
    "ScaledSwiGLU",
    "SiLU",
    "SwiGLU",
    "GLU",
    "QGELU",
    "QGEGLU",
    "SReLU",
    "SReGLU",
    "ScaledSReLU",
    "ClampedSwiGLU",
    "ScaledClampedQGeGLU",
    "SiTUGLU",
    "ScaledSiTUGLU",
    "L2Normalization",
]
