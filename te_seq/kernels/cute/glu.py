"""Fused grouped-MLP GLU steps on the CuTe DSL backend (sm_90a): FC1 + activation, FC2 dgrad +
activation gradient. Kernel: ``glu_epilogue.GluGemmKernel``; maths: ``reference.glu_forward`` /
``reference.glu_backward`` (fp32, one rounding per output).

Shape legend: M rows, E experts, H hidden, F ffn; h [M, 2F] in the activation op's column layout.
Imports no cutlass until a kernel is first compiled; no host reads of ``offs`` (sync-free,
CUDA-graph capturable once compiled). ``te_seq.kernels.glu_fc1_forward`` / ``glu_fc2_dgrad``
call these when ``<fn>.supports(...)`` is (True, "") and compose GEMM + elementwise otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from te_seq.kernels.activations import epilogue_activations

from .launch import (
    _AB_DTYPES,
    GATHER_CLUSTER,
    Tiling,
    _check_offs,
    _num_sms,
    _row_major,
    available,
    b_layout,
    b_view,
    bias_problem,
    check_tiling,
    coop_cluster,
    epilogue_subtiles,
    fc1_writes_h,
    gathered_rows,
    glu_dgrad_epi_rows,
    glu_dgrad_h_prefetch_setting,
    glu_dgrad_pingpong,
    glu_fc1_epi_cols,
    glu_fc1_pingpong_tile_n,
    half_tiles,
    mm_pingpong_cluster,
    no_route,
    pingpong_by_default,
    pingpong_max_k,
    tile_n_for,
    tiling_settings,
    varlen_m_clusters,
    with_route,
)
from .launch_plan import LaunchPlan, PlanCache, PreparedLaunch, tensor_signature

_PROBS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ACTS = epilogue_activations()  # the table entries with glu_epilogue=True
_FC1_TILE_N = 256
# The fused FC1 in ping-pong (128 x 128 tiles of 64 gate + 64 up columns, 1x2 cluster) against
# cooperative 128 x 256 (bench_grouped_gemm.py --glu, ScaledSwiGLU with probs, TFLOP/s; one
# H200, 2026-11-25, measured/h200_2026-11-25f_glu.txt; one H100 the same day,
# measured/h100_2026-11-25f_glu_2x2_cluster.txt): Q (K = H = 2048) 510 vs 462 on the H200,
# 449 vs 428 on the H100; B (K = 4096) 571 vs 589 and 475 vs 583: a short mainloop leaves the
# epilogue exposed, which ping-pong hides; a long one does not.
PINGPONG_FC1_TILE_N = 128
# The FP8 (row-wise) GLU dgrad in ping-pong, 128 wide, against its cooperative default (one H200,
# 2026-11-28, scratch timing of scaled_glu_fc2_dgrad alone, silu with probs, 256 rows per
# expert, ms; measured/h200_2026-11-28n_fp8_glu_dgrad_tilings.txt): Q 0.172 (1x2) and 0.167
# (2x1) vs 0.183; B's widths 0.320 and 0.300 vs 0.335; 192 wide 0.398 and 0.638. With B's 512
# rows per expert (..._2026-11-28o_fp8_glu_dgrad_tilings.txt): 0.595 (1x2) and 0.684 (2x1) vs
# 0.711; (64 x 32) epilogue subtiles slower (Q 0.204, B 0.639). The 16-bit dgrad takes the
# same tiles where `launch.glu_dgrad_pingpong()` (the default; measured there).
PINGPONG_DGRAD_TILE_N = 128
_DUMMY: dict = {}
_MAT_DUMMY: dict = {}  # (device type, index, dtype) -> the [8, 8] placeholder in that dtype
_PLANS = PlanCache()  # GLU launches (16-bit and FP8) by call signature
_FC1_CHECKED = PlanCache()  # ungathered 16-bit FC1 calls by signature (`_fc1_direct`)


def _supports(
    x: Tensor, w: Tensor, act: str, interleave: int | None, fc1: bool, bias: Tensor | None = None
) -> tuple[bool, str]:
    """Shared checks; ``w`` is w1t [E, H, 2F] (fc1) or w2 [E, H, F] (dgrad); ``bias`` [E, 2F]
    (fc1 only)."""
    if act not in _ACTS:
        return False, f"act {act!r} has no fused epilogue (only {_ACTS})"
    if x.dtype not in _AB_DTYPES or w.dtype != x.dtype:
        return False, f"needs bf16/fp16 operands of one dtype, got {x.dtype} and {w.dtype}"
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        return False, f"needs x [M, H] and w [E, H, N], got {tuple(x.shape)} and {tuple(w.shape)}"
    f = w.shape[2] // 2 if fc1 else w.shape[2]
    why = layout_problem(x.shape[1], f, interleave, fc1)
    if why:
        return False, why
    if not (x.is_cuda and w.is_cuda):
        return False, "needs CUDA tensors"
    why = bias_problem(bias, w.shape[0], w.shape[2], x.device)
    if why:
        return False, why
    return available()


def layout_problem(h: int, f: int, interleave: int | None, fc1: bool, h_align: int = 8) -> str:
    """Why the GLU kernels cannot take hidden size ``h`` (a multiple of ``h_align`` elements:
    16-byte TMA rows), ffn width ``f`` and ``interleave`` ("" when they can)."""
    if h % h_align:
        return f"H={h} must be a multiple of {h_align} (TMA rows are 16-byte aligned)"
    if interleave is None and f % 128:
        return f"F={f} must be a multiple of 128 for [gate | up] halves"
    allowed = (32, 64, 128) if fc1 else tuple(range(32, f + 1, 32))
    if interleave is not None and (interleave not in allowed or f % interleave):
        return f"glu_interleave_size={interleave} unsupported with F={f} (32, 64 or 128)"
    return ""


def epilogue_args(x: Tensor, act_out, probs, dprobs, h_in, bias) -> tuple:
    """The epilogue kernels' trailing arguments (act_out, probs, dprobs, h_in, bias), a small
    dummy tensor for each one not given (shared by the GLU and the non-gated kernels)."""
    fp32_dummy, mat_dummy = _dummy(x.device)
    return (
        act_out,
        fp32_dummy if probs is None else probs,
        fp32_dummy if dprobs is None else dprobs,
        _mat_dummy(x.device, act_out.dtype) if h_in is None else h_in,
        mat_dummy if bias is None else bias,
    )


def _dummy(device: torch.device) -> tuple[Tensor, Tensor]:
    """(fp32 [8], bf16 [8, 8]) placeholders for the kernel's unused tensor arguments."""
    key = (device.type, device.index)
    if key not in _DUMMY:
        _DUMMY[key] = (
            torch.zeros(8, dtype=torch.float32, device=device),
            torch.zeros(8, 8, dtype=torch.bfloat16, device=device),
        )
    return _DUMMY[key]


