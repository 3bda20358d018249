"""Helpers shared by the forward fusions that start with BasicLinear → Bias.

A forward-only fusion must leave each basic op's context exactly as that op's own forward would,
so the unfused backward (or a backward fusion) can run from it: the fusions call
`BasicLinear.save` (the one definition of what BasicLinear saves); `Bias.op_forward` saves nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_seq.fusion.registry import NoMatch
from te_seq.kernels.activations import ACTIVATIONS
from te_seq.ops.basic.activation import Activation
from te_seq.ops.basic.basic_linear import BasicLinear
from te_seq.ops.basic.bias import Bias


def shape_proxy(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """A tensor with `shape` and `like`'s dtype and device that owns no memory (zero strides),
    for checks that read only shape, dtype and device."""
    return torch.empty((), dtype=like.dtype, device=like.device).expand(shape)


def check_linear_bias(linear: BasicLinear, bias: Bias) -> NoMatch | None:
    """Why BasicLinear → Bias cannot run as one addmm (None when it can)."""
    if linear.tensor_parallel_mode is not None:  # its collectives live in its own forward
        return NoMatch(f"BasicLinear is tensor-parallel ({linear.tensor_parallel_mode!r}); "
                       "it runs unfused")
    if bias.size != linear.out_features:
        return NoMatch(
            f"Bias size {bias.size} does not match BasicLinear out_features {linear.out_features}"
        )
    w, b = linear.weight, bias.bias
    if (w.dtype, w.device) != (b.dtype, b.device):
        return NoMatch(
            f"Bias parameter ({b.dtype}, {b.device}) differs from BasicLinear weight "
            f"({w.dtype}, {w.device})"
        )
    return None


def check_activation(act: Activation, width: int) -> NoMatch | None:
    """Why an activation op cannot be run by a fused op over input width `width` (None if it can).

    A fused op knows the table's maths (te_seq.kernels.activations) and the built-in classes'
    contract: no extra input, or one per-row scale (`row_scales`). It
    declines an `act` not in the table and other extra inputs. (A user subclass that overrides
    an activation's maths never gets here: the matcher declines it for every fusion.)
    """
    name = type(act).__name__
    if act.act not in ACTIVATIONS:
        known = tuple(ACTIVATIONS)
        return NoMatch(f"{name}: act {act.act!r} is not in the activation table {known}")
    scales = 1 if act.row_scales else 0
    if act.num_extra_inputs != scales:
        return NoMatch(
            f"{name} takes {act.num_extra_inputs} extra inputs; fused ops take none, or one "
            "per-row scale"
        )
    if act.gated:
        multiple = 2 * (act.glu_interleave_size or 1)
        if width % multiple:
            return NoMatch(f"{name} needs a width that is a multiple of {multiple}, got {width}")
    return None

