"""Fused ops and their registered fusions (importing this module registers them)."""

from te_seq.ops.fused.activation_bias_backward import ActivationBiasBackward
from te_seq.ops.fused.activation_recompute import ActivationRecompute
from te_seq.ops.fused.grouped_mlp import GroupedMLP
from te_seq.ops.fused.linear_bias_activation import LinearBiasActivation
from te_seq.ops.fused.linear_bias_add import LinearBiasAdd
from te_seq.ops.fused.make_extra_output_linear_backward import MakeExtraOutputLinearBackward
from te_seq.ops.fused.moe_block import MoeBlock

__all__ = [
    "ActivationBiasBackward",
    "ActivationRecompute",
    "GroupedMLP",
    "LinearBiasActivation",
    "LinearBiasAdd",
    "MakeExtraOutputLinearBackward",
    "MoeBlock",
]
