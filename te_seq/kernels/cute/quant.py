"""FP8 quantization on the CuTe DSL backend: ``quantize_rows`` (one scale per row) and
``quantize_spans`` (one scale per (group, column), token-major), ``quantize_rows_and_spans``
(both forms in the passes of the second), ``quantize_span_blocks`` (token-major, one scale per
(128-token block, column): ``Float8BlockScaling``'s wgrad operands), with ``quant_problem``.
Kernels: ``quant_kernels``, ``span_kernels`` and ``block_span_kernels``; the numbers are
``fp8_reference``'s bit for bit (E4M3 or E5M2, margin 0, with or without power-of-two scales).

Each call is one or two kernel launches (~10 µs of host time) in place of a compiled torch
region or a dozen eager kernels, and reads no sizes on the host: sync-free and CUDA-graph
capturable. Imports no cutlass until a kernel is first compiled.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fp8 import A_DTYPES, FP8_DTYPE, _aligned, _device_problem
from .launch import _row_major, available
from .launch_plan import LaunchPlan, PlanCache

SPAN_BLOCK = 128  # tokens per padded block (fp8_wgrad.WGRAD_PAD)
_IN_DTYPES = (torch.bfloat16, torch.float16)
_BLOCK_IN_DTYPES = (*_IN_DTYPES, torch.float32)  # quantize_span_blocks reads fp32 too


def quant_problem(t: Tensor, fp8_dtype: torch.dtype, margin: int, fp32: bool = False) -> str:
    """Why the cute quantization kernels cannot quantize t [R, C] into `fp8_dtype` with scale
    margin `margin` ("" when they can): a 2-D bf16/fp16 CUDA tensor (`fp32`: or fp32, which
    `quantize_span_blocks` takes) on an sm_90 GPU, C a multiple of 16, E4M3 or E5M2, margin
    0, the CuTe DSL installed."""
    if t.dim() != 2 or t.dtype not in (_BLOCK_IN_DTYPES if fp32 else _IN_DTYPES):
        names = "bf16/fp16/fp32" if fp32 else "bf16/fp16"
        return f"needs a 2-D {names} tensor, got {t.dtype} {tuple(t.shape)}"
    if t.shape[1] % 16:
        return f"needs C a multiple of 16, got C={t.shape[1]}"
    if fp8_dtype not in A_DTYPES or margin != 0:
        return (f"quantizes to float8_e4m3fn or float8_e5m2 with margin 0, got {fp8_dtype}, "
                f"margin {margin}")
    why = _device_problem((t,))
    if why:
        return why
    ok, why = available()
    return "" if ok else why


_KERNELS = PlanCache()  # (kind, dtype, options) -> LaunchPlan(the compiled kernel, 0)


def _kernel(kind: str, t: Tensor, power_of_two: bool, rows: bool = False,
            fp8_dtype: torch.dtype = FP8_DTYPE):
    dtype = t.dtype if t.dtype in _BLOCK_IN_DTYPES else torch.bfloat16  # span_table: no data
    key = (kind, dtype, power_of_two, rows, fp8_dtype)
    plan = _KERNELS.get(key)
    if plan is None:  # the config built and looked up once per key (the import too)
        from .compile_quant import QuantConfig, compile_quant

        plan = _KERNELS.put(key, LaunchPlan(compile_quant(QuantConfig(*key)).fn, 0))
    return plan.kernel


def quantize_rows(t: Tensor, power_of_two: bool = False,
                  fp8_dtype: torch.dtype = FP8_DTYPE) -> tuple[Tensor, Tensor]:
    """t [R, C] quantized to `fp8_dtype` (E4M3 or E5M2) with one scale per row: (data [R, C],
    scale_inv fp32 [R, 1]), `fp8_reference.quantize(t, QuantBlock(1, None), ScaleRule(fmt, 0,
    power_of_two))`."""
    t = _aligned(_row_major(t))
    data = torch.empty(t.shape, dtype=fp8_dtype, device=t.device)
    scale_inv = torch.empty(t.shape[0], dtype=torch.float32, device=t.device)
    if t.numel():
        _kernel("rows", t, power_of_two, False, fp8_dtype)(t, data, scale_inv)
    return data, scale_inv[:, None]


def quantize_spans(t: Tensor, table: Tensor, groups: int, power_of_two: bool = False,
                   fp8_dtype: torch.dtype = FP8_DTYPE) -> tuple[Tensor, Tensor]:
    """t [T, C] quantized to `fp8_dtype` along the tokens of each group, token-major: (data [C, P],
    scale_inv fp32 [G, C]) as `fp8_wgrad.quantize_token_major` lays them out. `table` int32
    [P / 128, 4] describes each padded 128-token block: (its first row of t, its valid rows
    0..128, its group, 1 on a group's first block); blocks past the last span have group
    `groups` and no valid rows (their columns of data are zeros). Groups without tokens keep
    scale_inv 1 (scale 1, as an all-zero block)."""
    return _spans(t, table, groups, power_of_two, False, fp8_dtype)[:2]


def quantize_rows_and_spans(t: Tensor, table: Tensor, groups: int, power_of_two: bool = False,
                            fp8_dtype: torch.dtype = FP8_DTYPE
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`quantize_spans` and `quantize_rows` of t in the same two passes: (token-major data,
    its scale_inv, row-wise data [T, C], its scale_inv [T, 1]). Rows in no group (past the last
    group's end) are not quantized row-wise: their data and scale_inv are unspecified (the
    grouped GEMMs write zeros for those rows whatever they hold)."""
    return _spans(t, table, groups, power_of_two, True, fp8_dtype)


def quantize_span_blocks(t: Tensor, table: Tensor, power_of_two: bool = False,
                         fp8_dtype: torch.dtype = FP8_DTYPE) -> tuple[Tensor, Tensor]:
    """t [T, C] quantized to `fp8_dtype` along the tokens of each group in 1x128 blocks, one
    scale per (padded 128-token block, column), token-major: (data [C, P], scale_inv fp32
    [P / 128, C]) as `fp8_wgrad.quantize_token_major_blocks` lays them out; `table` as
    `quantize_spans` reads it. One launch, one pass over t (a block's scale is its own tile's
    maximum); blocks past the last span get zero data and scale_inv 1. No output is filled
    first: the kernel writes every element. t may be bf16, fp16 or fp32 (`quant_problem`
    with `fp32=True`)."""
    t = _aligned(_row_major(t))
    cols, blocks = t.shape[1], table.shape[0]
    data = torch.empty(cols, blocks * SPAN_BLOCK, dtype=fp8_dtype, device=t.device)
    scale_inv = torch.empty(blocks, cols, dtype=torch.float32, device=t.device)
    if blocks and cols:
        _kernel("span_block_cast", t, power_of_two, False, fp8_dtype)(
            t, table.contiguous(), data, scale_inv)
    return data, scale_inv


def span_table(offs: Tensor, blocks: int) -> tuple[Tensor, Tensor]:
    """The block table `quantize_spans` reads, made on the GPU in one launch from the group
    ends `offs` int32 [G]: (table int32 [blocks, 4], padded span ends int32 [G]); `blocks`
    (P / 128) bounds the padded spans (`fp8_wgrad.padded_width`)."""
    offs = offs.to(torch.int32).contiguous()
    table = torch.empty(blocks, 4, dtype=torch.int32, device=offs.device)
    padded_offs = torch.empty_like(offs)
    if blocks:
        _kernel("span_table", table, False)(offs, table, padded_offs)
    return table, padded_offs


def _spans(t: Tensor, table: Tensor, groups: int, power_of_two: bool, rows: bool,
           fp8_dtype: torch.dtype) -> tuple:
    """The span kernels' buffers and launches. No output needs a fill: the cast kernel writes
    every column of data and every group's scale_inv (1 for groups without tokens); with
    ``rows`` the row maxima (atomic max) are the one zeroed buffer."""
    t = _aligned(_row_major(t))
    (count, cols), blocks = t.shape, table.shape[0]
    device, width = t.device, blocks * SPAN_BLOCK
    data = torch.empty(cols, width, dtype=fp8_dtype, device=device)
    row_shape = (count if rows else 1, cols)  # one dummy row without the row-wise form
    row_data = torch.empty(row_shape, dtype=fp8_dtype, device=device)
    row_scale_inv = torch.empty(row_shape[0], dtype=torch.float32, device=device)
    if not (width and cols):  # no kernel: every group without tokens
        scale_inv = torch.ones(groups, cols, dtype=torch.float32, device=device)
        return data, scale_inv, row_data, row_scale_inv[:, None]
    scale_inv = torch.empty(groups, cols, dtype=torch.float32, device=device)
    alloc = torch.zeros if rows else torch.empty
    row_amax = alloc(row_shape[0], dtype=torch.float32, device=device)
    block_amax = torch.empty(blocks, cols, dtype=torch.float32, device=device)
    extents = torch.empty(max(groups, 1), 2, dtype=torch.int32, device=device)
    table = table.contiguous()
    _kernel("span_amax", t, power_of_two, rows, fp8_dtype)(t, table, block_amax, extents,
                                                          row_amax)
    _kernel("span_cast", t, power_of_two, rows, fp8_dtype)(
        t, table, block_amax, extents, data, scale_inv, row_amax, row_data, row_scale_inv)
    return data, scale_inv, row_data, row_scale_inv[:, None]


__all__ = ["quant_problem", "quantize_rows", "quantize_rows_and_spans", "quantize_span_blocks",
           "quantize_spans", "span_table"]
