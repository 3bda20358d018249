"""Host helpers shared by every CuTe DSL functional: tiling, capability, operand views, the grid.

Shape legend: M routed rows (tokens), E groups (experts), K reduction dim, N output dim.
``offs`` is int32 [E] of cumulative row ends on the device. Imports no cutlass (``available``
imports it only to probe) and never reads ``offs`` on the host.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass, replace

import torch
from torch import Tensor

_AB_DTYPES = (torch.bfloat16, torch.float16)
_TILE_M = 128  # every kernel's CTA tile is 128 rows (two 64-row WGMMA warpgroups)


@dataclass(frozen=True)
class Tiling:
    """CTA tile width (the tile is 128 x tile_n x 64) and cluster shape (cluster_m, cluster_n).

    cluster (2, 1): two m-tiles of one group share B by multicast; (1, 2): two n-tiles share A.
    pingpong: the two MMA warpgroups take alternate tiles, one's epilogue overlapping the
    other's mainloop (tile_n 128 or 192; the plain GEMMs, the GLU steps and the row-wise FP8
    kernels, not the bias, routed-row or block-scaled ones); otherwise both work on each tile
    (64 rows each).
    epi_rows: rows of an epilogue subtile, 128 or (the GLU kernels in ping-pong only) 64: half
    the registers per subtile for a warpgroup that holds the whole tile.
    dynamic: the work units are handed out as clusters free up, the longest groups' first
    (``grouped_wgrad`` only: even under skewed split sizes every cluster stays busy to the
    end); otherwise each cluster takes a fixed stride of them.
    epi_cols: columns of an epilogue subtile (one smem store-ring slot, one TMA store), 32 or
    64 (the plain and FP8 row-wise kernels writing a fresh 16-bit output only: the wgrads,
    and the varlen-M GEMMs in ping-pong; and the 16-bit GLU FC1 in ping-pong): half the TMA
    stores, proxy fences and barrier pairs per tile, in a 2-slot ring of the same bytes as
    the 4 x 32 one.
    """

    tile_n: int = 256
    cluster_mn: tuple[int, int] = (1, 2)
    pingpong: bool = False
    epi_rows: int = 128
    dynamic: bool = False
    epi_cols: int = 32


def check_tiling(tiling: Tiling | None, op: str, *, dynamic_ok: bool = False,
                 wide_ok: bool = False) -> Tiling | None:
    """``tiling``, refused with a ValueError naming ``op`` where it asks for what ``op`` lacks:
    dynamic units (``dynamic_ok``: only the plain varlen-K GEMM, ``grouped_wgrad``, has them)
    or 64-column epilogue subtiles (``wide_ok``: only the plain and FP8 row-wise kernels
    writing a fresh 16-bit output have them, the varlen-M ones in ping-pong, and the 16-bit
    GLU FC1 in ping-pong)."""
    if tiling is None:
        return None
    if tiling.dynamic and not dynamic_ok:
        raise ValueError(
            f"{op}: dynamic work units run in grouped_wgrad only so far, got {tiling}"
        )
    if tiling.epi_cols not in (32, 64) or (tiling.epi_cols == 64 and not wide_ok):
        raise ValueError(
            f"{op}: epilogue subtiles are 32 columns here (64 only in the plain and FP8 "
            f"row-wise kernels writing a fresh 16-bit output, varlen M in ping-pong, and the "
            f"16-bit GLU FC1 in ping-pong without bias or gathered rows), got {tiling}"
        )
    return tiling


# Measured on one H200 (2026-11-22, benchmarks/bench_grouped_gemm.py, shapes A/B/Q/Z):
# 128x256 with a 1x2 cluster was best or within 2% of best for every GEMM; 2x1 lost 5-20% on
# varlen M (256-row cluster units waste rows of small experts), 128x128 lost up to 35% on A.
# (That 2x1 ran whole 256-row units; split tails, tile_scheduler.py, now give 2x1 1x2's tile
# count, and the ping-pong default below runs 2x1. The cooperative tilings, the long
# mainloops', have not been re-measured since.)
# The tile width is then narrowed where 256 would leave columns idle (``tile_n_for``).
MM_TILING = Tiling(256, (1, 2))
WGRAD_TILING = Tiling(256, (1, 2))
TILE_WIDTHS = (256, 192, 128)
# ping-pong tile widths: a warpgroup holds a whole 128 x tile_n tile of fp32 accumulators,
# 192 registers per thread at 192 (of the 232 an MMA thread gets)
PINGPONG_TILE_WIDTHS = (128, 192)


def tile_n_for(n: int, cluster_n: int = 2) -> int:
    """The widest tile in ``TILE_WIDTHS`` whose cluster units cover ``n`` columns with the least
    padding: N = 768 takes 192 (two 384-column units) where 256 would compute 1024 columns."""
    return min(TILE_WIDTHS, key=lambda t: (-(-n // (t * cluster_n)) * t * cluster_n, -t))


def default_tiling(n: int, base: Tiling) -> Tiling:
    """``base`` with its tile width fitted to ``n`` columns (``tile_n_for``)."""
    return Tiling(tile_n_for(n, base.cluster_mn[1]), base.cluster_mn)


# Measured on one H100 (2026-11-25, benchmarks/bench_grouped_gemm.py in bursts of 10 calls,
# measured/h100_2026-11-25_gemm_pingpong_burst.json): alone, ping-pong 128 x 128 (1x2 cluster)
# beat cooperative 128 x 256 where the mainloop is short: FC2's forward (K = F = 768) on Q 417
# vs 388 TFLOP/s, on Zipf-skewed Z 381 vs 354; FC1's dgrad (K = 2F = 1536) on Q 452 vs 429, Z
# 416 vs 407; B's FC2 (K = 1024, 192-wide) 516 vs 494. Whole-MLP runs in separate processes
# disagreed (±3-4 % apart run to run); in one process, interleaved (bench_grouped_mlp.py
# --pingpong, same H100, 20 bursts of 10, measured/h100_2026-11-25e_mlp_{Q,Z,B}_pp_inprocess.txt),
# fwd+bwd with ping-pong against without: Q 2.090 vs 2.173 ms, Z 2.463 vs 2.493, B 8.611 vs
# 8.972 (a rotating order, which favoured some variants: benchmarks/README.md, Protocol). So it
# is the default; TE_SEQ_PINGPONG=0 turns it off. The bound on K: in the MLP on one H200, the
# same module under each setting, shuffled order (bench_grouped_mlp.py --env-variant,
# measured/h200_2026-11-25g_mlp_{b,a}_shuffled.txt), K <= 4096 (B's and A's GLU FC1 in
# ping-pong too) against K <= 2048 and K <= 1536: B forward 2.681 / 2.803 / 2.800 ms, fwd+bwd
# 8.399 / 8.436 / 8.539; A forward 17.968 vs 18.149, fwd+bwd 54.312 vs 54.432. (Alone, on
# random data, B's plain FC1 at K = 4096 ran 529 TFLOP/s in ping-pong against 582: GEMMs
# alone do not predict the MLP.)
PINGPONG_MAX_K = 4096


# What the default tilings read from the environment (at import, and again at each
# `refresh_tiling_settings()`; the launch plans keep the values in their signatures, so a
# refresh takes effect at the next call):
#   TE_SEQ_PINGPONG=0          every ping-pong default off (all cooperative)
#   TE_SEQ_PINGPONG_MAX_K=K    the longest mainloop (K) of a varlen-M GEMM, plain or GLU FC1,
#                              that runs ping-pong by default (default PINGPONG_MAX_K)
#   TE_SEQ_WGRAD_CLUSTER=MxN   the cluster of the fresh ping-pong wgrads, 1x2 or 2x1
#                              (default: `wgrad_pingpong_cluster`'s rule)
#   TE_SEQ_PINGPONG_TILE_N=W   the width of the plain ping-pong tiles, 128 or 192 (default:
#                              `pingpong_tile_n`'s rule)
#   TE_SEQ_GLU_FC1_TILE_N=W    the width of the GLU FC1's ping-pong tiles, 128 or 192 (W / 2
#                              gate and W / 2 up columns; default 128: glu.py)
#   TE_SEQ_WGRAD_EPI_COLS=C    the epilogue subtiles' columns of the ping-pong wgrads writing
#                              a fresh 16-bit output, 32 or 64 (default: `wgrad_epi_cols`'s rule)
#   TE_SEQ_GLU_FC1_EPI_COLS=C  the epilogue subtiles' columns of the 16-bit GLU FC1 in
#                              ping-pong, 32 or 64 (default GLU_FC1_EPI_COLS)
#   TE_SEQ_MM_EPI_COLS=C       the epilogue subtiles' columns of the plain ping-pong varlen-M
#                              GEMMs (16-bit and FP8 row-wise) writing 16-bit outputs, 32 or 64
#                              (default MM_EPI_COLS)
#   TE_SEQ_WGRAD_SCHEDULE=S    how the 16-bit wgrads hand out their work units: "dynamic"
#                              (longest group first, as clusters free up) or "static" (a
#                              fixed stride); default WGRAD_SCHEDULE
#   TE_SEQ_MM_CLUSTER=MxN      the cluster of the ping-pong varlen-M GEMMs, plain and GLU FC1,
#                              1x2 or 2x1 (default MM_PINGPONG_CLUSTER, 2x1)
#   TE_SEQ_COOP_CLUSTER=MxN    the cluster of the cooperative varlen-M GEMMs on rows not
#                              gathered (long mainloops, the 16-bit GLU dgrad, the non-gated
#                              steps), 1x2 or 2x1 (default COOP_CLUSTER, 1x2)
#   TE_SEQ_GLU_DGRAD_PINGPONG=0|1  whether the 16-bit GLU dgrad with a short mainloop runs
#                              ping-pong, 128 wide, in `mm_pingpong_cluster()` (default
#                              GLU_DGRAD_PINGPONG, on)
#   TE_SEQ_GLU_DGRAD_EPI_ROWS=R  its epilogue subtiles' rows, 128 or 64 (default
#                              GLU_DGRAD_EPI_ROWS)
#   TE_SEQ_HALF_TILES=0|1      whether a ping-pong varlen-M tile with <= 64 rows of its group
#                              runs one 64-row WGMMA atom (default HALF_TILES)
#   TE_SEQ_FC1_KEEP_H=0|1      whether a GLU FC1 asked not to write h (a forward without
#                              backward) writes it all the same (default 0: it skips h)
# They exist to compare tilings inside one process (bench_grouped_mlp.py --env-variant). Read
# once, not per call: four environment lookups cost ~3 µs of host time per launch.
TILING_ENV = ("TE_SEQ_PINGPONG", "TE_SEQ_PINGPONG_MAX_K", "TE_SEQ_WGRAD_CLUSTER",
              "TE_SEQ_PINGPONG_TILE_N", "TE_SEQ_GLU_FC1_TILE_N", "TE_SEQ_WGRAD_SCHEDULE",
              "TE_SEQ_MM_CLUSTER", "TE_SEQ_HALF_TILES", "TE_SEQ_FC1_KEEP_H",
              "TE_SEQ_COOP_CLUSTER", "TE_SEQ_GLU_DGRAD_PINGPONG", "TE_SEQ_GLU_DGRAD_EPI_ROWS",
              "TE_SEQ_GLU_DGRAD_H_PREFETCH", "TE_SEQ_WGRAD_EPI_COLS",
              "TE_SEQ_MM_EPI_COLS", "TE_SEQ_GLU_FC1_EPI_COLS")
_SETTINGS: list = [(), {}]  # [the values in TILING_ENV order, {name: value}]


def refresh_tiling_settings() -> tuple[str | None, ...]:
    """Read ``TILING_ENV`` from the environment again; the default tilings of later calls
    follow the values read. Returns them (None where unset)."""
    values = tuple(os.environ.get(name) for name in TILING_ENV)
    _SETTINGS[:] = [values, dict(zip(TILING_ENV, values))]
    return values


def tiling_settings() -> tuple[str | None, ...]:
    """The values of ``TILING_ENV`` read last (None where unset): everything the default
    tilings depend on besides the call's shapes, for the plan signatures of default-tiled
    calls."""
    return _SETTINGS[0]


def _setting(name: str) -> str | None:
    return _SETTINGS[1][name]


def _chosen(name: str, choices: dict):
    """What the setting ``name`` selects from ``choices`` (by its text); None where unset; a
    ValueError naming the variable, its allowed values and the value it holds otherwise."""
    raw = _setting(name)
    if raw is None:
        return None
    if raw.strip() not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {raw!r}")
    return choices[raw.strip()]


_WIDTHS = {"128": 128, "192": 192}


refresh_tiling_settings()


def pingpong_tile_n(n: int, cluster_n: int = 2) -> int:
    """``TE_SEQ_PINGPONG_TILE_N`` where set; else 192 (measured 4 % faster than 128 on B's
    FC2) unless its cluster units compute over 5 % more columns than 128's: N = 2048 takes 128
    (192 would compute 2304 columns)."""
    chosen = _chosen("TE_SEQ_PINGPONG_TILE_N", _WIDTHS)
    if chosen is not None:
        return chosen

    def cols(t: int) -> int:
        return -(-n // (t * cluster_n)) * t * cluster_n

    return 192 if cols(192) <= 1.05 * cols(128) else 128


# The ping-pong wgrads' cluster by the mean rows per group (the host knows M and E, not the
# split): 2x1 up to WGRAD_2X1_MAX_ROWS_PER_GROUP, else 1x2. In the MLP on one H200 (the same
# module under each setting, shuffled order, measured/h200_2026-11-25g_mlp_*_final.txt and
# ..._mlp_qz_tiles.txt), fwd+bwd with 2x1 against 1x2: Q (256 rows per expert) 1.782 vs 1.802
# ms and 1.813 vs 1.845; Z (Zipf, 256 on average) 2.127 vs 2.179 and 2.144 vs 2.191; B (512)
# 8.528 vs 8.521; A (4096) 57.025 vs 55.464. (Alone, on random data: Q 496 vs 468 TFLOP/s, Z
# 465 vs 389, B 608 vs 632, measured/h200_2026-11-25g_gemm_tilings.txt.)
WGRAD_2X1_MAX_ROWS_PER_GROUP = 512
_CLUSTERS = {"1x2": (1, 2), "2x1": (2, 1)}


def glu_fc1_pingpong_tile_n(default: int) -> int:
    """The GLU FC1's ping-pong tile width: ``TE_SEQ_GLU_FC1_TILE_N`` or ``default``."""
    return _chosen("TE_SEQ_GLU_FC1_TILE_N", _WIDTHS) or default


