"""Fusions as data: the registry, the one window matcher, and the plan it produces."""

from te_seq.fusion.plan import FusionPlan, PlanMiss, PlanStep
from te_seq.fusion.registry import (
    FusionPattern,
    NoMatch,
    disable_fusion,
    enable_fusion,
    fusions_disabled,
    list_fusions,
    register_fusion,
)

__all__ = [
    "FusionPattern",
    "FusionPlan",
    "NoMatch",
    "PlanMiss",
    "PlanStep",
    "disable_fusion",
    "enable_fusion",
    "fusions_disabled",
    "list_fusions",
    "register_fusion",
]
