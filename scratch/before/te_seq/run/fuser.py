"""The Fuser: runs one run of adjacent basic ops through a cached fusion plan.

There is exactly one autograd bridge (`_FuserFunction`) for every Fuser: fused or not, ops never
subclass `torch.autograd.Function`. Each basic op gets its own `OperationContext` per call; their
saved tensors go through the autograd context's `save_for_backward`, so saved-tensor hooks apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from te_seq.core import amp, fp8, fp8_gemm
from te_seq.core.amp import AutocastState
from te_seq.core.channels import ChannelRef
from te_seq.core.context import CallInputs, OperationContext
from te_seq.core.operation import BasicOperation, is_te_seq_class
from te_seq.distributed.fsdp import check_not_sharded
from te_seq.fusion.matcher import Segment, fill_unfused, match_phase, same_extra_input
from te_seq.fusion.plan import FusionPlan, PlanMiss, PlanStep
from te_seq.fusion.registry import registry_version
from te_seq.kernels import backend as kernel_backends
from te_seq.kernels.backend import Backend, BackendChoice
from te_seq.kernels.traced import traced
from te_seq.run import compiled, fast_path
from te_seq.run.channels import ChannelLink, channel_links, feed_channels, route_channel_grads
from te_seq.run.op_kwargs import kwargs_signature
from te_seq.run.step_checks import checked_backward, checked_forward


@dataclass
class RunPlan:
    """A cached plan for one run: segments per phase (backward in backward order), the backend
    of each segment, and (under torch.compile) why the run must run eagerly ("" if not)."""

    forward: list[Segment]
    backward: list[Segment]
    forward_backends: list[Backend]
    backward_backends: list[Backend]
    public: FusionPlan
    eager_reason: str = ""
    # id(segment op) -> whether it is one of te_seq's own classes: they are run with torch's
    # autocast off (they apply its policy) and their results are trusted (tested); a user's op
    # has what it returns checked against its window (run/step_checks.py).
    builtin: dict[int, bool] = field(default_factory=dict)
    # one forward step, run by one of te_seq's own ops (`_forward_steps` runs it straight)
    one_builtin_step: bool = False

    def traced(self) -> RunPlan:
        """This plan with every backend swapped for its traced kernels (custom ops)."""
        return replace(
            self,
            forward_backends=[traced(b) for b in self.forward_backends],
            backward_backends=[traced(b) for b in self.backward_backends],
        )


@dataclass
class _Call:
    """Everything one forward call hands to its backward (besides the saved tensors).

    `traced`: dynamo is tracing the call; backward then makes new contexts instead of writing
    into the forward's (a traced backward may not mutate objects it did not create)."""

    plan: RunPlan
    ops: list[BasicOperation]
    ctxs: list[OperationContext]
    extra_counts: list[int]
    param_counts: list[int]
    saved_ranges: list[tuple[int, int]] = field(default_factory=list)
    traced: bool = False
    positions: list[int] | None = None  # where each of (input, extras, params) is in the
    # autograd.Function's arguments when those are deduplicated (None: one to one)
    offset: int = 0  # basic-op index of the run's first op in the Sequential
    autocast: AutocastState | None = None  # torch.autocast at the forward call (core/amp.py)
    # The input shape of each forward step's first op (position -> shape): backward steps that
    # start there must return a grad input of that shape.
    input_shapes: dict[int, torch.Size] = field(default_factory=dict)
    # Extra-input slots fed by an earlier op of this run through a channel (run/channels.py).
    links: list[ChannelLink] = field(default_factory=list)
    # Keyword arguments per op for this call (run/op_kwargs.py); None: none given.
    op_kwargs: list[dict] | None = None
    # The extra inputs per op as `_run` hands them to the autograd bridge: an eager forward
    # receives those very tensors, so it reads them here instead of regrouping its arguments.
    extra: list[tuple] | None = None



def _extra_signature(flat: Sequence[Any]) -> tuple:
    """Types, dtypes, devices and the sameness relation of the extra inputs (part of plan keys)."""
    sig = []
    for i, item in enumerate(flat):
        label = next(j for j in range(i + 1) if same_extra_input(flat[j], item))
        if isinstance(item, Tensor):
            sig.append((label, item.dtype, item.device, item.requires_grad, item.dim()))
        else:
            sig.append((label, type(item)))
    return tuple(sig)