def pingpong_by_default() -> bool:
    """Whether the defaults below may choose ping-pong tilings: yes (the measurement above),
    unless ``TE_SEQ_PINGPONG=0``."""
    return (_setting("TE_SEQ_PINGPONG") or "1").strip() != "0"


def pingpong_max_k() -> int:
    """The longest K that runs ping-pong by default: ``TE_SEQ_PINGPONG_MAX_K`` or
    ``PINGPONG_MAX_K``."""
    raw = _setting("TE_SEQ_PINGPONG_MAX_K")
    if raw is None:
        return PINGPONG_MAX_K
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"TE_SEQ_PINGPONG_MAX_K must be an integer, got {raw!r}") from None


def wgrad_pingpong_cluster(rows_per_group: float) -> tuple[int, int]:
    """The ping-pong wgrads' cluster: ``TE_SEQ_WGRAD_CLUSTER``, else 2x1 for groups of up to
    ``WGRAD_2X1_MAX_ROWS_PER_GROUP`` rows on average, 1x2 for longer ones."""
    chosen = _chosen("TE_SEQ_WGRAD_CLUSTER", _CLUSTERS)
    if chosen is not None:
        return chosen
    return (2, 1) if rows_per_group <= WGRAD_2X1_MAX_ROWS_PER_GROUP else (1, 2)


