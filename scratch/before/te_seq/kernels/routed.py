"""Kernels on routed rows: a GEMM whose A rows are gathered from a token matrix, or whose result
rows are scattered into a permuted order, with the one fallback for backends that cannot.

Shape legend: T token rows, M routed rows, K reduction dim, N output dim, E groups.

- `gather_rows` (int32 / int64 [M], on the data's device): the kernel's A row r is
  x[gather_rows[r]] for x [T, K] (any T). Native where the backend lists the kernel in
  `Backend.gather_kernels` ("grouped_mm", "glu_fc1_forward", "act_fc1_forward") and
  `routes_natively(kernel, "gather", **static)` agrees; otherwise the rows are gathered first
  (`x.index_select(0, gather_rows)`: one [M, K] copy).
- `scatter_rows` (a permutation of range(M)): result row r is written to out[scatter_rows[r]].
  Native for "grouped_mm" where listed in `Backend.scatter_kernels`; otherwise the result is
  computed in row order and copied into a second [M, N] buffer (`index_copy_`).

`native` is the plan's decision (`route_decision`, static facts only); a call also requires the
backend object at hand to list the kernel, so a wrapped backend (the traced one under
torch.compile, whose custom ops take no index) falls back instead of failing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from te_seq.kernels.backend import Backend

GATHER_KERNELS = ("grouped_mm", "glu_fc1_forward", "act_fc1_forward")
SCATTER_KERNELS = ("grouped_mm",)


class Route(NamedTuple):
    """Routed rows for one kernel call: the index [M] and the plan's native-or-not decision."""

    rows: Tensor
    native: bool


def route_decision(backend: Backend, kernel: str, what: str, **static: Any) -> bool:
    """Whether `kernel` gathers (what="gather") or scatters ("scatter") its rows inside itself on
    `backend` for the static facts: the plan-time decision the helpers below take as `native`."""
    return backend.routes_natively(kernel, what, **static)


def check_rows_index(op: str, what: str, index: object, device: torch.device,
                     rows: int | None = None) -> Tensor:
    """A 1-D int32 / int64 index on `device` (of `rows` entries, if given); TypeError /
    ValueError naming `op` otherwise (metadata only: the values are never read on the host)."""
    if not isinstance(index, Tensor):
        raise TypeError(f"{op}: {what} must be a tensor, got {type(index).__name__}")
    if index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: {what} must be int32 or int64, got {index.dtype}")
    if index.dim() != 1 or (rows is not None and index.shape[0] != rows):
        expected = "[M]" if rows is None else f"[{rows}]"
        raise ValueError(
            f"{op}: {what} has shape {tuple(index.shape)}, expected {expected} (one entry per "
            "routed row)"
        )
    if index.device != device:
        raise ValueError(f"{op}: {what} is on {index.device}, the data on {device}")
    return index


def gathered(backend: Backend, kernel: str, x: Tensor, gather_rows: Tensor, *args: Any,
             native: bool | None = None, op: str = "routed", **kw: Any) -> Any:
    """`backend.<kernel>(x[gather_rows], *args, **kw)` without materialising x[gather_rows]
    where the backend gathers in its loads. x [T, K], gather_rows [M]; `native`: the plan's
    decision (None: ask `backend.routes_natively(kernel, "gather")` now)."""
    if kernel not in GATHER_KERNELS:
        raise ValueError(f"{op}: {kernel!r} takes no gather_rows; kernels that do: "
                         f"{GATHER_KERNELS}")
    check_rows_index(op, "gather_rows", gather_rows, x.device)
    if native is None:
        native = backend.routes_natively(kernel, "gather")
    fn = getattr(backend, kernel)
    if native and kernel in backend.gather_kernels:
        return fn(x, *args, gather_rows=gather_rows, **kw)
    return fn(x.index_select(0, gather_rows), *args, **kw)


def scattered_mm(backend: Backend, a: Tensor, b: Tensor, offs: Tensor, scatter_rows: Tensor, *,
                 gather_rows: Tensor | None = None, native: bool | None = None,
                 gather_native: bool | None = None, op: str = "routed", **kw: Any) -> Tensor:
    """out[scatter_rows[r]] = (a @ b per group)[r]: `grouped_mm` with its result rows permuted.

    a [M, K] (or [T, K] rows gathered by `gather_rows` [M]), b [E, K, N], scatter_rows a
    permutation of range(M) -> [M, N]. `native` / `gather_native`: the plan's decisions (None:
    asked now). Fallback: the result in row order, then `index_copy_` into a new buffer."""
    if gather_rows is not None:
        check_rows_index(op, "gather_rows", gather_rows, a.device)
    rows = a.shape[0] if gather_rows is None else gather_rows.shape[0]
    check_rows_index(op, "scatter_rows", scatter_rows, a.device, rows)
    if native is None:
        native = backend.routes_natively("grouped_mm", "scatter")
    if native and "grouped_mm" in backend.scatter_kernels:
        kw = dict(kw, scatter_rows=scatter_rows)
        if gather_rows is None:
            return backend.grouped_mm(a, b, offs, **kw)
        return gathered(backend, "grouped_mm", a, gather_rows, b, offs, native=gather_native,
                        op=op, **kw)
    if gather_rows is None:
        res = backend.grouped_mm(a, b, offs, **kw)
    else:
        res = gathered(backend, "grouped_mm", a, gather_rows, b, offs, native=gather_native,
                       op=op, **kw)
    out = torch.empty_like(res)
    return out.index_copy_(0, scatter_rows, res)


def call(backend: Backend, kernel: str, x: Tensor, *args: Any, gather: Route | None = None,
         op: str = "routed", **kw: Any) -> Any:
    """`backend.<kernel>(x, *args, **kw)`, or with x's rows gathered by `gather` (`gathered`)."""
    if gather is None:
        return getattr(backend, kernel)(x, *args, **kw)
    return gathered(backend, kernel, x, gather.rows, *args, native=gather.native, op=op, **kw)


def mm(backend: Backend, a: Tensor, b: Tensor, offs: Tensor, *, gather: Route | None = None,
       scatter: Route | None = None, op: str = "routed", **kw: Any) -> Tensor:
    """`backend.grouped_mm(a, b, offs, **kw)` with optional routed rows: A rows a[gather.rows],
    result rows written to scatter.rows (`gathered`, `scattered_mm`)."""
    if scatter is None:
        return call(backend, "grouped_mm", a, b, offs, gather=gather, op=op, **kw)
    g_rows, g_native = (None, None) if gather is None else gather
    return scattered_mm(backend, a, b, offs, scatter.rows, gather_rows=g_rows,
                        native=scatter.native, gather_native=g_native, op=op, **kw)
