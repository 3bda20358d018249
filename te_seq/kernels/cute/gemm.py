"""The plain grouped GEMMs on the CuTe DSL backend: ``grouped_mm`` (varlen M) and
``grouped_wgrad`` (varlen K), with their ``supports`` checks. Kernel:
``grouped_gemm.GroupedGemmKernel``; maths: ``reference.grouped_mm`` / ``reference.grouped_wgrad``.

Shape legend: M routed rows (tokens), E groups (experts), K reduction dim, N output dim.
Imports no cutlass until a kernel is first compiled; no host reads of ``offs``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .launch import (
    _AB_DTYPES,
    GATHER_CLUSTER,
    PINGPONG_TILE_WIDTHS,
    Tiling,
    _check_offs,
    _num_sms,
    _row_major,
    _row_ok,
    b_layout,
    b_view,
    bias_problem,
    check_tiling,
    coop_tiling,
    half_tiles,
    no_route,
    plain_mm_tiling,
    route_rows,
    row_scales,
    tile_n_for,
    tiling_settings,
    varlen_k_clusters,
    varlen_m_clusters,
    wgrad_tiling,
    with_route,
)
from .launch_plan import LaunchPlan, PlanCache
from .unit_order import unit_order

_MM_PLANS = PlanCache()  # grouped_mm launches by call signature
_WGRAD_PLANS = PlanCache()  # grouped_wgrad launches by call signature


def _supports(
    operands: tuple[Tensor, Tensor], shapes_ok: bool, expected: str, k: int, n: int
) -> tuple[bool, str]:
    """The checks both GEMMs share, in order: one 16-bit dtype, the shapes (``shapes_ok``, else
    "needs ``expected``"), 16-byte aligned K and N rows, CUDA tensors."""
    first, second = operands
    if first.dtype != second.dtype or first.dtype not in _AB_DTYPES:
        return False, f"needs bf16/fp16 operands of one dtype, got {first.dtype} and {second.dtype}"
    if not shapes_ok:
        return False, f"needs {expected}, got {tuple(first.shape)} and {tuple(second.shape)}"
    if not (_row_ok(k, first.dtype) and _row_ok(n, first.dtype)):
        return False, f"K={k} and N={n} must be multiples of 8 (TMA rows are 16-byte aligned)"
    if not (first.is_cuda and second.is_cuda):
        return False, "needs CUDA tensors"
    return True, ""


def supports(a: Tensor, b: Tensor, bias: Tensor | None = None) -> tuple[bool, str]:
    """Whether ``grouped_mm(a, b, ..., bias=bias)`` can run on this backend, with the reason if
    not (a bias must be [E, N] in bf16, fp16 or fp32)."""
    shapes_ok = a.dim() == 2 and b.dim() == 3 and a.shape[1] == b.shape[1]
    k, n = (b.shape[1], b.shape[2]) if shapes_ok else (0, 0)
    ok, why = _supports((a, b), shapes_ok, "a [M, K] and b [E, K, N]", k, n)
    if ok and bias is not None:
        why = bias_problem(bias, b.shape[0], n, a.device)
        ok = not why
    return ok, why


def supports_wgrad(grad_out: Tensor, x: Tensor) -> tuple[bool, str]:
    """Whether ``grouped_wgrad(grad_out, x, ...)`` can run here, with the reason if not."""
    shapes_ok = grad_out.dim() == 2 and x.dim() == 2 and grad_out.shape[0] == x.shape[0]
    k, n = (x.shape[1], grad_out.shape[1]) if shapes_ok else (0, 0)
    return _supports((grad_out, x), shapes_ok, "grad_out [M, N] and x [M, K]", k, n)


def _check_pingpong(t: Tiling, bias: Tensor | None, route: str | None) -> None:
    """Ping-pong tilings run the plain kernel only (no bias, no routed rows; ``route``
    "accumulate", a wgrad adding into its output, is plain) so far; the plain epilogue's
    subtiles are 128 rows."""
    if t.epi_rows != 128:
        raise ValueError(f"cute grouped_mm, grouped_wgrad: epilogue subtiles are 128 rows: {t}")
    if not t.pingpong or route == "accumulate":
        return
    if bias is not None or route is not None:
        raise ValueError(
            f"cute grouped_mm: a ping-pong tiling ({t}) supports neither a bias nor routed rows "
            f"yet (bias given: {bias is not None}, route: {route})"
        )
    if t.tile_n not in PINGPONG_TILE_WIDTHS:
        raise ValueError(
            f"cute grouped_mm: a ping-pong tiling needs tile_n in {PINGPONG_TILE_WIDTHS}, "
            f"got {t}"
        )


def grouped_mm(
    a: Tensor,
    b: Tensor,
    offs: Tensor,
    out: Tensor | None = None,
    *,
    tiling: Tiling | None = None,
    bias: Tensor | None = None,
    bias_scales: Tensor | None = None,
    gather_rows: Tensor | None = None,
    scatter_rows: Tensor | None = None,
) -> Tensor:
    """Varlen-M grouped GEMM: ``out[rows of e] = a[rows of e] @ b[e] (+ s_t · bias[e])``
    (fp32 accumulate; the bias is added to the accumulator, then rounded once).

    a: [M, K], b: [E, K, N] (either major: ``W.transpose(1, 2)`` or ``W``), offs: int32 [E],
    bias: [E, N] (bf16/fp16/fp32) or None, bias_scales: [M] floats (s_t) or None
    -> out: [M, N] in ``a.dtype``. Rows past ``offs[-1]`` are written as zeros, as in
    ``reference.grouped_mm``. Raises ValueError when ``supports(a, b, bias)`` is False.

    Routed rows (one of the two; ``routed.py``): ``gather_rows`` int [M] reads GEMM row r
    from ``a[gather_rows[r]]`` (a is then a [T, K] token matrix; K a multiple of 64);
    ``scatter_rows`` (a permutation of the M rows) writes GEMM row r to
    ``out[scatter_rows[r]]``.
    """
    plain = bias is None and gather_rows is None and scatter_rows is None
    check_tiling(tiling, "cute grouped_mm", wide_ok=plain and (tiling is None or tiling.pingpong))
    ok, why = supports(a, b, bias)
    if bias_scales is not None and bias is None:
        ok, why = False, "bias_scales given without a bias"
    route, what = _route_of(gather_rows, scatter_rows)
    ok, why = with_route((ok, why), what, a.shape[1])
    if not ok:
        raise ValueError(f"cute grouped_mm: a {tuple(a.shape)}, b {tuple(b.shape)}: {why}")

    rows, groups, n = a.shape[0], b.shape[0], b.shape[2]
    if route is not None:
        rows = route.shape[0] if what == "gather" else rows
        route = route_rows(route, rows, a.shape[0], "grouped_mm", what)
        tiling = tiling or (Tiling(tile_n_for(n, 1), GATHER_CLUSTER) if what == "gather" else None)
    offs = _check_offs(offs, groups, a.device)
    if out is None:
        out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    elif out.shape != (rows, n) or out.dtype != a.dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous [{rows}, {n}] {a.dtype} tensor, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    if rows == 0:
        return out
    a = _row_major(a)
    signature = (
        a.dtype, a.device, a.shape[1], b.dtype, b.shape, b.stride(), b.device, rows, what,
        tiling, None if bias is None else bias.dtype, bias_scales is not None,
        tiling is None and tiling_settings(),  # the default tiling reads the environment
    )
    plan = _MM_PLANS.get(signature) or _MM_PLANS.put(
        signature, _mm_plan(a, b, rows, tiling, bias, bias_scales is not None, what)
    )
    scales = row_scales(bias_scales, rows, "grouped_mm")
    args = (a, b_view(b, plan.b_copy), out, offs, plan.clusters)
    route = no_route(a.device) if route is None else route
    if bias is None:
        plan.kernel(*args, route)
    else:
        if scales is None:  # the kernel reads no scales; its argument still needs a tensor
            scales = torch.empty(1, dtype=torch.float32, device=a.device)
        plan.kernel(*args, bias.contiguous(), scales, route)
    return out


def _mm_plan(a: Tensor, b: Tensor, rows: int, tiling: Tiling | None, bias: Tensor | None,
             bias_scales: bool, what: str | None) -> LaunchPlan:
    """The `LaunchPlan` of a ``grouped_mm`` launch of ``rows`` rows: the tiling (default or
    checked), its config compiled (once per config), the grid, B's copy."""
    from .compile import GemmConfig, compile_gemm

    groups, n = b.shape[0], b.shape[2]
    b_major, b_copy = b_layout(b)
    if tiling is None:
        plain = bias is None and what is None
        tiling = plain_mm_tiling(n, a.shape[1]) if plain else coop_tiling(n)
    t = tiling
    _check_pingpong(t, bias, what)
    cfg = GemmConfig(
        "m", a.dtype, a.dtype, b_major, t.tile_n, t.cluster_mn,
        bias_dtype=None if bias is None else bias.dtype, bias_scales=bias_scales,
        route=what, pingpong=t.pingpong, half_tiles=half_tiles(t), epi_cols=t.epi_cols,
    )
    sms = _num_sms(a.device.index or 0)
    clusters = varlen_m_clusters(rows, groups, n, t.tile_n, t.cluster_mn, sms)
    return LaunchPlan(compile_gemm(cfg).fn, clusters, b_copy)


