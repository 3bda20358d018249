"""Compiling the CuTe DSL grouped GEMM: one compile per static config, token dims symbolic.

Imports cutlass; only ``te_seq.kernels.cute``'s functionals import this module, lazily.
Set ``CUTE_DSL_ARCH=sm_90a`` before the first ``import cutlass`` to compile without a GPU.

Compiled kernels are cached in memory (per process) and on disk (``disk_cache``): a TVM-FFI
kernel is exported as an object file to ``$TE_SEQ_CACHE_DIR``, else
``$XDG_CACHE_HOME/te_seq/cute`` or ``~/.cache/te_seq/cute``, named by a sha256 of the config,
the nvidia-cutlass-dsl and apache-tvm-ffi versions, ``CUTE_DSL_ARCH``, the kernel sources and a
format version. A later process loads it (under 0.3 s) instead of compiling (2-8 s per config,
measured on CPU and on an H200). ``TE_SEQ_DISK_CACHE=0`` turns the disk cache off; a broken or
unwritable cache only warns and compiles. Without apache-tvm-ffi kernels compile uncached (one
warning per process).
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from dataclasses import dataclass, field

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from te_seq.kernels.activations import param_values

from . import disk_cache
from .grouped_gemm import GroupedGemmKernel

_DTYPES = {
    torch.bfloat16: cutlass.BFloat16,
    torch.float16: cutlass.Float16,
    torch.float32: cutlass.Float32,
    torch.float8_e4m3fn: cutlass.Float8E4M3FN,
    torch.float8_e5m2: cutlass.Float8E5M2,
}


@dataclass(frozen=True)
class GemmConfig:
    """Everything a compiled kernel is specialised on (no sizes: M, N, K, E are symbolic).

    varlen: "m" (grouped_mm) or "k" (grouped_wgrad). b_major: "k" or "n" (varlen "m" only).
    bias_dtype: the per-expert bias [E, N] (varlen "m" only; None: no bias, the plain kernel);
    bias_scales: the bias is scaled per row by an fp32 [M] tensor.
    scaled: the FP8 kernel (``scale_epilogue``): E4M3 operands, K-major B, the accumulators
    times fp32 scales [M] (rows) and [E, N] (expert columns) (varlen "m", no bias, no route);
    varlen "k": token-major (K-major) operands in zero-padded, k-tile aligned spans, scales
    [E, N] and [E, K], ``accumulate`` allowed.
    """

    varlen: str
    ab_dtype: torch.dtype
    c_dtype: torch.dtype
    b_major: str = "k"
    tile_n: int = 256
    cluster_mn: tuple[int, int] = (1, 2)
    accumulate: bool = False
    bias_dtype: torch.dtype | None = None
    bias_scales: bool = False
    route: str | None = None  # "gather" (A's rows) or "scatter" (C's rows) by index (routed.py)
    scaled: bool = False
    a_dtype: torch.dtype | None = None  # A's dtype where it is not ab_dtype (E5M2 gradients)
    pingpong: bool = False  # ping-pong MMA warpgroups (the plain kernel, accumulate allowed)
    dynamic: bool = False  # units handed out longest group first (the plain varlen-K kernel)
    # varlen M in ping-pong: a tile with <= 64 rows of its group runs one 64-row WGMMA atom
    half_tiles: bool = False
    # columns of an epilogue subtile: 32, or 64 in the plain and scaled kernels, fresh varlen
    # K or varlen M in ping-pong (``_wide_ok``)
    epi_cols: int = 32
    # the FP8 block-scaled kernel (``block_scaled``); out of the repr, so the other configs'
    # disk-cache keys stay as they were (its own kernels are cached under another name)
    block_scaled: bool = field(default=False, repr=False)
    # the FP8 block-scaled wgrad kernel (``block_wgrad``): out of the repr as well, cached
    # under its own name
    block_wgrad: bool = field(default=False, repr=False)


@dataclass
class CompiledGemm:
    """A compiled kernel, the seconds it took to get and where it came from.

    source: "compiled" (compile_s: the compile) or "disk" (compile_s: the load from the disk
    cache). Repeated calls in a process return the same object from the in-memory cache.
    """

    fn: object
    compile_s: float
    source: str = "compiled"


def _fake_args(cfg: GemmConfig) -> tuple:
    """Fake tensors in the kernel's views: sizes symbolic, inner dims 16-byte aligned."""
    ab = _DTYPES[cfg.ab_dtype]
    a_el = _DTYPES[cfg.a_dtype or cfg.ab_dtype]  # same width as ab (checked by the caller)
    c = _DTYPES[cfg.c_dtype]
    rows = cute.sym_int32()
    groups = cute.sym_int32()
    div = 16 * 8 // ab.width
    offs = make_fake_compact_tensor(cutlass.Int32, (groups,), assumed_align=4)
    if cfg.varlen == "m":
        k, n = cute.sym_int32(divisibility=div), cute.sym_int32(divisibility=div)
        a_rows = cute.sym_int32() if cfg.route == "gather" else rows  # gather: T token rows
        a = make_fake_compact_tensor(a_el, (a_rows, k), stride_order=(1, 0), assumed_align=16)
        s1, s2 = cute.sym_int64(divisibility=div), cute.sym_int64(divisibility=div)
        b_stride = (s1, 1, s2) if cfg.b_major == "k" else (1, s1, s2)
        b = make_fake_tensor(ab, (n, k, groups), stride=b_stride, assumed_align=16)
        out = make_fake_compact_tensor(c, (rows, n), stride_order=(1, 0), assumed_align=16)
    else:  # dY and X token-major (K-major: the FP8 wgrad's padded spans) or M-major
        n_out, k_in = cute.sym_int32(divisibility=div), cute.sym_int32(divisibility=div)
        order = (0, 1)
        if cfg.scaled:
            rows, order = cute.sym_int32(divisibility=div), (1, 0)
        a = make_fake_compact_tensor(a_el, (n_out, rows), stride_order=order, assumed_align=16)
        b = make_fake_compact_tensor(ab, (k_in, rows), stride_order=order, assumed_align=16)
        out = make_fake_compact_tensor(
            c, (n_out, k_in, groups), stride_order=(1, 0, 2), assumed_align=16
        )
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    route = _fake_route()
    if cfg.scaled:
        # own symbolic sizes (as the bias's): the kernel clamps its reads to them
        scale_a = _fake_scales(1 if cfg.varlen == "m" else 2)
        return a, b, out, offs, cutlass.Int32(1), scale_a, _fake_scales(2), route, stream
    if cfg.bias_dtype is None:
        return a, b, out, offs, cutlass.Int32(1), route, stream
    return a, b, out, offs, cutlass.Int32(1), *_fake_bias(cfg.bias_dtype), route, stream


