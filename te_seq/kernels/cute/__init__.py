"""te_seq's CuTe DSL (CUTLASS Python DSL) kernels for Hopper (sm_90a): functional entry points.

Shape legend: M routed rows (tokens), E groups (experts), K reduction dim, N output dim.
``offs`` is int32 [E] of cumulative row ends on the device (``offs[e] = sum(split_sizes[:e+1])``).

Importing this package imports no cutlass and compiles nothing: each kernel config compiles on
first use (``compile.compile_gemm``, symbolic M/N/K/E, cached in memory and on disk) and
launches on torch's current stream through TVM-FFI. No function here reads ``offs`` on the
host, so every call is sync-free and CUDA-graph capturable. ``te_seq.kernels.reference``
defines the maths.

Modules: ``launch`` (host helpers every functional shares: tiling, capability, operand views,
the persistent grid), ``gemm`` (``grouped_mm`` / ``grouped_wgrad``), ``glu`` (the fused GLU
steps, each with a ``.supports(x, w, act, interleave)``), ``act`` (the fused non-gated
activation steps ``act_fc1_forward`` / ``act_fc2_dgrad``, each with a ``.supports(x, w, act)``),
``fp8`` (the FP8 grouped GEMMs ``scaled_grouped_mm`` and ``scaled_grouped_wgrad`` with row-wise
scales, ``supports_scaled`` / ``supports_scaled_wgrad``; ``scaled_mm_launch`` prepares a
``scaled_grouped_mm`` call for later ones), ``fp8_glu`` (the fused FP8 GLU
steps ``scaled_glu_fc1_forward`` / ``scaled_glu_fc2_dgrad`` and, under block scales,
``block_scaled_glu_fc1_forward`` / ``block_scaled_glu_fc2_dgrad``, each with a
``.supports``; ``scaled_glu_fc1_forward.launch_for`` prepares a call), ``block_fp8`` (the
FP8 block-scaled grouped GEMM ``block_scaled_grouped_mm``,
``supports_block_scaled``), ``block_fp8_wgrad`` (its varlen-K weight gradient
``block_scaled_grouped_wgrad``, ``supports_block_scaled_wgrad``),
``offsets`` (``group_offsets``: the checked group offsets in one launch, ``offsets_problem``),
``quant`` (the FP8 quantization kernels ``quantize_rows`` (``quantize_rows_launch`` prepares a
call) / ``quantize_spans`` /
``quantize_span_blocks``, ``quantize_rows_and_group_amax`` / ``quantize_spans_from_group_amax``,
``quantize_spans_in_strips`` with ``strips_fit``, ``quant_problem``),
``compile`` and ``disk_cache`` (compiling and caching), and the kernels (``grouped_gemm``,
``glu_epilogue``, ``act_epilogue`` and the modules they are built from). This file only
re-exports.
"""

from .act import act_fc1_forward, act_fc2_dgrad
from .block_fp8 import block_scaled_grouped_mm, supports_block_scaled
from .block_fp8_wgrad import block_scaled_grouped_wgrad, supports_block_scaled_wgrad
from .fp8 import (
    scaled_grouped_mm,
    scaled_grouped_wgrad,
    scaled_mm_launch,
    supports_scaled,
    supports_scaled_wgrad,
)
from .fp8_glu import (
    block_scaled_glu_fc1_forward,
    block_scaled_glu_fc2_dgrad,
    scaled_glu_fc1_forward,
    scaled_glu_fc2_dgrad,
)
from .gemm import grouped_mm, grouped_wgrad, supports, supports_wgrad
from .glu import glu_fc1_forward, glu_fc2_dgrad
from .launch import (
    MM_TILING,
    PINGPONG_TILE_WIDTHS,
    TILE_WIDTHS,
    WGRAD_TILING,
    Tiling,
    available,
    default_tiling,
    pingpong_tile_n,
    plain_mm_tiling,
    refresh_tiling_settings,
    route_problem,
    tile_n_for,
    wgrad_tiling,
)
from .offsets import group_offsets, offsets_problem
from .quant import (
    STRIP_TOKENS,
    group_amax_problem,
    quant_problem,
    quantize_row_blocks,
    quantize_rows,
    quantize_rows_and_group_amax,
    quantize_rows_and_spans,
    quantize_rows_launch,
    quantize_span_blocks,
    quantize_spans,
    quantize_spans_from_group_amax,
    quantize_spans_in_strips,
    span_table,
    strips_fit,
)

__all__ = [
    "Tiling",
    "tile_n_for",
    "default_tiling",
    "pingpong_tile_n",
    "plain_mm_tiling",
    "wgrad_tiling",
    "refresh_tiling_settings",
    "available",
    "route_problem",
    "supports",
    "supports_wgrad",
    "grouped_mm",
    "grouped_wgrad",
    "glu_fc1_forward",
    "glu_fc2_dgrad",
    "act_fc1_forward",
    "act_fc2_dgrad",
    "scaled_grouped_mm",
    "scaled_mm_launch",
    "supports_scaled",
    "scaled_grouped_wgrad",
    "supports_scaled_wgrad",
    "scaled_glu_fc1_forward",
    "scaled_glu_fc2_dgrad",
    "block_scaled_glu_fc1_forward",
    "block_scaled_glu_fc2_dgrad",
    "group_offsets",
    "offsets_problem",
    "quant_problem",
    "quantize_rows",
    "quantize_rows_launch",
    "quantize_row_blocks",
    "quantize_spans",
    "quantize_rows_and_spans",
    "span_table",
    "quantize_span_blocks",
    "quantize_rows_and_group_amax",
    "quantize_spans_from_group_amax",
    "quantize_spans_in_strips",
    "strips_fit",
    "STRIP_TOKENS",
    "group_amax_problem",
    "block_scaled_grouped_mm",
    "supports_block_scaled",
    "block_scaled_grouped_wgrad",
    "supports_block_scaled_wgrad",
    "MM_TILING",
    "PINGPONG_TILE_WIDTHS",
    "WGRAD_TILING",
    "TILE_WIDTHS",
]