class Fuser:
    """Runs `ops` (a run of adjacent basic ops of a Sequential starting at basic-op `offset`)."""

    def __init__(self, ops: Sequence[BasicOperation], offset: int) -> None:
        self.ops = list(ops)
        self.offset = offset
        self.num_extra_inputs = sum(op.num_extra_inputs for op in self.ops)
        self._cache_key: tuple | None = None
        self._cache: RunPlan | None = None
        self.last_plan: FusionPlan | None = None
        self.compiled_plans: list[tuple[tuple, RunPlan]] = []  # (key, plan) found while tracing
        self.compile_token = compiled.token_for(self)
        self._fast: fast_path.FastEntry | None = None  # the last full-path call's decisions
        self.fast_calls = 0  # calls that took the fast path (run/fast_path.py)

    def __getstate__(self) -> dict:
        """A copy (deepcopy, pickle) starts without a fast-path entry: what its signature's
        first call prepared (`OperationContext.steady`) holds launches of this process's
        kernels, and a copy's first call decides afresh anyway (its parameters are new)."""
        return {**self.__dict__, "_fast": None}

    def __setstate__(self, state: dict) -> None:
        """A copy (deepcopy, pickle) gets a compile token of its own."""
        self.__dict__.update(state)
        self.compile_token = compiled.token_for(self)

    # --- planning ---------------------------------------------------------------------------
    def _key(
        self, input_: Tensor, flat_extra: Sequence[Any], with_backward: bool,
        autocast: AutocastState | None = None, op_kwargs: list[dict] | None = None,
    ) -> tuple:
        """Everything the plan depends on (compiled.KEY_* name the positions it reads back)."""
        params = tuple(
            (p.dtype, p.device, p.requires_grad, p.shape)
            for op in self.ops
            for p in op.fuser_parameters()
        )
        return (
            registry_version(),
            kernel_backends.registry_version(),
            kernel_backends.current_backend(),
            tuple(op.plan_facts() for op in self.ops),
            input_.dtype,
            input_.device,
            with_backward,
            input_.requires_grad,
            params,
            tuple(op.training for op in self.ops),
            _extra_signature(flat_extra),
            tuple(map(type, self.ops)),  # the matcher's subclass rule reads the classes
            # plain values, not the record: dynamo passes the key to compiled.ensure_plan
            None if autocast is None else (autocast.dtype, autocast.device_type),
            fp8.recipe_key(),  # plain values (dynamo passes the key on): plans are per recipe
            kwargs_signature(op_kwargs),  # fusions decline ops given kwargs they do not honour
        )

    def plan(
        self, input_: Tensor, extra: list[tuple], with_backward: bool,
        autocast: AutocastState | None = None, op_kwargs: list[dict] | None = None,
    ) -> RunPlan:
        flat_extra = [t for group in extra for t in group]
        key = self._key(input_, flat_extra, with_backward, autocast, op_kwargs)
        if key != self._cache_key:
            self._cache = self.build_plan(input_, input_.device, extra, with_backward, autocast,
                                          op_kwargs)
            self._cache_key = key
        return self._cache

    def build_plan(
        self, input_: Tensor, device: torch.device, extra: list[tuple], with_backward: bool,
        autocast: AutocastState | None = None, op_kwargs: list[dict] | None = None,
    ) -> RunPlan:
        """Match the fusions and choose each step's backend for `input_`'s dtype on `device`
        (under torch.autocast the GEMMs run in the autocast dtype: backends are chosen for it)."""
        dtype = amp.gemm_dtype(autocast, input_) or input_.dtype
        for op in self.ops:  # an op fully_shard wrapped on its own (never gathered) says so
            check_not_sharded(type(op).__name__, op.fuser_parameters())
        taken = [False] * len(self.ops)
        joint, misses = match_phase(self.ops, taken, "joint", extra, self.offset, op_kwargs)
        fwd_taken = list(taken)
        fwd, fwd_misses = match_phase(self.ops, fwd_taken, "forward", extra, self.offset,
                                      op_kwargs)
        forward = fill_unfused(self.ops, joint + fwd)
        backward: list[Segment] = []
        misses += fwd_misses
        if with_backward:
            bwd, bwd_misses = match_phase(self.ops, list(taken), "backward", extra, self.offset,
                                          op_kwargs)
            backward = list(reversed(fill_unfused(self.ops, joint + bwd)))
            misses += bwd_misses
        requested = kernel_backends.current_backend()
        choices: dict[int, BackendChoice] = {}
        for seg in forward + backward:  # a joint fused op has a forward and a backward segment
            if id(seg.op) not in choices:
                choices[id(seg.op)] = seg.op.plan_backend(requested, dtype, device)
        public = self._public(forward, backward, misses, choices, dtype, device,
                              fp8.active_recipe())
        return RunPlan(
            forward,
            backward,
            [choices[id(seg.op)].backend for seg in forward],
            [choices[id(seg.op)].backend for seg in backward],
            public,
            builtin={id(seg.op): is_te_seq_class(type(seg.op)) for seg in forward + backward},
            one_builtin_step=len(forward) == 1 and is_te_seq_class(type(forward[0].op)),
        )

    def _public(
        self, forward, backward, misses: list[PlanMiss], choices, dtype, device, recipe=None
    ) -> FusionPlan:
        def step(seg: Segment) -> PlanStep:
            indices = tuple(p + self.offset for p in seg.positions)
            chosen, why = choices[id(seg.op)]
            note = seg.op.plan_note(chosen, dtype, device)
            if getattr(seg.op, "fp8_gemms", False):  # how its GEMMs run under the recipe
                fp8_note = fp8_gemm.step_note(recipe, chosen.name, seg.op, dtype, device)
                note = "; ".join(filter(None, [note, fp8_note]))
            why = f"{why}; {note}" if note else why
            return PlanStep(type(seg.op).__name__, indices, chosen.name, seg.op, why,
                            recipe=recipe)

        return FusionPlan([step(s) for s in forward], [step(s) for s in backward], misses)

    # --- running ----------------------------------------------------------------------------
    def __call__(
        self, input_: Tensor, extra: list[tuple], call_inputs: CallInputs | None = None,
        op_kwargs: list[dict] | None = None,
    ) -> tuple[Tensor, list[tuple]]:
        """Run the ops on `input_`; `op_kwargs`: keyword arguments per op (None: none), which
        Sequential.forward only passes eagerly (a compiled call runs at a graph break)."""
        if not isinstance(input_, Tensor):
            raise TypeError(
                f"{type(self.ops[0]).__name__} (basic op {self.offset}): input must be a "
                f"torch.Tensor, got {type(input_).__name__}"
            )
        if torch.compiler.is_compiling():
            return self._run_traced(input_, extra, call_inputs)
        return self.run_eager(input_, extra, call_inputs, op_kwargs)

    def run_eager(
        self, input_: Tensor, extra: list[tuple], call_inputs: CallInputs | None = None,
        op_kwargs: list[dict] | None = None,
    ) -> tuple[Tensor, list[tuple]]:
        autocast = AutocastState.current(input_.device)
        signature = None
        params = [p for op in self.ops for p in op.fuser_parameters()]  # read once a call
        if op_kwargs is None:
            signature = fast_path.call_signature(self.ops, input_, extra, autocast, params)
        entry = self._fast
        if signature is not None and entry is not None and entry.signature == signature:
            self.fast_calls += 1
            self.last_plan = entry.plan.public
            return self._run(entry.plan, entry.contexts(call_inputs, autocast), input_, extra,
                             entry.with_backward, False, autocast, None, entry.counts, params)
        ctxs = new_contexts(self.ops, input_, extra, call_inputs, autocast,
                            None if signature is None else {})  # this signature's steady dict
        with_backward = any(ctx.requires_grad for ctx in ctxs)
        plan = self.plan(input_, extra, with_backward, autocast, op_kwargs)
        self.last_plan = plan.public
        self._fast = None
        counts = self._counts(extra)
        result = self._run(plan, ctxs, input_, extra, with_backward, False, autocast, op_kwargs,
                           counts, params)
        if signature is not None:  # checked and run: the next identical call may reuse it
            self._fast = fast_path.FastEntry.remember(signature, plan, ctxs, counts)
        return result

    def _counts(self, extra: list[tuple]) -> tuple[list[int], list[int], list[ChannelLink]]:
        """(extra inputs per op, parameters per op, channel links) of a call's extra inputs."""
        return ([len(e) for e in extra], [len(op.fuser_parameters()) for op in self.ops],
                channel_links(extra, self.offset))

    def _run_traced(
        self, input_: Tensor, extra: list[tuple], call_inputs: CallInputs | None = None
    ) -> tuple[Tensor, list[tuple]]:
        """Under dynamo: the key is traced (its facts become guards), the plan is built as real
        Python (`compiled.ensure_plan`), kernels are custom ops; or the eager run at a graph
        break when the plan says the run cannot be traced."""
        autocast = AutocastState.current(input_.device)
        ctxs = new_contexts(self.ops, input_, extra, call_inputs, autocast)
        with_backward = any(ctx.requires_grad for ctx in ctxs)
        flat_extra = [t for group in extra for t in group]
        key = self._key(input_, flat_extra, with_backward, autocast)
        index = compiled.ensure_plan(self.compile_token, key)
        plan = self.compiled_plans[index][1]
        if plan.eager_reason:
            return compiled.run_eagerly(self, input_, extra, call_inputs)
        self.last_plan = plan.public
        return self._run(plan, ctxs, input_, extra, with_backward, True, autocast)

    def _run(
        self, plan: RunPlan, ctxs, input_, extra, with_backward: bool, traced: bool, autocast,
        op_kwargs: list[dict] | None = None, counts: tuple | None = None,
        params: list[Tensor] | None = None,
    ):
        """Run `plan`; `counts`: `_counts(extra)`, `params`: the ops' `fuser_parameters()`,
        where the caller has them already."""
        counts = counts or self._counts(extra)
        call = _Call(plan, self.ops, ctxs, counts[0], counts[1], traced=traced,
                     offset=self.offset, autocast=autocast, links=counts[2], op_kwargs=op_kwargs)
        if counts[2]:  # each bound slot (a ChannelRef) has a link: filled in as its publisher runs
            extra = [tuple(None if isinstance(t, ChannelRef) else t for t in group)
                     for group in extra]
        if not with_backward:
            out, extra_out = _run_forward(call, input_, extra)
            return out, extra_out
        if params is None:
            params = [p for op in self.ops for p in op.fuser_parameters()]
        # A channel-bound slot (None now) is no input of the autograd bridge: made inside it.
        flat_extra = [t for group in extra for t in group]
        inputs = [input_, *flat_extra, *params]
        if traced:  # dynamo's autograd.Function takes each tensor once
            inputs, call.positions = _dedupe(inputs)
        else:
            call.extra = extra
        outputs = _FuserFunction.apply(call, *inputs)
        return outputs[0], _unflatten(outputs[1:], [op.num_extra_outputs for op in self.ops])


