"""Compiling the CuTe DSL FP8 quantization kernels (``quant_kernels``, ``span_kernels``): one
compile per static config, sizes symbolic, cached in memory and on disk as the GEMMs are
(``compile._compile``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from .compile import _DTYPES, CompiledGemm, _compile, _fake_scales


@dataclass(frozen=True)
class QuantConfig:
    """An FP8 quantization kernel's static config (sizes symbolic): ``quant_kernels``.

    kind "rows" (``RowQuantKernel``), "span_amax" or "span_cast" (``span_kernels``: the
    token-major pair, with ``rows``: the row-wise form too), "span_table" (their block table;
    in_dtype unused), "span_block_cast" (``block_span_kernels``: token-major with one scale
    per 128-token block; rows unused), "rows_group_amax" (``row_amax_kernels``: row-wise
    with each group's column maxima; rows unused), "strip_cast" (``strip_kernels``:
    token-major in one read of t, from the group ends; rows unused); in_dtype the input
    (16-bit; fp32 too for "span_block_cast"); power_of_two the rule's scale rounding."""

    kind: str
    in_dtype: torch.dtype
    power_of_two: bool = False
    rows: bool = False  # span kernels: the row-wise form too
    fp8: torch.dtype = torch.float8_e4m3fn  # or float8_e5m2 (gradients under "HYBRID")
    lane_vecs: int = 0  # "rows": 16-byte vectors a lane keeps in registers (0: two passes);
    # "rows_group_amax": 16-byte vectors per thread and row (0: the kernel's most, 8)
    rows_in_flight: int = 1  # "rows_group_amax": rows a thread loads before using any


def _fake_quant_args(cfg: QuantConfig) -> tuple:
    """Fake tensors: t [R, C] row-major (C a multiple of 16), the kind's outputs."""
    src = _DTYPES[cfg.in_dtype]
    fp8 = _DTYPES[cfg.fp8]
    cols = cute.sym_int32(divisibility=16)
    t = make_fake_compact_tensor(src, (cute.sym_int32(), cols), stride_order=(1, 0),
                                 assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    if cfg.kind == "rows":
        data = make_fake_compact_tensor(fp8, (t.shape[0], cols), stride_order=(1, 0),
                                        assumed_align=16)
        return t, data, _fake_scales(1), stream
    table = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int32(), 4), stride_order=(1, 0),
                                     assumed_align=16)
    block_amax = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int32(), cols),
                                          stride_order=(1, 0), assumed_align=16)
    if cfg.kind == "span_table":  # offs [G] -> table [NB, 4], padded ends [G]
        offs = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int32(),), assumed_align=4)
        return offs, table, make_fake_compact_tensor(cutlass.Int32, (cute.sym_int32(),),
                                                     assumed_align=4), stream
    if cfg.kind == "strip_cast":  # offs, padded_offs [G] -> data [C, P], scale_inv [G, C]
        ends = [make_fake_compact_tensor(cutlass.Int32, (cute.sym_int32(),), assumed_align=4)
                for _ in range(2)]
        data = make_fake_compact_tensor(fp8, (cols, cute.sym_int32(divisibility=128)),
                                        stride_order=(1, 0), assumed_align=16)
        return t, *ends, data, _fake_scales(2), stream
    row_amax = _fake_scales(1)
    extents = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int32(), 2),
                                       stride_order=(1, 0), assumed_align=8)
    if cfg.kind == "span_amax":  # block_amax [NB, C], extents [G, 2] int32
        return t, table, block_amax, extents, row_amax, stream
    width = cute.sym_int32(divisibility=128)
    data = make_fake_compact_tensor(fp8, (cols, width), stride_order=(1, 0), assumed_align=16)
    if cfg.kind == "span_block_cast":  # data [C, P], scale_inv [P / 128, C]
        return t, table, data, _fake_scales(2), stream
    row_data = make_fake_compact_tensor(fp8, (cute.sym_int32(), cols), stride_order=(1, 0),
                                        assumed_align=16)
    if cfg.kind == "rows_group_amax":  # row_data [T, C], scale_inv [T], group_amax [G, C]
        return t, table, row_data, _fake_scales(1), block_amax, cutlass.Int32(1), stream
    return t, table, block_amax, extents, data, _fake_scales(2), row_amax, row_data, \
        _fake_scales(1), stream


@functools.lru_cache(maxsize=None)
def compile_quant(cfg: QuantConfig) -> CompiledGemm:
    """An FP8 quantization kernel for ``cfg``: compiled once per config, cached in memory and
    on disk."""
    from . import quant_kernels as qk
    from . import row_amax_kernels, span_kernels
    from .block_span_kernels import SpanBlockCastKernel
    from .row_amax_kernels import RowGroupAmaxKernel
    from .strip_kernels import StripCastKernel

    kernels = {"span_amax": span_kernels.SpanAmaxKernel, "span_cast": span_kernels.SpanCastKernel,
               "span_block_cast": SpanBlockCastKernel}
    fp8_max, fp8 = float(torch.finfo(cfg.fp8).max), _DTYPES[cfg.fp8]
    if cfg.kind == "rows":
        kernel = qk.RowQuantKernel(fp8_max, cfg.power_of_two, fp8, cfg.lane_vecs)
    elif cfg.kind == "strip_cast":
        kernel = StripCastKernel(fp8_max, cfg.power_of_two, fp8)
    elif cfg.kind == "span_table":
        kernel = qk.SpanTableKernel()
    elif cfg.kind == "rows_group_amax":
        kernel = RowGroupAmaxKernel(fp8_max, cfg.power_of_two, fp8,
                                    cfg.lane_vecs or row_amax_kernels.MAX_VECS,
                                    cfg.rows_in_flight)
    else:
        kernel = kernels[cfg.kind](fp8_max, cfg.power_of_two, cfg.rows, fp8)
    return _compile("quant", cfg, kernel, _fake_quant_args(cfg))
