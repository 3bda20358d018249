"""Extra-tensor channels: one op's extra output feeds a later op's extra input in a Sequential.

An op *publishes* an extra output on a named channel; a later op *subscribes* an extra input to
a channel and then takes its value from the nearest earlier publisher of that channel in the
same (flattened) Sequential instead of from the caller. Bindings are per op instance:

- class defaults: `default_output_channels` / `default_input_channels` map an extra output /
  input name to a channel (e.g. ExpertDispatch publishes "split_sizes", GroupedLinear's
  `split_sizes` subscribes to it). A default subscription binds only where an earlier op
  publishes the channel; elsewhere the slot stays positional (the caller gives it).
- explicit: `op.set_extra_output_channel(slot, channel, output_to_caller=False)` and
  `op.set_extra_input_channel(slot, channel)` (slot: an index or an extra input/output name;
  channel None: no channel, which also turns a class default off). An explicit subscription with
  no earlier publisher is a ValueError when the Sequential runs.

The resolution itself (who feeds whom, which extra outputs the caller gets) is in
run/channels.py; this module holds what an op declares and the `ChannelRef` a bound slot holds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from te_seq.core import checks

_VERSION = itertools.count(1)
_version = 0


def bindings_version() -> int:
    """Bumped by every explicit binding call (part of a Sequential's structure key)."""
    return _version


def _bump() -> None:
    global _version
    _version = next(_VERSION)


@dataclass(frozen=True, eq=False)
class ChannelRef:
    """What a channel-bound extra-input slot holds until its value exists: the channel and the
    publisher (its basic-op index in the Sequential, its extra-output slot). Consumers bound to
    the same publication share one object, so fusions see them as "the same" extra input."""

    channel: str
    producer: int
    slot: int

    def __repr__(self) -> str:
        return f"ChannelRef({self.channel!r} from basic op {self.producer}, output {self.slot})"


def _slot_index(op: Any, slot: int | str, names: tuple[str, ...], count: int, what: str) -> int:
    """`slot` as an index into the op's extra inputs/outputs (by position or by name)."""
    name = checks.op_name(op)
    if isinstance(slot, str):
        if slot not in names:
            raise ValueError(f"{name}: no extra {what} named {slot!r} (it has {names})")
        return names.index(slot)
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < count:
        raise ValueError(f"{name}: extra {what} slot must be in [0, {count}), got {slot!r}")
    return slot


def _check_channel(op: Any, channel: object) -> str | None:
    if channel is not None and (not isinstance(channel, str) or not channel):
        raise TypeError(
            f"{checks.op_name(op)}: channel must be a non-empty str or None, got {channel!r}"
        )
    return channel


def set_input_channel(op: Any, slot: int | str, channel: str | None) -> None:
    index = _slot_index(op, slot, tuple(getattr(op, "extra_input_names", ())),
                        op.num_extra_inputs, "input")
    op.__dict__.setdefault("_input_channels", {})[index] = _check_channel(op, channel)
    _bump()


def set_output_channel(op: Any, slot: int | str, channel: str | None, to_caller: bool) -> None:
    index = _slot_index(op, slot, tuple(getattr(op, "extra_output_names", ())),
                        op.num_extra_outputs, "output")
    checks.flag(op, "output_to_caller", to_caller)
    entry = (_check_channel(op, channel), to_caller)
    op.__dict__.setdefault("_output_channels", {})[index] = entry
    _bump()


def input_subscription(op: Any, index: int) -> tuple[str | None, bool]:
    """(channel or None, explicit?) of extra input `index`."""
    explicit = op.__dict__.get("_input_channels", {})
    if index in explicit:
        return explicit[index], True
    names = tuple(getattr(op, "extra_input_names", ()))
    defaults = getattr(op, "default_input_channels", {})
    return (defaults.get(names[index]) if index < len(names) else None), False


def output_publication(op: Any, index: int) -> tuple[str | None, bool, bool]:
    """(channel or None, explicit?, output_to_caller) of extra output `index`."""
    explicit = op.__dict__.get("_output_channels", {})
    if index in explicit:
        channel, to_caller = explicit[index]
        return channel, True, to_caller
    names = tuple(getattr(op, "extra_output_names", ()))
    defaults = getattr(op, "default_output_channels", {})
    return (defaults.get(names[index]) if index < len(names) else None), False, False
