"""ScaledSwiGLU: y = silu(gate) · up · s, with one scale per row (router probabilities)."""

from __future__ import annotations

from te_seq.core import checks
from te_seq.core.operation import no_value_checks
from te_seq.ops.basic.swiglu import SwiGLU


class ScaledSwiGLU(SwiGLU):
    """y = silu(gate) · up · s[:, None]; x [..., 2F], extra input `scales` with one entry per
    row of x (shape [T] or x.shape[:-1]) -> y [..., F]. `scales` gets a gradient:
    ds_t = Σ_j dy_tj · silu(gate_tj) · up_tj. `activation_recompute_in_mlp=True`: a following
    GroupedLinear keeps no copy of y, which is recomputed in backward. After an ExpertDispatch in
    the same Sequential, `scales` is its "probs" channel (no caller argument).
    """

    num_extra_inputs = 1
    extra_input_names = ("scales",)
    default_input_channels = {"scales": "probs"}  # ExpertDispatch's per-row probs, if published
    row_scales = True

    def __init__(
        self,
        glu_interleave_size: int | None = None,
        *,
        activation_recompute_in_mlp: bool = False,
        cache_quantized_input: bool = False,
    ) -> None:
        super().__init__(
            glu_interleave_size=glu_interleave_size, cache_quantized_input=cache_quantized_input
        )
        # True: where a GroupedLinear follows, it keeps no copy of y; y is recomputed in
        # backward (fusion "activation_recompute"; the fused grouped MLP always recomputes)
        self.activation_recompute_in_mlp = checks.flag(
            self, "activation_recompute_in_mlp", activation_recompute_in_mlp
        )

    def pre_forward_checks(self, input_, extra_inputs) -> None:
        super().pre_forward_checks(input_, extra_inputs)
        checks.check_tensor(self, "scales", extra_inputs[0])
        checks.check_per_row(self, "scales", extra_inputs[0], input_)

    value_checks = no_value_checks  # its checks read only the call's signature

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        ctx = basic_op_ctxs[0]
        (scales,) = basic_op_extra_inputs[0]
        rows = scales.reshape(input_.shape[:-1])
        if ctx.requires_grad:
            ctx.save_for_backward(input_, scales)
        return ctx.backend.glu_forward(input_, self.glu_spec, rows), [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        x, scales = ctx.saved_tensors
        rows = scales.reshape(x.shape[:-1])
        dx, dscales = ctx.backend.glu_backward(x, grad_output, self.glu_spec, rows)
        return dx, [[]], [(dscales.reshape(scales.shape),)]