def new_contexts(
    ops: Sequence[BasicOperation],
    input_: Tensor,
    extra: list[tuple],
    call_inputs: CallInputs | None = None,
    autocast: AutocastState | None = None,
    steady: dict | None = None,
) -> list[OperationContext]:
    """One context per basic op for this call, with which gradients its backward must produce.

    The one place contexts are made and their per-call fields filled (except `backend`, which
    depends on the plan step running the op in each phase: see `_step_contexts`). `recipe` is
    te_seq.autocast's FP8 recipe (None outside); `process_group` is the op's `process_group`
    attribute (None for ops without one: the communication ops and the tensor-parallel linear
    have one). `steady`: the dict of this call's signature (`OperationContext.steady`), shared
    by all the contexts of the call.
    """
    grad_on = torch.is_grad_enabled()
    running = grad_on and input_.requires_grad  # the gradient flows from the input onward
    ctxs = []
    for op, op_extra in zip(ops, extra):
        weight_grad = grad_on and any(p.requires_grad for p in op.fuser_parameters())
        extra_grad = grad_on and any(isinstance(t, Tensor) and t.requires_grad for t in op_extra)
        requires_grad = running or weight_grad or extra_grad
        ctxs.append(OperationContext(requires_grad=requires_grad, input_requires_grad=running,
                                     weight_requires_grad=weight_grad,
                                     call_inputs=call_inputs, autocast=autocast,
                                     recipe=fp8.active_recipe(),
                                     process_group=getattr(op, "process_group", None),
                                     steady=steady))
        running = requires_grad
    return ctxs


