"""Real FP8 GEMMs on PyTorch's scaled matmuls: `torch._scaled_mm` and `torch._scaled_grouped_mm`.

The torch backend runs a linear's forward GEMM y = x Wᵀ on FP8 operands where PyTorch has a
kernel for the recipe's scales (`forward_reason` says where not; callers then emulate, see
te_seq.kernels.fp8_reference). Both take the *dequantization* scales: te_seq quantizes
q = fp8(v · scale), so the scale a kernel multiplies by is `scale_inv = 1 / scale`
(`QuantizedTensor.scale_inv`), and

    y[m, n] = scale_inv_x[m] · scale_inv_w[n] · Σ_k fp32(q_x[m, k]) · fp32(q_w[n, k])

accumulated in fp32 and rounded once to bf16: the emulation's numbers up to summation order.

What PyTorch takes (torch 2.11, read from its checks and tests):

* operands E4M3 (te_seq's forward operands always are), the first row-major [M, K], the second
  column-major [K, N] (W [N, K] contiguous, transposed); K and N multiples of 16 (16-byte
  strides); the output bf16 for row-wise scales (we ask bf16 for both).
* `_scaled_mm`: per-tensor scales as 0-d fp32, row-wise as [M, 1] and [1, N] fp32; CUDA sm_89+
  (we take it from sm_90).
* `_scaled_grouped_mm` (2-D x 3-D with `offs`, varlen M): scale_a [M] fp32, scale_b [G, N] fp32,
  both contiguous; `offs` int32 group ends; any group size, empty groups included. Its FP8
  row-wise kernel is Hopper's (sm_90 only; torch's own tests expect it to fail on sm_100+).
  Per-tensor scales are passed as row-wise ones, each row repeating its tensor's scale (the same
  product). Rows past offs[-1] are unspecified.

Block scaling (1x128 / 128x128) has no kernel on torch 2.11 for sm_90: it stays emulated.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from te_seq.kernels.fp8_reference import QuantBlock, QuantizedTensor

ROWWISE = QuantBlock(1, None)
PER_TENSOR = QuantBlock(None, None)
# Float8BlockScaling's (x or dy, W): 1x128 tiles along K, 128x128 weight blocks
BLOCK_SCALED = (QuantBlock(1, 128), QuantBlock(128, 128))
_ALIGN = 16  # elements of K and N (16-byte strides of 1-byte FP8 data)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device (tests replace this function to fake a GPU)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def forward_reason(
    blocks: tuple[QuantBlock, QuantBlock], dtypes: tuple[torch.dtype, torch.dtype],
    gemm_dtype: torch.dtype, device: torch.device, dims: list[tuple[int, int]], grouped: bool,
) -> str:
    """Why the forward GEMMs of shapes `dims` ((K, N) each) cannot run on PyTorch's scaled
    matmul for operands quantized with `blocks` (x's, W's) into FP8 `dtypes`, in `gemm_dtype`
    on `device` ("" when they can). Never raises, never touches a GPU that is not there."""
    name = "_scaled_grouped_mm" if grouped else "_scaled_mm"
    if not hasattr(torch, name):
        return f"torch {torch.__version__} has no torch.{name}"
    why = operands_reason(f"torch.{name}", blocks, dtypes, device, " for sm_90 in torch 2.11")
    if why:
        return why
    if torch.version.hip is not None:  # ROCm's FP8 GEMMs take other formats (e4m3fnuz)
        return "ROCm: te_seq's FP8 formats are NVIDIA's (E4M3/E5M2 fn)"
    major, minor = cuda_capability(device)
    if (major, minor) < (9, 0) or (grouped and major != 9):
        needs = "sm_90 (Hopper) exactly" if grouped else "sm_90 or newer"
        return f"torch.{name} in FP8 needs {needs}, the GPU is sm_{major}{minor}"
    return output_reason(f"torch.{name}", gemm_dtype, dims)


def output_reason(kernel: str, gemm_dtype: torch.dtype, dims: list[tuple[int, int]]) -> str:
    """What every FP8 GEMM here needs of its output and widths ("" when met): a bfloat16 GEMM
    dtype and K, N (each of `dims`) multiples of 16 (16-byte rows of FP8 data). `kernel` names
    the kernel in the reason."""
    if gemm_dtype != torch.bfloat16:
        return f"the GEMM dtype is {gemm_dtype}, {kernel} outputs bfloat16 only"
    for k, n in dims:
        if k % _ALIGN or n % _ALIGN:
            return f"K={k}, N={n}: both must be multiples of {_ALIGN} for {kernel}"
    return ""


def operands_reason(kernel: str, blocks: tuple[QuantBlock, QuantBlock],
                    dtypes: tuple[torch.dtype, torch.dtype], device: torch.device,
                    where: str = "", block_scaled: bool = False) -> str:
    """What every FP8 GEMM here needs of its operands ("" when met): the same per-tensor or
    row-wise blocks on both, or with `block_scaled` (a kernel that takes them) also
    `BLOCK_SCALED` (1x128 / 128x128); E4M3 data; CUDA. `kernel` names the kernel in the
    reason, `where` the context of a missing block-scaled kernel."""
    rowwise = blocks[0] == blocks[1] and blocks[0] in (ROWWISE, PER_TENSOR)
    if not rowwise and not (block_scaled and tuple(blocks) == BLOCK_SCALED):
        shown = "/".join(f"{b.rows or 'all'}x{b.cols or 'all'}" for b in blocks)
        takes = "per-tensor, row-wise or 1x128/128x128" if block_scaled else \
            "per-tensor or row-wise"
        missing = "" if block_scaled else f" (no block-scaled FP8 kernel{where})"
        return f"{kernel} takes {takes} scales, not {shown} blocks{missing}"
    if any(d != torch.float8_e4m3fn for d in dtypes):
        return f"{kernel} takes E4M3 operands, got {dtypes[0]}/{dtypes[1]}"
    if device.type != "cuda":
        return f"data on {device.type}, not CUDA"
    return ""


def _is_per_tensor(q: QuantizedTensor) -> bool:
    return q.block == PER_TENSOR


def scaled_mm(x: QuantizedTensor, w: QuantizedTensor, out_dtype: torch.dtype) -> Tensor:
    """y [M, N] = x wᵀ on FP8 data: x [M, K], w [N, K], both E4M3 with per-tensor ([1, 1]) or
    per-row ([M, 1], [N, 1]) `scale_inv`. Checked by `forward_reason` first."""
    m, n = x.data.shape[0], w.data.shape[0]
    if m == 0:
        return torch.zeros(0, n, dtype=out_dtype, device=x.data.device)
    if _is_per_tensor(x):
        scale_a, scale_b = x.scale_inv.reshape(()), w.scale_inv.reshape(())
    else:
        scale_a = x.scale_inv.reshape(m, 1).contiguous()
        scale_b = w.scale_inv.reshape(1, n).contiguous()
    return torch._scaled_mm(x.data.contiguous(), w.data.contiguous().t(), scale_a=scale_a,
                            scale_b=scale_b, out_dtype=out_dtype)


def rowwise_scales(x: QuantizedTensor, w_scale_inv: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """The grouped kernels' dequantization scales: (x's [M] fp32, W's [G, N] fp32), contiguous,
    from per-tensor or per-row `scale_inv`s (x's [1, 1] or [M, 1], W's [G, 1, 1] or [G, N, 1]);
    a per-tensor scale is repeated along its rows (the same product)."""
    m, g = x.data.shape[0], w_scale_inv.shape[0]
    scale_a = x.scale_inv.reshape(-1)  # [M] (row-wise [M, 1]: a view, no copy)
    if scale_a.shape[0] != m or not scale_a.is_contiguous():  # per tensor: repeated
        scale_a = scale_a.expand(m).contiguous()
    scale_b = w_scale_inv.reshape(g, -1)  # [G, N]
    if scale_b.shape[1] != n or not scale_b.is_contiguous():
        scale_b = scale_b.expand(g, n).contiguous()
    return scale_a, scale_b


def scaled_grouped_mm(
    x: QuantizedTensor, w_data: Tensor, w_scale_inv: Tensor, offs: Tensor,
    out_dtype: torch.dtype,
) -> Tensor:
    """y [M, N]: rows of group g = x[rows of g] w_data[g]ᵀ, on FP8 data. x [M, K] (per-tensor or
    per-row `scale_inv`), w_data [G, N, K] E4M3 with w_scale_inv [G, 1, 1] (per tensor) or
    [G, N, 1] (per row), offs [G] cumulative row ends. Checked by `forward_reason` first."""
    m, n = x.data.shape[0], w_data.shape[1]
    if m == 0:
        return torch.zeros(0, n, dtype=out_dtype, device=w_data.device)
    scale_a, scale_b = rowwise_scales(x, w_scale_inv, n)
    return torch._scaled_grouped_mm(
        x.data.contiguous(), w_data.contiguous().transpose(1, 2), scale_a, scale_b,
        offs=offs.to(torch.int32), out_dtype=out_dtype,
    )
