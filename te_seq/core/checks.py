"""Input validation shared by ops: every error names the op and shows the values."""

from __future__ import annotations

import torch
from torch import Tensor


def op_name(op: object) -> str:
    return type(op).__name__


def check_tensor(op: object, what: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{op_name(op)}: {what} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_last_dim(op: object, input_: Tensor, expected: int, what: str) -> None:
    """The input's last dimension must equal the op's `what` (in_features, size, ...)."""
    if input_.dim() == 0:
        raise ValueError(f"{op_name(op)}: input is a scalar; expected [..., {expected}]")
    if input_.shape[-1] != expected:
        raise ValueError(
            f"{op_name(op)}: input has last dimension {input_.shape[-1]} "
            f"(shape {tuple(input_.shape)}), but {what}={expected}"
        )


def check_matches_param(op: object, input_: Tensor, param: Tensor) -> None:
    """The input must have the parameter's dtype and device (no silent casts or copies)."""
    if input_.device != param.device:
        raise ValueError(
            f"{op_name(op)}: input is on {input_.device} but the op's parameters are on "
            f"{param.device}"
        )
    if input_.dtype != param.dtype:
        raise ValueError(
            f"{op_name(op)}: input dtype {input_.dtype} does not match the op's parameter dtype "
            f"{param.dtype} (cast the input or call .to(dtype) on the module)"
        )


def check_floating(op: object, input_: Tensor) -> None:
    if not input_.is_floating_point():
        raise ValueError(f"{op_name(op)}: input must be floating point, got {input_.dtype}")


def check_even_last_dim(op: object, input_: Tensor, interleave: int | None) -> None:
    """GLU inputs hold gate and up: an even width, a multiple of 2·interleave when given."""
    width = input_.shape[-1] if input_.dim() else 0
    multiple = 2 * interleave if interleave else 2
    if width % multiple:
        extra = f" (glu_interleave_size={interleave})" if interleave else ""
        raise ValueError(
            f"{op_name(op)}: input's last dimension {width} must be a multiple of "
            f"{multiple}{extra} to hold gate and up"
        )


def check_per_row(op: object, what: str, value: Tensor, input_: Tensor) -> None:
    """A per-token tensor (router scales) must have one entry per row of the input."""
    rows = int(torch.Size(input_.shape[:-1]).numel()) if input_.dim() else 1
    if value.numel() != rows:
        raise ValueError(
            f"{op_name(op)}: {what} has {value.numel()} entries (shape {tuple(value.shape)}), "
            f"expected one per row of the input: {rows}"
        )
    if value.device != input_.device:
        raise ValueError(f"{op_name(op)}: {what} is on {value.device}, input on {input_.device}")
    if not value.is_floating_point():
        raise ValueError(f"{op_name(op)}: {what} must be floating point, got {value.dtype}")
