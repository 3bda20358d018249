"""FP8 quantization on the CuTe DSL backend: ``quantize_rows`` (one scale per row) and
``quantize_spans`` (one scale per (group, column), token-major), ``quantize_rows_and_spans``
(both forms in the passes of the second), ``quantize_rows_and_group_amax`` with
``quantize_spans_from_group_amax`` (the same two forms from one read of t each: the row-wise
pass keeps each group's column maxima, the token-major cast reads them later),
``quantize_span_blocks`` (token-major, one scale per (128-token block, column):
``Float8BlockScaling``'s wgrad operands), ``quantize_spans_in_strips`` (``quantize_spans`` in
one read of t and one launch where the groups fit a 512-token strip, ``strips_fit``), with
``quant_problem``. Kernels: ``quant_kernels``, ``span_kernels``, ``row_amax_kernels``,
``strip_kernels`` and ``block_span_kernels``; the numbers are
``fp8_reference``'s bit for bit (E4M3 or E5M2, margin 0, with or without power-of-two scales).

Each call is one or two kernel launches (~10 µs of host time) in place of a compiled torch
region or a dozen eager kernels, and reads no sizes on the host: sync-free and CUDA-graph
capturable. Imports no cutlass until a kernel is first compiled.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .fp8 import A_DTYPES, FP8_DTYPE, _device_problem
from .launch import _row_major, aligned_16, available
from .launch_plan import LaunchPlan, PlanCache, PreparedLaunch

SPAN_BLOCK = 128  # tokens per padded block (fp8_wgrad.WGRAD_PAD)
_IN_DTYPES = (torch.bfloat16, torch.float16)
_BLOCK_IN_DTYPES = (*_IN_DTYPES, torch.float32)  # quantize_span_blocks reads fp32 too
GROUP_AMAX_MAX_COLS = 16384  # row_amax_kernels.MAX_COLS: 256 threads x 64 columns


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
            fp8_dtype: torch.dtype = FP8_DTYPE, lane_vecs: int = 0, rows_in_flight: int = 1):
    dtype = t.dtype if t.dtype in _BLOCK_IN_DTYPES else torch.bfloat16  # span_table: no data
    key = (kind, dtype, power_of_two, rows, fp8_dtype, lane_vecs, rows_in_flight)
    plan = _KERNELS.get(key)
    if plan is None:  # the config built and looked up once per key (the import too)
        from .compile_quant import QuantConfig, compile_quant

        plan = _KERNELS.put(key, LaunchPlan(compile_quant(QuantConfig(*key)).fn, 0))
    return plan.kernel


def quantize_rows(t: Tensor, power_of_two: bool = False,
                  fp8_dtype: torch.dtype = FP8_DTYPE) -> tuple[Tensor, Tensor]:
    """t [R, C] quantized to `fp8_dtype` (E4M3 or E5M2) with one scale per row: (data [R, C],
    scale_inv fp32 [R, 1]), `fp8_reference.quantize(t, QuantBlock(1, None), ScaleRule(fmt, 0,
    power_of_two))`. The kernel and t's copy are decided once per call signature;
    `quantize_rows_launch` prepares a call for later ones."""
    plan = _rows_plan(t, power_of_two, fp8_dtype) if t.numel() else None
    return _run_rows(plan, t, fp8_dtype)


def _rows_plan(t: Tensor, power_of_two: bool, fp8_dtype: torch.dtype) -> _QuantPlan:
    """The `_QuantPlan` of a `quantize_rows` call on t (not empty), once per call signature."""
    signature = ("rows", t.dtype, t.shape, t.stride(), t.device, power_of_two, fp8_dtype)
    return _QUANT_PLANS.get(signature) or _QUANT_PLANS.put(signature, _QuantPlan(
        (_kernel("rows", t, power_of_two, False, fp8_dtype, _row_lane_vecs(t.shape[1])),),
        _row_major(t) is not t))


def _run_rows(plan: _QuantPlan | None, t: Tensor, fp8_dtype: torch.dtype) -> tuple:
    """`quantize_rows`' outputs, its kernel launched on t where `plan` (None: t is empty)."""
    data = torch.empty(t.shape, dtype=fp8_dtype, device=t.device)
    scale_inv = torch.empty(t.shape[0], dtype=torch.float32, device=t.device)
    if plan is not None:
        plan.kernels[0](aligned_16(t, plan.t_copy), data, scale_inv)
    return data, scale_inv[:, None]


