"""te_seq.Sequential: a container that runs adjacent te_seq ops through fusers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from te_seq.core.channels import bindings_version
from te_seq.core.context import CallInputs
from te_seq.core.operation import BasicOperation, CompositeOperation
from te_seq.fusion.plan import FusionPlan
from te_seq.run import compiled
from te_seq.run.channels import ChannelPlan, resolve_channels, substitute
from te_seq.run.fuser import Fuser
from te_seq.run.op_kwargs import OpKwargs, split_op_kwargs

Run = Fuser | torch.nn.Module


class Sequential(torch.nn.Sequential):
    """Chain of te_seq ops and plain `torch.nn.Module`s, fused where registered fusions match.

    `forward(input, *extra_inputs)`: extra inputs go, in order, to the basic ops that declare them
    (e.g. `split_sizes` for each GroupedLinear). Returns the output, or `(output, *extra_outputs)`
    when some op makes extra outputs. Plain modules run unfused and split fusion windows; nested
    te_seq Sequentials are flattened into this one's windows and basic-op indices.

    `forward(..., op_kwargs={index: {name: value}})` gives basic op `index` (as `basic_ops()`
    counts) keyword arguments for this call, e.g. caller-provided buffers (run/op_kwargs.py).
    """

    def __init__(self, *modules: torch.nn.Module) -> None:
        super().__init__(*modules)
        self._runs_key: tuple | None = None
        self._runs: list[Run] = []
        self._channels: ChannelPlan | None = None
        self._last_plan: FusionPlan | None = None
        self._plan_parts: list[FusionPlan] = []
        self._lone_fuser: Fuser | None = None  # see `_lone_fuser`
        self._compile_token = compiled.token_for(self)

    def __setstate__(self, state: dict) -> None:
        """A copy (deepcopy, pickle) gets a compile token of its own."""
        super().__setstate__(state)
        self._compile_token = compiled.token_for(self)

    # --- structure --------------------------------------------------------------------------
    def _flat_modules(self) -> Iterator[torch.nn.Module]:
        for module in self:
            if isinstance(module, Sequential):
                yield from module._flat_modules()
            elif isinstance(module, CompositeOperation):
                yield from module.basic_ops()
            else:
                yield module

    def basic_ops(self) -> list[BasicOperation]:
        """The flat list of basic ops, in forward order (what plan indices count)."""
        return [m for m in self._flat_modules() if isinstance(m, BasicOperation)]

    def _flat_list(self) -> list[torch.nn.Module]:
        """`_flat_modules()` as a list, built without generators (read on every call)."""
        flat: list[torch.nn.Module] = []
        for module in self:
            if isinstance(module, Sequential):
                flat += module._flat_list()
            elif isinstance(module, CompositeOperation):
                flat += module.basic_ops()
            else:
                flat.append(module)
        return flat

    def prepare_runs(self) -> None:
        """Split the flat modules into runs (Fusers and plain modules) if they changed."""
        flat = self._flat_list()
        key = (*map(id, flat), bindings_version())
        if key != self._runs_key:
            _check_no_forward_override(flat)
            self._channels = resolve_channels([m for m in flat if isinstance(m, BasicOperation)])
            self._runs, self._runs_key = _split_runs(flat), key
            self._extra_slots = None  # which extra input each op gets: per count, see below
            self._lone_fuser = _lone_fuser(self._runs, self._channels)

    def _current_runs(self) -> list[Run]:
        if torch.compiler.is_compiling():
            compiled.prepare(self._compile_token)  # real Python at trace time
        else:
            self.prepare_runs()
        return self._runs

    # --- running ----------------------------------------------------------------------------
    def forward(
        self, input_: Tensor, *extra_inputs: Any, op_kwargs: OpKwargs | None = None
    ) -> Tensor | tuple[Tensor, ...]:
        if torch.compiler.is_compiling():
            if op_kwargs or not compiled.TRACEABLE:  # buffers written in place: run eagerly
                return compiled.run_sequential_eagerly(self, input_, *extra_inputs,
                                                       op_kwargs=op_kwargs)
            return self._forward_runs(self._current_runs(), input_, extra_inputs, op_kwargs)
        self.prepare_runs()
        lone = self._lone_fuser
        if lone is None or op_kwargs or not isinstance(input_, Tensor):
            return self._forward_runs(self._runs, input_, extra_inputs, op_kwargs)
        # one run of basic ops, nothing bound nor returned besides the output, a tensor input,
        # not traced: `_forward_runs` and `Fuser.__call__` for that case, without their
        # bookkeeping (this runs before every call's first kernel)
        call_inputs = CallInputs(input_, extra_inputs, self.parameters)
        x, _ = lone.run_eager(input_, self._per_op_extra_inputs(extra_inputs), call_inputs)
        plan, parts = lone.last_plan, self._plan_parts
        if len(parts) != 1 or parts[0] is not plan:  # else `_joined_plan` keeps the last one
            self._last_plan = self._joined_plan([plan])
        return x

    def _forward_runs(
        self, runs: list[Run], input_: Tensor, extra_inputs: tuple, op_kwargs: OpKwargs | None
    ) -> Tensor | tuple[Tensor, ...]:
        """Run `runs` in order, handing each Fuser its extra inputs and the values published
        by earlier runs; the output, and the extra outputs that go to the caller."""
        channels = self._channels
        per_op = self._per_op_extra_inputs(extra_inputs)
        kwargs = split_op_kwargs(self.basic_ops(), op_kwargs) if op_kwargs else None
        call_inputs = CallInputs(input_, extra_inputs, self.parameters)
        x, extra_outputs, plans, used = input_, [], [], 0
        published: dict[tuple[int, int], Tensor] = {}  # (basic op, output slot) -> tensor
        for run in runs:
            if isinstance(run, Fuser):
                op_extra = per_op[used : used + len(run.ops)]
                if channels.any_bound:  # values published by earlier runs (run/channels.py)
                    op_extra = substitute(op_extra, published)
                run_kwargs = kwargs[used : used + len(run.ops)] if kwargs else None
                x, outs = run(x, op_extra, call_inputs, run_kwargs)
                for p, op_out in enumerate(outs, start=used):
                    for slot, t in enumerate(op_out):
                        published[(p, slot)] = t
                        if channels.to_caller[p][slot]:
                            extra_outputs.append(t)
                used += len(run.ops)
                plans.append(run.last_plan)
            else:
                x = run(x)
        joined = self._joined_plan(plans)
        # nn.Module.__setattr__ costs on every call; a traced call must not read the old one
        if torch.compiler.is_compiling() or joined is not self._last_plan:
            self._last_plan = joined
        return (x, *extra_outputs) if extra_outputs else x

    def _per_op_extra_inputs(self, extra_inputs: tuple) -> list[tuple]:
        """`_distribute_extra_inputs` of this call: checked once per structure and count of
        extra inputs, then reused as the position each op's slot takes (or its ChannelRef)."""
        count = len(extra_inputs)
        tracing = torch.compiler.is_compiling()  # then real Python, nothing read or kept
        slots = None if tracing else getattr(self, "_extra_slots", None)
        if slots is None or slots[0] != count:
            layout = _distribute_extra_inputs(self.basic_ops(), tuple(range(count)),
                                              self._channels.inputs)
            slots = (count, layout)
            if not tracing:
                self._extra_slots = slots
        return [tuple([extra_inputs[i] if isinstance(i, int) else i for i in op_slots])
                for op_slots in slots[1]]

    def _joined_plan(self, plans: list[FusionPlan]) -> FusionPlan:
        """The whole plan; the same object as last call when no run's cached plan changed.

        While tracing, the plan is joined without reading what the last call left: a graph
        would otherwise guard on it, and an eager call between two compiled ones would make
        the next compiled call recompile."""
        if torch.compiler.is_compiling():
            return plans[0] if len(plans) == 1 else FusionPlan.concat(plans)
        if len(plans) == len(self._plan_parts) and all(
            a is b for a, b in zip(plans, self._plan_parts)
        ):
            return self._last_plan
        self._plan_parts = plans
        return FusionPlan.concat(plans)

    def fusion_plan(self) -> FusionPlan | None:
        """The plan of the last forward call (None before any)."""
        return self._last_plan

    # --- delayed weight gradients (docs/gradient_contract.md) ---------------------------------
    def need_backward_dw(self) -> bool:
        return any(op.need_backward_dw() for op in self.basic_ops())

    def backward_dw(self) -> None:
        """Run the oldest pending wgrad of each op (one call per backward)."""
        for op in self.basic_ops():
            op.backward_dw()