# The ping-pong varlen-M GEMMs' cluster: 2x1 (two m-tiles of one group share B; an expert's
# last tile of <= 128 rows runs over two n-tiles instead: tile_scheduler.py's split tails).
# Sustained fwd+bwd on one H200 (2026-11-30, run "p", probe_clocks.py, SwiGLU unless said),
# ms per step against 1x2: Q 1.920 vs 1.954 (-1.8 %), J 2.180 vs 2.201 (-1.0 %), Z 2.221 vs
# 2.222 (level), B 8.387 vs 8.505 (-1.4 %), Q ScaledSwiGLU 1.890 vs 1.929 (-2.0 %), Z
# ScaledSwiGLU 2.192 vs 2.200; before split tails 2x1 lost 6.7 % on J and 10.6 % on Z
# (kernel README, sections 23-24).
MM_PINGPONG_CLUSTER = (2, 1)


def mm_pingpong_cluster() -> tuple[int, int]:
    """The ping-pong varlen-M GEMMs' cluster (plain and GLU FC1, the FP8 row-wise dgrad):
    ``TE_SEQ_MM_CLUSTER``, else ``MM_PINGPONG_CLUSTER``."""
    return _chosen("TE_SEQ_MM_CLUSTER", _CLUSTERS) or MM_PINGPONG_CLUSTER