def _step_contexts(
    call: _Call, seg: Segment, backend: Backend, saved: Sequence[Tensor | None] | None = None
) -> list[OperationContext]:
    """The contexts of one plan step's basic ops, with the step's backend set (and, in backward,
    their saved tensors). A traced backward gets new contexts with those fields replaced (dynamo
    traces backward without side effects; a traced forward may write into its contexts)."""
    ctxs = [call.ctxs[p] for p in seg.positions]
    if saved is None:  # forward
        for ctx in ctxs:
            ctx.backend = backend
        return ctxs
    for i, p in enumerate(seg.positions):
        start, n = call.saved_ranges[p]
        tensors = tuple(saved[start : start + n])
        if call.traced:
            ctxs[i] = replace(ctxs[i], backend=backend, saved_tensors=tensors)
        else:
            ctxs[i].backend, ctxs[i].saved_tensors = backend, tensors
    return ctxs


def _unflatten(flat: Sequence[Any], counts: Sequence[int]) -> list[tuple]:
    out, start = [], 0
    for n in counts:
        out.append(tuple(flat[start : start + n]))
        start += n
    return out


def _run_forward(call: _Call, input_: Tensor, extra: list[tuple]) -> tuple[Tensor, list[tuple]]:
    """Run the plan's forward segments; returns the output and the extra outputs per basic op."""
    if call.autocast is None:
        return _forward_steps(call, input_, extra)
    with amp.running(call.autocast):  # te_seq's ops apply autocast's policy themselves
        return _forward_steps(call, input_, extra)