def _fake_scales(rank: int):
    """Fake fp32 scales: [M] (rank 1), row-major [E, C] (rank 2) or [E, R, C] (rank 3, the
    block scales of ``block_scaled``), symbolic sizes."""
    shape = tuple(cute.sym_int32() for _ in range(rank))
    order = tuple(reversed(range(rank)))
    return make_fake_compact_tensor(cutlass.Float32, shape, stride_order=order, assumed_align=4)


def _fake_route():
    """A fake int32 [M] row index (gathered A or scattered C rows; a dummy when unused)."""
    return make_fake_compact_tensor(cutlass.Int32, (cute.sym_int32(),), assumed_align=4)


def _fake_bias(dtype: torch.dtype) -> tuple:
    """A fake bias [E, N] (row-major, element-aligned) and fp32 row scales [M]."""
    b = _DTYPES[dtype]
    bias = make_fake_compact_tensor(
        b, (cute.sym_int32(), cute.sym_int32()), stride_order=(1, 0), assumed_align=b.width // 8
    )
    scales = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int32(),), assumed_align=4)
    return bias, scales


def tvm_ffi_available() -> bool:
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def _warn_uncached() -> None:
    """Say once per process that kernels compile without the disk cache, and why."""
    if disk_cache.enabled():
        warnings.warn(
            "te_seq disk cache: apache-tvm-ffi is not installed, so CuTe DSL kernels compile "
            "in every process and are not cached on disk (pip install 'te_seq[cute]')",
            RuntimeWarning,
            stacklevel=3,
        )