# The cooperative varlen-M GEMMs' cluster on rows not gathered (gathered rows are never
# multicast: GATHER_CLUSTER). 1x2 measured best with whole 256-row 2x1 units (MM_TILING's
# note). With split tails, sustained fwd+bwd on one H200 (2026-11-30, run "q",
# probe_clocks.py, two rounds, ms per step, 2x1 vs 1x2): A (long mainloops: FC2, FC1 dgrad,
# GLU dgrad) 54.53 / 54.45 vs 54.48 / 54.60, B 8.395 / 8.389 vs 8.406 / 8.418, Q 1.908 /
# 1.906 vs 1.920 / 1.938, J and Z level (the cooperative 16-bit GLU dgrad then); with the
# ping-pong GLU dgrad A 54.11 / 54.18 vs 54.19 / 54.27. Within the rounds' spread: 1x2 stays.
COOP_CLUSTER = (1, 2)


def coop_cluster() -> tuple[int, int]:
    """The cooperative varlen-M GEMMs' cluster (plain past ``pingpong_max_k()``, the 16-bit
    GLU FC1 past it and the 16-bit GLU dgrad, the non-gated steps): ``TE_SEQ_COOP_CLUSTER``,
    else ``COOP_CLUSTER``."""
    return _chosen("TE_SEQ_COOP_CLUSTER", _CLUSTERS) or COOP_CLUSTER


def coop_tiling(n: int) -> Tiling:
    """The cooperative varlen-M tiling of ``n`` columns: ``coop_cluster()``, its tile width
    fitted to ``n`` (``tile_n_for``)."""
    cluster = coop_cluster()
    return Tiling(tile_n_for(n, cluster[1]), cluster)


# Half tiles: an expert's last tile with at most 64 of its rows runs its first 64-row WGMMA
# atom only (ping-pong varlen M: the plain GEMM and the GLU FC1; mainloop._pingpong_mainloop).
# Off by default: in the MLP on one H200 (2026-11-28, bench_grouped_mlp.py --env-variant,
# measured/h200_2026-11-28f_mlp_half_tiles.txt) it ran Zipf-skewed Z's forward 4 % faster
# (0.648 vs 0.677 ms) but near-uniform J's 5 % slower (0.703 vs 0.669 ms; each of J's
# ~60 experts over 256 rows ends in a tile of 1-26 rows), fwd+bwd level on both; why J
# loses is not established (kernel README, section 11).
HALF_TILES = False
_SWITCH = {"0": False, "1": True}


def half_tiles(tiling: Tiling) -> bool:
    """Whether a varlen-M launch at ``tiling`` runs half tiles: ping-pong tilings only, unless
    ``TE_SEQ_HALF_TILES=0`` (default ``HALF_TILES``)."""
    chosen = _chosen("TE_SEQ_HALF_TILES", _SWITCH)
    return tiling.pingpong and (HALF_TILES if chosen is None else chosen)


