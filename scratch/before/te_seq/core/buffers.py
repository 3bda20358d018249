"""Caller-provided buffers: checks and writes for ops that accept `out=`-style keyword arguments.

A caller who manages memory passes a preallocated tensor through `Sequential.forward(...,
op_kwargs={index: {"out": buf}})` (run/op_kwargs.py routes it to the op); the op checks it
against what it would have allocated, writes its result into it and returns that very tensor.
Every error names the op and shows the values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_seq.core.checks import op_name


def _shares_memory(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors view the same allocation (conservative: any overlap of storages)."""
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return False


def check_buffer(
    op: object,
    name: str,
    buffer: object,
    shape: torch.Size | tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    must_not_alias: tuple[tuple[str, Tensor], ...] = (),
) -> Tensor:
    """`buffer`, checked to be a tensor the op can write its result into: exactly `shape`,
    `dtype` and `device`, not requiring grad (autograd tracks the result through the op, not
    through the buffer), and sharing memory with none of `must_not_alias` ((what, tensor) pairs
    the op still reads after writing). TypeError for a non-tensor, ValueError otherwise."""
    who = f"{op_name(op)}: {name}="
    if not isinstance(buffer, Tensor):
        raise TypeError(f"{who} must be a torch.Tensor, got {type(buffer).__name__}")
    if tuple(buffer.shape) != tuple(shape):
        raise ValueError(f"{who} must have shape {tuple(shape)}, got {tuple(buffer.shape)}")
    if buffer.dtype != dtype:
        raise ValueError(f"{who} must have dtype {dtype}, got {buffer.dtype}")
    if buffer.device != torch.device(device):
        raise ValueError(f"{who} must be on device {device}, got {buffer.device}")
    if buffer.requires_grad:
        raise ValueError(
            f"{who} must not require grad (the op writes into it; gradients flow through the "
            "op's result), got a tensor with requires_grad=True"
        )
    for what, other in must_not_alias:
        if other is not None and _shares_memory(buffer, other):
            raise ValueError(
                f"{who} shares memory with the op's {what}, which the op still reads after "
                "writing the buffer: give it memory of its own"
            )
    return buffer


def gemm_into(buffer: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """buffer = (a @ b) reshaped to buffer's shape, a [M, K] and b [K, N]; returns `buffer`.

    The GEMM writes straight into the buffer (no temporary) when the buffer is contiguous, all
    three dtypes agree and no graph is being recorded (`out=` is not differentiable); otherwise
    the product is computed and copied in (cast to the buffer's dtype)."""
    direct = (
        buffer.is_contiguous()
        and a.dtype == b.dtype == buffer.dtype
        and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))
    )
    if direct:
        torch.mm(a, b, out=buffer.view(a.shape[0], b.shape[1]))
    else:
        with torch.no_grad():
            buffer.copy_((a @ b).reshape(buffer.shape))
    return buffer


def copy_into(buffer: Tensor, value: Tensor) -> Tensor:
    """buffer = value (same shape; cast to the buffer's dtype); returns `buffer`."""
    with torch.no_grad():
        buffer.copy_(value)
    return buffer