@contextlib.contextmanager
def _unrolled_on_purpose():
    """Silence the DSL's warning on 64-iteration static loops: a 64-column epilogue
    subtile's per-value loops (``store_epilogue``) index the accumulators by compile-time
    values, so they unroll by design."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"This static loop has 64 iterations")
        yield


def _compile(name: str, cfg: object, kernel: object, fake_args: tuple) -> CompiledGemm:
    """Compile ``kernel`` for ``cfg`` through the disk cache (with TVM-FFI only: the path whose
    exported files were verified to load and run). Without apache-tvm-ffi it compiles uncached
    and warns once; the cute backend itself then reports itself unavailable (it launches
    through TVM-FFI), so this path serves compile-only checks."""
    if not tvm_ffi_available():
        _warn_uncached()
        start = time.perf_counter()
        with _unrolled_on_purpose():
            fn = cute.compile(kernel, *fake_args)
        return CompiledGemm(fn, time.perf_counter() - start)

    def build():
        with _unrolled_on_purpose():
            return cute.compile(kernel, *fake_args, options="--enable-tvm-ffi")

    return CompiledGemm(*disk_cache.load_or_compile(name, (cfg,), build))


@functools.lru_cache(maxsize=None)
def compile_gemm(cfg: GemmConfig) -> CompiledGemm:
    """The grouped GEMM for ``cfg``: compiled once per config, cached in memory and on disk."""
    if cfg.dynamic and (cfg.varlen != "k" or cfg.scaled or cfg.block_wgrad):
        raise ValueError(f"dynamic units are for the plain 16-bit varlen-K GEMM, got {cfg}")
    if cfg.epi_cols != 32 and not (cfg.epi_cols == 64 and _wide_ok(cfg)):
        raise ValueError(f"64-column epilogue subtiles are for the fresh varlen-K GEMMs and the "
                         f"ping-pong varlen-M ones (plain or scaled), other widths for none: "
                         f"{cfg}")
    if cfg.block_wgrad:  # first: it refuses block_scaled as well
        return _compile_block_wgrad(cfg)
    if cfg.block_scaled:
        return _compile_block_scaled(cfg)
    if cfg.scaled:
        return _compile_scaled(cfg)
    if cfg.bias_dtype is not None:
        from .bias_epilogue import BiasGemmKernel

        if cfg.varlen != "m" or cfg.accumulate:
            raise ValueError(f"a bias needs varlen 'm' without accumulate, got {cfg}")
        kernel = BiasGemmKernel((128, cfg.tile_n), cfg.cluster_mn, cfg.bias_scales, cfg.route)
        return _compile("gemm", cfg, kernel, _fake_args(cfg))
    kernel = GroupedGemmKernel(
        cfg.varlen, (128, cfg.tile_n), cfg.cluster_mn, accumulate=cfg.accumulate, route=cfg.route,
        pingpong=cfg.pingpong, trade_store_slot=True, dynamic_units=cfg.dynamic,
        half_tiles=cfg.half_tiles, epi_cols=cfg.epi_cols,
    )
    return _compile("gemm", cfg, kernel, _fake_args(cfg))


def _wide_ok(cfg: GemmConfig) -> bool:
    """Whether ``cfg``'s kernel takes 64-column epilogue subtiles: the plain and row-wise
    scaled kernels, fresh (varlen K) or in ping-pong without bias or routed rows (varlen M)."""
    if cfg.block_wgrad or cfg.block_scaled or cfg.accumulate:
        return False
    return cfg.varlen == "k" or (cfg.pingpong and cfg.route is None and cfg.bias_dtype is None)


def _compile_scaled(cfg: GemmConfig) -> CompiledGemm:
    """The FP8 grouped GEMM with row-wise dequantization scales (``scale_epilogue``)."""
    from .scale_epilogue import ScaledGemmKernel

    if (cfg.varlen == "m" and cfg.accumulate) or cfg.bias_dtype or cfg.route or cfg.b_major != "k":
        raise ValueError(f"scaled GEMMs take K-major B, no bias or route (varlen 'm': no "
                         f"accumulate): {cfg}")
    kernel = ScaledGemmKernel(cfg.varlen, (128, cfg.tile_n), cfg.cluster_mn, cfg.accumulate,
                              pingpong=cfg.pingpong, half_tiles=cfg.half_tiles,
                              epi_cols=cfg.epi_cols)
    return _compile("gemm", cfg, kernel, _fake_args(cfg))


def _compile_block_scaled(cfg: GemmConfig) -> CompiledGemm:
    """The FP8 block-scaled GEMM (``block_scaled``), cached on disk as "block_gemm" (the
    config's repr leaves ``block_scaled`` out): scales [M, KB] and [E, NB, KB] after offs."""
    from .block_scaled import BlockScaledGemmKernel, config_problem

    if config_problem(cfg):
        raise ValueError(config_problem(cfg))
    a, b, out, offs, clusters, route, stream = _fake_args(cfg)
    scales = (_fake_scales(2), _fake_scales(3))
    kernel = BlockScaledGemmKernel((128, cfg.tile_n), cfg.cluster_mn)
    return _compile("block_gemm", cfg, kernel, (a, b, out, offs, clusters, *scales, route, stream))


def _compile_block_wgrad(cfg: GemmConfig) -> CompiledGemm:
    """The FP8 block-scaled wgrad GEMM (``block_wgrad``), cached on disk as "block_wgrad":
    the row-wise FP8 wgrad's fake arguments (token-major operands, two rank-2 scale tensors:
    here [PB, N] and [PB, K])."""
    from dataclasses import replace

    from .block_wgrad import BlockWgradKernel, config_problem

    if config_problem(cfg):
        raise ValueError(config_problem(cfg))
    fake = _fake_args(replace(cfg, scaled=True, block_wgrad=False))
    kernel = BlockWgradKernel(cfg.cluster_mn, cfg.accumulate)
    return _compile("block_wgrad", cfg, kernel, fake)


# ---------------------------------------------------------------- fused GLU epilogues


@dataclass(frozen=True)
class GluConfig:
    """A fused GLU GEMM's static config (sizes symbolic): ``glu_epilogue.GluGemmKernel``.

    mode "fc1" (B = W1 as (2F, H, E)) or "dgrad" (B = W2 as (F, H, E)); probs_dtype None
    without router probs. scaled: the FP8 kernel (``scaled_glu.ScaledGluGemmKernel``): E4M3
    operands, K-major B (W1 [E, 2F, H] or W2ᵀ [E, F, H]), bf16 outputs, the accumulators times
    fp32 scales [M] (rows) and [E, N] (expert columns); no bias, no route.
    """

    mode: str
    ab_dtype: torch.dtype
    b_major: str
    act: str
    interleave: int | None
    probs_dtype: torch.dtype | None
    cluster_mn: tuple[int, int] = (1, 2)
    store_stages: int | None = None  # dgrad's smem store ring (None: the kernel's default)
    tile_n: int = 256  # CTA tile width (fc1: 256; dgrad: 256, 192 or 128)
    # the activation's float parameters, compile-time constants of the kernel; () is replaced
    # by the table's defaults, so the cache key always names the values compiled in
    params: tuple[float, ...] = ()
    bias_dtype: torch.dtype | None = None  # fc1's per-expert bias [E, 2F] (None: no bias)
    route: str | None = None  # "gather": fc1 reads x's rows by index (routed.py)
    scaled: bool = False  # FP8 operands with row-wise dequantization scales (scaled_glu.py)
    pingpong: bool = False  # one MMA warpgroup per tile (fc1: tile_n 128; dgrad: 128 or 192)
    h_prefetch: int = 1  # dgrad: h subtile pairs loaded ahead (1, 2 or 4; divides the subtiles)
    epi_rows: int = 128  # rows of an epilogue subtile (64: ping-pong only)
    half_tiles: bool = False  # ping-pong: a tile with <= 64 rows runs one 64-row WGMMA atom
    # the FP8 block-scaled GLU steps (``block_glu``): E4M3 operands, scales [M, HB] and
    # [E, NB, HB] promoted in the main loop; out of the repr (cached as "block_glu")
    block_scaled: bool = field(default=False, repr=False)
    store_h: bool = True  # fc1: False writes a only (no backward reads h)
    epi_cols: int = 32  # epilogue subtile columns: 64 for the 16-bit ping-pong FC1 only

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", param_values(self.act, self.params))


def _fake_glu_args(cfg: GluConfig) -> tuple:
    """Fake tensors: every tensor gets its own symbolic sizes (unused ones come as dummies)."""
    ab = _DTYPES[cfg.ab_dtype]
    out = cutlass.BFloat16 if ab.width == 8 else ab  # FP8 kernels write bf16
    div = 16 * 8 // ab.width
    rows, groups = cute.sym_int32(), cute.sym_int32()
    k, n = cute.sym_int32(divisibility=div), cute.sym_int32(divisibility=div)
    a = make_fake_compact_tensor(ab, (rows, k), stride_order=(1, 0), assumed_align=16)
    s1, s2 = cute.sym_int64(divisibility=div), cute.sym_int64(divisibility=div)
    b_stride = (s1, 1, s2) if cfg.b_major == "k" else (1, s1, s2)
    b = make_fake_tensor(ab, (n, k, groups), stride=b_stride, assumed_align=16)

    def matrix():
        r, w = cute.sym_int32(), cute.sym_int32(divisibility=16 * 8 // out.width)
        return make_fake_compact_tensor(out, (r, w), stride_order=(1, 0), assumed_align=16)

    c, act_out, h_in = matrix(), matrix(), matrix()
    offs = make_fake_compact_tensor(cutlass.Int32, (groups,), assumed_align=4)
    p_dtype = _DTYPES[cfg.probs_dtype or torch.float32]
    probs = make_fake_compact_tensor(p_dtype, (cute.sym_int32(),), assumed_align=p_dtype.width // 8)
    dprobs = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int32(),), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    bias = _fake_bias(getattr(cfg, "bias_dtype", None) or torch.bfloat16)[0]  # ActConfig: none
    route = _fake_route()
    # the FP8 kernel's scales: own symbolic sizes (the kernel clamps its reads to them)
    scales = (_fake_scales(1), _fake_scales(2)) if getattr(cfg, "scaled", False) else ()
    if getattr(cfg, "block_scaled", False):  # 1x128 blocks of x, 128x128 blocks of W1
        scales = (_fake_scales(2), _fake_scales(3))
    return (a, b, c, offs, cutlass.Int32(1), act_out, probs, dprobs, h_in, bias, *scales, route,
            stream)


@functools.lru_cache(maxsize=None)
def compile_glu(cfg: GluConfig) -> CompiledGemm:
    """A fused GLU GEMM for ``cfg``: compiled once per config, cached in memory and on disk."""
    if cfg.block_scaled:
        return _compile_block_scaled_glu(cfg)
    if cfg.scaled:
        return _compile_scaled_glu(cfg)
    from .glu_epilogue import GluGemmKernel

    kernel = GluGemmKernel(
        cfg.mode,
        cfg.act,
        cfg.interleave,
        cfg.probs_dtype is not None,
        cfg.cluster_mn,
        cfg.store_stages,
        cfg.tile_n,
        cfg.params,
        cfg.bias_dtype is not None,
        cfg.route,
        cfg.pingpong,
        cfg.h_prefetch,
        cfg.epi_rows,
        cfg.half_tiles,
        cfg.store_h,
        epi_cols=cfg.epi_cols,
    )
    return _compile("glu", cfg, kernel, _fake_glu_args(cfg))


def _compile_block_scaled_glu(cfg: GluConfig) -> CompiledGemm:
    """The FP8 block-scaled GLU step (``block_glu``), cached on disk as "block_glu" (the
    config's repr leaves ``block_scaled`` out)."""
    from .block_glu import TILE_N, BlockScaledGluGemmKernel

    plain = (cfg.ab_dtype, cfg.b_major, cfg.tile_n, cfg.epi_rows, cfg.h_prefetch)
    extras = (cfg.scaled, cfg.bias_dtype, cfg.route, cfg.pingpong, cfg.half_tiles,
              not cfg.store_h)
    if plain != (torch.float8_e4m3fn, "k", TILE_N, 128, 1) or any(extras):
        raise ValueError(f"the block-scaled GLU kernel is a cooperative E4M3 fc1 or dgrad with "
                         f"K-major B, tile_n {TILE_N}, one h buffer pair, no bias, route or "
                         f"row-wise scales, h stored: {cfg}")
    kernel = BlockScaledGluGemmKernel(
        cfg.mode, cfg.act, cfg.interleave, cfg.probs_dtype is not None, cfg.cluster_mn,
        cfg.params,
    )
    return _compile("block_glu", cfg, kernel, _fake_glu_args(cfg))


def _compile_scaled_glu(cfg: GluConfig) -> CompiledGemm:
    """The FP8 GLU GEMM (``scaled_glu``): E4M3 operands, K-major B, no bias, no route."""
    from .scaled_glu import ScaledGluGemmKernel

    if cfg.ab_dtype != torch.float8_e4m3fn or cfg.b_major != "k" or cfg.bias_dtype or cfg.route:
        raise ValueError(f"scaled GLU GEMMs take E4M3 operands, K-major B, no bias or route: "
                         f"{cfg}")
    kernel = ScaledGluGemmKernel(
        cfg.mode, cfg.act, cfg.interleave, cfg.probs_dtype is not None, cfg.cluster_mn,
        cfg.store_stages, cfg.tile_n, cfg.params, pingpong=cfg.pingpong,
        epi_rows=cfg.epi_rows, half_tiles=cfg.half_tiles, store_h=cfg.store_h,
        h_prefetch=cfg.h_prefetch,
    )
    return _compile("glu", cfg, kernel, _fake_glu_args(cfg))


# ---------------------------------------------------------------- fused non-gated epilogues


@dataclass(frozen=True)
class ActConfig:
    """A fused non-gated activation GEMM's static config (sizes symbolic):
    ``act_epilogue.ActGemmKernel``. mode "fc1" (B = W1 as (F, H, E)) or "dgrad" (B = W2 as
    (F, H, E)); probs_dtype None without router probs. Its tensor arguments are the GLU
    kernel's (``_fake_glu_args``)."""

    mode: str
    ab_dtype: torch.dtype
    b_major: str
    act: str
    probs_dtype: torch.dtype | None
    cluster_mn: tuple[int, int] = (1, 2)
    store_stages: int | None = None  # dgrad's smem store ring (None: the kernel's default)
    tile_n: int = 256  # CTA tile width: 256, 192 or 128
    route: str | None = None  # "gather": fc1 reads x's rows by index (routed.py)


@functools.lru_cache(maxsize=None)
def compile_act(cfg: ActConfig) -> CompiledGemm:
    """A fused non-gated activation GEMM for ``cfg``: compiled once per config, cached in
    memory and on disk."""
    from .act_epilogue import ActGemmKernel

    kernel = ActGemmKernel(
        cfg.mode, cfg.act, cfg.probs_dtype is not None, cfg.cluster_mn, cfg.store_stages,
        cfg.tile_n, cfg.route,
    )
    return _compile("act", cfg, kernel, _fake_glu_args(cfg))