def _check_no_forward_override(flat: list[torch.nn.Module]) -> None:
    """A basic op's maths is its op_/fuser_ methods: a Sequential never calls `forward` on it,
    so a subclass that overrides `forward` would silently lose its change there."""
    for index, module in enumerate(m for m in flat if isinstance(m, BasicOperation)):
        if type(module).forward is not BasicOperation.forward:
            raise TypeError(
                f"{type(module).__name__} (basic op {index}) overrides forward(), which a "
                "te_seq.Sequential never calls: put an op's maths in op_forward / op_backward "
                "(fuser_forward / fuser_backward for extra inputs or outputs)"
            )


def _lone_fuser(runs: list[Run], channels: ChannelPlan) -> Fuser | None:
    """The Fuser that is the whole of `runs`, when no extra input is bound to a channel and
    no extra output goes to the caller (then a call is that Fuser's call alone), else None."""
    if len(runs) != 1 or not isinstance(runs[0], Fuser) or channels.any_bound:
        return None
    if any(any(group) for group in channels.to_caller):
        return None
    return runs[0]


def _split_runs(flat: list[torch.nn.Module]) -> list[Run]:
    """Maximal runs of adjacent basic ops become Fusers; plain modules stand alone."""
    runs: list[Run] = []
    pending: list[BasicOperation] = []
    offset = 0
    for module in flat + [None]:
        if isinstance(module, BasicOperation):
            pending.append(module)
            continue
        if pending:
            runs.append(Fuser(pending, offset))
            offset += len(pending)
            pending = []
        if module is not None:
            runs.append(module)
    return runs


