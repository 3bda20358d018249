"""The "torch" backend: te_seq's grouped GEMMs on ``torch._grouped_mm``.

Activations use the reference maths, compiled on CUDA (``te_seq.kernels.gpu_backend``).

Same signatures and maths as ``te_seq.kernels.reference`` (read its docstrings first). Shape legend:
M rows (tokens), E groups (experts), K reduction dim, N output dim, A row alignment of a padded
layout, P = M + E·(A − 1) rows of a padded layout (a static bound: no split size is read).

Nothing here synchronises with the host: ``offs`` stays on the device and is only used by device
ops (``searchsorted``, ``cumsum``, ``index_copy_``), every shape is a function of M, E, K and N, so
the functions can be captured in a CUDA graph and replayed with new split sizes.

Which path runs (decided from dtypes, device and strides only):

* **native** — ``torch._grouped_mm`` (2D×3D with ``offs`` for varlen-M, 2D×2D for varlen-K).
  CUDA: bf16 in and out on sm_90+ (torch 2.11 takes a host-syncing per-group fallback for any
  other dtype or older GPU, so those go to the tiled path). CPU: fp32/fp16/bf16 with the output
  in the input dtype. ``torch._grouped_mm`` wants 16-byte strides: an operand whose K or N is not
  a multiple of 16/itemsize elements, or whose layout is not 16-byte aligned, is first copied
  into a zero-padded buffer (costs one copy of that operand, weights included, per call; real
  model widths are multiples of 8, so te_seq's MLPs never pay it).
  The 2D×2D (wgrad) form takes groups that start on any row when both operands are row-major
  (``grad_out.t()`` and ``x`` are then strided along the rows by N and K elements, so every
  group start is 16-byte aligned once the widths are; verified on an H100 with torch 2.11,
  ``tests/kernels/test_torch_backend.py``; it is what autograd's own ``_grouped_mm`` backward
  runs). An operand contiguous along the rows (a transposed view) makes torch's kernel assert on
  the device that every group spans a multiple of 16 bytes, so then both operands are first
  scattered into zero buffers with 8-row group boundaries (``_padded_layout``: one extra read
  and write of both; also the path for unaligned widths).
  A wgrad written into a float32 ``out`` (``main_grad``) is rounded to the input dtype first,
  since ``torch._grouped_mm`` only writes bf16 on CUDA: one bf16 rounding per call that the
  reference does not make.
* **tiled** — exact and sync-free, for correctness rather than speed: float64 anywhere, fp32/fp16
  on CUDA, an ``out_dtype`` other than the input dtype, mixed operand dtypes, GPUs before sm_90,
  torch without ``_grouped_mm``. Groups are padded to 64-row tiles (A = 64), and each tile is
  multiplied by its own group's weight with ``bmm`` in float32 (float64 stays float64), in chunks
  of tiles bounded to 256 MiB of gathered weights. Costs (M + 63E)·K·N multiply-adds and a weight
  gather per tile.

One difference from the reference on every path: rows past ``offs[-1]`` of ``grouped_mm``'s
output are unspecified (te_seq's ops check ``offs[-1] == M`` on the device). Zeroing them would
cost a full extra pass over the output, ~35% of FC2's time on shape Q by bandwidth estimate.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from te_seq.kernels.backend import register_backend
from te_seq.kernels.bias import add_group_bias
from te_seq.kernels.gpu_backend import GpuBackend

_TILE = 64  # rows per tile of the tiled path
_CHUNK_BYTES = 256 << 20  # gathered weights per bmm of the tiled path
_CPU_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def available() -> tuple[bool, str]:
    """Whether this backend can run here, and why not."""
    if hasattr(torch, "_grouped_mm"):
        return True, ""
    return False, f"torch {torch.__version__} has no torch._grouped_mm (added in torch 2.8)"


# --------------------------------------------------------------------------- path choice


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _native_ok(
    dtypes: tuple[torch.dtype, ...], out_dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether ``torch._grouped_mm`` runs these operands exactly, without a host sync."""
    if not hasattr(torch, "_grouped_mm") or any(d != out_dtype for d in dtypes):
        return False
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return out_dtype == torch.bfloat16 and _cuda_capability(index) >= (9, 0)
    return device.type == "cpu" and out_dtype in _CPU_NATIVE_DTYPES


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _aligned(t: Tensor, align: int) -> bool:
    """16-byte strides in the last two dims (row- or column-major) and a 16-byte base address."""
    rows, cols = t.shape[-2:]
    s_row, s_col = t.stride()[-2:]
    row_major = s_col == 1 and s_row % align == 0 and s_row >= cols
    col_major = s_row == 1 and s_col % align == 0 and s_col >= rows
    batch_ok = t.dim() == 2 or t.stride(0) % align == 0
    return (row_major or col_major) and batch_ok and t.data_ptr() % 16 == 0


