"""Per-expert biases of the grouped GEMMs in plain PyTorch: the add (for backends whose GEMM
has no bias epilogue) and the bias gradient as one segmented column sum.

Shape legend: M rows (tokens, sorted by expert), E experts, N output columns. ``offs`` [E] are
the int32 cumulative row ends on the data's device; nothing here reads them on the host, so
these run inside CUDA graphs and trace under torch.compile without data-dependent guards.
"""

from __future__ import annotations

import torch
from torch import Tensor


def row_groups(offs: Tensor, rows: int) -> Tensor:
    """Expert of every row [M] (int64); rows past ``offs[-1]`` get E (one past the last)."""
    positions = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, positions, right=True)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def group_bias_rows(
    bias: Tensor, offs: Tensor, rows: int, scales: Tensor | None, dtype: torch.dtype
) -> Tensor:
    """b_e(t) (· s_t) per row [M, N] in ``dtype``; zero for rows past ``offs[-1]``.

    bias [E, N], scales [M] or None."""
    padded = torch.cat([bias.to(dtype), bias.new_zeros(1, bias.shape[1], dtype=dtype)])
    per_row = padded[row_groups(offs, rows)]  # [M, N]
    if scales is not None:
        per_row = per_row * scales.reshape(-1, 1).to(dtype)
    return per_row


def add_group_bias(
    y: Tensor, bias: Tensor | None, offs: Tensor, scales: Tensor | None = None
) -> Tensor:
    """y_t + (s_t ·) b_e(t) for the rows of every expert e, computed in float32 (float64 stays
    float64) and rounded once to ``y.dtype``; ``y`` unchanged without bias.

    y [M, N], bias [E, N], scales [M] or None. Rows past ``offs[-1]`` stay as they are."""
    if bias is None:
        return y
    acc = _acc_dtype(y.dtype)
    return (y.to(acc) + group_bias_rows(bias, offs, y.shape[0], scales, acc)).to(y.dtype)


def group_col_sums(dout: Tensor, offs: Tensor, scales: Tensor | None = None) -> Tensor:
    """db_e = Σ_{rows t of e} (s_t ·) dout_t -> [E, N] in float32 (float64 for float64 data).

    The gradient of a per-expert bias: one pass over dout [M, N] (an index_add by row group);
    rows past ``offs[-1]`` are dropped. scales [M] or None (the bias was scaled per row)."""
    acc = _acc_dtype(dout.dtype)
    num_groups = offs.shape[0]
    rows = dout.to(acc)
    if scales is not None:
        rows = rows * scales.reshape(-1, 1).to(acc)
    sums = torch.zeros(num_groups + 1, dout.shape[1], device=dout.device, dtype=acc)
    sums.index_add_(0, row_groups(offs, dout.shape[0]), rows)
    return sums[:num_groups]


def bias_scale_grads(dout: Tensor, bias: Tensor, offs: Tensor) -> Tensor:
    """ds_t = dout_t · b_e(t) -> [M] in float32 (float64 for float64 data): the gradient of the
    per-row bias scale s_t in y_t = x_t W_eᵀ + s_t b_e."""
    acc = _acc_dtype(dout.dtype)
    per_row = group_bias_rows(bias, offs, dout.shape[0], None, acc)
    return (dout.to(acc) * per_row).sum(-1)
