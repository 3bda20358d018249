"""MoeBlock: ExpertDispatch → GroupedLinear → activation → GroupedLinear → ExpertCombine as one op.

Registered as the joint fusion "moe_block". Shape legend: T tokens, k top-k, N = T·k routed rows,
E experts, H hidden, F ffn width (FC1: H -> 2F gated, F otherwise).

FC1 reads its rows straight from the tokens (`gather_rows = order // k`) and FC2 writes its rows
in slot order (`scatter_rows = order`), so neither [N, H] permuted copy exists where the backend
gathers / scatters inside its GEMMs (te_seq.kernels.routed; elsewhere each is one separate pass).
y = y_slots.view(T, k, H).sum(1): the k-sum in choice order, as ExpertCombine (no atomics).
The grouped MLP's maths is GroupedMLP's (held by composition, its helpers given the routes).
Saved for backward: x [T, H] (not the [N, H] rows), order, the routing map, token_of_row, h, the
weights, the offsets and the row probabilities; FC1's wgrad gathers its x rows just before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq.core import amp
from te_seq.core.channels import ChannelRef, input_subscription, output_publication
from te_seq.core.operation import BasicOperation, FusedOperation
from te_seq.fusion.matcher import Window
from te_seq.fusion.registry import NoMatch, register_fusion
from te_seq.kernels import as_rows, routed, routing
from te_seq.kernels.backend import Backend, KernelNeed
from te_seq.kernels.routed import Route, route_decision
from te_seq.ops.basic._split_sizes import device_offsets
from te_seq.ops.basic.activation import Activation
from te_seq.ops.basic.expert_combine import ExpertCombine
from te_seq.ops.basic.expert_dispatch import ExpertDispatch
from te_seq.ops.basic.grouped_linear import GroupedLinear
from te_seq.ops.fused.grouped_mlp import GroupedMLP, _build_grouped_mlp, _Extras


@dataclass(frozen=True)
class MoeSaved:
    """What backward needs besides the saved tensors: the input's shape and dtype, and k."""

    input_shape: torch.Size
    input_dtype: torch.dtype
    routing_shape: torch.Size  # topk_indices' shape [..., k]


@dataclass(frozen=True)
class RouteStatus:
    """The plan's decisions: FC1 gathers, FC2 and the dX GEMM scatter inside their kernels."""

    gather: bool
    scatter: bool
    dgrad_scatter: bool