# The 16-bit GLU dgrad (FC2's dgrad with the activation's backward) with a short mainloop runs
# ping-pong, 128 wide, in the ping-pong cluster (2x1, split tails). Sustained fwd+bwd on one
# H200 (2026-11-30, run "q", probe_clocks.py, SwiGLU, two rounds, ms per step) against the
# cooperative dgrad (1x2): Q 1.907 / 1.913 vs 1.920 / 1.938, J 2.160 / 2.163 vs 2.179 / 2.202,
# Z 2.211 / 2.204 vs 2.225 / 2.223, B 8.368 / 8.386 vs 8.406 / 8.418, A 54.19 / 54.27 vs
# 54.48 / 54.60 (0.3-1.3 %; 1.5-2 % fewer cycles). In 1x2 clusters with whole units it had
# lost on Q (kernel README, sections 22 and 25).
GLU_DGRAD_PINGPONG = True


def glu_dgrad_pingpong() -> bool:
    """Whether the 16-bit GLU dgrad with a short mainloop runs ping-pong by default:
    ``TE_SEQ_GLU_DGRAD_PINGPONG``, else ``GLU_DGRAD_PINGPONG``."""
    chosen = _chosen("TE_SEQ_GLU_DGRAD_PINGPONG", _SWITCH)
    return GLU_DGRAD_PINGPONG if chosen is None else chosen


# The ping-pong 16-bit GLU dgrad's epilogue subtiles: 128 rows (ptxas spills 20-36 B per
# thread) or 64 (no spills; alone on an H100 level with cooperative: kernel README, "Ping-pong
# consumers").
GLU_DGRAD_EPI_ROWS = 128
_EPI_ROWS = {"128": 128, "64": 64}


def glu_dgrad_epi_rows() -> int:
    """The rows of the ping-pong 16-bit GLU dgrad's epilogue subtiles:
    ``TE_SEQ_GLU_DGRAD_EPI_ROWS``, else ``GLU_DGRAD_EPI_ROWS``."""
    return _chosen("TE_SEQ_GLU_DGRAD_EPI_ROWS", _EPI_ROWS) or GLU_DGRAD_EPI_ROWS


_H_PREFETCH = {"1": 1, "2": 2, "4": 4}


def epilogue_subtiles(tile_n: int, epi_rows: int) -> int:
    """Epilogue subtiles of one 128-row tile ``tile_n`` wide: 32 columns each, in row blocks
    of ``epi_rows`` (the GLU dgrad's h loads come in as many)."""
    return tile_n // 32 * (128 // epi_rows)


def glu_dgrad_h_prefetch_setting() -> int | None:
    """``TE_SEQ_GLU_DGRAD_H_PREFETCH`` (1, 2 or 4: the GLU dgrad's h subtile pairs loaded
    ahead, where it divides the tile's subtiles), None where unset (``glu._dgrad_h_prefetch``
    decides)."""
    return _chosen("TE_SEQ_GLU_DGRAD_H_PREFETCH", _H_PREFETCH)


def fc1_writes_h(wanted: bool) -> bool:
    """Whether a GLU FC1 launch writes h: where it is ``wanted`` (a backward reads it), and
    where it is not only with ``TE_SEQ_FC1_KEEP_H=1`` (to compare both in one process)."""
    return wanted or bool(_chosen("TE_SEQ_FC1_KEEP_H", _SWITCH))


def plain_mm_tiling(n: int, k: int, out_bits: int = 16) -> Tiling:
    """The default tiling of the plain varlen-M grouped GEMM (no bias, no routed rows) of N =
    ``n`` columns and K = ``k`` writing ``out_bits``: with ``pingpong_by_default()``,
    ping-pong for short mainloops (K <= ``pingpong_max_k()``) in ``mm_pingpong_cluster()``
    (``mm_epi_cols()``' subtiles for a 16-bit output); else cooperative (``coop_tiling``)."""
    if not pingpong_by_default() or k > pingpong_max_k():
        return coop_tiling(n)
    cluster = mm_pingpong_cluster()
    cols = mm_epi_cols() if out_bits == 16 else 32
    return Tiling(pingpong_tile_n(n, cluster[1]), cluster, True, epi_cols=cols)


# The plain ping-pong varlen-M GEMMs' epilogue subtile columns (Tiling.epi_cols).
MM_EPI_COLS = 32


def mm_epi_cols() -> int:
    """``TE_SEQ_MM_EPI_COLS``, else ``MM_EPI_COLS``."""
    return _chosen("TE_SEQ_MM_EPI_COLS", _EPI_COLS) or MM_EPI_COLS


# The 16-bit GLU FC1's epilogue subtile columns in ping-pong (Tiling.epi_cols): 64 stages a
# tile's gate and up halves of h and its a in 3 TMA stores per 128-wide tile instead of 6.
# Measured on one H200 (2026-12-01, run "12-01a", the FC1 alone, same bits): level with 32 on
# Q, J, B and A with h (+0.2 / -0.4 / +0.2 / 0.0 %), without h +0.5 / -0.4 / +3.9 / -1.0 %
# (kernel README, section 32), so 32 stays the default.
GLU_FC1_EPI_COLS = 32


