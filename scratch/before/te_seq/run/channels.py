"""Resolving extra-tensor channels over a Sequential's flat list of basic ops.

The rules (what ops declare is in core/channels.py):

1. An extra input subscribed to channel c takes the value of the nearest earlier op's extra
   output published on c (an op never feeds itself; a later publisher of c shadows an earlier
   one for the ops after it, so two MoE blocks can sit in one Sequential). Such a slot is not
   given by the caller: the positional extra inputs skip it.
2. A default (class-level) subscription with no earlier publisher leaves the slot positional,
   exactly as without channels; an explicit one is a ValueError naming the op and the channel.
3. An extra output goes to the caller when it has no channel, when it was published with
   `output_to_caller=True`, or when it was published only by a class default and no op
   subscribes to it (so an op alone still returns everything it computes).

The binding is structural: fixed when the Sequential's structure is prepared, never read from
data, so fusions (and the plan key) see two slots bound to one publication as "the same" input.
Inside one Fuser the value is handed from step to step (run/fuser.py); across Fusers (a plain
module in between) the Sequential hands the tensor itself, and autograd links the two runs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq.core.channels import ChannelRef, input_subscription, output_publication
from te_seq.core.operation import BasicOperation


@dataclass(frozen=True)
class ChannelPlan:
    """Per basic op: what each extra-input slot is bound to (None: the caller gives it) and
    whether each extra output goes to the caller."""

    inputs: tuple[tuple[ChannelRef | None, ...], ...]
    to_caller: tuple[tuple[bool, ...], ...]

    @functools.cached_property
    def any_bound(self) -> bool:
        """Whether any slot is bound (read on every call: computed once per plan)."""
        return any(ref is not None for group in self.inputs for ref in group)


def resolve_channels(ops: Sequence[BasicOperation]) -> ChannelPlan:
    """Bind every subscribed extra input to its publisher (rules 1-3 of this module)."""
    publishers: dict[str, tuple[int, int]] = {}  # channel -> (op index, output slot)
    refs: dict[tuple[int, int], ChannelRef] = {}
    inputs = []
    for index, op in enumerate(ops):
        inputs.append(tuple(_bind(op, index, s, publishers, refs)
                            for s in range(op.num_extra_inputs)))
        for slot in range(op.num_extra_outputs):
            channel = output_publication(op, slot)[0]
            if channel is not None:
                publishers[channel] = (index, slot)
    consumed = set(refs)
    to_caller = tuple(
        tuple(_to_caller(op, index, slot, consumed) for slot in range(op.num_extra_outputs))
        for index, op in enumerate(ops)
    )
    return ChannelPlan(tuple(inputs), to_caller)


def _bind(op, index: int, slot: int, publishers, refs) -> ChannelRef | None:
    channel, explicit = input_subscription(op, slot)
    if channel is None:
        return None
    if channel not in publishers:
        if not explicit:
            return None
        raise ValueError(
            f"{type(op).__name__} (basic op {index}): extra input {slot} is bound to channel "
            f"{channel!r}, but no earlier op in the Sequential publishes it (publish it with "
            "set_extra_output_channel, or unbind with set_extra_input_channel(slot, None))"
        )
    producer, out_slot = publishers[channel]
    key = (producer, out_slot)
    if key not in refs:
        refs[key] = ChannelRef(channel, producer, out_slot)
    return refs[key]


def _to_caller(op, index: int, slot: int, consumed: set) -> bool:
    channel, explicit, to_caller = output_publication(op, slot)
    if channel is None or to_caller:
        return True
    return not explicit and (index, slot) not in consumed


def substitute(extra: list[tuple], published: dict[tuple[int, int], Tensor]) -> list[tuple]:
    """The extra inputs with every slot whose publisher already ran (an earlier run) replaced
    by the published tensor; slots bound inside the run keep their ChannelRef."""
    return [
        tuple(
            published.get((t.producer, t.slot), t) if isinstance(t, ChannelRef) else t
            for t in group
        )
        for group in extra
    ]


# --- inside one Fuser run (run/fuser.py): handing values and gradients from step to step -------


@dataclass(frozen=True)
class ChannelLink:
    """Extra input `slot` of the op at local position `consumer` is extra output `out_slot` of
    the op at local position `producer` (an earlier op of the same run)."""

    consumer: int
    slot: int
    producer: int
    out_slot: int


def channel_links(extra: list[tuple], offset: int) -> list[ChannelLink]:
    """The channel-bound slots of a run's extra inputs (ChannelRefs the Sequential left there
    because their publisher is in this run, which starts at basic op `offset`)."""
    links = []
    for p, group in enumerate(extra):
        for slot, item in enumerate(group):
            if isinstance(item, ChannelRef):
                producer = item.producer - offset
                if not 0 <= producer < p:
                    raise RuntimeError(f"te_seq: {item} is not published before basic op "
                                       f"{p + offset} of this run")
                links.append(ChannelLink(p, slot, producer, item.slot))
    return links


def feed_channels(links: Sequence[ChannelLink], ctxs: Sequence, positions: tuple[int, ...],
                  extra: list[tuple], extra_out: list[tuple]) -> None:
    """Hand the extra outputs the step over `positions` published to the later ops bound to
    them (in `extra`). A fused op spanning a publisher and its consumer hands it over itself."""
    for link in links:
        if link.producer in positions and link.consumer not in positions:
            group = list(extra[link.consumer])
            group[link.slot] = as_extra_input(extra_out[link.producer][link.out_slot],
                                              ctxs[link.producer].requires_grad)
            extra[link.consumer] = tuple(group)


def as_extra_input(value: Tensor, differentiable: bool) -> Tensor:
    """A published value as its consumer sees it: like a caller's extra input, it requires
    grad when its gradient is wanted (the publisher's backward runs and it is floating point).
    Ops read `requires_grad` to decide which gradients to compute; inside the autograd bridge
    grad mode is off, so this marks a detached alias and records no graph."""
    if differentiable and value.is_floating_point() and not value.requires_grad:
        # Traced: a copy (dynamo's autograd.Function may not keep an alias of an output).
        alias = value.detach().clone() if torch.compiler.is_compiling() else value.detach()
        return _requiring_grad(alias)
    return value


@torch._dynamo.allow_in_graph
def _requiring_grad(t: Tensor) -> Tensor:
    """`t` (a detached tensor of our own) marked as requiring grad.

    Called opaquely under torch.compile (allow_in_graph: dynamo puts the call in the graph and
    learns `requires_grad` from running it on fake tensors): torch 2.11's dynamo rejects
    `requires_grad_()`, `requires_grad=True` factories and `nn.Parameter` while tracing (2.13
    accepts `requires_grad_()`). Grad mode is off where this runs, so no graph is recorded."""
    return t.requires_grad_()


def route_channel_grads(links: Sequence[ChannelLink], positions: tuple[int, ...],
                        egrads: Sequence, grad_extra_out: list) -> list[list]:
    """Add the gradients of the step's channel-bound extra inputs to their publishers'
    extra-output gradients in `grad_extra_out` (publishers run their backward later); returns
    `egrads` with those slots None (they are no inputs of the autograd bridge)."""
    out = [list(g) for g in egrads]
    for link in links:
        if link.consumer not in positions or link.producer in positions:
            continue
        local = positions.index(link.consumer)
        if not out[local]:
            continue
        g, out[local][link.slot] = out[local][link.slot], None
        if g is not None:
            grads = list(grad_extra_out[link.producer])
            prev = grads[link.out_slot]
            grads[link.out_slot] = g if prev is None else prev + g
            grad_extra_out[link.producer] = tuple(grads)
    return out