def _mat_dummy(device: torch.device, dtype: torch.dtype) -> Tensor:
    """The [8, 8] matrix placeholder in ``dtype``, made once per device and dtype (not a
    conversion, and so not a copy kernel, per call)."""
    key = (device.type, device.index, dtype)
    if key not in _MAT_DUMMY:
        _MAT_DUMMY[key] = _dummy(device)[1].to(dtype)
    return _MAT_DUMMY[key]


def _check_probs(probs: Tensor | None, rows: int, op: str) -> Tensor | None:
    """probs as a contiguous [rows] tensor the kernel reads (other float dtypes go through fp32)."""
    if probs is None:
        return None
    if probs.numel() != rows or not probs.is_floating_point():
        raise ValueError(
            f"cute {op}: probs must hold one float per row ({rows}), "
            f"got {tuple(probs.shape)} {probs.dtype}"
        )
    if probs.dim() != 1:  # a 1-D one is [rows] already: no view made (a torch call less)
        probs = probs.reshape(rows)
    return (probs if probs.dtype in _PROBS_DTYPES else probs.float()).contiguous()


def _glu_tiling(mode: str, n: int, gather: bool, tiling: Tiling | None, k: int = 0,
                plain_fc1: bool = False, fp8_dgrad: bool = False,
                plain_dgrad: bool = False, wide_fc1: bool = False) -> Tiling:
    """The tiling of a GLU launch of N = ``n`` columns and K = ``k``: ``tiling`` if given;
    else an FC1 with a short mainloop (K <= ``pingpong_max_k()``) that is ``plain_fc1``
    (16-bit or row-wise FP8, no bias, interleave None, 32 or 64) on rows not gathered runs in
    ping-pong, 64 gate + 64 up columns per tile, while ``pingpong_by_default()``; the rest is
    cooperative:
    FC1's 128 gate + 128 up columns per tile, the dgrad's width fitted to N = F
    (``tile_n_for``), in ``coop_cluster()``; gathered rows are never multicast
    (``GATHER_CLUSTER``).

    The 16-bit GLU dgrad (``plain_dgrad``: not block-scaled) with a short mainloop on rows
    not gathered runs ping-pong 128 wide where ``glu_dgrad_pingpong()`` (the default since
    the 2x1 split tails: kernel README, section 25), as the row-wise FP8 one (``fp8_dgrad``)
    does (``PINGPONG_DGRAD_TILE_N``); the rest is cooperative.

    ``wide_fc1``: a 16-bit FC1 without bias on rows not gathered, [gate | up] halves or
    64-column blocks, whose 128-wide ping-pong tiles can stage 64-column epilogue subtiles
    (``glu_fc1_epi_cols()`` by default; a given ``tiling`` may ask for them)."""
    if tiling is not None:
        wide_ok = wide_fc1 and tiling.pingpong and tiling.tile_n == 128 \
            and tiling.epi_rows == 128
        return check_tiling(tiling, f"cute GLU {mode}", wide_ok=wide_ok)
    short = k <= pingpong_max_k() and pingpong_by_default()
    plain_pingpong = plain_dgrad and not gather and glu_dgrad_pingpong()
    if mode == "dgrad" and short and (fp8_dgrad or plain_pingpong):
        return Tiling(PINGPONG_DGRAD_TILE_N, mm_pingpong_cluster(), pingpong=True,
                      epi_rows=128 if fp8_dgrad else glu_dgrad_epi_rows())
    if mode == "fc1" and plain_fc1 and not gather and short:
        width = glu_fc1_pingpong_tile_n(PINGPONG_FC1_TILE_N)
        if (n // 2) % (width // 2):  # F not whole tiles of width / 2 gate columns
            width = PINGPONG_FC1_TILE_N
        cols = glu_fc1_epi_cols() if wide_fc1 and width == 128 else 32
        return Tiling(width, mm_pingpong_cluster(), pingpong=True, epi_cols=cols)
    cluster = GATHER_CLUSTER if gather else coop_cluster()
    return Tiling(_FC1_TILE_N if mode == "fc1" else tile_n_for(n, cluster[1]), cluster)


# The GLU dgrad with two h buffer pairs (one H100, 2026-11-25, bench_grouped_gemm.py --glu,
# measured/h100_2026-11-25_glu_h_prefetch_burst.json): Q 286 vs 267 TFLOP/s, Z 278 vs 265 at
# 192-wide tiles; B's 256-wide tiles lost a mainloop stage to the extra smem (458 vs 481).
_H_PREFETCH_MAX_TILE_N = 192
# The FP8 (row-wise) GLU dgrad in ping-pong with two h pairs (one H200, 2026-11-30, run "r",
# profile_kernels.py --fp8 ROWWISE --hp-wgrad, two rounds; kernel README, section 26): Q
# 0.150-0.151 ms against 0.155-0.156 with one, Z 0.170-0.171 against 0.177-0.178. The 16-bit
# one in ping-pong stays at one pair: level with two (Q 0.218 against 0.219 ms, Z 0.257 both),
# slower with four (0.233, 0.275).
FP8_PINGPONG_DGRAD_H_PREFETCH = 2


def _dgrad_h_prefetch(t: Tiling, scaled: bool) -> int:
    """h subtile pairs the dgrad loads ahead by default: ``TE_SEQ_GLU_DGRAD_H_PREFETCH``
    where set and it divides the tile's subtiles; else in ping-pong
    ``FP8_PINGPONG_DGRAD_H_PREFETCH`` for the FP8 kernel and 1 for the 16-bit one; else
    (cooperative) 2 for 16-bit tiles up to ``_H_PREFETCH_MAX_TILE_N`` wide (smem for a second
    pair costs them no mainloop stage) and 1 for the rest."""
    chosen = glu_dgrad_h_prefetch_setting()
    if chosen is not None and epilogue_subtiles(t.tile_n, t.epi_rows) % chosen == 0:
        return chosen
    if t.pingpong:
        return FP8_PINGPONG_DGRAD_H_PREFETCH if scaled else 1
    if scaled or t.tile_n > _H_PREFETCH_MAX_TILE_N:
        return 1
    return 2


def _launch(mode: str, x, b, c, offs, act_out, probs, dprobs, h_in, act, interleave, params,
            bias=None, gather=None, scales=(), tiling=None, h_prefetch=None,
            block_scaled=False) -> Tensor | None:
    """Launch the GLU kernel over a's M rows (``gather``: int32 [M], x's row of each GEMM
    row; x is then the [T, H] token matrix; ``scales``: the FP8 kernel's fp32 (scale_a [M],
    scale_b [E, N]), ``fp8_glu``; ``block_scaled``: they are the block scales [M, HB] and
    [E, 2F/128, HB] of the block-scaled FC1, ``block_glu``; ``tiling``: ``_glu_tiling``;
    ``h_prefetch``: the dgrad's, None for ``_dgrad_h_prefetch``; c None: an fc1 whose h is
    not wanted, ``launch.fc1_writes_h`` decides), its kernel and grid planned (and compiled)
    once per call signature (`glu_plan`). Returns c (None where the fc1 wrote no h)."""
    offs = _check_offs(offs, b.shape[0], x.device)
    plan = glu_plan(mode, x, b, act_out.shape[0], probs, act, interleave, params, bias, gather,
                    bool(scales), tiling, h_prefetch, block_scaled, c is not None)
    return run_glu_plan(plan, x, b, c, offs, act_out, probs, dprobs, h_in, bias, scales, gather)


def glu_plan(mode: str, x, b, rows: int, probs, act, interleave, params, bias=None, gather=None,
             scaled: bool = False, tiling=None, h_prefetch=None, block_scaled: bool = False,
             store_h: bool = True) -> LaunchPlan:
    """The `LaunchPlan` of a GLU launch over ``rows`` rows with `_launch`'s operands
    (``scaled``: FP8 scales given; ``store_h``: h wanted), made once per call signature."""
    signature = (
        mode, x.dtype, x.device, b.dtype, b.shape, b.stride(), b.device, rows,
        None if probs is None else probs.dtype, act, interleave, tuple(params),
        None if bias is None else bias.dtype, gather is None, scaled, tiling, h_prefetch,
        tiling is None and tiling_settings(),  # the default tiling reads the environment
        block_scaled, not store_h,
    )
    return _PLANS.get(signature) or _PLANS.put(
        signature, _plan(mode, x, b, rows, probs, act, interleave, params, bias, gather,
                         scaled, tiling, h_prefetch, block_scaled, store_h)
    )


def run_glu_plan(plan: LaunchPlan, x, b, c, offs, act_out, probs, dprobs, h_in, bias=None,
                 scales=(), gather=None) -> Tensor | None:
    """Launch a GLU `plan` on `_launch`'s operands (offs checked); returns c, made here where
    h was not wanted but the plan writes it anyway (None where the fc1 wrote no h)."""
    if c is None and plan.writes_c:  # h not wanted, but this tiling writes it anyway
        c = torch.empty(act_out.shape[0], b.shape[2], dtype=act_out.dtype,
                        device=act_out.device)
    plan.kernel(
        _row_major(x), b_view(b, plan.b_copy), act_out if c is None else c, offs,
        plan.clusters, *epilogue_args(x, act_out, probs, dprobs, h_in, bias), *scales,
        no_route(x.device) if gather is None else gather,
    )
    return c


def _plan(mode, x, b, rows, probs, act, interleave, params, bias, gather, scaled, tiling,
          h_prefetch, block_scaled=False, store_h=True):
    """The `LaunchPlan` of a GLU launch: its config compiled (once per config), the grid."""
    from .compile import GluConfig, compile_glu

    b_major, b_copy = b_layout(b)
    groups, n = b.shape[0], b.shape[2]
    plain_fc1 = bias is None and not block_scaled and interleave in (None, 32, 64) \
        and (scaled or x.dtype in (torch.bfloat16, torch.float16))
    fp8_dgrad = mode == "dgrad" and scaled and not block_scaled
    # two h buffer pairs (an explicit h_prefetch=2) run in the cooperative dgrad only
    plain_dgrad = mode == "dgrad" and not scaled and not block_scaled and h_prefetch != 2
    wide_fc1 = mode == "fc1" and plain_fc1 and not scaled and gather is None \
        and interleave in (None, 64)
    t = _glu_tiling(mode, n, gather is not None, tiling, x.shape[1], plain_fc1, fp8_dgrad,
                    plain_dgrad, wide_fc1)
    _check_fc1_halves(mode, interleave, n, t)
    store_h = fc1_writes_h(store_h)
    if h_prefetch is None:  # the block-scaled kernel takes one pair
        h_prefetch = _dgrad_h_prefetch(t, scaled) if mode == "dgrad" and not block_scaled \
            else 1
    cfg = GluConfig(
        mode, x.dtype, b_major, act, interleave, None if probs is None else probs.dtype,
        t.cluster_mn, tile_n=t.tile_n, params=params,
        bias_dtype=None if bias is None else bias.dtype,
        route=None if gather is None else "gather", scaled=scaled and not block_scaled,
        pingpong=t.pingpong, h_prefetch=h_prefetch, epi_rows=t.epi_rows,
        half_tiles=half_tiles(t), block_scaled=block_scaled, store_h=store_h,
        epi_cols=t.epi_cols,
    )
    sms = _num_sms(x.device.index or 0)
    clusters = varlen_m_clusters(rows, groups, n, t.tile_n, t.cluster_mn, sms)
    return LaunchPlan(compile_glu(cfg).fn, clusters, b_copy, writes_c=store_h)


def _check_fc1_halves(mode: str, interleave: int | None, n: int, t: Tiling) -> None:
    """An FC1 tile of [gate | up] halves holds tile_n / 2 gate columns and as many up ones:
    F = ``n`` / 2 must be a multiple of that (ValueError naming both)."""
    half = t.tile_n // 2
    if mode == "fc1" and interleave is None and (n // 2) % half:
        raise ValueError(f"cute glu_fc1_forward: F={n // 2} is not a multiple of {half}, the gate "
                         f"(and up) columns of a {t.tile_n}-wide tile ({t})")


class _Fc1Forward:
    """``glu_fc1_forward(x, w1t, offs, act, interleave, probs, params) -> (h, a)``."""

    @staticmethod
    def supports(
        x: Tensor, w1t: Tensor, act: str, interleave: int | None, bias: Tensor | None = None,
        gather: bool = False,
    ) -> tuple[bool, str]:
        """(True, "") when the fused kernel handles these operands (and the bias [E, 2F] in
        bf16, fp16 or fp32; ``gather``: x's rows read by index), else (False, why)."""
        check = _supports(x, w1t, act, interleave, fc1=True, bias=bias)
        return with_route(check, "gather" if gather else None, x.shape[1])

    @staticmethod
    def launch_for(x: Tensor, w1: Tensor, act: str, interleave: int | None,
                   probs: Tensor | None = None, params: tuple[float, ...] = (),
                   store_h: bool = True) -> Fc1Launch:
        """An `Fc1Launch`: this call without bias, gathered rows or a tiling, for later calls
        with operands of these facts (W1 untransposed, [E, 2F, H]); ValueError as the call
        where the kernel cannot take them."""
        return Fc1Launch(x, w1, act, interleave, probs, tuple(params), store_h)

    def __call__(
        self,
        x: Tensor,
        w1t: Tensor,
        offs: Tensor,
        act: str,
        interleave: int | None,
        probs: Tensor | None = None,
        params: tuple[float, ...] = (),
        bias: Tensor | None = None,
        gather_rows: Tensor | None = None,
        tiling: Tiling | None = None,
        store_h: bool = True,
    ) -> tuple[Tensor | None, Tensor]:
        """h = x_e W1_eᵀ (+ bias[e], added to the fp32 accumulator; bias [E, 2F] in h's
        columns) [M, 2F] (w1t = W1.transpose(1, 2) [E, H, 2F]) and
        a = act(gate)·up(·probs) [M, F] from the bf16 h, as ``reference.glu_forward(h, ...)``
        (``params``: the activation's float parameters, () for its defaults; each set of values
        compiles its own kernel). Rows past ``offs[-1]`` are zeros in h and a.
        ``gather_rows`` int [M]: row r of the GEMM is ``x[gather_rows[r]]`` (x a [T, H] token
        matrix, H a multiple of 64), read by the kernel's loads (no [M, H] copy).
        ``tiling``: None (128 x 256 tiles, two warpgroups on each) or
        ``Tiling(128, cluster, pingpong=True)`` (64 gate + 64 up columns per tile, one
        warpgroup on each; no bias, no gather; ``epi_rows=64``: 64 x 32 epilogue subtiles).
        ``store_h=False`` (no backward reads h): h is neither allocated nor written
        (returned as None; with ``TE_SEQ_FC1_KEEP_H=1`` written and returned as usual); a is
        the same bit for bit either way. With a bias h is written all the same (that kernel
        has not been checked without it on a GPU yet)."""
        gather = gather_rows is not None
        store_h = store_h or bias is not None
        if not gather:
            return _fc1_direct(x, w1t, offs, act, interleave, probs, tuple(params), bias, tiling,
                               store_h)
        ok, why = self.supports(x, w1t, act, interleave, bias, gather)
        if not ok:
            raise ValueError(
                f"cute glu_fc1_forward: x {tuple(x.shape)}, w1t {tuple(w1t.shape)}: {why}"
            )
        (rows, gather_rows), f = gathered_rows(x, gather_rows, "glu_fc1_forward"), w1t.shape[2] // 2
        probs = _check_probs(probs, rows, "glu_fc1_forward")
        h = torch.empty(rows, 2 * f, dtype=x.dtype, device=x.device) if store_h else None
        a = torch.empty(rows, f, dtype=x.dtype, device=x.device)
        if rows:
            bias = None if bias is None else bias.contiguous()
            h = _launch("fc1", x, w1t, h, offs, a, probs, None, None, act, interleave, params,
                        bias, gather_rows, tiling=tiling)
        return h, a


class _CheckedFc1(NamedTuple):
    """An FC1 call signature whose operands passed `_Fc1Forward.supports`: its `LaunchPlan`
    and the kernel's placeholder arguments on its device (the unused dprobs, h_in and bias,
    probs when not given, the route)."""

    plan: LaunchPlan
    fp32_dummy: Tensor
    mat_dummy: Tensor
    h_dummy: Tensor
    route: Tensor


def _fc1_signature(x: Tensor, w1t: Tensor, probs: Tensor | None, act: str,
                   interleave: int | None, params: tuple, bias: Tensor | None,
                   tiling: Tiling | None, store_h: bool) -> tuple:
    """Everything `_Fc1Forward.supports` and the FC1 `LaunchPlan` read of an ungathered call
    (M = x's rows is in x.shape; data and offs are never part of it)."""
    return (
        x.dtype, x.shape, x.device, w1t.dtype, w1t.shape, w1t.stride(), w1t.device,
        None if probs is None else (probs.dtype, probs.shape), act, interleave, params,
        tensor_signature(bias), tiling, tiling is None and tiling_settings(), store_h,
    )


def _checked_fc1(signature: tuple, x: Tensor, w1t: Tensor, probs: Tensor | None, act: str,
                 interleave: int | None, params: tuple, bias: Tensor | None,
                 tiling: Tiling | None, store_h: bool) -> _CheckedFc1:
    """Check an FC1 call's operands (ValueError with the reason) and plan its launch; kept
    for the next calls with the same `signature`."""
    ok, why = _Fc1Forward.supports(x, w1t, act, interleave, bias)
    if not ok:
        raise ValueError(
            f"cute glu_fc1_forward: x {tuple(x.shape)}, w1t {tuple(w1t.shape)}: {why}"
        )
    plan = _plan("fc1", x, w1t, x.shape[0], probs, act, interleave, params, bias, None, False,
                 tiling, None, store_h=store_h)
    fp32_dummy, mat_dummy = _dummy(x.device)
    checked = _CheckedFc1(plan, fp32_dummy, mat_dummy, _mat_dummy(x.device, x.dtype),
                          no_route(x.device))
    return _FC1_CHECKED.put(signature, checked)


def _fc1_direct(x: Tensor, w1t: Tensor, offs: Tensor, act: str, interleave: int | None,
                probs: Tensor | None, params: tuple, bias: Tensor | None,
                tiling: Tiling | None, store_h: bool = True) -> tuple[Tensor | None, Tensor]:
    """`glu_fc1_forward` of ungathered rows: the operand checks and the launch plan looked up
    by the call's signature first (decided once per signature, as `_launch`'s plans are), so
    a repeated call runs only its per-call work (probs' and offs' layout, h and a, the
    launch) before the kernel starts: its host time is exposed on an idle GPU."""
    signature = _fc1_signature(x, w1t, probs, act, interleave, params, bias, tiling, store_h)
    checked = _FC1_CHECKED.get(signature) or _checked_fc1(
        signature, x, w1t, probs, act, interleave, params, bias, tiling, store_h)
    probs, h, a = fc1_outputs(x, w1t.shape[2] // 2, probs, checked.plan.writes_c)
    if x.shape[0]:
        _fc1_kernel(checked, x, b_view(w1t, checked.plan.b_copy), h, a, offs, w1t.shape[0],
                    probs, None if bias is None else bias.contiguous())
    return h, a


def fc1_outputs(x: Tensor, f: int, probs: Tensor | None, store_h: bool = True,
                op: str = "glu_fc1_forward", dtype: torch.dtype | None = None) -> tuple:
    """(probs as the kernel reads them, h [M, 2F] (None unless `store_h`), a [M, F]) of an
    FC1 call (`op`, for the probs' error) on rows x, in `dtype` (None: x's; the FP8 FC1s'
    bf16)."""
    rows, dtype, device = x.shape[0], dtype or x.dtype, x.device
    probs = _check_probs(probs, rows, op)
    h = torch.empty(rows, 2 * f, dtype=dtype, device=device) if store_h else None  # [M, 2F]
    a = torch.empty(rows, f, dtype=dtype, device=device)  # [M, F]
    return probs, h, a


def _fc1_kernel(checked: _CheckedFc1, x: Tensor, b: Tensor, h: Tensor | None, a: Tensor,
                offs: Tensor, groups: int, probs: Tensor | None, bias: Tensor | None) -> None:
    """Launch a checked FC1 plan on rows x (M > 0) and B in the kernel's (N, K, E) view (h
    None: a plan that writes no h, which stores nothing through its c: a is passed)."""
    plan = checked.plan
    plan.kernel(
        _row_major(x), b, a if h is None else h, _check_offs(offs, groups, x.device),
        plan.clusters, a,
        checked.fp32_dummy if probs is None else probs, checked.fp32_dummy, checked.h_dummy,
        checked.mat_dummy if bias is None else bias, checked.route,
    )


class Fc1Launch(PreparedLaunch):
    """``glu_fc1_forward(x, w1.transpose(1, 2), offs, act, interleave, probs, params,
    store_h=store_h)`` for calls whose x, w1 [E, 2F, H] and probs have the dtypes, shapes,
    strides and devices of the
    ones it was made from (``glu_fc1_forward.launch_for``; x's and probs' layouts may vary):
    the checks and the plan are found once, at its making, so a call runs only its per-call
    work, and the kernel's view of B is read straight off W1 (one view, not a transpose and
    then a permute). A caller that cannot vouch for those facts calls ``glu_fc1_forward``.
    Checked and planned anew as every `PreparedLaunch`."""

    def __init__(self, x: Tensor, w1: Tensor, act: str, interleave: int | None,
                 probs: Tensor | None, params: tuple, store_h: bool = True) -> None:
        self._args = (act, interleave, params)
        self._groups, self._f, self._store_h = w1.shape[0], w1.shape[1] // 2, store_h
        self._planned(x, w1, probs)

    def _make_plan(self, x: Tensor, w1: Tensor, probs: Tensor | None) -> _CheckedFc1:
        w1t = w1.transpose(1, 2)  # [E, H, 2F]
        signature = _fc1_signature(x, w1t, probs, *self._args, None, None, self._store_h)
        return _FC1_CHECKED.get(signature) or _checked_fc1(
            signature, x, w1t, probs, *self._args, None, None, self._store_h)

    def __call__(self, x: Tensor, w1: Tensor, offs: Tensor,
                 probs: Tensor | None) -> tuple[Tensor | None, Tensor]:
        checked = self._current(x, w1, probs)
        probs, h, a = fc1_outputs(x, self._f, probs, checked.plan.writes_c)
        if x.shape[0]:
            # w1t.permute(2, 1, 0) is w1.permute(1, 2, 0): (N, K, E)
            b = w1.transpose(1, 2).contiguous().permute(2, 1, 0) if checked.plan.b_copy \
                else w1.permute(1, 2, 0)
            _fc1_kernel(checked, x, b, h, a, offs, self._groups, probs, None)
        return h, a


class _Fc2Dgrad:
    """``glu_fc2_dgrad(dy, w2, offs, h, act, interleave, probs, params) -> (dh, a, dprobs)``."""

    @staticmethod
    def supports(dy: Tensor, w2: Tensor, act: str, interleave: int | None) -> tuple[bool, str]:
        """(True, "") when the fused kernel handles these operands, else (False, why)."""
        return _supports(dy, w2, act, interleave, fc1=False)

    def __call__(
        self,
        dy: Tensor,
        w2: Tensor,
        offs: Tensor,
        h: Tensor,
        act: str,
        interleave: int | None,
        probs: Tensor | None = None,
        params: tuple[float, ...] = (),
        tiling: Tiling | None = None,
        h_prefetch: int | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """dA = dY_e W2_e (w2 [E, H, F]) never stored; dh [M, 2F] =
        ``reference.glu_backward(h, dA, ...)``, a [M, F] = ``reference.glu_forward(h, ...)`` and
        dprobs [M] (fp32 sums, in probs.dtype; None without probs); ``params`` as in
        ``glu_fc1_forward``; ``tiling``: None (fitted to F, cooperative) or a ping-pong
        ``Tiling(128 or 192, cluster, pingpong=True)`` (``epi_rows=64``: 64 x 32 epilogue
        subtiles); ``h_prefetch``: pairs of smem buffers for h's subtiles, loaded ahead of
        the one being computed (1, 2 or 4, dividing the tile's subtiles: tile_n / 32 with
        128-row subtiles, twice that with 64-row ones; None: ``_dgrad_h_prefetch``). An
        explicit 2 without a tiling runs the cooperative tiling."""
        ok, why = self.supports(dy, w2, act, interleave)
        if not ok:
            raise ValueError(
                f"cute glu_fc2_dgrad: dy {tuple(dy.shape)}, w2 {tuple(w2.shape)}: {why}"
            )
        return run_dgrad("glu_fc2_dgrad", dy, w2, offs, h, act, interleave, probs, params,
                         dy.dtype, tiling=tiling, h_prefetch=h_prefetch)


def run_dgrad(op: str, dy: Tensor, w2: Tensor, offs: Tensor, h: Tensor, act: str,
              interleave: int | None, probs: Tensor | None, params: tuple[float, ...],
              out_dtype: torch.dtype, scales: tuple = (), tiling: Tiling | None = None,
              h_prefetch: int | None = None, block_scaled: bool = False,
              plan: LaunchPlan | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The dgrad GLU kernel on checked operands (dy [M, H], w2 [E, H, F] in the kernel's
    view; ``scales``: the FP8 kernel's, block scales where ``block_scaled``): h checked
    against dy's rows and F, (dh, a, dprobs) allocated in ``out_dtype``, the kernel launched
    over the rows, dprobs in probs' dtype. ``plan``: the call's `glu_plan`, found by a
    prepared launch (else looked up here by the call's signature)."""
    rows, f = dy.shape[0], w2.shape[2]
    if h.shape != (rows, 2 * f) or h.dtype != out_dtype:
        raise ValueError(
            f"cute {op}: h must be [{rows}, {2 * f}] {out_dtype}, got {tuple(h.shape)} {h.dtype}"
        )
    probs_dtype = None if probs is None else probs.dtype
    probs = _check_probs(probs, rows, op)
    dh = torch.empty(rows, 2 * f, dtype=out_dtype, device=dy.device)
    a = torch.empty(rows, f, dtype=out_dtype, device=dy.device)
    dprobs = None if probs is None else torch.zeros(rows, dtype=torch.float32, device=dy.device)
    if rows and plan is None:
        _launch("dgrad", dy, w2, dh, offs, a, probs, dprobs, h.contiguous(), act, interleave,
                params, scales=scales, tiling=tiling, h_prefetch=h_prefetch,
                block_scaled=block_scaled)
    elif rows:
        run_glu_plan(plan, dy, w2, dh, _check_offs(offs, w2.shape[0], dy.device), a, probs,
                     dprobs, h.contiguous(), scales=scales)
    if dprobs is not None and probs_dtype != torch.float32:
        dprobs = dprobs.to(probs_dtype)
    return dh, a, dprobs


glu_fc1_forward = _Fc1Forward()
glu_fc2_dgrad = _Fc2Dgrad()
