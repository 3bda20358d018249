"""Input validation shared by ops: every error names the op and shows the values.

Constructor arguments are checked here too (before anything is allocated): wrong types are a
`TypeError`, values out of range a `ValueError`, both as "<Op>: <arg> must be ..., got <value>".
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from te_seq.core import amp


def op_name(op: object) -> str:
    """The name errors use: the op's class name (or the string itself)."""
    return op if isinstance(op, str) else type(op).__name__


# --- constructor arguments -------------------------------------------------------------------


def positive_int(op: object, name: str, value: object) -> int:
    """An int > 0 (bools are not ints here)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op_name(op)}: {name} must be a positive int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{op_name(op)}: {name} must be a positive int, got {value!r}")
    return int(value)


def optional_positive_int(op: object, name: str, value: object) -> int | None:
    return None if value is None else positive_int(op, name, value)


def flag(op: object, name: str, value: object) -> bool:
    """A bool (not 0/1 or a string: `in_place="no"` would otherwise mean True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{op_name(op)}: {name} must be a bool, got {value!r}")
    return value


def real_number(op: object, name: str, value: object, what: str, ok=lambda v: True) -> float:
    """A finite real number with `ok(value)`; `what` says which ("positive", "a number in
    [0, 1)"): TypeError for a non-number, ValueError for a value out of range or not finite."""
    must = f"{op_name(op)}: {name} must be {what}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{must}, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{op_name(op)}: {name} must be finite, got {value!r}")
    if not ok(value):
        raise ValueError(f"{must}, got {value!r}")
    return float(value)


def choice(op: object, name: str, value: object, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{op_name(op)}: {name} must be one of {sorted(choices)}, got {value!r}")
    return value


def param_dtype(op: object, dtype: object) -> torch.dtype | None:
    """None (torch's default) or a floating-point torch.dtype for the op's parameters."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"{op_name(op)}: dtype must be a torch.dtype or None, got {type(dtype).__name__} "
            f"{dtype!r}"
        )
    if not dtype.is_floating_point:
        raise ValueError(f"{op_name(op)}: dtype must be a floating-point dtype, got {dtype}")
    return dtype


def param_device(op: object, device: object) -> torch.device | None:
    """None (torch's default), or what `torch.device` accepts: a torch.device, str or int."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, torch.device | str | int):
        raise TypeError(
            f"{op_name(op)}: device must be a torch.device, str, int or None, got "
            f"{type(device).__name__} {device!r}"
        )
    try:
        return torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise ValueError(
            f"{op_name(op)}: device {device!r} is not a torch device ({err})"
        ) from None


def normalized_dims(op: object, normalized_shape: object) -> tuple[int, ...]:
    """A norm's trailing dims from an int or a non-empty sequence of positive ints (as torch's
    `normalized_shape`: the last len(shape) dimensions are normalized together)."""
    value = normalized_shape
    dims = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else (value,)
    if not dims or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) for d in dims):
        raise TypeError(
            f"{op_name(op)}: normalized_shape must be an int or a non-empty tuple of ints, "
            f"got {normalized_shape!r}"
        )
    if any(d <= 0 for d in dims):
        raise ValueError(f"{op_name(op)}: normalized_shape must be positive, got {value}")
    return tuple(int(d) for d in dims)


def check_trailing_dims(op: object, input_: Tensor, dims: tuple[int, ...]) -> None:
    """The input's last len(dims) dimensions must equal a norm's normalized_shape `dims`."""
    shape = tuple(input_.shape)
    if shape[len(shape) - len(dims):] != dims or len(shape) < len(dims):
        raise ValueError(
            f"{op_name(op)}: input has trailing dimensions {shape[-len(dims):]} (shape {shape}), "
            f"but normalized_shape={dims}"
        )


def shape_spec(op: object, shape: object) -> tuple[int, ...]:
    """A target shape: ints >= 0 and at most one -1 (inferred), like `torch.reshape`'s."""
    dims = (shape,) if isinstance(shape, numbers.Integral) else shape
    if not isinstance(dims, Sequence) or isinstance(dims, str) or not all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in dims
    ):
        raise TypeError(f"{op_name(op)}: shape must be a sequence of ints, got {shape!r}")
    dims = tuple(int(d) for d in dims)
    if any(d < -1 for d in dims) or dims.count(-1) > 1:
        raise ValueError(
            f"{op_name(op)}: shape {dims} may hold sizes >= 0 and at most one -1 (inferred)"
        )
    return dims


# --- forward inputs --------------------------------------------------------------------------


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
    """The input must have the parameter's device and dtype (no silent casts or copies; under
    torch.autocast the op casts, so any two dtypes autocast casts may meet: core/amp.py)."""
    if input_.device != param.device:
        raise ValueError(
            f"{op_name(op)}: input is on {input_.device} but the op's parameters are on "
            f"{param.device}"
        )
    if input_.dtype != param.dtype and not amp.mixes_allowed(input_, param):
        raise ValueError(
            f"{op_name(op)}: input dtype {input_.dtype} does not match the op's parameter dtype "
            f"{param.dtype} (cast the input or call .to(dtype) on the module)"
        )


def check_floating(op: object, input_: Tensor) -> None:
    if not input_.is_floating_point():
        raise ValueError(f"{op_name(op)}: input must be floating point, got {input_.dtype}")


def check_even_last_dim(op: object, input_: Tensor, interleave: int | None) -> None:
    """GLU inputs hold gate and up: an even width, a multiple of 2·interleave when given."""
    if input_.dim() == 0:
        raise ValueError(f"{op_name(op)}: input is a scalar; expected [..., 2F] (gate and up)")
    width = input_.shape[-1]
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
