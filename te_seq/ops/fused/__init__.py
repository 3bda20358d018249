"""Fused ops and their registered fusions (importing this module registers them)."""

from te_seq.ops.fused.grouped_mlp import GroupedMLP

__all__ = ["GroupedMLP"]
