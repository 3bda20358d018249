"""Row-scaled activations: y = act(x) · s[:, None], one scale per row (router probabilities).

The mixin `RowScaled` gives an activation op (gated or elementwise) the extra input `scales`
and its gradient, and the `activation_recompute_in_mlp` switch: when True and the op is followed
by a GroupedLinear that does not fuse into the grouped MLP, the fusion "activation_recompute"
saves the activation's input instead of the GroupedLinear's input (its output) and recomputes
it in backward. (The fused grouped MLP always recomputes the activation from FC1's output.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_seq.core import checks
from te_seq.core.operation import no_value_checks
from te_seq.kernels.backend import Backend


def _wide(t: Tensor) -> Tensor:
    """fp32 for low-precision tensors (float64 stays), the compute precision of the maths."""
    return t if t.dtype == torch.float64 else t.float()


class RowScaled:
    """Mixin for an `Activation` subclass: one extra input `scales` [T] or x.shape[:-1].

    Gated: y = f(gate)·up(up)·s (the GLU kernels take the scales); elementwise: y = f(x)·s,
    dx = dy·s·f'(x). `scales` gets a gradient: ds_t = Σ_j dy_tj · act(x)_tj.
    """

    num_extra_inputs = 1
    extra_input_names = ("scales",)
    default_input_channels = {"scales": "probs"}  # an ExpertDispatch's per-row probs
    row_scales = True
    activation_recompute_in_mlp: bool = False

    def _set_recompute(self, activation_recompute_in_mlp: object) -> None:
        self.activation_recompute_in_mlp = checks.flag(
            self, "activation_recompute_in_mlp", activation_recompute_in_mlp
        )

    def pre_forward_checks(self, input_, extra_inputs) -> None:
        super().pre_forward_checks(input_, extra_inputs)
        checks.check_tensor(self, "scales", extra_inputs[0])
        checks.check_per_row(self, "scales", extra_inputs[0], input_)

    value_checks = no_value_checks  # its checks read only the call's signature

    def scaled_forward(self, backend: Backend, x: Tensor, rows: Tensor) -> Tensor:
        """act(x) · rows[..., None], rows of shape x.shape[:-1]."""
        if self.gated:
            return backend.glu_forward(x, self.glu_spec, rows)
        y = _wide(backend.act_forward(x, self.act)) * _wide(rows).unsqueeze(-1)
        return y.to(x.dtype)

    def scaled_backward(self, backend: Backend, x: Tensor, dy: Tensor, rows: Tensor):
        """(dx, d rows) of `scaled_forward`."""
        if self.gated:
            return backend.glu_backward(x, dy, self.glu_spec, rows)
        fx = _wide(backend.act_forward(x, self.act))
        drows = (_wide(dy) * fx).sum(-1).to(rows.dtype)
        return backend.act_backward(x, _wide(dy) * _wide(rows).unsqueeze(-1), self.act), drows

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        ctx = basic_op_ctxs[0]
        (scales,) = basic_op_extra_inputs[0]
        if ctx.requires_grad:
            ctx.save_for_backward(input_, scales)
        return self.scaled_forward(ctx.backend, input_, scales.reshape(input_.shape[:-1])), [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        x, scales = ctx.saved_tensors
        dx, dscales = self.scaled_backward(
            ctx.backend, x, grad_output, scales.reshape(x.shape[:-1])
        )
        return dx, [[]], [(dscales.reshape(scales.shape),)]