def _forward_steps(call: _Call, input_: Tensor, extra: list[tuple]):
    plan = call.plan
    if plan.one_builtin_step and call.autocast is None and not call.links:
        # the loop below for one step over every op (the steady-state grouped MLP's case)
        x, outs = _forward_step(call, plan.forward[0], plan.forward_backends[0], input_, extra,
                                True)
        return x, [tuple(op_out) for op_out in outs]
    x = input_
    extra_out: list[tuple] = [()] * len(call.ctxs)
    extra = list(extra)  # channel-bound slots are filled in as their publishers run
    for seg, backend in zip(call.plan.forward, call.plan.forward_backends):
        builtin = call.plan.builtin[id(seg.op)]
        if call.autocast is None:
            x, outs = _forward_step(call, seg, backend, x, extra, builtin)
        else:
            with amp.step_scope(call.autocast, builtin):
                x, outs = _forward_step(call, seg, backend, x, extra, builtin)
        for p, op_out in zip(seg.positions, outs):
            extra_out[p] = tuple(op_out)
        if call.links:
            feed_channels(call.links, call.ctxs, seg.positions, extra, extra_out)
    return x, extra_out



def _forward_step(
    call: _Call, seg: Segment, backend: Backend, x: Tensor, extra: list[tuple], builtin: bool
):
    ctxs = _step_contexts(call, seg, backend)
    # The first op of a segment is checked here; a fused op checks its inner ops' inputs.
    first = seg.positions[0]
    call.ops[first].forward_checks(x, extra[first], ctxs[0].signature_checked)
    call.input_shapes[first] = x.shape
    positions = seg.positions
    kwargs = call.op_kwargs
    result = seg.op.fuser_forward(
        ctxs,
        x,
        basic_op_extra_inputs=[extra[p] for p in positions],
        basic_op_kwargs=[kwargs[p] for p in positions] if kwargs else [{} for _ in positions],
    )
    if builtin:
        return result
    return checked_forward(seg.op, [call.ops[p] for p in seg.positions], _indices(call, seg),
                           result)


