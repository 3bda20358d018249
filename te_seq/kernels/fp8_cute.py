"""Real FP8 forward GEMMs on the cute backend: ``te_seq.kernels.cute.scaled_grouped_mm``.

The cute backend runs the forward GEMM y = x Wᵀ of a GroupedLinear and of the fused
GroupedMLP's FC1 / FC2 on FP8 operands with its own Hopper kernel (`forward_reason` says where
it cannot; the plan then runs torch or the reference). The operand and scale conventions are
`fp8_torch.scaled_grouped_mm`'s (the same quantized tensors go in):

    y[m, n] = scale_inv_x[m] · scale_inv_w[g(m), n] · Σ_k fp32(q_x[m, k]) · fp32(q_w[g(m), n, k])

accumulated in fp32 and rounded once to bf16; g(m) is the group holding row m. x [M, K] and the
weight stack [G, N, K] are E4M3; per-tensor scales are passed as row-wise ones (each row repeats
its tensor's scale). The dgrad GEMM of the native FP8 backward (E4M3 dy) runs here too, on dy
[T, N] and Wᵀ [G, K, N] quantized along N; its wgrad is ``cute.scaled_grouped_wgrad``
(core/fp8_gemm.py); otherwise they are emulated (fp32 operands; see `CuteBackend.grouped_mm`).

What the kernel takes (``cute.supports_scaled``): E4M3 operands, fp32 dequantization scales
[M] and [G, N], K and N multiples of 16, a bf16 output, CUDA data on an sm_90 GPU.
``Float8BlockScaling`` (1x128 tiles of x / dy, 128x128 blocks of W) runs on
``cute.block_scaled_grouped_mm`` under the same conditions (scales [M, ⌈K/128⌉] and
[G, ⌈N/128⌉, ⌈K/128⌉]: `block_scales`), for the forward and the dgrad (E4M3 dy only); its
wgrad, whose 1x128 blocks run along each expert's tokens, on the varlen-K
``cute.block_scaled_grouped_wgrad`` (core/fp8_gemm.py, operands from
``fp8_quantize.token_major_blocks``: the one-pass ``cute.quantize_span_blocks``, bitwise
``fp8_wgrad.quantize_token_major_blocks``).
There is no plain (one-matrix) FP8 kernel: BasicLinear / Linear take ``torch._scaled_mm`` on
the torch backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_seq.kernels import cute, fp8_torch
from te_seq.kernels.activations import GluSpec
from te_seq.kernels.fp8_reference import QuantBlock, QuantizedTensor

_KERNEL = "cute scaled_grouped_mm"
_TILES = (fp8_torch.BLOCK_SCALED[0].rows, fp8_torch.BLOCK_SCALED[0].cols)  # x's 1x128 blocks
_BLOCK_KERNEL = "cute block_scaled_grouped_mm"


def kernel_name(blocks: tuple[QuantBlock, QuantBlock]) -> str:
    """The cute FP8 kernel that runs GEMMs of operands quantized with `blocks` (x's, W's):
    `block_scaled_grouped_mm` for 1x128 / 128x128 blocks, else `scaled_grouped_mm`."""
    return _BLOCK_KERNEL if tuple(blocks) == fp8_torch.BLOCK_SCALED else _KERNEL


def forward_reason(
    blocks: tuple[QuantBlock, QuantBlock], dtypes: tuple[torch.dtype, torch.dtype],
    gemm_dtype: torch.dtype, device: torch.device, dims: list[tuple[int, int]],
) -> str:
    """Why the grouped forward GEMMs of shapes `dims` ((K, N) each) cannot run on a cute FP8
    kernel (`kernel_name`) for operands quantized with `blocks` (x's, W's) into FP8 `dtypes`,
    in `gemm_dtype` on `device` ("" when they can). Never raises, never touches a GPU that is
    not there."""
    kernel = kernel_name(blocks)
    why = fp8_torch.operands_reason(kernel, blocks, dtypes, device, block_scaled=True)
    if why:
        return why
    major, minor = fp8_torch.cuda_capability(device)
    if major != 9:
        return f"{kernel} needs sm_90 (Hopper WGMMA), the GPU is sm_{major}{minor}"
    return fp8_torch.output_reason(kernel, gemm_dtype, dims)


def recipe_reason(recipe, gemm_dtype: torch.dtype, device: torch.device,
                  dims: list[tuple[int, int]]) -> str:
    """`forward_reason` for the forward operands of `recipe` (x: role "input", W: "weight")."""
    blocks = (recipe.block("input"), recipe.block("weight"))
    formats = (recipe.rule("input").dtype, recipe.rule("weight").dtype)
    return forward_reason(blocks, formats, gemm_dtype, device, dims)


def block_scales(x: QuantizedTensor, w_scale_inv: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The block-scaled kernel's dequantization scales from `fp8_reference.quantize`'s:
    (a_scale [M, KB], b_scale [G, NB, KB]) fp32 contiguous, KB = ⌈K/128⌉, NB = ⌈n/128⌉.

    x [M, K] is quantized with 1x128 blocks (its scale_inv is [M, KB]); `w_scale_inv`
    [G, NB, KB] stacks each [n, K] matrix's 128x128 block scales. For the dgrad (x = dy
    [M, N], the matrices Wᵀ [K, N]) that is W's grid transposed, [G, ⌈K/128⌉, ⌈N/128⌉]
    (core/fp8.py `_weight_pair`), which is the kernel's layout for b = Wᵀ. ValueError naming
    the shapes where they do not fit."""
    (m, k), g = x.data.shape, w_scale_inv.shape[0]
    want_a, want_b = (m, -(-k // 128)), (g, -(-n // 128), -(-k // 128))
    if x.block != fp8_torch.BLOCK_SCALED[0] or tuple(x.scale_inv.shape) != want_a \
            or tuple(w_scale_inv.shape) != want_b:
        raise ValueError(
            f"{_BLOCK_KERNEL}: x {list(x.data.shape)} with {x.block} scales "
            f"{list(x.scale_inv.shape)} and weight scales {list(w_scale_inv.shape)} do not fit "
            f"1x128 scales {list(want_a)} and 128x128 ones {list(want_b)} (N={n})")
    return (x.scale_inv.to(torch.float32).contiguous(),
            w_scale_inv.to(torch.float32).contiguous())


def row_scales(x: QuantizedTensor, w_scale_inv: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """`fp8_torch.rowwise_scales` (x's [M], W's [G, N] fp32, contiguous), without its view ops
    where both scales are `t[..., None]` views of contiguous tensors of those shapes (the cute
    quantizers' row scales, the weight cache's: `fp8.WeightOperands`): those tensors
    themselves, the same memory and layout. A view op costs ~6 µs of host on an H100 (the
    2026-11-25 step profile), and a step took four pairs."""
    scale_a, scale_b = _viewed(x.scale_inv), _viewed(w_scale_inv)
    if scale_a is None or scale_b is None or scale_a.shape[0] != x.data.shape[0] \
            or scale_b.shape != (w_scale_inv.shape[0], n):
        return fp8_torch.rowwise_scales(x, w_scale_inv, n)
    return scale_a, scale_b


def _viewed(s: Tensor) -> Tensor | None:
    """The contiguous tensor b with s = b[..., None] (s's `_base`, read without a view op), or
    None where s is not such a view."""
    base = s._base  # both contiguous from one address, shapes that differ by s's last 1:
    if base is None or not (base.is_contiguous() and s.is_contiguous()) \
            or base.data_ptr() != s.data_ptr() or base.shape != s.shape[:-1]:
        return None  # (one element per row of s: the same layout)
    return base


def scaled_grouped_mm(
    x: QuantizedTensor, w_data: Tensor, w_scale_inv: Tensor, offs: Tensor,
    out_dtype: torch.dtype,
) -> Tensor:
    """y [M, N]: rows of group g = x[rows of g] w_data[g]ᵀ on FP8 data, by a cute kernel.
    x [M, K] (per-tensor, per-row or 1x128 `scale_inv`), w_data [G, N, K] E4M3 with
    w_scale_inv [G, 1, 1] (per tensor), [G, N, 1] (per row) or [G, NB, KB] (128x128 blocks:
    `block_scales`), offs [G] cumulative row ends. Checked by `forward_reason` first."""
    n, offs32 = w_data.shape[1], offs.to(torch.int32)
    # looked up on the package at call time: the one place the cute FP8 kernels are called
    if (x.block.rows, x.block.cols) == _TILES:  # 1x128 (tuples: no dataclass comparison)
        scale_a, scale_b = block_scales(x, w_scale_inv, n)
        return cute.block_scaled_grouped_mm(x.data.contiguous(), w_data.contiguous(), scale_a,
                                            scale_b, offs32, out_dtype)
    scale_a, scale_b = row_scales(x, w_scale_inv, n)
    # W as given: the cute GEMMs read any K-contiguous layout of whole 16-byte strides (a
    # stacked weight's dgrad form is a strided view) and copy the others themselves
    return cute.scaled_grouped_mm(x.data.contiguous(), w_data, scale_a, scale_b, offs32,
                                  out_dtype)


# ---------------------------------------------------------------- GLU epilogues (fused MLP)


def glu_reason(glu: GluSpec, hidden: int, ffn: int, device: torch.device) -> str:
    """Why the fused GroupedMLP's FP8 FC1 and FC2-dgrad GEMMs cannot run its gated activation
    in their epilogues (`cute.scaled_glu_fc1_forward` / `scaled_glu_fc2_dgrad`) for H=`hidden`,
    F=`ffn` ("" when they can); checked on empty operands of those widths."""
    def empty(*sizes: int, dtype=FP8) -> Tensor:
        return torch.empty(*sizes, dtype=dtype, device=device)

    il = glu.glu_interleave_size
    checks = (
        ("FC1", cute.scaled_glu_fc1_forward.supports(
            empty(0, hidden), empty(1, 2 * ffn, hidden), empty(0, dtype=torch.float32),
            empty(1, 2 * ffn, dtype=torch.float32), glu.act, il)),
        ("FC2 dgrad", cute.scaled_glu_fc2_dgrad.supports(
            empty(0, hidden), empty(1, ffn, hidden), empty(0, dtype=torch.float32),
            empty(1, ffn, dtype=torch.float32), glu.act, il)),
    )
    for label, (ok, why) in checks:
        if not ok:
            return f"{label}: {why}"
    return ""


FP8 = torch.float8_e4m3fn


def block_glu_reason(glu: GluSpec, hidden: int, ffn: int, device: torch.device) -> str:
    """Why the fused GroupedMLP's FC1 and FC2 dgrad under `Float8BlockScaling` cannot run its
    gated activation in their epilogues (`cute.block_scaled_glu_fc1_forward` /
    `block_scaled_glu_fc2_dgrad`) for H=`hidden`, F=`ffn` ("" when they can); checked on
    empty operands of those widths."""
    def empty(*sizes: int, dtype=FP8) -> Tensor:
        return torch.empty(*sizes, dtype=dtype, device=device)

    hb, il = -(-hidden // 128), glu.glu_interleave_size
    checks = (
        ("FC1", cute.block_scaled_glu_fc1_forward.supports(
            empty(0, hidden), empty(1, 2 * ffn, hidden), empty(0, hb, dtype=torch.float32),
            empty(1, -(-2 * ffn // 128), hb, dtype=torch.float32), glu.act, il)),
        ("FC2 dgrad", cute.block_scaled_glu_fc2_dgrad.supports(
            empty(0, hidden), empty(1, ffn, hidden), empty(0, hb, dtype=torch.float32),
            empty(1, -(-ffn // 128), hb, dtype=torch.float32), glu.act, il)),
    )
    for label, (ok, why) in checks:
        if not ok:
            return f"{label}: {why}"
    return ""


def glu_fc1(x: QuantizedTensor, w_data: Tensor, w_scale_inv: Tensor, offs: Tensor,
            out_dtype: torch.dtype, *, glu: GluSpec, probs: Tensor | None,
            store_h: bool = True) -> tuple[Tensor | None, Tensor]:
    """(h [M, 2F], a [M, F]): FC1's FP8 GEMM (`scaled_grouped_mm`'s operands: x [M, H], W1
    [G, 2F, H]) with the gated activation (· probs) in its epilogue, bf16 (`out_dtype`):
    `block_scaled_glu_fc1_forward` for 1x128 / 128x128 blocks, else
    `scaled_glu_fc1_forward` (row-wise or per-tensor scales). `store_h=False`: h may be
    left unwritten (None; the row-wise kernel skips it, the block-scaled one writes it)."""
    args = (glu.act, glu.glu_interleave_size, probs, glu.params)
    if (x.block.rows, x.block.cols) == _TILES:  # 1x128 (tuples: no dataclass comparison)
        scale_a, scale_b = block_scales(x, w_scale_inv, w_data.shape[1])
        return cute.block_scaled_glu_fc1_forward(
            x.data.contiguous(), w_data, scale_a, scale_b, offs.to(torch.int32), *args)
    scale_a, scale_b = row_scales(x, w_scale_inv, w_data.shape[1])
    return cute.scaled_glu_fc1_forward(
        x.data.contiguous(), w_data, scale_a, scale_b, offs.to(torch.int32), *args,
        store_h=store_h)


def glu_dgrad(dy: QuantizedTensor, w_data: Tensor, w_scale_inv: Tensor, offs: Tensor,
              out_dtype: torch.dtype, *, h: Tensor, glu: GluSpec, probs: Tensor | None
              ) -> tuple[Tensor, Tensor, Tensor | None]:
    """(dh [M, 2F], a [M, F], dprobs [M] or None): FC2's FP8 dgrad (dy [M, H], W2ᵀ [G, F, H]
    quantized along H) with the gated activation's backward from h [M, 2F] in its epilogue:
    `block_scaled_glu_fc2_dgrad` for 1x128 / 128x128 blocks, else `scaled_glu_fc2_dgrad`."""
    args = (h, glu.act, glu.glu_interleave_size, probs, glu.params)
    if (dy.block.rows, dy.block.cols) == _TILES:  # 1x128 (tuples: no dataclass comparison)
        scale_a, scale_b = block_scales(dy, w_scale_inv, w_data.shape[1])
        return cute.block_scaled_glu_fc2_dgrad(
            dy.data.contiguous(), w_data, scale_a, scale_b, offs.to(torch.int32), *args)
    scale_a, scale_b = row_scales(dy, w_scale_inv, w_data.shape[1])
    return cute.scaled_glu_fc2_dgrad(
        dy.data.contiguous(), w_data, scale_a, scale_b, offs.to(torch.int32), *args)


# ---------------------------------------------------------------- launches prepared once


class _RowwiseLaunch:
    """A row-wise-scaled FP8 GEMM call prepared for later calls (`prepare_glu_fc1`,
    `prepare_scaled_grouped_mm`): with the unprepared kernel's arguments (x a QuantizedTensor,
    w_data, w_scale_inv, offs, out_dtype, its options), it launches the prepared kernel where
    x's and W's data have the strides they had (the rest the caller's signature vouches for:
    dtypes, shapes, devices, options), else runs the unprepared kernel, which checks
    everything."""

    def __init__(self, launch, unprepared, x: QuantizedTensor, w_data: Tensor) -> None:
        self._launch, self._unprepared = launch, unprepared
        self._strides = (x.data.stride(), w_data.stride())

    def __call__(self, x: QuantizedTensor, w_data: Tensor, w_scale_inv: Tensor, offs: Tensor,
                 out_dtype: torch.dtype, **options):
        if (x.data.stride(), w_data.stride()) != self._strides:
            return self._unprepared(x, w_data, w_scale_inv, offs, out_dtype, **options)
        scale_a, scale_b = row_scales(x, w_scale_inv, w_data.shape[1])
        return self._launch(x.data, w_data, scale_a, scale_b, offs, **options)


def _rowwise(x: QuantizedTensor) -> bool:
    """Whether x's scales are per row or per tensor (not 1x128 blocks)."""
    return (x.block.rows, x.block.cols) != _TILES


def prepare_glu_fc1(x: QuantizedTensor, w_data: Tensor, w_scale_inv: Tensor, offs: Tensor,
                    out_dtype: torch.dtype, *, glu: GluSpec, probs: Tensor | None,
                    store_h: bool = True):
    """``run(x, w_data, w_scale_inv, offs, out_dtype, probs=probs) -> (h, a)``, equal to
    ``glu_fc1(..., glu=glu, probs=probs, store_h=store_h)`` for later calls whose operands
    have these ones' facts (`_RowwiseLaunch`), checked and planned once, here
    (``cute.scaled_glu_fc1_forward.launch_for``); None under 1x128 block scales (the caller
    calls ``glu_fc1``)."""
    if not _rowwise(x):
        return None
    scale_a, scale_b = row_scales(x, w_scale_inv, w_data.shape[1])
    launch = cute.scaled_glu_fc1_forward.launch_for(
        x.data, w_data, scale_a, scale_b, glu.act, glu.glu_interleave_size, probs, glu.params,
        store_h)
    # glu and store_h were fixed here: the later calls' signature vouches they are unchanged
    return _RowwiseLaunch(lambda *a, probs, **fixed: launch(*a, probs), glu_fc1, x, w_data)


def prepare_scaled_grouped_mm(x: QuantizedTensor, w_data: Tensor, w_scale_inv: Tensor,
                              offs: Tensor, out_dtype: torch.dtype):
    """``run(x, w_data, w_scale_inv, offs, out_dtype) -> y``, equal to ``scaled_grouped_mm``
    of those arguments for later calls whose operands have these ones' facts
    (`_RowwiseLaunch`), checked and planned once, here (``cute.scaled_mm_launch``); None
    under 1x128 block scales (the caller calls ``scaled_grouped_mm``)."""
    if not _rowwise(x):
        return None
    scale_a, scale_b = row_scales(x, w_scale_inv, w_data.shape[1])
    launch = cute.scaled_mm_launch(x.data, w_data, scale_a, scale_b, offs.to(torch.int32),
                                   out_dtype)
    return _RowwiseLaunch(lambda a, b, sa, sb, offs: launch(a, b, sa, sb, offs.to(torch.int32)),
                          scaled_grouped_mm, x, w_data)


def prepare_glu_dgrad(dy: QuantizedTensor, w_data: Tensor, w_scale_inv: Tensor, offs: Tensor,
                      out_dtype: torch.dtype, *, h: Tensor, glu: GluSpec, probs: Tensor | None):
    """``run(dy, w_data, w_scale_inv, offs, out_dtype, h=h, probs=probs) -> (dh, a,
    dprobs)``, equal to ``glu_dgrad(..., h=h, glu=glu, probs=probs)`` for later calls whose
    operands have these ones' facts (`_RowwiseLaunch`), checked and planned once, here
    (``cute.scaled_glu_fc2_dgrad.launch_for``); None under 1x128 block scales."""
    if not _rowwise(dy):
        return None
    scale_a, scale_b = row_scales(dy, w_scale_inv, w_data.shape[1])
    launch = cute.scaled_glu_fc2_dgrad.launch_for(
        dy.data, w_data, scale_a, scale_b, glu.act, glu.glu_interleave_size, probs, glu.params)
    # glu was fixed here: the later calls' signature vouches it is unchanged
    return _RowwiseLaunch(lambda *a, h, probs, **fixed: launch(*a, h, probs), glu_dgrad, dy,
                          w_data)