class RowQuantLaunch(PreparedLaunch):
    """``quantize_rows(t, power_of_two, fp8_dtype)`` for calls whose t has the dtype, shape,
    strides and device of the one it was made from (`quantize_rows_launch`): the kernel found
    once, so a call runs only its outputs' allocation, t's 16-byte alignment and the launch.
    Planned anew as every `PreparedLaunch`. Holds no tensor."""

    def __init__(self, t: Tensor, power_of_two: bool, fp8_dtype: torch.dtype) -> None:
        self._options = (power_of_two, fp8_dtype)
        self._planned(t)

    def _make_plan(self, t: Tensor) -> _QuantPlan | None:
        return _rows_plan(t, *self._options) if t.numel() else None

    def __call__(self, t: Tensor) -> tuple[Tensor, Tensor]:
        return _run_rows(self._current(t), t, self._options[1])


def quantize_rows_launch(t: Tensor, power_of_two: bool = False,
                         fp8_dtype: torch.dtype = FP8_DTYPE) -> RowQuantLaunch:
    """A `RowQuantLaunch`: this ``quantize_rows`` call for later calls with a t of these
    facts (the caller checked `quant_problem` first, as for ``quantize_rows``)."""
    return RowQuantLaunch(t, power_of_two, fp8_dtype)


def _row_lane_vecs(cols: int) -> int:
    """`RowQuantKernel`'s 16-byte vectors per lane for rows of `cols` 16-bit values (one warp
    per row): the fewest of 4, 8 or 16 that hold the row in registers, 0 (two passes over the
    row) past 4096 columns and below 1024. Measured on one H100 (2026-11-25, bench_quant.py,
    65536 or 32768 rows): in registers 4096 columns ran 0.452 -> 0.273 ms, 2048 0.217 -> 0.142,
    1024 0.085 -> 0.075; 768 columns 0.032 -> 0.039, so narrower rows keep two passes."""
    vectors = cols // 8
    if vectors < 128:
        return 0
    return next((n for n in (4, 8, 16) if vectors <= 32 * n), 0)