def _route_of(gather_rows: Tensor | None, scatter_rows: Tensor | None):
    """(the route tensor, "gather" / "scatter") of a call, (None, None) without one."""
    if gather_rows is not None and scatter_rows is not None:
        raise ValueError("cute grouped_mm: gather_rows and scatter_rows cannot be combined")
    if gather_rows is not None:
        return gather_rows, "gather"
    return (None, None) if scatter_rows is None else (scatter_rows, "scatter")


def grouped_wgrad(
    grad_out: Tensor,
    x: Tensor,
    offs: Tensor,
    out: Tensor | None = None,
    accumulate: bool = False,
    *,
    tiling: Tiling | None = None,
) -> Tensor:
    """Varlen-K grouped GEMM: ``out[e] = grad_out[rows of e]ᵀ @ x[rows of e]`` -> [E, N, K].

    A new tensor in ``x.dtype``, or written into (``accumulate=True``: added to) ``out``, a
    contiguous [E, N, K] buffer in float32 (``main_grad``) or the operands' dtype.
    """
    check_tiling(tiling, "cute grouped_wgrad", dynamic_ok=True,
                 wide_ok=out is None or (not accumulate and out.dtype.itemsize == 2))
    ok, why = supports_wgrad(grad_out, x)
    if not ok:
        raise ValueError(
            f"cute grouped_wgrad: grad_out {tuple(grad_out.shape)}, x {tuple(x.shape)}: {why}"
        )
    rows, n, k = x.shape[0], grad_out.shape[1], x.shape[1]
    groups = offs.shape[0]
    offs = _check_offs(offs, groups, x.device)
    if out is None:
        out, accumulate = torch.empty(groups, n, k, dtype=x.dtype, device=x.device), False
    if out.shape != (groups, n, k) or out.dtype not in (torch.float32, x.dtype):
        raise ValueError(
            f"out must be [{groups}, {n}, {k}] in float32 or {x.dtype}, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    if not out.is_contiguous():
        tmp = torch.empty_like(out, memory_format=torch.contiguous_format)
        result = grouped_wgrad(grad_out, x, offs, tmp, tiling=tiling)
        return out.add_(result) if accumulate else out.copy_(result)
    if rows == 0:
        return out if accumulate else out.zero_()
    grad_out, x = _row_major(grad_out), _row_major(x)
    signature = (x.dtype, x.device, rows, n, k, groups, out.dtype, accumulate, tiling,
                 tiling is None and tiling_settings())  # the default reads the environment
    plan = _WGRAD_PLANS.get(signature) or _WGRAD_PLANS.put(
        signature, _wgrad_plan(x, n, k, groups, out.dtype, accumulate, tiling)
    )
    # the dynamic schedule's order and counter (a row of one launch per offs: unit_order.py),
    # else the unused placeholder
    sched = unit_order(offs) if plan.dynamic else no_route(x.device)
    plan.kernel(grad_out.t(), x.t(), out.permute(1, 2, 0), offs, plan.clusters, sched)
    return out


def _wgrad_plan(x: Tensor, n: int, k: int, groups: int, out_dtype: torch.dtype,
                accumulate: bool, tiling: Tiling | None) -> LaunchPlan:
    """The `LaunchPlan` of a ``grouped_wgrad`` launch: its config compiled, the grid."""
    from .compile import GemmConfig, compile_gemm

    t = tiling or wgrad_tiling(k, accumulate, x.shape[0] / max(groups, 1),
                               out_dtype.itemsize * 8)
    _check_pingpong(t, None, "accumulate" if accumulate else None)
    cfg = GemmConfig("k", x.dtype, out_dtype, "n", t.tile_n, t.cluster_mn, accumulate,
                     pingpong=t.pingpong, dynamic=t.dynamic, epi_cols=t.epi_cols)
    sms = _num_sms(x.device.index or 0)
    clusters = varlen_k_clusters(groups, n, k, t.tile_n, t.cluster_mn, sms)
    return LaunchPlan(compile_gemm(cfg).fn, clusters, dynamic=t.dynamic)