# --------------------------------------------------------------------------- padded row layout


class _Layout(NamedTuple):
    dest: Tensor  # [M] int64: row of the padded buffer for each input row (P for rows past the end)
    padded_offs: Tensor  # [E] int32: group ends in the padded buffer
    num_rows: int  # P, a multiple of the alignment


def _padded_layout(offs: Tensor, num_rows: int, align: int) -> _Layout:
    """Where each row goes when every group starts at a multiple of ``align`` rows (device ops)."""
    num_groups = offs.shape[0]
    ends = offs.long()  # [E]
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))  # [E]
    padded_sizes = (sizes + align - 1) // align * align  # [E]
    padded_ends = padded_sizes.cumsum(0)  # [E]
    rows = torch.arange(num_rows, device=offs.device)  # [M]
    group = torch.searchsorted(ends, rows, right=True)  # [M], E past the last group
    g = group.clamp(max=num_groups - 1)
    dest = rows - (ends - sizes)[g] + (padded_ends - padded_sizes)[g]  # [M]
    padded_rows = _round_up(num_rows + num_groups * (align - 1), align)  # P
    dest = torch.where(group < num_groups, dest, padded_rows)
    return _Layout(dest, padded_ends.int(), padded_rows)


def _scatter_rows(x: Tensor, layout: _Layout, width: int, dtype: torch.dtype) -> Tensor:
    """x [M, C] -> zero buffer [P, width] with x's rows at ``layout.dest`` (dump row dropped)."""
    buf = x.new_zeros(layout.num_rows + 1, width, dtype=dtype)  # [P + 1, width]
    buf[:, : x.shape[1]].index_copy_(0, layout.dest, x.to(dtype))
    return buf[: layout.num_rows]  # [P, width]


def _tile_groups(layout: _Layout, tile: int) -> Tensor:
    """[P / tile] int64: the group of every tile of a layout aligned to ``tile`` rows."""
    starts = torch.arange(0, layout.num_rows, tile, device=layout.dest.device)
    group = torch.searchsorted(layout.padded_offs.long(), starts, right=True)
    return group.clamp(max=layout.padded_offs.shape[0] - 1)  # tiles past the end hold zeros