def glu_fc1_epi_cols() -> int:
    """``TE_SEQ_GLU_FC1_EPI_COLS``, else ``GLU_FC1_EPI_COLS``."""
    return _chosen("TE_SEQ_GLU_FC1_EPI_COLS", _EPI_COLS) or GLU_FC1_EPI_COLS


# Measured on one H100 (2026-11-25, bench_grouped_gemm.py, bursts of 10 calls,
# measured/h100_2026-11-25c_gemm_pp_wgrad.json): FC1's wgrad (256 tokens per expert) in
# ping-pong against cooperative 256 wide, TFLOP/s: Q 457 vs 415 (128 wide), B 553 vs 532 (192),
# but Zipf-skewed Z 338 vs 373 alone; the whole MLP gained on all three (above), so it follows
# the same default.
def wgrad_tiling(n: int, accumulate: bool, rows_per_group: float = 0,
                 out_bits: int = 16) -> Tiling:
    """The default tiling of the varlen-K grouped GEMM writing ``n`` output columns of
    ``out_bits``, its groups ``rows_per_group`` long on average: with
    ``pingpong_by_default()``, ping-pong in ``wgrad_pingpong_cluster`` when writing fresh
    (``wgrad_epi_cols``' subtiles for a 16-bit output), ``ACCUMULATE_TILING`` when adding into
    the output over groups of up to ``ACCUMULATE_PINGPONG_MAX_ROWS`` rows; else cooperative
    ``WGRAD_TILING`` fitted to ``n``. Its units are dynamic where ``wgrad_dynamic()``."""
    dynamic = wgrad_dynamic()
    if not pingpong_by_default() or (accumulate and rows_per_group > ACCUMULATE_PINGPONG_MAX_ROWS):
        return replace(default_tiling(n, WGRAD_TILING), dynamic=dynamic)
    if accumulate:
        return replace(ACCUMULATE_TILING, dynamic=dynamic)
    cluster = wgrad_pingpong_cluster(rows_per_group)
    cols = wgrad_epi_cols(rows_per_group) if out_bits == 16 else 32
    return Tiling(pingpong_tile_n(n, cluster[1]), cluster, True, dynamic=dynamic, epi_cols=cols)


# The fresh ping-pong wgrads' epilogue subtiles: 64 columns for groups of up to
# WGRAD_EPI64_MAX_ROWS rows on average (or padded FP8 spans), else 32. Short groups leave the
# other warpgroup's main loop too short to hide a tile's epilogue, and 64 halves its TMA
# stores, fences and barrier pairs. Measured on one H200 (2026-11-30, run "za",
# probe_wgrad_epilogue.py --variants none,cols=64+ring=2 --seconds 1, two rounds, ms / M
# cycles, both at the 700 W cap; measured/h200_2026-11-30za_wgrad_epi_cols.txt): Q (256 rows
# per group) FC1 bf16 0.439 vs 0.453-0.455 / 0.665 vs 0.673-0.683, FP8 0.344 vs 0.363-0.365 /
# 0.568 vs 0.610-0.618; FC2 bf16 0.225 vs 0.230, FP8 0.176 vs 0.184; B (512 rows) FC1 bf16
# 1.889-1.892 vs 1.863-1.870 / 2.75 vs 2.66 (lost), FP8 1.293-1.296 vs 1.315-1.316, FC2 bf16
# 0.998-1.000 vs 0.982-0.983, FP8 0.709-0.710 vs 0.699-0.702. Same bits either way.
WGRAD_EPI64_MAX_ROWS = 384
_EPI_COLS = {"32": 32, "64": 64}


def wgrad_epi_cols(rows_per_group: float) -> int:
    """The fresh 16-bit ping-pong wgrads' epilogue columns: ``TE_SEQ_WGRAD_EPI_COLS``, else 64
    for groups of up to ``WGRAD_EPI64_MAX_ROWS`` rows on average, 32 for longer ones."""
    chosen = _chosen("TE_SEQ_WGRAD_EPI_COLS", _EPI_COLS)
    if chosen is not None:
        return chosen
    return 64 if rows_per_group <= WGRAD_EPI64_MAX_ROWS else 32


