"""The fuser's steady-state fast path: a call with the same signature as the last one that ran
through the full path reuses what that call decided and validated.

Reused: the plan (no plan key), each context's per-call flags (`requires_grad`,
`input_requires_grad`, `weight_requires_grad`, `process_group`), the channel links, the
per-op counts, and the input checks that read only the signature (`BasicOperation.value_checks`
still runs every call, e.g. host split sizes' values; contexts get `signature_checked=True`).

The signature holds everything those depend on:
- every attribute write to any basic op (`op_state_version`: settings, `training`, a Parameter
  replaced, the class) and each op's `plan_facts()`;
- the fusion and backend registries' versions, the requested backend, the FP8 recipe;
- grad mode and torch.autocast's state;
- the input's shape, dtype, device, requires_grad and class;
- each extra input's shape, dtype, device, requires_grad and which of them are "the same"
  (`same_extra_input`: identity, or equal values of small host integer tensors);
- each parameter's identity, shape, dtype, device, requires_grad and class.
A call with an extra input that is not a tensor (nor a channel slot), or with op_kwargs, always
takes the full path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from te_seq.core import fp8
from te_seq.core.amp import AutocastState
from te_seq.core.channels import ChannelRef
from te_seq.core.context import CallInputs, OperationContext
from te_seq.core.operation import BasicOperation, op_state_version
from te_seq.fusion.matcher import same_extra_input
from te_seq.fusion.registry import registry_version
from te_seq.kernels import backend as kernel_backends


def _extra_facts(flat: Sequence[Any]) -> tuple | None:
    """Per extra input (sameness label, facts); None if one is neither a tensor nor a slot."""
    facts: list[tuple] = []
    seen: list[Any] = []  # one representative per sameness class
    for item in flat:
        if isinstance(item, Tensor):
            fact: tuple = (item.shape, item.dtype, item.device, item.requires_grad, type(item))
        elif item is None or isinstance(item, ChannelRef):
            fact = (type(item),)
        else:
            return None
        facts.append((_sameness_label(seen, item), fact))
    return tuple(facts)


def _sameness_label(seen: list[Any], item: Any) -> int:
    """The index of `item`'s class under `same_extra_input` among `seen` (one representative
    per class; appended if new). Identity first: only host integer tensors can be the same
    without being one object."""
    for i, r in enumerate(seen):
        if r is item:
            return i
    if isinstance(item, Tensor) and item.device.type == "cpu" and not item.is_floating_point():
        for i, r in enumerate(seen):
            if same_extra_input(r, item):
                return i
    seen.append(item)
    return len(seen) - 1


def call_signature(
    ops: Sequence[BasicOperation], input_: Tensor, extra: list[tuple],
    autocast: AutocastState | None, params: Sequence[Tensor] | None = None,
) -> tuple | None:
    """Everything the fast path's reused decisions depend on (module docstring); None where
    the call must take the full path. `params`: the ops' `fuser_parameters()` in order, where
    the caller has them already."""
    extras = _extra_facts([t for group in extra for t in group])
    if extras is None:
        return None
    if params is None:
        params = [p for op in ops for p in op.fuser_parameters()]
    # list comprehensions, not generators: this runs before every call's first kernel
    param_facts = [(id(p), p.shape, p.dtype, p.device, p.requires_grad, type(p)) for p in params]
    return (
        op_state_version(),
        tuple([op.plan_facts() for op in ops]),
        registry_version(),
        kernel_backends.registry_version(),
        kernel_backends.current_backend(),
        fp8.recipe_key(),
        torch.is_grad_enabled(),
        None if autocast is None else (autocast.dtype, autocast.device_type),
        input_.shape, input_.dtype, input_.device, input_.requires_grad, type(input_),
        extras,
        tuple(param_facts),
    )


@dataclass
class FastEntry:
    """What a full-path call with `signature` decided, for the next calls with the same one."""

    signature: tuple
    plan: Any  # run/fuser.py's RunPlan
    flags: list[tuple[bool, bool, bool, Any]]  # per op: the contexts' per-call fields
    with_backward: bool
    counts: tuple  # (extra inputs per op, parameters per op, channel links): Fuser._counts

    @staticmethod
    def remember(
        signature: tuple, plan: Any, ctxs: Sequence[OperationContext], counts: tuple
    ) -> FastEntry:
        flags = [
            (c.requires_grad, c.input_requires_grad, c.weight_requires_grad, c.process_group)
            for c in ctxs
        ]
        return FastEntry(signature, plan, flags, any(c.requires_grad for c in ctxs), counts)

    def contexts(
        self, call_inputs: CallInputs | None, autocast: AutocastState | None
    ) -> list[OperationContext]:
        """Fresh contexts for this call with the remembered flags (recipe read now)."""
        recipe = fp8.active_recipe()
        return [
            OperationContext(requires_grad=rg, input_requires_grad=irg, weight_requires_grad=wrg,
                             call_inputs=call_inputs, autocast=autocast, recipe=recipe,
                             process_group=group, signature_checked=True)
            for rg, irg, wrg, group in self.flags
        ]
