"""The fusion plan: what ran, fused or not, and why fusions declined. Public and printable."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PlanStep:
    """One op the fuser runs: a basic op alone, or a fused op over several basic ops."""

    name: str
    basic_op_indices: tuple[int, ...]
    backend: str
    op: Any = field(default=None, repr=False, compare=False)
    backend_reason: str = field(default="", compare=False)  # why this backend ran
    recipe: Any = None  # the FP8 recipe the step ran under (te_seq.autocast; None: no FP8)

    def __str__(self) -> str:
        why = f" ({self.backend_reason})" if self.backend_reason else ""
        fp8 = f" fp8={self.recipe}" if self.recipe is not None else ""
        return f"{self.name}{list(self.basic_op_indices)} [{self.backend}]{fp8}{why}"


@dataclass(frozen=True)
class PlanMiss:
    """A registered fusion whose pattern matched a window but declined, with its reason."""

    fusion: str
    basic_op_indices: tuple[int, ...]
    reason: str

    def __str__(self) -> str:
        return f"{self.fusion}{list(self.basic_op_indices)}: {self.reason}"


@dataclass
class FusionPlan:
    """The plan of one forward call: forward steps, backward steps (backward order), misses."""

    forward: list[PlanStep] = field(default_factory=list)
    backward: list[PlanStep] = field(default_factory=list)
    misses: list[PlanMiss] = field(default_factory=list)

    @staticmethod
    def concat(plans: list[FusionPlan]) -> FusionPlan:
        """Join the plans of consecutive runs; backward steps run last run first."""
        out = FusionPlan()
        for plan in plans:
            out.forward.extend(plan.forward)
            out.misses.extend(plan.misses)
        for plan in reversed(plans):
            out.backward.extend(plan.backward)
        return out

    @property
    def fused_steps(self) -> list[PlanStep]:
        return [s for s in self.forward + self.backward if len(s.basic_op_indices) > 1]

    def __str__(self) -> str:
        def lines(title: str, items: list[Any]) -> list[str]:
            return [f"{title}:"] + [f"  {item}" for item in items] if items else [f"{title}: -"]

        body = lines("forward", self.forward) + lines("backward", self.backward)
        return "\n".join(
            ["FusionPlan"] + ["  " + line for line in body + lines("declined", self.misses)]
        )