def quantize_row_blocks(t: Tensor, block_cols: int, power_of_two: bool = False,
                        fp8_dtype: torch.dtype = FP8_DTYPE) -> tuple[Tensor, Tensor]:
    """t [R, C] quantized in 1 x `block_cols` blocks, C a multiple of it: (data [R, C],
    scale_inv fp32 [R, C / block_cols]), `quantize_rows` of t seen as [R·C / block_cols,
    block_cols] (bit for bit), its outputs made in their final shapes (the kernel reads views
    of them: one view op a call fewer than reshaping `quantize_rows`' results)."""
    t = aligned_16(_row_major(t))
    rows, cols = t.shape
    data = torch.empty(rows, cols, dtype=fp8_dtype, device=t.device)
    scale_inv = torch.empty(rows, cols // block_cols, dtype=torch.float32, device=t.device)
    if t.numel():
        _kernel("rows", t, power_of_two, False, fp8_dtype, _row_lane_vecs(block_cols))(
            t.view(-1, block_cols), data.view(-1, block_cols), scale_inv.view(-1))
    return data, scale_inv


def quantize_spans(t: Tensor, table: Tensor, groups: int, power_of_two: bool = False,
                   fp8_dtype: torch.dtype = FP8_DTYPE) -> tuple[Tensor, Tensor]:
    """t [T, C] quantized to `fp8_dtype` along the tokens of each group, token-major: (data [C, P],
    scale_inv fp32 [G, C]) as `fp8_wgrad.quantize_token_major` lays them out. `table` int32
    [P / 128, 4] describes each padded 128-token block: (its first row of t, its valid rows
    0..128, its group, 1 on a group's first block); blocks past the last span have group
    `groups` and no valid rows (their columns of data are zeros). Groups without tokens keep
    scale_inv 1 (scale 1, as an all-zero block)."""
    return _spans(t, table, groups, power_of_two, False, fp8_dtype)


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
    t = aligned_16(_row_major(t))
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


class _QuantPlan(NamedTuple):
    """A quantization call signature's compiled kernels (in launch order), whether t must be
    copied into a row-major layout first, and the launch's integer option (0 where none)."""

    kernels: tuple
    t_copy: bool
    option: int = 0


# quantization call signatures (kind, t's dtype, shape, strides, device; options) -> plan
_QUANT_PLANS = PlanCache()


def _spans(t: Tensor, table: Tensor, groups: int, power_of_two: bool, rows: bool,
           fp8_dtype: torch.dtype) -> tuple:
    """The span kernels' buffers and launches: (data, scale_inv), and with ``rows`` (row_data,
    row_scale_inv [T, 1]) after them. No output needs a fill: the cast kernel writes
    every column of data and every group's scale_inv (1 for groups without tokens); with
    ``rows`` the row maxima (atomic max) are the one zeroed buffer. Without ``rows`` the
    kernels' row-wise arguments are constant dummies (`_span_dummies`): no allocation. The
    kernels and t's copy are decided once per call signature (`_QuantPlan`)."""
    (count, cols), blocks = t.shape, table.shape[0]
    device, width = t.device, blocks * SPAN_BLOCK
    data = torch.empty(cols, width, dtype=fp8_dtype, device=device)
    if not (width and cols):  # no kernel: every group without tokens
        scale_inv = torch.ones(groups, cols, dtype=torch.float32, device=device)
        if not rows:
            return data, scale_inv
        row_data = torch.empty(count, cols, dtype=fp8_dtype, device=device)
        row_scale_inv = torch.empty(count, dtype=torch.float32, device=device)
        return data, scale_inv, row_data, row_scale_inv[:, None]
    scale_inv = torch.empty(groups, cols, dtype=torch.float32, device=device)
    if rows:
        row_data = torch.empty(count, cols, dtype=fp8_dtype, device=device)
        row_scale_inv = torch.empty(count, dtype=torch.float32, device=device)
        row_amax = torch.zeros(count, dtype=torch.float32, device=device)  # atomic max
    else:
        row_amax, row_data, row_scale_inv = _span_dummies(cols, fp8_dtype, device)
    block_amax = torch.empty(blocks, cols, dtype=torch.float32, device=device)
    extents = torch.empty(max(groups, 1), 2, dtype=torch.int32, device=device)
    table = table.contiguous()
    signature = ("spans", t.dtype, t.shape, t.stride(), t.device, power_of_two, rows,
                 fp8_dtype)
    plan = _QUANT_PLANS.get(signature) or _QUANT_PLANS.put(signature, _QuantPlan(
        (_kernel("span_amax", t, power_of_two, rows, fp8_dtype),
         _kernel("span_cast", t, power_of_two, rows, fp8_dtype)), _row_major(t) is not t))
    t = aligned_16(t, plan.t_copy)
    amax, cast = plan.kernels
    amax(t, table, block_amax, extents, row_amax)
    cast(t, table, block_amax, extents, data, scale_inv, row_amax, row_data, row_scale_inv)
    if not rows:
        return data, scale_inv
    return data, scale_inv, row_data, row_scale_inv[:, None]


_DUMMIES: dict[tuple[int, torch.dtype, torch.device], tuple[Tensor, Tensor, Tensor]] = {}


def _span_dummies(cols: int, fp8_dtype: torch.dtype, device: torch.device
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """(row_amax fp32 [1], row_data [1, C], row_scale_inv fp32 [1]): the span cast kernel's
    row-wise arguments where it makes no row-wise form (compiled without ``rows``, it neither
    reads nor writes them). Cached per (C, dtype, device), except while a CUDA graph is
    captured (the tensors would live in the graph's memory pool): three allocations fewer per
    call (on an H100 host a `torch.empty` costs ~6.7 µs)."""
    key = (cols, fp8_dtype, device)
    found = _DUMMIES.get(key)
    if found is None:
        found = (torch.empty(1, dtype=torch.float32, device=device),
                 torch.empty(1, cols, dtype=fp8_dtype, device=device),
                 torch.empty(1, dtype=torch.float32, device=device))
        if not _capturing(device):
            _DUMMIES[key] = found
    return found


def _capturing(device: torch.device) -> bool:
    """Whether `device`'s current stream is capturing a CUDA graph (then nothing is cached)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------- row-wise + group maxima

_ROWS_GROUP_AMAX_OP = "cute quantize_rows_and_group_amax"
_SPANS_FROM_AMAX_OP = "cute quantize_spans_from_group_amax"
_UNIT_EXTENTS: dict[tuple[int, torch.device], Tensor] = {}


def group_amax_problem(t: Tensor, fp8_dtype: torch.dtype, margin: int) -> str:
    """Why `quantize_rows_and_group_amax` cannot quantize t [T, C] ("" when it can):
    `quant_problem`'s conditions, and C at most 16384 (a CTA holds whole rows)."""
    if t.dim() == 2 and t.shape[1] > GROUP_AMAX_MAX_COLS:
        return f"needs C <= {GROUP_AMAX_MAX_COLS}, got C={t.shape[1]}"
    return quant_problem(t, fp8_dtype, margin)


def quantize_rows_and_group_amax(t: Tensor, table: Tensor, groups: int,
                                 power_of_two: bool = False, fp8_dtype: torch.dtype = FP8_DTYPE
                                 ) -> tuple[Tensor, Tensor, Tensor]:
    """t [T, C] quantized row-wise in one read of t, with each group's column maxima: (row_data
    [T, C], row_scale_inv fp32 [T, 1], group_amax fp32 [G, C]). Rows in a group are bitwise
    `quantize_rows`; rows in no group (past the last group's end) are unspecified, as in
    `quantize_rows_and_spans`. group_amax[g, c] = max |t[r, c]| over group g's rows (nan as
    inf; 0 for a group without rows): what `quantize_spans_from_group_amax` needs to cast the
    token-major form later. `table`: `quantize_spans`' block table. C <= 16384
    (`group_amax_problem`). The kernel, its CTA slices and t's copy are decided once per call
    signature."""
    if t.shape[1] > GROUP_AMAX_MAX_COLS:
        raise ValueError(f"{_ROWS_GROUP_AMAX_OP}: needs C <= {GROUP_AMAX_MAX_COLS}, got "
                         f"t {tuple(t.shape)}")
    count, cols = t.shape
    row_data = torch.empty(t.shape, dtype=fp8_dtype, device=t.device)
    row_scale_inv = torch.empty(count, dtype=torch.float32, device=t.device)
    group_amax = torch.zeros(groups, cols, dtype=torch.float32, device=t.device)  # atomic max
    if count and cols and groups and table.shape[0]:
        blocks = table.shape[0]
        signature = ("rows_group_amax", t.dtype, t.shape, t.stride(), t.device, power_of_two,
                     fp8_dtype, blocks)
        plan = _QUANT_PLANS.get(signature) or _QUANT_PLANS.put(
            signature, _group_amax_plan(t, blocks, power_of_two, fp8_dtype))
        plan.kernels[0](aligned_16(t, plan.t_copy), table.contiguous(), row_data, row_scale_inv,
                        group_amax, plan.option)
    return row_data, row_scale_inv[:, None], group_amax


def _group_amax_plan(t: Tensor, blocks: int, power_of_two: bool, fp8_dtype: torch.dtype
                     ) -> _QuantPlan:
    """The `_QuantPlan` of a `quantize_rows_and_group_amax` call (its kernel and row slices
    from `_group_amax_layout`)."""
    vecs, rows_in_flight, slices = _group_amax_layout(t.shape[1], blocks)
    kernel = _kernel("rows_group_amax", t, power_of_two, False, fp8_dtype, vecs, rows_in_flight)
    return _QuantPlan((kernel,), _row_major(t) is not t, slices)


def _group_amax_layout(cols: int, blocks: int) -> tuple[int, int, int]:
    """`RowGroupAmaxKernel`'s (16-byte vectors per thread and row, rows a thread loads before
    using any, CTAs per 128-token block) for rows of `cols` 16-bit values over `blocks` blocks
    of the span table. Each thread has vectors x rows = 8 loads in flight in either form:

    - 2 x 4 where C <= 4096 and 4 x 2 would launch fewer than 2048 warps unsliced (one step's
      activations): twice the threads per row, so twice the loads in flight where few CTAs
      run; sliced to the fewest of 1, 2, 4 CTAs per block that launch 2048 warps;
    - else 4 x 2 up to C = 8192 and 8 x 1 above (the weights' thousands of blocks, or wide
      rows), sliced by `_row_slices`.

    Measured on one H200 (2026-11-30, run "w": every layout x slicing, interleaved, ms; the
    previous rule's 4 x 2 -> this one's 2 x 4): x [T, H] Q 0.085 -> 0.072, A 0.156 -> 0.134;
    dh [T, 2F] Q 0.075 -> 0.062, B 0.127 -> 0.124; a [T, F] B 0.093 -> 0.071 (Q 0.044 ->
    0.049, a form the step does not use). B x (0.229 against 0.247 in 2 x 4) and the weights
    keep 4 x 2 and their slicing, best or within 1 % (Q W2 aside: 0.193 sliced in two against
    0.182 unsliced). Row-wise quantization alone of the same tensors: Q x 0.053, A x 0.102,
    Q dh 0.041, B dh 0.099, B a 0.053."""
    if cols <= 4096 and blocks * -(-cols // 1024) < 2048:
        warps = -(-cols // (256 * 2))
        return 2, 4, next((s for s in (1, 2) if blocks * warps * s >= 2048), 4)
    vecs, rows_in_flight = (4, 2) if cols <= 8192 else (0, 1)  # 0: the kernel's most, 8
    return vecs, rows_in_flight, _row_slices(cols, blocks, vecs or 8)


def _row_slices(cols: int, blocks: int, vecs: int) -> int:
    """CTAs per 128-token block for `RowGroupAmaxKernel` with `vecs` vectors per thread and
    row (`_group_amax_layout`'s 4 x 2 and 8 x 1): the fewest of 1, 2, 4 that launch at least
    4096 warps over the `blocks` blocks, and no more than a CTA's width allows (one warp: 4
    slices of 32 rows, two warps: 2 of 64, wider ones the whole block). More CTAs keep more
    loads in flight on few or narrow rows, at the cost of one more atomic per column and
    slice: the weights (thousands of blocks) run best unsliced. Measured on one H200
    (2026-11-29, scratch sweep of 6 shapes, each with its best slices), 8 x 1 -> 4 x 2: the
    weights' [G N, K] B W1 (K 4096) 1.070 -> 0.861 ms, B W2 (K 1024) 0.790 -> 0.442, Q W1
    (K 2048) 0.440 -> 0.354, Q W2 (K 768) 0.367 -> 0.184; x [T, H] B 0.288 -> 0.230."""
    warps = -(-cols // (256 * vecs))
    widest = 4 if warps == 1 else 2 if warps == 2 else 1
    needed = -(-4096 // max(blocks * warps, 1))
    return next(s for s in (1, 2, 4) if s >= min(needed, widest))


def quantize_spans_from_group_amax(t: Tensor, table: Tensor, group_amax: Tensor,
                                   power_of_two: bool = False,
                                   fp8_dtype: torch.dtype = FP8_DTYPE) -> tuple[Tensor, Tensor]:
    """`quantize_spans(t, table, G, ...)` (data [C, P], scale_inv fp32 [G, C], bit for bit)
    in one read of t, from the group maxima `quantize_rows_and_group_amax` made (fp32
    [G, C]). The span cast kernel reads a group's maxima as those of its blocks first..end-1;
    with group_amax as the block maxima and extents[g] = (g, g + 1) that is group_amax[g].
    The kernel and t's copy are decided once per call signature."""
    groups, cols = group_amax.shape if group_amax.dim() == 2 else (-1, -1)
    if cols != t.shape[1] or group_amax.dtype != torch.float32:
        raise ValueError(f"{_SPANS_FROM_AMAX_OP}: group_amax must be fp32 [G, {t.shape[1]}], "
                         f"got {group_amax.dtype} {tuple(group_amax.shape)}")
    device, width = t.device, table.shape[0] * SPAN_BLOCK
    data = torch.empty(cols, width, dtype=fp8_dtype, device=device)
    if not (width and cols):  # no kernel: every group without tokens
        return data, torch.ones(groups, cols, dtype=torch.float32, device=device)
    scale_inv = torch.empty(groups, cols, dtype=torch.float32, device=device)
    maxima = group_amax.contiguous() if groups else group_amax.new_zeros(1, cols)
    signature = ("spans_from_amax", t.dtype, t.shape, t.stride(), t.device, power_of_two,
                 fp8_dtype)
    plan = _QUANT_PLANS.get(signature) or _QUANT_PLANS.put(signature, _QuantPlan(
        (_kernel("span_cast", t, power_of_two, False, fp8_dtype),), _row_major(t) is not t))
    plan.kernels[0](  # no row-wise form: dummies
        aligned_16(t, plan.t_copy), table.contiguous(), maxima,
        _unit_extents(max(groups, 1), device), data, scale_inv,
        *_span_dummies(cols, fp8_dtype, device))
    return data, scale_inv


def _unit_extents(groups: int, device: torch.device) -> Tensor:
    """int32 [G, 2] with row g = (g, g + 1): each group's "blocks" are its own row of
    group_amax. Cached per (G, device), except while a CUDA graph is captured (the tensor
    would live in the graph's memory pool)."""
    key = (groups, device)
    found = _UNIT_EXTENTS.get(key)
    if found is None:
        first = torch.arange(groups, dtype=torch.int32, device=device)
        found = torch.stack([first, first + 1], 1)
        if not _capturing(device):
            _UNIT_EXTENTS[key] = found
    return found


# ---------------------------------------------------------------- token-major in strips

STRIP_TOKENS = 512  # strip_kernels.STRIP_TOKENS: the tokens of a group a CTA holds at once


def strips_fit(rows: int, groups: int) -> bool:
    """Whether `rows` tokens in `groups` groups take `quantize_spans_in_strips` (the host's
    rule; it knows no split): more than half a strip and at most a strip of tokens per group
    on average (`STRIP_TOKENS`). On one H200 (2026-11-30) the strips cast B's x in 0.247 ms
    (512 tokens a group, level with the cast from a row pass's maxima, whose row pass they
    spare), but Q's in 0.105 against 0.072 (256 a group: half of each CTA's loads are of no
    token) and skewed Z's in 0.159 against 0.074 (a long group is one CTA's per chunk, read
    twice)."""
    return groups > 0 and groups * STRIP_TOKENS < 2 * rows <= 2 * groups * STRIP_TOKENS


def quantize_spans_in_strips(t: Tensor, offs: Tensor, padded_offs: Tensor, blocks: int,
                             power_of_two: bool = False, fp8_dtype: torch.dtype = FP8_DTYPE
                             ) -> tuple[Tensor, Tensor]:
    """`quantize_spans` of t (data [C, P], P = 128 `blocks`, scale_inv fp32 [G, C], bit for
    bit) in one launch and one read of t for groups of up to `STRIP_TOKENS` tokens, from the
    group ends `offs` int32 [G] and `span_table`'s padded span ends `padded_offs` (`blocks`:
    its table's rows). Longer groups are exact too, read twice. The kernel and t's copy are
    decided once per call signature."""
    groups, cols = offs.shape[0], t.shape[1]
    device, width = t.device, blocks * SPAN_BLOCK
    if not (groups and width and cols):  # no kernel: zeros, and every group without tokens
        return (torch.zeros(cols, width, dtype=fp8_dtype, device=device),
                torch.ones(groups, cols, dtype=torch.float32, device=device))
    data = torch.empty(cols, width, dtype=fp8_dtype, device=device)
    scale_inv = torch.empty(groups, cols, dtype=torch.float32, device=device)
    signature = ("strips", t.dtype, t.shape, t.stride(), t.device, power_of_two, fp8_dtype)
    plan = _QUANT_PLANS.get(signature) or _QUANT_PLANS.put(signature, _QuantPlan(
        (_kernel("strip_cast", t, power_of_two, False, fp8_dtype),), _row_major(t) is not t))
    plan.kernels[0](aligned_16(t, plan.t_copy), offs.to(torch.int32).contiguous(),
                    padded_offs.contiguous(), data, scale_inv)
    return data, scale_inv


__all__ = ["group_amax_problem", "quant_problem", "quantize_row_blocks", "quantize_rows",
           "quantize_rows_and_group_amax", "quantize_rows_and_spans", "quantize_span_blocks",
           "quantize_spans", "quantize_spans_from_group_amax", "quantize_spans_in_strips",
           "span_table", "strips_fit", "STRIP_TOKENS"]