def _indices(call: _Call, seg: Segment) -> tuple[int, ...]:
    """The segment's basic-op indices in the whole Sequential (as the plan shows them)."""
    return tuple(p + call.offset for p in seg.positions)


def _run_backward(call: _Call, grad_output: Tensor, grad_extra_out: list[tuple],
                  saved: Sequence[Tensor | None], extra_needs_grad: list[bool]):
    """Run the plan's backward segments; returns (dx, param grads per op, extra grads per op)."""
    step_args = (call, grad_output, grad_extra_out, saved, extra_needs_grad)
    if call.autocast is None:
        return _backward_steps(*step_args)
    with amp.running(call.autocast):  # computed in the dtypes the forward chose
        return _backward_steps(*step_args)


def _backward_steps(call: _Call, grad_output: Tensor, grad_extra_out: list[tuple],
                    saved: Sequence[Tensor | None], extra_needs_grad: list[bool]):
    n = len(call.ctxs)
    param_grads: list[Sequence] = [()] * n
    extra_grads: list[Sequence] = [()] * n
    dy = grad_output
    grad_extra_out = list(grad_extra_out)  # channel consumers add to their publishers' slots
    for seg, backend in zip(call.plan.backward, call.plan.backward_backends):
        if not any(call.ctxs[p].requires_grad for p in seg.positions):
            # requires_grad only grows in forward order: no earlier op needs a backward either
            # (their contexts saved nothing), and the run's input needs no gradient.
            dy = None
            break
        builtin = call.plan.builtin[id(seg.op)]
        step = (call, seg, backend, saved, dy, grad_extra_out, extra_needs_grad, builtin)
        if call.autocast is None:
            dy, pgrads, egrads = _backward_step(*step)
        else:
            with amp.step_scope(call.autocast, builtin):
                dy, pgrads, egrads = _backward_step(*step)
        if call.links:
            egrads = route_channel_grads(call.links, seg.positions, egrads, grad_extra_out)
        for p, pg, eg in zip(seg.positions, pgrads, egrads):
            param_grads[p], extra_grads[p] = tuple(pg), tuple(eg)
    return dy, param_grads, extra_grads


def _backward_step(call: _Call, seg: Segment, backend: Backend, saved, dy, grad_extra_out,
                   extra_needs_grad, builtin: bool):
    ctxs = _step_contexts(call, seg, backend, saved)
    result = seg.op.fuser_backward(
        ctxs, dy, basic_op_grad_extra_outputs=[grad_extra_out[p] for p in seg.positions]
    )
    if builtin:
        return result
    counts = ([call.param_counts[p] for p in seg.positions],
              [call.extra_counts[p] for p in seg.positions])
    return checked_backward(
        seg.op, ctxs, _indices(call, seg), result, counts,
        [extra_needs_grad[p] for p in seg.positions], call.input_shapes.get(seg.positions[0]),
    )


def _check_saved_unmodified(call: _Call) -> None:
    """RuntimeError if a tensor an op saved was written in place later in this forward.

    autograd records a saved tensor's version when it receives it, which is after this whole
    forward, so such a write would otherwise pass unseen and corrupt the op's gradient (te_seq's
    own in-place ops avoid memory the call shares; this catches anyone else's)."""
    if torch.compiler.is_compiling():
        return
    for index, (op, ctx) in enumerate(zip(call.ops, call.ctxs)):
        slot = ctx.modified_saved_tensor()
        if slot is not None:
            t = ctx.to_save[slot]
            raise RuntimeError(
                f"{type(op).__name__} (op {index} of its run): tensor {slot} it saved for "
                f"backward (shape {tuple(t.shape)}) was written in place later in the same "
                "forward, so its gradients would be wrong: an in-place op was given memory "
                "that this tensor shares (e.g. the Sequential's input as an in-place residual); "
                "give that op a tensor of its own or run it out of place"
            )


def _padded(grads: Sequence, count: int) -> list:
    """One op's gradient slots; an empty list (checked: none was needed) as Nones."""
    return list(grads) if grads else [None] * count


