"""The FP8 block-scaled weight-gradient GEMM on the CuTe DSL backend:
``block_scaled_grouped_wgrad`` (varlen K) with its ``supports_block_scaled_wgrad`` check.
Kernel: ``block_wgrad.BlockWgradKernel``.

Shape legend: E experts, N = dY's columns, K = X's columns, P the padded token width, PB =
P / 128. The maths (``Float8BlockScaling`` along the tokens: 1×128 blocks that restart at each
expert's first token, the last one of an expert partial and zero-padded;
``te_seq.kernels.fp8_wgrad.quantize_token_major_blocks`` lays the operands out):

    out[e, n, k] = Σ_{tb in span e} a_scale[tb, n] · b_scale[tb, k]
                     · Σ_{t in block tb} fp32(a[n, t]) · fp32(b[k, t])

accumulated in fp32 (promoted with the two scales every 128 tokens) and rounded once. The
scales are *dequantization* scales (``scale_inv``). Imports no cutlass until the kernel is
first compiled; no host reads of ``offs``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fp8 import FP8_DTYPE, WGRAD_SPAN, _device_problem, token_major_problem
from .launch import _check_offs, _num_sms, _row_major, aligned_16, no_route, varlen_k_clusters

TILE_N = 128  # the kernel's tile width: accumulators, the k-tile's product and scales fit
_OP = "cute block_scaled_grouped_wgrad"
_OUT_DTYPES = (torch.float32, torch.bfloat16)


def _operand_problem(a: Tensor, b: Tensor, groups: int) -> str:
    """Why a and b are unsupported ("" when they are): E4M3 a [N, P] and b [K, P], E, N and
    K > 0, N and K multiples of 16, P of 128."""
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        return f"needs float8_e4m3fn a and b, got {a.dtype} and {b.dtype}"
    return token_major_problem(a, b, groups)


def _scale_problem(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor) -> str:
    """Why the scales are unsupported: fp32 a_scale [PB, N] and b_scale [PB, K]."""
    blocks = a.shape[1] // WGRAD_SPAN
    for name, s, cols in (("a_scale", a_scale, a.shape[0]), ("b_scale", b_scale, b.shape[0])):
        if s.dtype != torch.float32 or tuple(s.shape) != (blocks, cols):
            return (f"{name} must be float32 {[blocks, cols]} (one scale per 128-token block "
                    f"and column), got {s.dtype} {list(s.shape)}")
    return ""


def supports_block_scaled_wgrad(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor,
                                offs: Tensor) -> tuple[bool, str]:
    """Whether ``block_scaled_grouped_wgrad(a, b, a_scale, b_scale, offs)`` can run here, with
    the reason if not: E4M3 a [N, P] and b [K, P] (tokens contiguous), fp32 scales [P/128, N]
    and [P/128, K], N and K multiples of 16, P of 128, E = len(offs) > 0, CUDA tensors on an
    sm_90 GPU."""
    why = (_operand_problem(a, b, offs.shape[0] if offs.dim() == 1 else 0)
           or _scale_problem(a, b, a_scale, b_scale)
           or _device_problem((a, b, a_scale, b_scale, offs)))
    return not why, why


def _output(out: Tensor | None, shape: tuple[int, int, int], device: torch.device,
            accumulate: bool) -> tuple[Tensor, bool]:
    """(the output [E, N, K], whether to accumulate): a new bf16 tensor without ``out``."""
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=device), False
    if tuple(out.shape) != shape or out.dtype not in _OUT_DTYPES or not out.is_contiguous():
        raise ValueError(f"{_OP}: out must be a contiguous {list(shape)} float32 or bfloat16 "
                         f"tensor, got {tuple(out.shape)} {out.dtype}")
    if out.device != device:
        raise ValueError(f"{_OP}: out must be on {device}, got {out.device}")
    return out, accumulate


def block_scaled_grouped_wgrad(
    a: Tensor,
    b: Tensor,
    a_scale: Tensor,
    b_scale: Tensor,
    offs: Tensor,
    out: Tensor | None = None,
    accumulate: bool = False,
    *,
    cluster_mn: tuple[int, int] = (1, 2),
) -> Tensor:
    """Varlen-K FP8 grouped GEMM (the weight gradient) with (128-token block, column) scales:
    ``out[e] = Σ_{tb in span e} (a_scale[tb] ⊗ b_scale[tb]) ∘ (a[:, tb] @ b[:, tb]ᵀ)``
    (``a[:, tb]``: the 128 tokens of block tb).

    a: [N, P] float8_e4m3fn (dY token-major), b: [K, P] float8_e4m3fn (X token-major), spans
    given by offs: int32 [E] cumulative span ends in P; each span starts on a multiple of 128
    and is zero-padded to whole multiples of 128 (``fp8_wgrad.BlockTokenMajor``; not checked
    on the host: no sync); a_scale fp32 [P/128, N], b_scale fp32 [P/128, K] (dequantization
    scales; blocks outside every span are never read). -> [E, N, K]: a new bf16 tensor, or
    written into (``accumulate=True``: added to) ``out``, contiguous bf16 or fp32. fp32
    accumulation, one rounding; an empty span writes zeros (adds nothing). Sync-free and
    CUDA-graph capturable. ``cluster_mn``: (1, 2) (two K tiles share dY) or (2, 1) (two N
    tiles share X). Raises ValueError when ``supports_block_scaled_wgrad`` is False.
    """
    ok, why = supports_block_scaled_wgrad(a, b, a_scale, b_scale, offs)
    if not ok:
        raise ValueError(f"{_OP}: a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype}: "
                         f"{why}")
    from .compile import GemmConfig, compile_gemm

    groups, n, k = offs.shape[0], a.shape[0], b.shape[0]
    offs = _check_offs(offs, groups, a.device)
    out, accumulate = _output(out, (groups, n, k), a.device, accumulate)
    cfg = GemmConfig("k", FP8_DTYPE, out.dtype, "k", TILE_N, cluster_mn, accumulate,
                     block_wgrad=True)
    kernel = compile_gemm(cfg).fn
    clusters = varlen_k_clusters(groups, n, k, TILE_N, cluster_mn, _num_sms(a.device.index or 0))
    a, b = aligned_16(_row_major(a)), aligned_16(_row_major(b))
    kernel(a, b, out.permute(1, 2, 0), offs, clusters, a_scale.contiguous(), b_scale.contiguous(),
           no_route(a.device))
    return out