# The varlen-K accumulate (fp32 main_grad += wgrad) over short groups, memory-bound: ping-pong,
# 128 wide, one warpgroup's old-C loads and stores overlapping the other's mainloop, no cluster.
# Measured on one H200 (2026-11-29, benchmarks/probe_pingpong_accumulate.py --speed, dynamic
# units, two runs, ms; ping-pong 1x1 / 1x2 / cooperative 256): Q FC1 0.909-0.924 / 0.904-0.917
# / 1.014-1.025, FC2 0.482-0.493 / 0.479-0.489 / 0.611-0.612; Z FC1 1.019-1.038 / 1.021-1.039
# / 1.062-1.077, FC2 0.541-0.551 / 0.538-0.546 / 0.643-0.653; B FC1 2.973-2.979 / 3.067-3.089 /
# 3.778-3.828, FC2 1.461-1.476 / 1.541-1.560 / 1.944-1.960 (192 wide and 2x1 slower). Over
# long groups the accumulate is compute-bound (a 128 x 128 tile's old C is 128 KB read and
# written, its MMA 2 * 128 * 128 * rows flops: level with an H200's ~183 flops per byte of
# copy bandwidth at ~730 rows) and the cooperative 256-wide tile wins: A (4096 rows per group)
# FC1 12.81 ms cooperative against 14.42 ping-pong 1x2 and 17.37 1x1, FC2 6.42 / 6.58 / 6.62.
ACCUMULATE_TILING = Tiling(128, (1, 1), True)
ACCUMULATE_PINGPONG_MAX_ROWS = 512


# The 16-bit wgrads' work units: "dynamic" (tile_scheduler.py) or "static".
WGRAD_SCHEDULE = "dynamic"
_SCHEDULES = {"dynamic": True, "static": False}


def wgrad_dynamic() -> bool:
    """Whether the default wgrad tilings hand out units dynamically: ``TE_SEQ_WGRAD_SCHEDULE``
    or ``WGRAD_SCHEDULE``."""
    chosen = _chosen("TE_SEQ_WGRAD_SCHEDULE", _SCHEDULES)
    return _SCHEDULES[WGRAD_SCHEDULE] if chosen is None else chosen