def _dedupe(tensors: list) -> tuple[list, list[int]]:
    """(the distinct tensors in first-seen order, the index of each input among them)."""
    unique: list = []
    positions = []
    for t in tensors:
        index = next((i for i, u in enumerate(unique) if u is t), None)
        if index is None:
            index = len(unique)
            unique.append(t)
        positions.append(index)
    return unique, positions


def _summed(grads: list, positions: list[int]) -> list:
    """Gradients per distinct tensor: the sum over the places it was passed (None-aware)."""
    out: list = [None] * (max(positions) + 1)
    for g, i in zip(grads, positions):
        if g is not None:
            out[i] = g if out[i] is None else out[i] + g
    return out


def _not_a_view(t: Tensor | None) -> Tensor | None:
    """A traced forward may not save a view it made of its inputs (dynamo drops intermediates
    that alias an input from the traced forward's outputs): such a view is saved as a copy.
    te_seq's grouped ops save their inputs themselves, so they pay no copy."""
    if isinstance(t, Tensor) and t._base is not None:
        return t.clone()
    return t


def _own_output(t: Tensor, inputs: Sequence[Any]) -> Tensor:
    """A traced forward's output as a tensor of its own (`detach`, no copy) unless it is one of
    the inputs: torch 2.11's dynamo mistakes an output that is the same tensor as an
    intermediate (e.g. `y.to(y.dtype)` returns `y`) for two outputs, and its gradient arrives
    as zeros."""
    if not isinstance(t, Tensor) or any(t is a for a in inputs):
        return t
    return t.detach()


class _FuserFunction(torch.autograd.Function):
    """The single autograd bridge: forward and backward of one run of ops."""

    @staticmethod
    def forward(func_ctx, call: _Call, *args: Any):
        if call.traced:
            input_, *tensors = args if call.positions is None else [args[i] for i in call.positions]
            extra = _unflatten(tensors[: sum(call.extra_counts)], call.extra_counts)
        else:
            input_, extra = args[0], call.extra
        output, extra_out = _run_forward(call, input_, extra)
        _check_saved_unmodified(call)
        to_save: list[Tensor | None] = []
        for ctx in call.ctxs:
            call.saved_ranges.append((len(to_save), len(ctx.to_save)))
            to_save.extend(ctx.to_save)
            ctx.to_save = ()
        if call.traced:
            to_save = [_not_a_view(t) for t in to_save]
        func_ctx.save_for_backward(*to_save)
        func_ctx.call = call
        flat_out = [t for op_out in extra_out for t in op_out]
        if call.traced:
            return tuple(_own_output(t, args) for t in (output, *flat_out))
        return (output, *flat_out)

    @staticmethod
    def backward(func_ctx, grad_output: Tensor, *grad_extra_flat: Tensor):
        call: _Call = func_ctx.call
        basic_ops = call.ops
        grad_extra = _unflatten(grad_extra_flat, [op.num_extra_outputs for op in basic_ops])
        saved = func_ctx.saved_tensors
        needs = func_ctx.needs_input_grad
        # needs: (call, *arguments); arguments are (input, extras, params), deduplicated if traced
        flat_needs = needs[1:] if call.positions is None else [needs[1 + i] for i in call.positions]
        extra_needs = [any(group) for group in _unflatten(flat_needs[1:], call.extra_counts)]
        for op, ctx in zip(basic_ops, call.ctxs):  # before any gradient is written anywhere
            if ctx.requires_grad:
                op.pre_backward_checks(ctx)
        dx, param_grads, extra_grads = _run_backward(
            call, grad_output, grad_extra, saved, extra_needs
        )
        if not call.traced:
            for ctx in call.ctxs:
                ctx.saved_tensors = ()
        flat_extra = [
            g for n, eg in zip(call.extra_counts, extra_grads) for g in _padded(eg, n)
        ]
        flat_params = [
            g for n, pg in zip(call.param_counts, param_grads) for g in _padded(pg, n)
        ]
        grads = [dx, *flat_extra, *flat_params]
        if call.positions is not None:
            grads = _summed(grads, call.positions)
        return tuple(g if need else None for g, need in zip([None, *grads], needs))