class MoeBlock(FusedOperation):
    """y[t] = Σ_j FC2_e(act(FC1_e(x_t)))(·p_tj) for e = topk_indices[t, j]: the whole routed
    expert block, equal to its five basic ops run unfused (same maths, same k-sum order)."""

    def __init__(self, basic_ops: Sequence[BasicOperation], mlp: GroupedMLP) -> None:
        super().__init__(basic_ops)
        self.dispatch, self.fc1, self.activation, self.fc2, self.combine = basic_ops
        object.__setattr__(self, "mlp", mlp)  # shares the basic ops; no submodule
        self._route_memo: dict = {}

    def kernel_needs(self) -> list[KernelNeed]:
        return self.mlp.kernel_needs()

    def route_status(self, backend: Backend, dtype: torch.dtype, device: torch.device):
        """Which routed rows the GEMMs take natively on `backend` (static facts, remembered per
        plan like GroupedMLP.epilogue_status; keyed by name so a traced call finds it)."""
        key = (backend.name, dtype, device, self.activation.plan_facts())
        memo = self._route_memo
        if key not in memo:
            memo[key] = self._route_decision(backend, dtype, device)
        return memo[key]

    def _route_decision(self, backend: Backend, dtype, device) -> RouteStatus:
        h, f1, f = self.fc1.in_features, self.fc1.out_features, self.fc2.in_features
        facts = dict(dtype=dtype, device=device)
        if self.mlp.epilogue_status(backend, dtype, device)[0]:
            op = self.activation
            kernel = "glu_fc1_forward" if op.gated else "act_fc1_forward"
            spec = {"glu": op.glu_spec} if op.gated else {"act": op.act}
            gather = route_decision(backend, kernel, "gather", hidden=h, ffn=f, **spec, **facts)
        else:
            gather = route_decision(backend, "grouped_mm", "gather", k=h, n=f1, **facts)
        return RouteStatus(
            gather,
            route_decision(backend, "grouped_mm", "scatter", k=f, n=h, **facts),
            route_decision(backend, "grouped_mm", "scatter", k=f1, n=h, **facts),
        )

    def plan_note(self, backend: Backend, dtype: torch.dtype, device: torch.device) -> str:
        """The grouped MLP's note, plus where the gather and the scatters run."""
        status = self.route_status(backend, dtype, device)
        where = {True: "inside the GEMM", False: "a separate pass"}
        why = "" if status.gather and status.scatter else (
            f" (the {backend.name} backend does not route these rows in its kernels)")
        return (f"{self.mlp.plan_note(backend, dtype, device)}; FC1 gather: "
                f"{where[status.gather]}, FC2 scatter: {where[status.scatter]}, dX scatter: "
                f"{where[status.dgrad_scatter]}{why}")

    # --- forward ------------------------------------------------------------------------------
    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        ctx0, ctx1, _, ctx2, _ = basic_op_ctxs
        indices, topk_probs = basic_op_extra_inputs[0]
        k = indices.shape[-1]
        expert_of_slot = indices.reshape(-1)  # [N]
        order, row_of_slot = routing.sort_slots(expert_of_slot)  # [N], [N]
        splits = routing.count_rows(expert_of_slot, self.dispatch.num_experts)  # [E]
        row_probs = routing.permute_slot_values(topk_probs, order)  # [N]
        routing_map = row_of_slot.reshape(indices.shape)  # [..., k]
        token_of_row = torch.div(order, k, rounding_mode="floor")  # [N]
        x, w1 = self.fc1.operands(ctx1, as_rows(input_, self.fc1.in_features))  # [T, H]
        w2 = self.fc2.operands(ctx2, x)[1]
        n = order.shape[0]
        self._check_fc1(x, n, splits, row_probs, ctx1.signature_checked)
        offs = device_offsets(splits, n, x.device, ctx1.backend)
        extras = self._extras(splits, row_probs)
        status = self.route_status(ctx1.backend, x.dtype, x.device)
        # no backward (no_grad, inference, everything frozen): FC1 may skip writing h
        with_backward = any(c.requires_grad for c in basic_op_ctxs)
        h, a, y_slots = self.mlp.forward_rows(
            ctx1, x, w1, w2, offs, extras, self._inner_extra(splits, row_probs),
            gather=Route(token_of_row, status.gather), scatter=Route(order, status.scatter),
            need_h=with_backward)
        y = _sum_choices(y_slots, x.shape[0], k)  # [T, H]
        if with_backward:
            # routing_map (an output) rather than its base; under torch.compile a copy of the
            # probs (dynamo's autograd.Function may not save an alias of an output)
            probs_saved = row_probs.clone() if torch.compiler.is_compiling() else row_probs
            ctx0.save_for_backward(x, order, routing_map, token_of_row, h, w1, w2, offs,
                                   probs_saved)
            ctx0.saved = MoeSaved(input_.shape, input_.dtype, indices.shape)
            ctx1.saved = self.fc1.saved_record(input_, x.dtype)
            fc2_shape = torch.Size((n, self.fc2.in_features))
            ctx2.saved = self.fc2.saved_record(a, x.dtype, shape=fc2_shape)
        out = y.reshape(*input_.shape[:-1], self.fc2.out_features)
        return out, [(splits, row_probs, routing_map), (), (), (), ()]

    def _check_fc1(self, x: Tensor, n: int, splits: Tensor, row_probs: Tensor, seen: bool):
        """FC1's input checks on a stand-in of its [N, H] rows (shape and dtype only)."""
        rows_like = x.new_empty(()).expand(n, x.shape[1])
        extra = (splits, row_probs)[: self.fc1.num_extra_inputs]
        self.fc1.forward_checks(rows_like, extra, seen)

    def _extras(self, splits: Tensor, row_probs: Tensor) -> _Extras:
        """The grouped MLP's extra inputs: every probs-bound slot is the row probabilities."""
        return _Extras(
            splits=splits,
            fc1_scales=row_probs if self.fc1.num_extra_inputs > 1 else None,
            probs=row_probs if self.activation.num_extra_inputs else None,
            fc2_scales=row_probs if self.fc2.num_extra_inputs > 1 else None,
        )

    def _inner_extra(self, splits: Tensor, row_probs: Tensor) -> list[tuple]:
        """The activation's and FC2's extra inputs as the unfused chain would see them (every
        slot is bound to the dispatch: the build checked), for their input checks."""
        return [(row_probs,) * self.activation.num_extra_inputs,
                (splits, row_probs)[: self.fc2.num_extra_inputs]]

    # --- backward -----------------------------------------------------------------------------
    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx0, ctx1, ctx_act, ctx2, _ = basic_op_ctxs
        x, order, routing_map, token_of_row, h, w1, w2, offs, row_probs = ctx0.saved_tensors
        saved = ctx0.saved_as(MoeSaved)
        d_out = grad_output.reshape(-1, grad_output.shape[-1])  # [T, H]
        dy = self.fc2.grad_rows(ctx2, d_out.index_select(0, token_of_row))  # [N, H], transient
        mlp_ctxs = [ctx1, ctx_act, ctx2]
        extras = self._extras(None, row_probs)
        scales = (extras.fc1_scales, extras.fc2_scales)
        probs_in = row_probs if self.activation.num_extra_inputs else None
        dh, dprobs, fc1_grads, ds1, fc2_grads, ds2 = self.mlp.backward_rows(
            mlp_ctxs, dy, lambda: x.index_select(0, token_of_row), w2, offs, h, probs_in, scales)
        del dy
        dx = None
        if ctx0.input_requires_grad:
            dx = self._input_grad(ctx1.backend, dh, w1, offs, order, saved)
        d_row_probs = _added(basic_op_grad_extra_outputs[0][1], ds2, dprobs, ds1)
        d_topk = None
        if d_row_probs is not None:
            row_of = routing_map.reshape(-1, saved.routing_shape[-1])  # [T, k]
            d_topk = routing.unpermute_slot_values(d_row_probs, row_of)
            d_topk = d_topk.reshape(saved.routing_shape)
        extra = [(None, d_topk)] + [(None,) * op.num_extra_inputs for op in self.basic_ops[1:]]
        return dx, [[], fc1_grads, [], fc2_grads, []], extra

    def _input_grad(self, backend, dh: Tensor, w1: Tensor, offs: Tensor, order: Tensor,
                    saved: MoeSaved) -> Tensor:
        """dX[t] = Σ_j (dH W1)[row of (t, j)]: the dgrad GEMM writes slot order, summed over k."""
        status = self.route_status(backend, dh.dtype, dh.device)
        dx_slots = routed.mm(backend, dh, w1, offs, scatter=Route(order, status.dgrad_scatter))
        dx_slots = amp.cast(dx_slots, saved.input_dtype)  # [N, H] in slot order
        k = saved.routing_shape[-1]
        dx = _sum_choices(dx_slots, dx_slots.shape[0] // k, k)
        return dx.reshape(saved.input_shape)


def _sum_choices(slots: Tensor, tokens: int, k: int) -> Tensor:
    """[N, W] rows in slot order -> [T, W]: the k choices of each token summed in choice order
    (as routing.unpermute_rows); k = 1 is a view."""
    width = slots.shape[-1]
    return slots.view(tokens, width) if k == 1 else slots.view(tokens, k, width).sum(1)


def _added(*grads: Tensor | None) -> Tensor | None:
    """The sum of the present gradients, left to right (the order the unfused chain adds them:
    the caller's, then the consumers' in backward order)."""
    total = None
    for g in grads:
        if g is not None:
            total = g if total is None else total + g
    return total


def _bound_to_dispatch(window, position: int, slot: int, out_slot: int) -> bool:
    """Whether extra input `slot` of the window's op at `position` is the dispatch's extra output
    `out_slot` through a channel. Eager plans see the slot's ChannelRef; a plan built while
    torch.compile traces sees a stand-in (not a tensor) and reads the ops' declared channels
    (nothing between the dispatch and its consumers publishes: they have no extra outputs)."""
    ref = window.extra_inputs[position][slot]
    if isinstance(ref, ChannelRef):
        return ref.producer == window.basic_op_indices[0] and ref.slot == out_slot
    if isinstance(ref, Tensor):
        return False
    channel = input_subscription(window[position], slot)[0]
    return channel is not None and channel == output_publication(window[0], out_slot)[0]


def _unbound(window) -> str | None:
    """Which extra input is not bound to the dispatch's channels (None: all are)."""
    fc1, act, fc2 = window[1:4]
    wanted = [("GroupedLinear (FC1) split_sizes", 1, 0, 0),
              ("GroupedLinear (FC2) split_sizes", 3, 0, 0),
              ("ExpertCombine routing", 4, 0, 2)]
    wanted += [(f"{type(act).__name__} scales", 2, 0, 1)] * act.num_extra_inputs
    wanted += [("GroupedLinear (FC1) scales", 1, 1, 1)] * (fc1.num_extra_inputs - 1)
    wanted += [("GroupedLinear (FC2) scales", 3, 1, 1)] * (fc2.num_extra_inputs - 1)
    for label, position, slot, out_slot in wanted:
        if not _bound_to_dispatch(window, position, slot, out_slot):
            return label
    return None


@register_fusion(
    name="moe_block",
    phase="joint",
    pattern=(ExpertDispatch, GroupedLinear, Activation, GroupedLinear, ExpertCombine),
    builtin=True,
)
def _build_moe_block(window) -> MoeBlock | NoMatch:
    dispatch, _, _, _, combine = window
    if dispatch.expert_parallel is not None or combine.ep_group is not None:
        return NoMatch("expert parallelism (ep_group): the routed rows leave this rank between "
                       "the dispatch and FC1, so there are no token rows to gather from")
    unbound = _unbound(window)
    if unbound:
        names = ("split_sizes", "probs", "routing")
        return NoMatch(f"{unbound} is not bound to the ExpertDispatch's channels {names} "
                       "in this Sequential (the fused block computes them itself)")
    inner = Window(window[1:4], window.extra_inputs[1:4], window.basic_op_indices[1:4])
    mlp = _build_grouped_mlp(inner)
    if isinstance(mlp, NoMatch):
        return NoMatch(f"its grouped MLP does not fuse: {mlp.reason}")
    return MoeBlock(window, mlp)
