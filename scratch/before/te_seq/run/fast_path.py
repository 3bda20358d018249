"""The fuser's steady-state fast path: a call with the same signature as the last one that ran
through the full path reuses what that call decided and validated.

Reused: the plan (no plan key), each context's per-call flags (`requires_grad`,
`input_requires_grad`, `weight_requires_grad`, `process_group`), the channel links, the
per-op counts, and the input checks that read only the signature (`BasicOperation.value_checks`
still runs every call, e.g. host split sizes' values; contexts get `signature_checked=True`),
and the signature's `steady` dict: what the ops decided from its facts on its first call (e.g.
the grouped MLP's prepared offsets and FC1 launches), made anew with each full-path call.

The signature holds everything those depend on:
- every attribute write to any basic op (`op_state_version`: settings, `training`, a Parameter
  replaced, the class) and each op's `plan_facts()`;
- the fusion and backend registries' versions, the requested backend, the FP8 recipe;
- grad mode and torch.autocast's state;
- the input's shape, dtype, device, requires_grad and class;
- each extra input's shape, dtype, device, requires_grad and which of them are "the same"
  (`same_extra_input`: identity, or equal values of small host integer tensors);
- each parameter's identity, shape, strides, dtype, device, requires_grad and class.
A call with an extra input that is not a tensor (nor a channel slot), or with op_kwargs, always
takes the full path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
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


def _extra_facts(facts: list, extra: list[tuple]) -> bool:
    """Append each extra input's facts to `facts`: its sameness label (the first slot holding
    an input `same_extra_input` calls the same), then, for the first slot holding that very
    object, its class and, for a tensor, its shape, dtype, device and requires_grad (a later
    slot with the same object has the same facts). False if one is neither a tensor nor a
    slot (None or a ChannelRef)."""
    seen: list[Any] = []  # the inputs so far, by slot
    ids: list[int] = []  # and their ids
    for group in extra:
        for item in group:
            key = id(item)
            if key in ids:  # the first slot holding this very object
                facts.append(ids.index(key))
                seen.append(item)
                ids.append(key)
                continue
            label = len(seen)
            seen.append(item)
            ids.append(key)
            if isinstance(item, Tensor):
                if item.is_cpu and not item.is_floating_point():
                    label = _first_equal(seen, label)
                facts += (label, type(item), item.shape, item.dtype, item.device,
                          item.requires_grad)
            elif item is None or isinstance(item, ChannelRef):
                facts += (label, type(item))
            else:
                return False
    return True


def _first_equal(flat: Sequence[Any], position: int) -> int:
    """The first slot before `position` that `same_extra_input` calls the same as it (equal
    values of host integer tensors), else `position`: with identity, the smallest slot of the
    item's sameness class labels it."""
    item = flat[position]
    for i in range(position):
        if same_extra_input(flat[i], item):
            return i
    return position


def call_signature(
    ops: Sequence[BasicOperation], input_: Tensor, extra: list[tuple],
    autocast: AutocastState | None, params: Sequence[Tensor] | None = None,
) -> tuple | None:
    """Everything the fast path's reused decisions depend on (module docstring), as one flat
    tuple (cheaper to build and compare than nested ones: this runs before every call's first
    kernel); None where the call must take the full path. `params`: the ops'
    `fuser_parameters()` in order, where the caller has them already."""
    if params is None:
        params = [p for op in ops for p in op.fuser_parameters()]
    facts: list = [
        op_state_version(), registry_version(), kernel_backends.registry_version(),
        kernel_backends.current_backend(), fp8.recipe_key(), torch.is_grad_enabled(),
        None if autocast is None else (autocast.dtype, autocast.device_type),
        type(input_), input_.shape, input_.dtype, input_.device, input_.requires_grad,
        tuple([op.plan_facts() for op in ops]), tuple([len(group) for group in extra]),
        len(params),
    ]
    if not _extra_facts(facts, extra):
        return None
    for p in params:
        facts += (id(p), type(p), p.shape, p.stride(), p.dtype, p.device, p.requires_grad)
    return tuple(facts)


@dataclass
class FastEntry:
    """What a full-path call with `signature` decided, for the next calls with the same one."""

    signature: tuple
    plan: Any  # run/fuser.py's RunPlan
    flags: list[tuple[bool, bool, bool, Any]]  # per op: the contexts' per-call fields
    with_backward: bool
    counts: tuple  # (extra inputs per op, parameters per op, channel links): Fuser._counts
    # per op: the fields of a context with those flags (`contexts` copies them)
    templates: list[dict] = field(default_factory=list)

    @staticmethod
    def remember(
        signature: tuple, plan: Any, ctxs: Sequence[OperationContext], counts: tuple
    ) -> FastEntry:
        """The entry of a full-path call's decisions; its contexts' `steady` dict (made for
        this signature by `Fuser.run_eager`, filled by the ops) goes on to the next calls."""
        flags = [
            (c.requires_grad, c.input_requires_grad, c.weight_requires_grad, c.process_group)
            for c in ctxs
        ]
        templates = [
            vars(OperationContext(requires_grad=rg, input_requires_grad=irg,
                                  weight_requires_grad=wrg, process_group=group,
                                  signature_checked=True, steady=ctx.steady))
            for (rg, irg, wrg, group), ctx in zip(flags, ctxs)
        ]
        return FastEntry(signature, plan, flags, any(c.requires_grad for c in ctxs), counts,
                         templates)

    def contexts(
        self, call_inputs: CallInputs | None, autocast: AutocastState | None
    ) -> list[OperationContext]:
        """Fresh contexts for this call with the remembered flags (recipe read now): each a
        copy of its template's fields, the same object `OperationContext(...)` with those
        flags makes, for a third of its __init__'s host time."""
        recipe = fp8.active_recipe()
        ctxs = []
        for template in self.templates:
            ctx = OperationContext.__new__(OperationContext)
            fields = ctx.__dict__
            fields.update(template)
            fields["call_inputs"], fields["autocast"], fields["recipe"] = (
                call_inputs, autocast, recipe)
            ctxs.append(ctx)
        return ctxs
