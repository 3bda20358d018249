"""The FP8 block-scaled grouped GEMM on the CuTe DSL backend: ``block_scaled_grouped_mm``
(varlen M: forward and dgrad) with its ``supports_block_scaled`` check. Kernel:
``block_scaled.BlockScaledGemmKernel``.

Shape legend: M routed rows, E experts, K reduction dim, N output columns, KB = ⌈K/128⌉,
NB = ⌈N/128⌉. The maths (``Float8BlockScaling``: 1×128 blocks along K for x and dy, 128×128
blocks for W; te_seq.kernels.fp8_reference defines the quantization):

    out[m, n] = Σ_kb a_scale[m, kb] · b_scale[g(m), n // 128, kb]
                     · Σ_{k in block kb} fp32(a[m, k]) · fp32(b[g(m), n, k])

accumulated in fp32 and rounded once to bf16; g(m) is the group whose rows (``offs``) hold m.
The scales are *dequantization* scales (``scale_inv``). Imports no cutlass until the kernel is
first compiled; no host reads of ``offs``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fp8 import FP8_DTYPE, _device_problem, geometry_problem, run_scaled_mm

BLOCK = 128  # scale block: 128 elements along K (both operands), 128 rows of W along N
_OP = "cute block_scaled_grouped_mm"


def _blocks(size: int) -> int:
    return -(-size // BLOCK)


def _operand_problem(a: Tensor, b: Tensor) -> str:
    """Why a and b are unsupported ("" when they are): E4M3 a [M, K] and b [E, N, K], E, K and
    N > 0, K and N multiples of 16."""
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        return f"needs float8_e4m3fn a and b, got {a.dtype} and {b.dtype}"
    return geometry_problem(a, b)


def _scale_problem(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor) -> str:
    """Why the scales are unsupported: fp32 a_scale [M, KB] and b_scale [E, NB, KB]."""
    (m, k), (e, n, _) = a.shape, b.shape
    for name, s, shape in (("a_scale", a_scale, (m, _blocks(k))),
                           ("b_scale", b_scale, (e, _blocks(n), _blocks(k)))):
        if s.dtype != torch.float32 or tuple(s.shape) != shape:
            return (f"{name} must be float32 {list(shape)} (one scale per 128-element block), "
                    f"got {s.dtype} {list(s.shape)}")
    return ""


def supports_block_scaled(
    a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[bool, str]:
    """Whether ``block_scaled_grouped_mm(a, b, a_scale, b_scale, offs, out_dtype)`` can run
    here, with the reason if not: E4M3 a [M, K] and b [E, N, K], fp32 a_scale [M, ⌈K/128⌉] and
    b_scale [E, ⌈N/128⌉, ⌈K/128⌉], K and N multiples of 16, a bf16 output, CUDA tensors on an
    sm_90 GPU."""
    if out_dtype != torch.bfloat16:
        return False, f"outputs bfloat16 only, got out_dtype={out_dtype}"
    why = _operand_problem(a, b) or _scale_problem(a, b, a_scale, b_scale)
    why = why or _device_problem((a, b, a_scale, b_scale))
    return not why, why


def block_scaled_grouped_mm(
    a: Tensor,
    b: Tensor,
    a_scale: Tensor,
    b_scale: Tensor,
    offs: Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    cluster_mn: tuple[int, int] = (1, 2),
) -> Tensor:
    """Varlen-M FP8 grouped GEMM with block scales: for the rows of group g,
    ``out[m, n] = Σ_kb a_scale[m, kb] · b_scale[g, n // 128, kb] · (a[m, kb] · b[g, n, kb])``
    (``a[m, kb]``: the kb-th 128-element block of row m along K).

    a: [M, K] float8_e4m3fn, b: [E, N, K] float8_e4m3fn (a weight stack, any strides: copied
    K-contiguous where it is not), a_scale: float32 [M, ⌈K/128⌉], b_scale: float32
    [E, ⌈N/128⌉, ⌈K/128⌉], offs: int32 [E] cumulative row ends -> out [M, N] bf16 (fp32
    accumulation, the partial sums promoted with their scales every 128 elements of K, one
    rounding). Rows past ``offs[-1]`` are zeros. Sync-free and CUDA-graph capturable.
    ``cluster_mn``: (1, 2) (two n-tiles share A) or (2, 1) (two m-tiles share B).
    Raises ValueError when ``supports_block_scaled`` is False.
    """
    def config(n: int):
        from .compile import GemmConfig

        return GemmConfig("m", FP8_DTYPE, out_dtype, "k", BLOCK, cluster_mn, block_scaled=True)

    return run_scaled_mm(_OP, lambda: supports_block_scaled(a, b, a_scale, b_scale, out_dtype),
                         config, a, b, a_scale, b_scale, offs, out_dtype, cluster_mn)
