"""The torch.compile boundary of te_seq's kernels: `kernel_op`, a `torch.library.custom_op` helper.

A kernel functional decorated with `@kernel_op("te_seq::name", fake=...)` is registered as a
PyTorch custom op whose fake (meta) implementation gives output shapes without running anything,
so `torch.compile` sees one opaque op with known output shapes instead of tracing into Python that
reads device data or launches CuTe DSL kernels.

Eager calls skip the dispatcher: the decorated function runs directly unless something is
tracing (dynamo, export, a fake or proxy tensor mode, a fake tensor argument). Measured on the
CPU dev machine (2026-11-24, torch 2.13, a tiny op): the direct call 7.6 µs, through the bypass
9.5 µs (the tracing check), through the registered custom op 23.6 µs — about 16 µs of dispatcher
per kernel call saved, against the fused grouped MLP's host-time budget of ~60 µs per call for a
handful of kernels (``tests/kernels/test_torch_op.py`` prints the three again with ``-s``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["kernel_op", "tracing"]


def tracing(args: Iterable[Any] = ()) -> bool:
    """Whether a call must go through the dispatcher: under dynamo/export, inside a dispatch
    mode (fake tensors, make_fx proxies, opcheck), or with a fake/functional tensor argument."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return True
    return any(
        isinstance(a, torch.Tensor) and type(a) is not torch.Tensor and not isinstance(
            a, torch.nn.Parameter
        )
        for a in args
    )


def kernel_op(
    name: str,
    *,
    fake: Callable[..., Any],
    mutates_args: Iterable[str] = (),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as the custom op ``name`` ("te_seq::kernel") with the
    fake implementation ``fake`` (same signature; returns empty tensors of the output shapes, or
    None for an op that only writes into ``mutates_args``). The returned callable calls the
    function directly in eager mode and the op when tracing; ``.op`` is the registered op.

    The signature must use types `torch.library` accepts (tensors, optional tensors, int, float,
    bool, str, and optionals of them) and be fully annotated.
    """

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        op = torch.library.custom_op(name, fn, mutates_args=tuple(mutates_args))
        op.register_fake(fake)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if tracing((*args, *kwargs.values())):
                return op(*args, **kwargs)
            return fn(*args, **kwargs)

        call.op = op
        call.eager = fn
        return call

    return wrap
