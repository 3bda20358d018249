"""The FP8 grouped GEMMs on the CuTe DSL backend: ``scaled_grouped_mm`` (varlen M, row-wise
dequantization scales) and ``scaled_grouped_wgrad`` (varlen K, per-group row-wise scales), with
their ``supports_scaled`` / ``supports_scaled_wgrad`` checks. Kernel: ``scale_epilogue``.

Shape legend: M routed rows (tokens), E groups (experts), K reduction dim, N output dim.
The maths is ``torch._scaled_grouped_mm``'s (te_seq's ``fp8_torch.scaled_grouped_mm``):

    out[m, n] = a_scale[m] · b_scale[g(m), n] · Σ_k fp32(a[m, k]) · fp32(b[g(m), n, k])

accumulated in fp32 and rounded once to bf16; g(m) is the group whose rows (``offs``) hold m.
The scales are *dequantization* scales (``scale_inv``: te_seq quantizes q = fp8(v · scale)).
Imports no cutlass until a kernel is first compiled; no host reads of ``offs``.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

from .launch import (
    ACCUMULATE_PINGPONG_MAX_ROWS,
    WGRAD_TILING,
    Tiling,
    _check_offs,
    _num_sms,
    _row_major,
    aligned_16,
    check_tiling,
    default_tiling,
    half_tiles,
    no_route,
    pingpong_by_default,
    plain_mm_tiling,
    tiling_settings,
    varlen_k_clusters,
    varlen_m_clusters,
    wgrad_tiling,
)
from .launch_plan import PlanCache, PreparedLaunch

# FP8 launches by call signature: a plan exists only for a signature whose checks passed
_MM_PLANS = PlanCache()  # scaled_grouped_mm and block_scaled_grouped_mm
_WGRAD_PLANS = PlanCache()  # scaled_grouped_wgrad

FP8_DTYPE = torch.float8_e4m3fn
# A (the gradient in the dgrad and wgrad GEMMs) may be E5M2 ("HYBRID" recipes): WGMMA mixes them
A_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_ALIGN = 16  # K and N in elements: 16-byte TMA strides of 1-byte data
_OP = "cute scaled_grouped_mm"


def _shape_problem(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor) -> str:
    """Why the operands' dtypes or shapes are unsupported ("" when they are supported)."""
    why = _dtype_problem(a, b) or geometry_problem(a, b)
    if why:
        return why
    (m, _), (e, n, _) = a.shape, b.shape
    for name, s, shape in (("a_scale", a_scale, (m,)), ("b_scale", b_scale, (e, n))):
        if s.dtype != torch.float32 or tuple(s.shape) != shape:
            return f"{name} must be float32 {list(shape)}, got {s.dtype} {list(s.shape)}"
    return ""


def geometry_problem(a: Tensor, b: Tensor) -> str:
    """Why a [M, K] and b [E, N, K] cannot be a varlen-M FP8 GEMM's operands ("" when they
    can): the shapes must match, E, K and N be > 0, K and N multiples of 16 (TMA rows)."""
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[2]:
        return f"needs a [M, K] and b [E, N, K], got {tuple(a.shape)} and {tuple(b.shape)}"
    (_, k), (e, n, _) = a.shape, b.shape
    if e == 0 or k == 0 or n == 0:
        return f"needs E, K and N > 0, got E={e}, K={k}, N={n}"
    if k % _ALIGN or n % _ALIGN:
        return f"K={k} and N={n} must be multiples of {_ALIGN} (TMA rows are 16-byte aligned)"
    return ""


def _dtype_problem(a: Tensor, b: Tensor) -> str:
    """Why the operand dtypes are unsupported: a E4M3 or E5M2, b E4M3."""
    if a.dtype not in A_DTYPES or b.dtype != FP8_DTYPE:
        return (f"needs a float8_e4m3fn or float8_e5m2 a and a float8_e4m3fn b, got {a.dtype} "
                f"and {b.dtype}")
    return ""


