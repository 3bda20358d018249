"""Gated activations with float parameters (the clamped SwiGLU's limit, SiTU-GLU's caps)."""

from __future__ import annotations

from te_seq.kernels.activations import ACTIVATIONS, GluSpec
from te_seq.ops.basic.activation import GatedActivation


class ParamGatedActivation(GatedActivation):
    """A gated activation whose table entry takes parameters: the instance attributes named by
    the entry's ``params`` hold their values, which reach the kernels in `glu_spec`."""

    @property
    def act_params(self) -> tuple[float, ...]:
        """The parameter values, in the order of the table entry's ``params``."""
        return tuple(getattr(self, name) for name in ACTIVATIONS[self.act].params)

    @property
    def glu_spec(self) -> GluSpec:
        return GluSpec(self.act, self.glu_interleave_size, self.act_params)

    def plan_facts(self) -> tuple:
        return (self.act, self.glu_interleave_size, self.act_params)

    def extra_repr(self) -> str:
        names = ACTIVATIONS[self.act].params
        parts = [f"{n}={v}" for n, v in zip(names, self.act_params)]
        return ", ".join(parts + [super().extra_repr()] if super().extra_repr() else parts)