@functools.lru_cache(maxsize=None)
def available() -> tuple[bool, str]:
    """(True, "") when a CUDA device of capability >= 9.0 and the CuTe DSL (with TVM-FFI) import."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return False, f"needs compute capability >= 9.0, found {major}.{minor}"
    for module, package in (("cutlass.cute", "nvidia-cutlass-dsl"), ("tvm_ffi", "apache-tvm-ffi")):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return False, f"{package} is not importable ({exc}); pip install 'te_seq[cute]'"
    return True, ""


def _row_ok(n: int, dtype: torch.dtype) -> bool:
    """TMA needs every non-unit stride 16-byte aligned."""
    return (n * dtype.itemsize) % 16 == 0


@functools.lru_cache(maxsize=None)
def _num_sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def aligned_16(t: Tensor, copy: bool = False) -> Tensor:
    """``t`` as a TMA kernel reads it: contiguous where ``copy`` (its launch plan says the
    layout needs it), then copied where its data does not start on a 16-byte boundary (the
    address is per call, so it is checked on every call)."""
    if copy:
        t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _row_major(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 and t.stride(0) == t.shape[1] else t.contiguous()


def b_layout(b: Tensor) -> tuple[str, bool]:
    """(b's major, whether it must be copied first) for b [E, K, N]: "k" when K is contiguous
    with 16-byte aligned strides, else "n", copied to contiguous unless N-major and aligned."""
    el = 8  # 16 bytes of bf16/fp16
    if b.stride(1) == 1 and b.stride(2) % el == 0 and b.stride(0) % el == 0:
        return "k", False
    return "n", bool(b.stride(2) != 1 or b.stride(1) % el or b.stride(0) % el)


def b_view(b: Tensor, copy: bool) -> Tensor:
    """b [E, K, N] (a contiguous copy of it when ``copy``) as the kernel's (N, K, E) view."""
    return (b.contiguous() if copy else b).permute(2, 1, 0)


def _b_view(b: Tensor) -> tuple[Tensor, str]:
    """b [E, K, N] as the kernel's (N, K, E) view and its major ("k": K contiguous, else "n")."""
    major, copy = b_layout(b)
    return b_view(b, copy), major


def _check_offs(offs: Tensor, groups: int, device: torch.device) -> Tensor:
    if offs.dim() != 1 or offs.shape[0] != groups:
        raise ValueError(f"offs must be 1-D of length {groups}, got shape {tuple(offs.shape)}")
    if offs.device != device:
        raise ValueError(f"offs must be on {device}, got {offs.device}")
    return (
        offs
        if offs.dtype == torch.int32 and offs.is_contiguous()
        else offs.to(torch.int32).contiguous()
    )


# ---------------------------------------------------------------- the persistent grid


def _persistent(units: int, cluster_mn: tuple[int, int], sms: int) -> int:
    """Clusters to launch: one per work unit, at most as many as fit on ``sms`` SMs at once."""
    cm, cn = cluster_mn
    return max(1, min(units, sms // (cm * cn)))


def varlen_m_clusters(
    rows: int, groups: int, n: int, tile_n: int, cluster_mn: tuple[int, int], sms: int
) -> int:
    """Clusters for a varlen-M launch (``grouped_mm``, the GLU steps) of M = ``rows`` rows in
    E = ``groups`` groups and ``n`` output columns.

    The grid comes from M and E only: no group (nor the virtual one past ``offs[-1]``) has more
    m-units than its rows allow, so there are at most (M + (E + 1)(block_m - 1)) / block_m
    m-units per n-unit, block_m = 128 · cluster_m; an n-unit is tile_n · cluster_n columns.
    """
    cm, cn = cluster_mn
    block_m = _TILE_M * cm
    units = (rows + (groups + 1) * (block_m - 1)) // block_m * -(-n // (tile_n * cn))
    return _persistent(units, cluster_mn, sms)


def varlen_k_clusters(
    groups: int, n: int, k: int, tile_n: int, cluster_mn: tuple[int, int], sms: int
) -> int:
    """Clusters for a varlen-K launch (``grouped_wgrad``): E = ``groups`` output blocks of
    [n, k], each ⌈n / (128 · cluster_m)⌉ · ⌈k / (tile_n · cluster_n)⌉ cluster units."""
    cm, cn = cluster_mn
    units = groups * -(-n // (_TILE_M * cm)) * -(-k // (tile_n * cn))
    return _persistent(units, cluster_mn, sms)


_BIAS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def bias_problem(bias: Tensor | None, groups: int, width: int, device: torch.device) -> str:
    """Why a per-expert bias cannot go into a GEMM epilogue ("" when it can, or without one):
    it must be [E, N] (E = ``groups``, N = ``width``) in bf16, fp16 or fp32 on ``device``."""
    if bias is None:
        return ""
    if bias.dtype not in _BIAS_DTYPES:
        return f"bias dtype {bias.dtype} unsupported (bf16, fp16 or fp32)"
    if tuple(bias.shape) != (groups, width):
        return f"bias must be [E, N] = [{groups}, {width}], got {tuple(bias.shape)}"
    if bias.device != device:
        return f"bias is on {bias.device}, the operands on {device}"
    return ""


def row_scales(scales: Tensor | None, rows: int, op: str) -> Tensor | None:
    """Per-row scales as the contiguous fp32 [rows] tensor the kernels read (None stays None)."""
    if scales is None:
        return None
    if scales.numel() != rows or not scales.is_floating_point():
        raise ValueError(
            f"cute {op}: bias_scales must hold one float per row ({rows}), "
            f"got {tuple(scales.shape)} {scales.dtype}"
        )
    return scales.reshape(rows).float().contiguous()


# ---------------------------------------------------------------- routed rows (routed.py)

GATHER_CLUSTER = (2, 1)  # A gathered per CTA (no multicast of A); B multicast to 2 m-tiles
_GATHER_K_TILE = 64  # the k-tile: gathered rows are copied in whole 64-column chunks


def route_problem(what: str, k: int) -> str:
    """Why rows cannot be routed inside the kernel ("" when they can): ``what`` is "gather"
    (A's rows by index; K = ``k`` must be a multiple of the 64-column k-tile) or "scatter"."""
    if what == "gather" and k % _GATHER_K_TILE:
        return f"gathered rows need K={k} to be a multiple of {_GATHER_K_TILE}"
    if what not in ("gather", "scatter"):
        return f"unknown route {what!r}"
    return ""


def route_rows(route: Tensor, rows: int | None, source_rows: int | None, op: str,
               what: str) -> Tensor:
    """``route`` as the contiguous int32 [M] tensor the kernel reads, checked: 1-D integer on
    the operands' device, with ``rows`` entries when given. ``source_rows`` (gather): the token
    rows it indexes, which must fit int32. Values are not read on the host (no sync)."""
    if route.dim() != 1 or route.is_floating_point() or route.dtype == torch.bool:
        raise ValueError(
            f"cute {op}: {what}_rows must be a 1-D integer tensor, got {route.dtype} "
            f"{tuple(route.shape)}"
        )
    if rows is not None and route.shape[0] != rows:
        raise ValueError(f"cute {op}: {what}_rows has {route.shape[0]} entries, expected {rows}")
    if source_rows is not None and source_rows >= 2**31:
        raise ValueError(f"cute {op}: {source_rows} token rows do not fit int32 indices")
    return route if route.dtype == torch.int32 and route.is_contiguous() else (
        route.to(torch.int32).contiguous())


def with_route(check: tuple[bool, str], what: str | None, k: int) -> tuple[bool, str]:
    """A kernel's ``supports`` answer ``check``, narrowed by ``route_problem(what, k)`` when its
    rows are routed (``what`` "gather" / "scatter"; None: not routed)."""
    ok, why = check
    if ok and what:
        why = route_problem(what, k)
        ok = not why
    return ok, why


def gathered_rows(x: Tensor, gather_rows: Tensor | None, op: str) -> tuple[int, Tensor | None]:
    """(M, the int32 index) of an FC1 call: x's rows, or the gathered rows' count and their
    checked index (x is then the [T, K] token matrix)."""
    if gather_rows is None:
        return x.shape[0], None
    return gather_rows.shape[0], route_rows(gather_rows, None, x.shape[0], op, "gather")


_NO_ROUTE: dict = {}


def no_route(device: torch.device) -> Tensor:
    """The int32 placeholder for the kernels' route argument when rows are not routed."""
    key = (device.type, device.index)
    if key not in _NO_ROUTE:
        _NO_ROUTE[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _NO_ROUTE[key]