def _extra_names(op: BasicOperation) -> str:
    names = getattr(op, "extra_input_names", ())
    return ", ".join(names) if names else f"{op.num_extra_inputs} tensor(s)"


def _distribute_extra_inputs(
    ops: list[BasicOperation], extra: tuple, bound: tuple[tuple, ...]
) -> list[tuple]:
    """Hand each basic op its extra inputs, positionally, skipping the slots bound to a channel
    (`bound[i][s]`: a ChannelRef, or None for a slot the caller gives); ValueError naming the
    op if the count is off."""
    per_op, pos = [], 0
    for index, op in enumerate(ops):
        need = sum(ref is None for ref in bound[index])
        if pos + need > len(extra):
            raise ValueError(
                f"{type(op).__name__} (basic op {index}) expects {need} extra input(s) "
                f"({_extra_names(op)}), but only {len(extra) - pos} of the {len(extra)} extra "
                "inputs given to Sequential were left for it"
            )
        given = iter(extra[pos : pos + need])
        per_op.append(tuple(next(given) if ref is None else ref for ref in bound[index]))
        pos += need
    if pos != len(extra):
        takers = [
            f"{type(op).__name__}[{i}]: {sum(ref is None for ref in bound[i])}"
            for i, op in enumerate(ops)
            if any(ref is None for ref in bound[i])
        ]
        raise ValueError(
            f"Sequential got {len(extra)} extra inputs but its ops take {pos} "
            f"({', '.join(takers) or 'no op takes extra inputs'})"
        )
    return per_op
