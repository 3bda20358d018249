"""MoE token routing maths: permute tokens by expert, count rows per expert, un-permute.

Shape legend: T tokens, k experts per token (top-k), N = T·k routed rows, E experts, H hidden.
A *slot* is one (token t, choice j) pair, numbered t·k + j in the flattened top-k indices.

Every function runs on any device without a host sync (no `.item()`, no data-dependent
shapes): on CUDA a whole dispatch / combine can be captured in a CUDA graph. Out-of-range
expert indices fail the device-side bounds check of `scatter_add_` on CUDA; on host tensors
the ops check them first (`check_expert_indices`) and raise a ValueError.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sort_slots(expert_of_slot: Tensor) -> tuple[Tensor, Tensor]:
    """(order [N], row_of_slot [N]) for the flattened expert index of every slot [N].

    `order[r]` is the slot that becomes routed row r: rows sorted by expert, ties kept in slot
    order (token, then choice), so the order is stable and deterministic. `row_of_slot` is the
    inverse permutation: row_of_slot[order[r]] = r."""
    order = torch.sort(expert_of_slot, stable=True).indices  # [N]
    return order, invert_permutation(order)


def invert_permutation(perm: Tensor) -> Tensor:
    """inv with inv[perm[i]] = i, for a permutation `perm` [N] of 0 .. N-1 (one integer
    scatter: with it, moving H-wide rows by the inverse is a gather, `rows.index_select(0,
    inv)`, rather than an indexed store, `out[perm] = rows`, which is ~3x slower on CUDA)."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device, dtype=perm.dtype)
    return inv


def count_rows(expert_of_slot: Tensor, num_experts: int) -> Tensor:
    """Rows per expert, int64 [E], on the indices' device.

    `torch.bincount` would read the largest index on the host (a sync on CUDA); an integer
    `scatter_add_` counts without one, and integer adds make it deterministic."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=expert_of_slot.device)
    ones = torch.ones_like(expert_of_slot, dtype=torch.int64)
    return counts.scatter_add_(0, expert_of_slot.to(torch.int64), ones)


def permute_rows(x: Tensor, order: Tensor, k: int) -> Tensor:
    """rows[r] = x[order[r] // k]: token rows [T, H] gathered into routed rows [N, H]."""
    return x.index_select(0, torch.div(order, k, rounding_mode="floor"))


def unpermute_rows(rows: Tensor, row_of_slot: Tensor) -> Tensor:
    """y[t] = Σ_j rows[row_of_slot[t, j]]: routed rows [N, H] summed back per token [T, H].

    A gather and a sum over the k choices, in choice order: deterministic (a float
    `index_add_` would add with atomics on CUDA, in no fixed order)."""
    T, k = row_of_slot.shape
    gathered = rows.index_select(0, row_of_slot.reshape(-1))  # [T·k, H]
    return gathered.reshape(T, k, rows.shape[-1]).sum(1)  # [T, H]


def unpermute_rows_backward(grad: Tensor, row_of_slot: Tensor) -> Tensor:
    """The adjoint of `unpermute_rows`: d rows[row_of_slot[t, j]] = dy[t]  ([T, H] -> [N, H]).

    `row_of_slot` is a permutation of the rows, so row r is dy of the token of the slot that
    maps to it: one gather of dy (no [N, H] copy in slot order, no indexed store)."""
    k = row_of_slot.shape[1]
    slot_of_row = invert_permutation(row_of_slot.reshape(-1))  # [N]
    return grad.index_select(0, torch.div(slot_of_row, k, rounding_mode="floor"))


def permute_rows_backward(grad_rows: Tensor, row_of_slot: Tensor) -> Tensor:
    """The adjoint of `permute_rows`: dx[t] = Σ_j d rows[row_of_slot[t, j]]  ([N, H] -> [T, H])."""
    return unpermute_rows(grad_rows, row_of_slot)


def permute_slot_values(values: Tensor, order: Tensor) -> Tensor:
    """Per-slot values [T, k] (router probabilities) in routed-row order [N]."""
    return values.reshape(-1).index_select(0, order)


def unpermute_slot_values(row_values: Tensor, row_of_slot: Tensor) -> Tensor:
    """The adjoint of `permute_slot_values`: [N] in row order -> [T, k] in slot order."""
    return row_values.index_select(0, row_of_slot.reshape(-1)).reshape(row_of_slot.shape)