def _chunks(num_tiles: int, bytes_per_tile: int) -> list[slice]:
    step = max(1, _CHUNK_BYTES // max(1, bytes_per_tile))
    return [slice(i, min(i + step, num_tiles)) for i in range(0, num_tiles, step)]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- varlen-M


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """Varlen-M grouped GEMM: ``out[rows of e] = a[rows of e] @ b[e]``.

    a: [M, K], b: [E, K, N] (any strides), offs: [E] cumulative row ends on a's device ->
    out: [M, N] in ``out_dtype`` (default ``a.dtype``), float32 accumulation. See the module
    docstring for the paths and for rows past ``offs[-1]``.
    """
    out_dtype = out_dtype or a.dtype
    offs = offs.to(torch.int32)
    if _native_ok((a.dtype, b.dtype), out_dtype, a.device):
        return _native_mm(a, b, offs)
    return _tiled_mm(a, b, offs, out_dtype)


def _native_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    align = 16 // a.element_size()
    k, n = b.shape[1], b.shape[2]
    kp, np_ = _round_up(k, align), _round_up(n, align)
    # a must be row-major: with M contiguous, every group boundary would need 16-byte alignment.
    if kp != k or not _aligned(a, align) or a.stride(-1) != 1:
        a = F.pad(a, (0, kp - k)).contiguous()  # [M, Kp], zero columns
    if kp != k or np_ != n or not _aligned(b, align):
        b = F.pad(b, (0, np_ - n, 0, kp - k)).contiguous()  # [E, Kp, Np], zero rows/columns
    out = torch._grouped_mm(a, b, offs=offs)  # [M, Np]
    return out if np_ == n else out[:, :n].contiguous()  # [M, N]


def _tiled_mm(a: Tensor, b: Tensor, offs: Tensor, out_dtype: torch.dtype) -> Tensor:
    acc = _acc_dtype(a.dtype)
    num_rows, k = a.shape
    n = b.shape[2]
    layout = _padded_layout(offs, num_rows, _TILE)
    tiles = _scatter_rows(a, layout, k, acc).view(-1, _TILE, k)  # [P/64, 64, K]
    groups = _tile_groups(layout, _TILE)  # [P/64]
    out = tiles.new_empty(tiles.shape[0], _TILE, n)  # [P/64, 64, N]
    for c in _chunks(tiles.shape[0], k * n * tiles.element_size()):
        out[c] = torch.bmm(tiles[c], b[groups[c]].to(acc))  # out_t = a_t @ b[group(t)]
    rows = layout.dest.clamp(max=layout.num_rows - 1)  # rows past the end: unspecified
    return out.view(layout.num_rows, n)[rows].to(out_dtype)  # [M, N]


# --------------------------------------------------------------------------- varlen-K


def grouped_wgrad(
    grad_out: Tensor,
    x: Tensor,
    offs: Tensor,
    out: Tensor | None = None,
    accumulate: bool = False,
) -> Tensor:
    """Varlen-K grouped GEMM (weight gradient): ``out[e] = grad_out[rows of e]ᵀ @ x[rows of e]``.

    grad_out: [M, N], x: [M, K], offs: [E] -> out: [E, N, K]; an empty group gives zeros. With
    ``out`` given the result is written there (``accumulate=True``: added to it), in ``out.dtype``;
    otherwise a new tensor in ``x.dtype``.
    """
    offs = offs.to(torch.int32)
    if _native_ok((grad_out.dtype, x.dtype), x.dtype, x.device):
        result = _native_wgrad(grad_out, x, offs, _wgrad_row_align(grad_out, x))
    else:
        result = _tiled_wgrad(grad_out, x, offs)
    if out is None:
        return result.to(x.dtype).contiguous()
    if accumulate:
        return out.add_(result)
    return out.copy_(result)


def _wgrad_row_align(grad_out: Tensor, x: Tensor) -> int:
    """Rows per group boundary the CUDA wgrad needs: 1 for row-major operands (a group start
    moves the pointer by whole rows, 16-byte aligned with the widths), else 16 bytes of rows
    (torch's kernel asserts on the device that a group spans a multiple of 16 bytes along a
    contiguous token dim)."""
    if x.device.type != "cuda" or (grad_out.stride(-1) == 1 and x.stride(-1) == 1):
        return 1
    return 16 // x.element_size()


def _native_wgrad(grad_out: Tensor, x: Tensor, offs: Tensor, row_align: int) -> Tensor:
    """``row_align`` > 1 moves every group to a multiple of that many rows (unaligned widths are
    padded in the same pass)."""
    align = 16 // x.element_size()
    n, k = grad_out.shape[1], x.shape[1]
    np_, kp = _round_up(n, align), _round_up(k, align)
    widths_ok = np_ == n and kp == k and _aligned(grad_out, align) and _aligned(x, align)
    if row_align > 1 or not widths_ok:
        layout = _padded_layout(offs, x.shape[0], row_align)
        grad_out = _scatter_rows(grad_out, layout, np_, x.dtype)  # [P, Np]
        x = _scatter_rows(x, layout, kp, x.dtype)  # [P, Kp]
        offs = layout.padded_offs
    result = torch._grouped_mm(grad_out.t(), x, offs=offs)  # [E, Np, Kp]; dW_e = dY_eᵀ X_e
    return result[:, :n, :k]  # [E, N, K]


def _tiled_wgrad(grad_out: Tensor, x: Tensor, offs: Tensor) -> Tensor:
    acc = _acc_dtype(x.dtype)
    n, k = grad_out.shape[1], x.shape[1]
    layout = _padded_layout(offs, x.shape[0], _TILE)
    dy = _scatter_rows(grad_out, layout, n, acc).view(-1, _TILE, n)  # [P/64, 64, N], zero pads
    xs = _scatter_rows(x, layout, k, acc).view(-1, _TILE, k)  # [P/64, 64, K]
    groups = _tile_groups(layout, _TILE)  # [P/64]
    result = xs.new_zeros(offs.shape[0], n, k)  # [E, N, K]
    for c in _chunks(xs.shape[0], n * k * xs.element_size()):
        partial = torch.bmm(dy[c].transpose(1, 2), xs[c])  # [tiles, N, K]; dW_t = dY_tᵀ X_t
        result.index_add_(0, groups[c], partial)
    return result


class TorchBackend(GpuBackend):
    """The "torch" backend: the grouped GEMMs above (any dtype, CUDA or CPU data; "auto" picks it
    for CUDA data only) and the compiled elementwise maths of `GpuBackend`."""

    name = "torch"
    auto_priority = 10

    def available(self) -> tuple[bool, str]:
        return available()

    def grouped_mm(self, a, b, offs, bias=None, bias_scales=None) -> Tensor:
        # the bias goes on after the GEMM (in fp32, one more rounding of the GEMM's output)
        return add_group_bias(grouped_mm(a, b, offs), bias, offs, bias_scales)

    def grouped_wgrad(self, grad_out, x, offs, out=None, accumulate=False) -> Tensor:
        return grouped_wgrad(grad_out, x, offs, out=out, accumulate=accumulate)


TORCH = register_backend(TorchBackend())
