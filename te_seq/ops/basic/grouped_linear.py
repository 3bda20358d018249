"""GroupedLinear: one linear layer per group (expert) over contiguous row blocks."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from te_seq.core import amp, checks, fp8, fp8_gemm
from te_seq.core.context import OperationContext
from te_seq.core.grad_policy import (
    ForwardWeights,
    GradContractMixin,
    WeightGradPolicy,
    WgradRequest,
)
from te_seq.core.operation import BasicOperation
from te_seq.kernels import as_rows
from te_seq.kernels.backend import Backend, KernelNeed
from te_seq.kernels.reference import LazyGroupBounds
from te_seq.ops.basic._grouped_params import ParamBlock, block_of
from te_seq.ops.basic._split_sizes import (
    check_host_split_values,
    check_split_sizes,
    device_offsets,
    group_index,
    rows_of,
)
from te_seq.ops.basic.basic_linear import init_linear_weight_

# Shape legend: T tokens (routed rows), G groups, K = in_features, N = out_features.


@dataclass(frozen=True)
class GroupedLinearSaved:
    """What GroupedLinear's backward reads besides its saved tensors (the fused GroupedMLP fills
    one per linear too, through `GroupedLinear.saved_record`)."""

    input_shape: torch.Size  # dX is reshaped back to it
    weights: ForwardWeights  # the forward's weights, weakly held, for the gradient contract
    input_dtype: torch.dtype | None = None  # dX is cast back to it (None: the compute dtype)
    compute_dtype: torch.dtype | None = None  # dY is cast to it (None: as it comes)


class GroupedLinear(GradContractMixin, BasicOperation):
    """y_g = x_g W_gᵀ + b_g for each group g of contiguous rows (sizes from `split_sizes`).

    x [..., in_features] is flattened to rows [T, in]; `split_sizes` [G] (host or device
    integer tensor) cuts the rows into G blocks in order; empty groups are legal. With
    `scale_bias`, the bias is scaled per row: y_t = x_t W_gᵀ + s_t b_g (extra input `scales` [T]).
    Equivalent to `torch.cat([x_g @ W_g.T + b_g for g])`. Parameters `weight0..weight{G-1}`
    [out, in] (or `weight` [G, out, in] with single_grouped_weight), then `bias0..` [out]
    (or `bias` [G, out] with single_grouped_bias). After an ExpertDispatch in the same
    Sequential, `split_sizes` (and `scales`) come from its "split_sizes" ("probs") channel.
    """

    # Subscribed only where an earlier op publishes the channel (run/channels.py).
    default_input_channels = {"split_sizes": "split_sizes", "scales": "probs"}
    fp8_gemms = True  # under te_seq.autocast(recipe=...) the GEMMs take FP8 operands

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device=None,
        dtype: torch.dtype | None = None,
        accumulate_into_main_grad: bool = False,
        delay_wgrad_compute: bool = False,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        scale_bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_groups = checks.positive_int(self, "num_groups", num_groups)
        self.in_features = checks.positive_int(self, "in_features", in_features)
        self.out_features = checks.positive_int(self, "out_features", out_features)
        self.has_bias = checks.flag(self, "bias", bias)
        self.single_grouped_weight = checks.flag(
            self, "single_grouped_weight", single_grouped_weight
        )
        self.single_grouped_bias = checks.flag(self, "single_grouped_bias", single_grouped_bias)
        self.scale_bias = checks.flag(self, "scale_bias", scale_bias)
        if single_grouped_bias and not bias:
            raise ValueError("GroupedLinear: single_grouped_bias=True needs bias=True")
        self.grad_policy = WeightGradPolicy(
            checks.flag(self, "accumulate_into_main_grad", accumulate_into_main_grad),
            checks.flag(self, "delay_wgrad_compute", delay_wgrad_compute),
        )
        self._make_params(checks.param_device(self, device), checks.param_dtype(self, dtype))
        self.num_extra_inputs = 2 if (scale_bias and bias) else 1
        self.extra_input_names = ("split_sizes", "scales")[: self.num_extra_inputs]
        self.reset_parameters()

    def _make_params(self, device, dtype) -> None:
        """Allocate the parameters (uninitialised; `reset_parameters` fills them). Per-group
        weights and biases are views of one block each (see _grouped_params.py)."""
        G, N, K = self.num_groups, self.out_features, self.in_features
        self._weight_params = self._bias_params = None
        if self.single_grouped_weight:
            self.weight = torch.nn.Parameter(torch.empty(G, N, K, device=device, dtype=dtype))
        else:
            self._weight_params = self._register_block("weight", (N, K), device, dtype)
        if not self.has_bias:
            return
        if self.single_grouped_bias:
            self.bias = torch.nn.Parameter(torch.empty(G, N, device=device, dtype=dtype))
        else:
            self._bias_params = self._register_block("bias", (N,), device, dtype)

    def _register_block(self, prefix: str, shape: tuple[int, ...], device, dtype) -> ParamBlock:
        block, params = ParamBlock.allocate(prefix, self.num_groups, shape, device, dtype)
        for name, param in zip(block.names, params):
            self.register_parameter(name, param)
        return block

    def reset_parameters(self) -> None:
        """Initialise in place: each group's weight like `torch.nn.Linear` (Kaiming-uniform,
        a = sqrt(5), fan-in K), groups in order; biases to zero. Per-group blocks are kept."""
        with torch.no_grad():
            for _, weight in self.named_weights():
                for w in weight.unbind(0) if self.single_grouped_weight else (weight,):
                    init_linear_weight_(w)
            for _, bias in self.named_biases():
                bias.zero_()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True):
        """Module conversions (`.to`, `.cuda`, `.half`, `to_empty`, ...): each block of per-group
        Parameters is converted once and every Parameter gets its view of the result, so the
        grouped GEMM keeps reading them without a copy."""
        blocks = [b for b in (self._weight_params, self._bias_params) if b is not None]
        views: dict[int, Tensor] = {}
        befores = []
        for block in blocks:
            block_views, before = block.convert(self._parameters, fn)
            views.update(block_views)
            befores.append(before)
        super()._apply(lambda t: views[id(t)] if id(t) in views else fn(t), recurse)
        for block, before in zip(blocks, befores):
            block.settle(self._parameters, before)
        return self

    def __deepcopy__(self, memo: dict) -> GroupedLinear:
        """An independent copy with the same layout: each block of per-group Parameters is
        copied once and the copy's Parameters view it (so the copy's GEMMs read its own block,
        without a stack per forward). Pending delayed wgrads are not copied (WeightGradPolicy)."""
        for block in (self._weight_params, self._bias_params):
            if block is not None:
                block.seed_deepcopy(self._parameters, memo)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return copied

    def __setstate__(self, state: dict) -> None:
        """Unpickling (and deepcopy): per-group Parameters that arrive with storage of their own
        are put back into one block each."""
        super().__setstate__(state)
        for block in (self._weight_params, self._bias_params):
            if block is not None:
                block.unpickled(self._parameters)

    # --- parameters -------------------------------------------------------------------------
    def named_weights(self) -> list[tuple[str, torch.nn.Parameter]]:
        params = self._parameters
        if self.single_grouped_weight:
            return [("weight", params["weight"])]
        return [(name, params[name]) for name in _names("weight", self.num_groups)]

    def named_biases(self) -> list[tuple[str, torch.nn.Parameter]]:
        if not self.has_bias:
            return []
        params = self._parameters
        if self.single_grouped_bias:
            return [("bias", params["bias"])]
        return [(name, params[name]) for name in _names("bias", self.num_groups)]

    def stacked_weight(self) -> Tensor:
        """[G, N, K]: the single grouped weight, or the block the per-group weights view (no
        copy), or, when something gave them their own storage outside a module conversion
        (`param.data = ...`, FSDP2), the weights stacked (a copy; see _grouped_params.py)."""
        if self.single_grouped_weight:  # read from the table: `self.weight` is a __getattr__
            return self._parameters["weight"]
        return self._weight_params.stacked(self._parameters)

    def stacked_bias(self) -> Tensor | None:
        """[G, N]: like `stacked_weight`, for the biases (None without bias)."""
        if not self.has_bias:
            return None
        if self.single_grouped_bias:
            return self.bias
        return self._bias_params.stacked(self._parameters)

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.has_bias}"
        )

    # --- checks and planning ----------------------------------------------------------------
    def plan_note(self, backend, dtype: torch.dtype, device: torch.device) -> str:
        return per_expert_weights_hint([self])

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        checks.check_last_dim(self, input_, self.in_features, "in_features")
        first = self.weight if self.single_grouped_weight else self._parameters["weight0"]
        checks.check_matches_param(self, input_, first)
        check_split_sizes(self, extra_inputs[0], self.num_groups, input_)
        if self.num_extra_inputs == 2:
            checks.check_tensor(self, "scales", extra_inputs[1])
            checks.check_per_row(self, "scales", extra_inputs[1], input_)

    def value_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        """Host split sizes' values (they may change in place between calls)."""
        splits = extra_inputs[0]
        # is_cpu, not device.type: a new device object and string each call (~0.2 µs)
        if splits.is_cpu and not torch.compiler.is_compiling():
            check_host_split_values(checks.op_name(self), splits, rows_of(input_))

    def kernel_needs(self) -> list[KernelNeed]:
        """y = x Wᵀ (K=in, N=out), dX = dY W (K=out, N=in) and dW = dYᵀ X [N=out, K=in]."""
        k, n = self.in_features, self.out_features
        return fp8.with_recipe([
            KernelNeed("grouped_mm", {"k": k, "n": n}),
            KernelNeed("grouped_mm", {"k": n, "n": k}),
            KernelNeed("grouped_wgrad", {"k": k, "n": n}),
        ])

    # --- maths pieces (the fused GroupedMLP reuses them) -------------------------------------
    def operands(self, ctx: OperationContext, x: Tensor) -> tuple[Tensor, Tensor]:
        """(x [T, K], W [G, N, K]) in the GEMMs' compute dtype: the autocast dtype under
        torch.autocast (as `torch.nn.functional.linear` there), else as they are."""
        weight = self.stacked_weight()
        if ctx.autocast is None:
            return x, weight
        dtype = amp.gemm_dtype(ctx.autocast, x, weight)
        return amp.cast(x, dtype), amp.cast(weight, dtype)

    def offsets(self, splits: Tensor, input_: Tensor, backend: object = None) -> Tensor:
        """int32 cumulative row ends [G] of `splits`, checked (`device_offsets`); `backend`:
        the plan step's, which may compute them in one kernel."""
        return device_offsets(splits, rows_of(input_), input_.device, backend)

    def bias_rows(
        self, offs: Tensor, rows: int, scales: Tensor | None, dtype: torch.dtype | None = None
    ) -> Tensor | None:
        """Per-row bias [T, N] (times s_t with scale_bias) in `dtype` (default the bias's: the
        GEMM's compute dtype under torch.autocast), or None without bias."""
        bias = self.stacked_bias()
        if bias is None:
            return None
        rows_bias = amp.cast(bias, dtype)[group_index(offs, rows)]  # [T, N]
        if self.scale_bias:
            rows_bias = rows_bias * scales.reshape(-1, 1).to(rows_bias.dtype)
        return rows_bias

    def bias_grads(
        self, dy: Tensor, offs: Tensor, scales: Tensor | None
    ) -> tuple[list, Tensor | None]:
        """(grads of the bias parameters, grad of scales) from dY [T, N]."""
        if not self.has_bias:
            return [], None
        idx = group_index(offs, dy.shape[0])
        dscales = None
        acc = torch.float64 if dy.dtype == torch.float64 else torch.float32  # float64 stays exact
        if self.scale_bias:
            bias_rows = self.stacked_bias()[idx]  # [T, N]
            dscales = (dy.to(acc) * bias_rows.to(acc)).sum(-1).to(scales.dtype)
            dy = dy * scales.reshape(-1, 1).to(dy.dtype)
        sums = torch.zeros(self.num_groups, self.out_features, device=dy.device, dtype=acc)
        sums.index_add_(0, idx, dy.to(acc))  # db_g = Σ_{t in g} dy_t (· s_t)
        sums = sums.to(self.named_biases()[0][1].dtype)
        grads = [sums] if self.single_grouped_bias else list(sums.unbind(0))
        return grads, dscales

    def weight_grads(
        self, ctx: OperationContext, x: Tensor | None, dy: Tensor | None, offs: Tensor,
        wgrad_fn: Callable[[Tensor, bool], Tensor] | None = None,
    ) -> list[Tensor | None]:
        """What autograd gets for the weights (the fused GroupedMLP calls this too); `wgrad_fn`
        as in `wgrad_request`."""
        count = 1 if self.single_grouped_weight else self.num_groups
        if not ctx.weight_requires_grad:
            return [None] * count
        weights = ctx.saved_as(GroupedLinearSaved).weights
        if not weights.any_needs_grad:
            return [None] * count
        request = self.wgrad_request(weights, x, dy, offs, ctx.backend, wgrad_fn)
        return self.grad_policy.backward(request)

    def forward_weights(self) -> ForwardWeights:
        """The weights of this forward call, weakly held, for the gradient contract."""
        return ForwardWeights.take("GroupedLinear", self.named_weights())

    def saved_record(
        self, input_: Tensor, compute_dtype: torch.dtype | None = None,
        shape: torch.Size | None = None,
    ) -> GroupedLinearSaved:
        """The one definition of the record this op's forward leaves in `ctx.saved` (its
        tensors are x [T, K], the [G, N, K] weight in `compute_dtype`, the offsets and the
        scales); `input_` (or a stand-in of its shape and dtype) is the op's input; `shape`,
        if given, is the input's shape (`input_` then only gives its dtype)."""
        shape = input_.shape if shape is None else shape
        return GroupedLinearSaved(
            shape, self.forward_weights(), input_.dtype, compute_dtype or input_.dtype
        )

    def grad_rows(self, ctx: OperationContext, grad_output: Tensor) -> Tensor:
        """dY as rows [T, N] in the forward GEMM's compute dtype (the fused GroupedMLP too)."""
        dy = grad_output.reshape(-1, self.out_features)
        if ctx.autocast is None:
            return dy
        return amp.cast(dy, ctx.saved_as(GroupedLinearSaved).compute_dtype)

    def input_grad(self, ctx: OperationContext, dx: Tensor) -> Tensor:
        """dX [T, K] back in the input's shape and dtype."""
        saved = ctx.saved_as(GroupedLinearSaved)
        return amp.cast(dx.reshape(saved.input_shape), saved.input_dtype)

    def wgrad_request(
        self, weights: ForwardWeights, x: Tensor | None, dy: Tensor | None, offs: Tensor,
        backend: Backend, wgrad_fn: Callable[[Tensor, bool], Tensor] | None = None,
    ) -> WgradRequest:
        """dW_g = dY_gᵀ X_g (varlen-K grouped GEMM), routed by the gradient contract. With
        `wgrad_fn(out, accumulate)` (the native FP8 wgrad: core/fp8_gemm.py) that runs the GEMM
        into `out` [G, N, K] instead of `backend.grouped_wgrad(dy, x, offs)`."""
        G, N, K = self.num_groups, self.out_features, self.in_features
        fp8_wgrad = wgrad_fn is not None
        if not fp8_wgrad:
            def wgrad_fn(out: Tensor | None, accumulate: bool) -> Tensor:
                return backend.grouped_wgrad(dy, x, offs, out=out, accumulate=accumulate)

        def compute() -> Sequence[Tensor]:
            out = None
            if fp8_wgrad:  # into a buffer in the weights' dtype (fp32 unless bf16)
                dtype = self.named_weights()[0][1].dtype
                dtype = dtype if dtype == torch.bfloat16 else torch.float32
                out = torch.empty(G, N, K, device=offs.device, dtype=dtype)
            grads = wgrad_fn(out, False)  # [G, N, K]
            return [grads] if self.single_grouped_weight else list(grads.unbind(0))

        def compute_into(outs: Sequence[Tensor], accumulate: bool) -> None:
            block = outs[0] if self.single_grouped_weight else block_of(outs)
            if block is not None:  # one [G, N, K] buffer (Megatron's main_grad buckets are)
                wgrad_fn(block, accumulate)
                return
            tmp = torch.empty(G, N, K, device=outs[0].device, dtype=outs[0].dtype)
            wgrad_fn(tmp, False)
            for out, grad in zip(outs, tmp.unbind(0)):
                out.add_(grad) if accumulate else out.copy_(grad)

        return WgradRequest(weights, compute, compute_into)

    # --- forward / backward -----------------------------------------------------------------
    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        ctx = basic_op_ctxs[0]
        splits, *rest = basic_op_extra_inputs[0]
        scales = rest[0] if rest else None
        x, weight = self.operands(ctx, as_rows(input_, self.in_features))  # [T, K], [G, N, K]
        offs = self.offsets(splits, input_, ctx.backend)
        out_dtype = x.dtype
        saved = (x, weight)
        if ctx.recipe is not None:  # FP8 (core/fp8_gemm.py); x along T, W along N kept for grads
            params = [p for _, p in self.named_weights()]
            y, grad_operands = fp8_gemm.grouped_forward(self, ctx, input_, x, weight, params,
                                                        offs, LazyGroupBounds(offs))
            saved = grad_operands.tensors()
        else:
            y = amp.cast(ctx.backend.grouped_mm(x, weight.transpose(1, 2), offs), out_dtype)
        bias = self.bias_rows(offs, x.shape[0], scales, out_dtype)
        if bias is not None:
            y = y + bias
        if ctx.requires_grad:
            ctx.save_for_backward(*saved, offs, scales)
            ctx.saved = self.saved_record(input_, out_dtype)
        return y.reshape(*input_.shape[:-1], self.out_features), [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        *saved, offs, scales = ctx.saved_tensors
        dy = self.grad_rows(ctx, grad_output)  # [T, N]
        if ctx.recipe is not None:  # FP8 (core/fp8_gemm.py): real FP8 or emulated
            operands = fp8.GradOperands.load(tuple(saved))
            grads = fp8_gemm.GroupedGrads(ctx, dy, operands, offs, LazyGroupBounds(offs),
                                          ctx.weight_requires_grad)
            dgrad, (x, dy_wgrad, wgrad_fn) = grads.dgrad, grads.wgrad_operands()
        else:
            (x, weight), dy_wgrad, wgrad_fn = saved, dy, None

            def dgrad() -> Tensor:
                return ctx.backend.grouped_mm(dy, weight, offs)

        dx = None
        if ctx.input_requires_grad:  # dX_g = dY_g W_g
            dx = self.input_grad(ctx, dgrad())
        bias_grads, dscales = self.bias_grads(dy, offs, scales)
        weight_grads = self.weight_grads(ctx, x, dy_wgrad, offs, wgrad_fn)
        extra_grads = (None, dscales) if self.num_extra_inputs == 2 else (None,)
        return dx, [weight_grads + bias_grads], [extra_grads]


def _names(prefix: str, count: int) -> tuple[str, ...]:
    if torch.compiler.is_compiling():  # dynamo would warn about (and skip) the lru_cache
        return tuple(f"{prefix}{g}" for g in range(count))
    return _cached_names(prefix, count)


@functools.lru_cache(maxsize=64)
def _cached_names(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{g}" for g in range(count))


# experts from which fusion_plan() suggests one grouped weight Parameter per linear: on an
# H200 host each per-expert Parameter costs ~10-20 µs a step (docs/grouped_mlp.md), 0.6-1.3 ms
# for 2 x 32, as much as the GEMMs of a fine-grained step
PER_EXPERT_HINT_GROUPS = 32


def per_expert_weights_hint(linears: Sequence[GroupedLinear]) -> str:
    """A note for fusion_plan() where GroupedLinears hold one weight Parameter per expert and
    there are many experts: autograd handles each Parameter apart (an AccumulateGrad per
    Parameter every backward, per-Parameter checks every forward), which makes a step on
    fine-grained experts host-bound (docs/grouped_mlp.md, "One weight per expert costs host
    time"); "" otherwise."""
    per_expert = [lin for lin in linears if not lin.single_grouped_weight]
    if not per_expert or per_expert[0].num_groups < PER_EXPERT_HINT_GROUPS:
        return ""
    groups = per_expert[0].num_groups
    count = f"{len(per_expert)} x {groups}" if len(per_expert) > 1 else str(groups)
    return (f"{count} per-expert weight Parameters cost autograd host time each step: "
            "single_grouped_weight=True avoids it")