def _a_dtype(a: Tensor) -> torch.dtype | None:
    """The kernel config's A dtype where it differs from B's (E5M2 gradients)."""
    return None if a.dtype == FP8_DTYPE else a.dtype


def _device_problem(tensors: tuple[Tensor, ...]) -> str:
    """Why the tensors' device cannot run the kernel ("" when it can): one CUDA device of
    compute capability 9.x (the kernel is sm_90a WGMMA code)."""
    device = tensors[0].device
    if device.type != "cuda" or any(t.device != device for t in tensors):
        return f"needs CUDA tensors on one device, got {sorted({str(t.device) for t in tensors})}"
    index = torch.cuda.current_device() if device.index is None else device.index
    major, minor = _capability(index)
    if major != 9:
        return f"needs compute capability 9.x (sm_90a), found {major}.{minor}"
    return ""


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    """A device's compute capability, asked once (each query costs ~10 µs of host time)."""
    return torch.cuda.get_device_capability(index)


def supports_scaled(
    a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[bool, str]:
    """Whether ``scaled_grouped_mm(a, b, a_scale, b_scale, offs, out_dtype)`` can run here, with
    the reason if not: E4M3 (or E5M2) a [M, K] and E4M3 b [E, N, K], fp32 a_scale [M] and
    b_scale [E, N], K and N multiples of 16, a bf16 output, CUDA tensors on an sm_90 GPU."""
    if out_dtype != torch.bfloat16:
        return False, f"outputs bfloat16 only, got out_dtype={out_dtype}"
    why = _shape_problem(a, b, a_scale, b_scale) or _device_problem((a, b, a_scale, b_scale))
    return not why, why


def scaled_grouped_mm(
    a: Tensor,
    b: Tensor,
    a_scale: Tensor,
    b_scale: Tensor,
    offs: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    tiling: Tiling | None = None,
) -> Tensor:
    """Varlen-M FP8 grouped GEMM with row-wise scales:
    ``out[rows of g] = diag(a_scale[rows of g]) · (a[rows of g] @ b[g]ᵀ) · diag(b_scale[g])``.

    a: [M, K] float8_e4m3fn (or float8_e5m2: a gradient), b: [E, N, K] float8_e4m3fn (a
    weight stack, K contiguous),
    a_scale: float32 [M], b_scale: float32 [E, N], offs: int32 [E] cumulative row ends
    -> out [M, N] bf16 (fp32 accumulation, one rounding). Rows past ``offs[-1]`` are zeros.
    Sync-free and CUDA-graph capturable. Raises ValueError when ``supports_scaled`` is False.
    `scaled_mm_launch` prepares a call for later ones of the same operand facts.
    """
    return run_scaled_mm(_OP, *_scaled_mm_rules(a, b, a_scale, b_scale, out_dtype, tiling), a,
                         b, a_scale, b_scale, offs, out_dtype, tiling)


def _scaled_mm_rules(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor,
                     out_dtype: torch.dtype, tiling: Tiling | None) -> tuple:
    """(check, config) of a ``scaled_grouped_mm`` call, as `run_scaled_mm` takes them."""
    def config(n: int):
        from .compile import GemmConfig

        wide_ok = out_dtype == torch.bfloat16 and (tiling is None or tiling.pingpong)
        t = (check_tiling(tiling, _OP, wide_ok=wide_ok)
             or plain_mm_tiling(n, a.shape[1], out_dtype.itemsize * 8))
        return GemmConfig("m", FP8_DTYPE, out_dtype, "k", t.tile_n, t.cluster_mn, scaled=True,
                          a_dtype=_a_dtype(a), pingpong=t.pingpong, half_tiles=half_tiles(t),
                          epi_cols=t.epi_cols)

    return lambda: supports_scaled(a, b, a_scale, b_scale, out_dtype), config


class ScaledMmLaunch(PreparedLaunch):
    """``scaled_grouped_mm(a, b, a_scale, b_scale, offs, out_dtype)`` for calls whose operands
    have the dtypes, shapes, strides and devices of the ones it was made from
    (`scaled_mm_launch`): checked and planned once, at its making, so a call runs only its
    per-call work (out, the operands' 16-byte alignment, the launch). A caller that cannot
    vouch for those facts calls ``scaled_grouped_mm``. Planned anew as every
    `PreparedLaunch`. Holds no tensor."""

    def __init__(self, a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, offs: Tensor,
                 out_dtype: torch.dtype = torch.bfloat16) -> None:
        self._out_dtype = out_dtype
        self._planned(a, b, a_scale, b_scale, offs)

    def _make_plan(self, a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor,
                   offs: Tensor) -> MmPlan:
        rules = _scaled_mm_rules(a, b, a_scale, b_scale, self._out_dtype, None)
        return scaled_mm_plan(_OP, *rules, a, b, a_scale, b_scale, offs, self._out_dtype)

    def __call__(self, a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor,
                 offs: Tensor) -> Tensor:
        plan = self._current(a, b, a_scale, b_scale, offs)
        return run_mm_plan(plan, a, b, a_scale, b_scale, offs, self._out_dtype)


def scaled_mm_launch(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, offs: Tensor,
                     out_dtype: torch.dtype = torch.bfloat16) -> ScaledMmLaunch:
    """A `ScaledMmLaunch`: this ``scaled_grouped_mm`` call (default tiling) for later calls
    with operands of these facts; ValueError as the call where the kernel cannot take them."""
    return ScaledMmLaunch(a, b, a_scale, b_scale, offs, out_dtype)


class MmPlan(NamedTuple):
    """A checked FP8 varlen-M call signature's decisions: the compiled kernel (None without
    rows: nothing launches), its persistent grid's cluster count, which operands must be made
    contiguous first (a not row-major, b not K-major with 16-byte strides: `k_major`, a scale
    not contiguous, offs not contiguous int32), and the kernel's route placeholder."""

    kernel: object
    clusters: int
    a_copy: bool = False
    b_copy: bool = False
    scales_copy: bool = False
    offs_copy: bool = False
    route: Tensor | None = None


def run_scaled_mm(op: str, check, config, a: Tensor, b: Tensor, a_scale: Tensor,
                  b_scale: Tensor, offs: Tensor, out_dtype: torch.dtype, tiling=None) -> Tensor:
    """Launch an FP8 varlen-M grouped GEMM (row-wise or block scales): raise ValueError with
    ``check()``'s reason when it is (False, why), or `_check_offs`' where offs do not fit;
    else allocate out [M, N], compile ``config(N)`` (a ``GemmConfig``) and launch it over the
    rows with the scales as given (`scaled_mm_plan`, `run_mm_plan`)."""
    plan = scaled_mm_plan(op, check, config, a, b, a_scale, b_scale, offs, out_dtype, tiling)
    return run_mm_plan(plan, a, b, a_scale, b_scale, offs, out_dtype)


def scaled_mm_plan(op: str, check, config, a: Tensor, b: Tensor, a_scale: Tensor,
                   b_scale: Tensor, offs: Tensor, out_dtype: torch.dtype,
                   tiling=None) -> MmPlan:
    """The `MmPlan` of `run_scaled_mm`'s launch: the checks, the config, the grid and the
    operands' copies decided once per call signature (``launch_plan``: the operands' dtypes,
    shapes, strides and devices, ``out_dtype``, and ``tiling``: every option ``config`` reads
    besides those); a refused signature is never planned, so it is refused on every call."""
    signature = (op, a.dtype, a.shape, a.stride(), a.device, b.dtype, b.shape, b.stride(),
                 b.device, a_scale.dtype, a_scale.shape, a_scale.stride(), a_scale.device,
                 b_scale.dtype, b_scale.shape, b_scale.stride(), b_scale.device, offs.dtype,
                 offs.shape, offs.stride(), offs.device, out_dtype, tiling,
                 tiling is None and tiling_settings())  # the default tiling reads the environment
    return _MM_PLANS.get(signature) or _MM_PLANS.put(
        signature, _plan_mm(op, check(), config, a, b, a_scale, b_scale, offs))


def run_mm_plan(plan: MmPlan, a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor,
                offs: Tensor, out_dtype: torch.dtype) -> Tensor:
    """out [M, N] of an FP8 varlen-M `plan` on operands of its signature (copied where it
    says their layout needs it, or where their data is not 16-byte aligned)."""
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    if plan.kernel is None:  # no rows
        return out
    if plan.offs_copy:
        offs = offs.to(torch.int32).contiguous()
    a, b = aligned_16(a, plan.a_copy), aligned_16(b, plan.b_copy)
    if plan.scales_copy:
        a_scale, b_scale = a_scale.contiguous(), b_scale.contiguous()
    plan.kernel(a, b.permute(1, 2, 0), out, offs, plan.clusters, a_scale, b_scale, plan.route)
    return out


def _plan_mm(op: str, check: tuple[bool, str], config, a: Tensor, b: Tensor, a_scale: Tensor,
             b_scale: Tensor, offs: Tensor) -> MmPlan:
    """The checked `MmPlan` of an FP8 varlen-M launch (the kernel is None without rows:
    nothing launches)."""
    ok, why = check
    if not ok:
        shown = f"a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype}"
        raise ValueError(f"{op}: {shown}: {why}")
    from .compile import compile_gemm

    (rows, _), (groups, n, _) = a.shape, b.shape
    checked = _check_offs(offs, groups, a.device)
    if rows == 0:
        return MmPlan(None, 0)
    cfg = config(n)
    sms = _num_sms(a.device.index or 0)
    clusters = varlen_m_clusters(rows, groups, n, cfg.tile_n, cfg.cluster_mn, sms)
    return MmPlan(compile_gemm(cfg).fn, clusters, a_copy=_row_major(a) is not a,
                  b_copy=k_major(b) is not b,
                  scales_copy=not (a_scale.is_contiguous() and b_scale.is_contiguous()),
                  offs_copy=checked is not offs, route=no_route(a.device))


def k_major(b: Tensor) -> Tensor:
    """b [E, N, K] as the FP8 GEMMs read it: b itself where K is contiguous and the expert and
    row strides are whole 16-byte steps (the kernels take any such strides: a stacked weight's
    dgrad form is a [G, K, N] view of a [K, G·N] buffer, `fp8_quantize.stacked_weight_rows`),
    else a contiguous copy."""
    if b.stride(2) == 1 and b.stride(0) % _ALIGN == 0 and b.stride(1) % _ALIGN == 0:
        return b
    return b.contiguous()


# ---------------------------------------------------------------- varlen K (weight gradient)

WGRAD_SPAN = 128  # tokens: the 8-bit k-tile; every group's span in P is a multiple of it
_WGRAD_OP = "cute scaled_grouped_wgrad"


def token_major_problem(a: Tensor, b: Tensor, groups: int) -> str:
    """Why token-major wgrad operands have unsupported shapes ("" when they are supported):
    a [N, P] and b [K, P], E, N and K > 0, N and K multiples of 16, P of 128 (padded spans)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        return f"needs a [N, P] and b [K, P], got {tuple(a.shape)} and {tuple(b.shape)}"
    (n, p), k = a.shape, b.shape[0]
    if groups == 0 or n == 0 or k == 0:
        return f"needs E, N and K > 0, got E={groups}, N={n}, K={k}"
    if n % _ALIGN or k % _ALIGN or p % WGRAD_SPAN:
        return (f"N={n} and K={k} must be multiples of {_ALIGN}, P={p} of {WGRAD_SPAN} (padded "
                f"token spans)")
    return ""


def _wgrad_problem(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, groups: int) -> str:
    """Why the wgrad operands' dtypes or shapes are unsupported ("" when they are supported)."""
    why = _dtype_problem(a, b) or token_major_problem(a, b, groups)
    if why:
        return why
    n, k = a.shape[0], b.shape[0]
    for name, s, shape in (("a_scale", a_scale, (groups, n)), ("b_scale", b_scale, (groups, k))):
        if s.dtype != torch.float32 or tuple(s.shape) != shape:
            return f"{name} must be float32 {list(shape)}, got {s.dtype} {list(s.shape)}"
    return ""


def supports_scaled_wgrad(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor,
                          offs: Tensor) -> tuple[bool, str]:
    """Whether ``scaled_grouped_wgrad(a, b, a_scale, b_scale, offs)`` can run here, with the
    reason if not: E4M3 (or E5M2) a [N, P] and E4M3 b [K, P] (tokens contiguous), fp32 scales
    [E, N] and [E, K], N and K multiples of 16, P of 128, CUDA tensors on an sm_90 GPU."""
    why = (_wgrad_problem(a, b, a_scale, b_scale, offs.shape[0])
           or _device_problem((a, b, a_scale, b_scale, offs)))
    return not why, why


def scaled_grouped_wgrad(
    a: Tensor,
    b: Tensor,
    a_scale: Tensor,
    b_scale: Tensor,
    offs: Tensor,
    out: Tensor | None = None,
    accumulate: bool = False,
    *,
    tiling: Tiling | None = None,
) -> Tensor:
    """Varlen-K FP8 grouped GEMM (the weight gradient) with per-group row-wise scales:
    ``out[e] = diag(a_scale[e]) · (a[:, span e] @ b[:, span e]ᵀ) · diag(b_scale[e])``.

    a: [N, P] float8_e4m3fn or float8_e5m2 (dY token-major), b: [K, P] float8_e4m3fn (X
    token-major), spans
    given by offs: int32 [E] cumulative span ends in P; each span starts on a multiple of 128
    and is zero-padded to whole multiples of 128 (``te_seq.kernels.fp8_wgrad.TokenMajor``; not
    checked on the host: no sync); a_scale fp32 [E, N], b_scale fp32 [E, K] (dequantization
    scales). -> [E, N, K]: a new bf16 tensor, or written into (``accumulate=True``: added to)
    ``out``, contiguous bf16 or fp32. fp32 accumulation, sync-free, CUDA-graph capturable.
    """
    signature = (a.dtype, a.shape, a.stride(), a.device, b.dtype, b.shape, b.stride(), b.device,
                 a_scale.dtype, a_scale.shape, a_scale.stride(), a_scale.device, b_scale.dtype,
                 b_scale.shape, b_scale.stride(), b_scale.device, offs.dtype, offs.shape,
                 offs.stride(), offs.device,
                 None if out is None else (out.dtype, out.shape, out.is_contiguous()),
                 accumulate, tiling, tiling is None and tiling_settings())
    plan = _WGRAD_PLANS.get(signature) or _WGRAD_PLANS.put(
        signature, _plan_wgrad(a, b, a_scale, b_scale, offs, out, accumulate, tiling))
    if out is None:
        out = torch.empty(offs.shape[0], a.shape[0], b.shape[0], dtype=torch.bfloat16,
                          device=a.device)
    if plan.offs_copy:
        offs = offs.to(torch.int32).contiguous()
    if plan.a_copy:
        a, b = _row_major(a), _row_major(b)
    if plan.scales_copy:
        a_scale, b_scale = a_scale.contiguous(), b_scale.contiguous()
    a, b = aligned_16(a), aligned_16(b)
    plan.kernel(a, b, out.permute(1, 2, 0), offs, plan.clusters, a_scale, b_scale, plan.route)
    return out


# The scaled main_grad accumulate over short groups: ping-pong, 128 wide, 2x1 clusters, static
# units (probe_pingpong_accumulate.py --fp8-speed, one H200, 2026-11-29: against the 256-wide
# cooperative tiling Q's FC1 / FC2 0.930 / 0.475 ms against 0.946 / 0.538, Z 0.987 / 0.512
# against 1.027 / 0.615, B 2.610 / 1.347 against 2.933 / 1.465; 1x1 level on Q and Z, 5 % slower
# on B; bit for bit the cooperative result).
SCALED_ACCUMULATE_TILING = Tiling(128, (2, 1), True)


def _wgrad_tiling(k: int, accumulate: bool, span_tokens: float,
                  out_dtype: torch.dtype = torch.bfloat16) -> Tiling:
    """The 16-bit wgrad's default tiling (``wgrad_tiling``: ping-pong, its cluster and a
    bf16 output's epilogue columns from the groups' average padded span ``span_tokens``) with
    static units (the scaled kernel has no dynamic schedule). Accumulating:
    ``SCALED_ACCUMULATE_TILING`` where the groups hold up to ``ACCUMULATE_PINGPONG_MAX_ROWS``
    tokens on average (their spans up to one ``WGRAD_SPAN`` more), as the 16-bit accumulate
    chooses; cooperative over longer groups or with ``TE_SEQ_PINGPONG=0``."""
    if not accumulate:
        out_bits = out_dtype.itemsize * 8
        return replace(wgrad_tiling(k, False, span_tokens, out_bits), dynamic=False)
    if pingpong_by_default() and span_tokens <= ACCUMULATE_PINGPONG_MAX_ROWS + WGRAD_SPAN:
        return SCALED_ACCUMULATE_TILING
    return default_tiling(k, WGRAD_TILING)


def _plan_wgrad(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, offs: Tensor,
                out: Tensor | None, accumulate: bool, tiling: Tiling | None) -> MmPlan:
    """The checked `MmPlan` of a ``scaled_grouped_wgrad`` launch (ValueError where the
    operands, offs or ``out`` do not fit)."""
    ok, why = supports_scaled_wgrad(a, b, a_scale, b_scale, offs)
    if not ok:
        raise ValueError(f"{_WGRAD_OP}: a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} "
                         f"{b.dtype}: {why}")
    from .compile import GemmConfig, compile_gemm

    groups, n, k = offs.shape[0], a.shape[0], b.shape[0]
    out_dtype = torch.bfloat16 if out is None else out.dtype
    if out is not None and (tuple(out.shape) != (groups, n, k)
                            or out_dtype not in (torch.float32, torch.bfloat16)
                            or not out.is_contiguous()):
        raise ValueError(f"{_WGRAD_OP}: out must be a contiguous [{groups}, {n}, {k}] float32 or "
                         f"bfloat16 tensor, got {tuple(out.shape)} {out.dtype}")
    checked = _check_offs(offs, groups, a.device)
    accumulate = accumulate and out is not None
    wide_ok = not accumulate and out_dtype == torch.bfloat16
    t = (check_tiling(tiling, _WGRAD_OP, wide_ok=wide_ok)
         or _wgrad_tiling(k, accumulate, a.shape[1] / groups, out_dtype))
    cfg = GemmConfig("k", FP8_DTYPE, out_dtype, "k", t.tile_n, t.cluster_mn, accumulate,
                     scaled=True, a_dtype=_a_dtype(a), pingpong=t.pingpong, epi_cols=t.epi_cols)
    sms = _num_sms(a.device.index or 0)
    clusters = varlen_k_clusters(groups, n, k, t.tile_n, t.cluster_mn, sms)
    return MmPlan(compile_gemm(cfg).fn, clusters,
                  a_copy=_row_major(a) is not a or _row_major(b) is not b,
                  scales_copy=not (a_scale.is_contiguous() and b_scale.is_contiguous()),
                  offs_copy=checked is not offs, route=no_route(a.device))
