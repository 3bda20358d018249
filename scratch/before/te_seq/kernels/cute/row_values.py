"""Per-row registers of the fused epilogues: one fp32 per distinct row a thread holds.

A thread's accumulator values of one (tm x 32) epilogue subtile lie on few rows: in a 64-row
WGMMA atom lane l of warp w holds rows 16w + l // 4 and 16w + l // 4 + 8, so 2 rows per thread
when each warpgroup owns 64 rows (cooperative) and 4 when one warpgroup owns the 128-row tile
(ping-pong: rows r, r + 8, r + 64, r + 72). The router probs p[row] and the d(probs) partial
sums Σ_j dA·act(gate)·up are per row, so they take one register per row ("row slot") instead
of one per accumulator value (16 or 32): the ping-pong GLU epilogues otherwise spill.

The row of value v is the thread's own base row plus a static offset that is the same for
every thread (the accumulator layout is affine in the thread index), so the slots are found
at trace time from the offsets of the coordinate view (``row_slots``).

Subtiles of 64 rows (``epi_rows`` 64, ping-pong): a warpgroup's 128-row tile is cut into
(64 x 32) subtiles, s = 2·(column block) + (row half), so each subtile holds half the values
(16 per thread) and the per-subtile registers (h, outputs) halve. ``_sub_index`` maps value v
of subtile s onto the accumulator; ``_check_subtiles`` verifies that map against the
coordinate view at trace time.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32


class RowSlots(NamedTuple):
    """Trace-time map between a subtile's values and the thread's distinct rows."""

    first_index: tuple[int, ...]  # per slot: the first flat accumulator index on that row
    slot_of: tuple[int, ...]  # per flat accumulator index (tRS_acc's order): its slot


def _static_offsets(kernel: object, coords, count: int) -> list[tuple[int, int]]:
    """The (row, col) offsets from the thread's own base of flat values 0 .. count - 1 of a
    coordinate view (its layout's image; trace time)."""
    offsets = [tuple(coords.layout(i)) for i in range(count)]
    if not all(len(o) == 2 and all(isinstance(x, int) for x in o) for o in offsets):
        raise ValueError(f"{type(kernel).__name__}: accumulator offsets are not static: "
                         f"{offsets[:4]}")
    return offsets


class RowValuesMixin:
    """Row-slot and subtile-index helpers of the epilogue kernels; uses ``_acc_index``
    (``store_epilogue``), ``epi_tile`` and ``tile_mnk``."""

    def _halves(self) -> int:
        """Row subtiles per tile: 1 (128-row subtiles) or 2 (64-row, ``epi_rows``)."""
        return self.tile_mnk[0] // self.epi_tile[0]

    def _sub_index(self, ep, s: int, v: int) -> int:
        """Flat index in ``tRS_acc`` (and coordinate views retiled alike) of value ``v`` (rD's
        order) of subtile ``s`` (trace time). 128-row subtiles: ``_acc_index``. 64-row ones:
        s = 2·col + half; rD is (copy values, 1, 16-column chunks) and tRS_acc ((copy values,
        tile chunks), 2 m-atoms, 1) with the 64-row m-atom ``half``."""
        halves = self._halves()
        if halves == 1:
            return self._acc_index(ep, s, v)
        col, half = divmod(s, halves)
        values, chunks = cute.size(ep.rD, mode=[0]), cute.size(ep.rD, mode=[2])
        tile_chunks = cute.size(ep.tRS_acc) // (values * halves)
        value, chunk = v % values, v // values
        return value + values * (col * chunks + chunk) + values * tile_chunks * half

    def _check_subtiles(self, ep, coords) -> None:
        """Trace-time check of ``_sub_index``: value v of subtile s = 2·col + half sits at
        value v of subtile 0 moved by (epi_rows · half, 32 · col)."""
        offsets = _static_offsets(self, coords, cute.size(ep.tRS_acc))
        halves, size_rD = self._halves(), cute.size(ep.rD)
        for s in range(self.tile_mnk[1] // 32 * halves):
            col, half = divmod(s, halves)
            for v in range(size_rD):
                r0, c0 = offsets[self._sub_index(ep, 0, v)]
                r, c = offsets[self._sub_index(ep, s, v)]
                if (r - r0, c - c0) != (self.epi_tile[0] * half, 32 * col):
                    raise ValueError(
                        f"{type(self).__name__}: subtile {s} value {v} at {(r, c)}, "
                        f"expected {(r0 + self.epi_tile[0] * half, c0 + 32 * col)}"
                    )

    def _row_slots(self, ep, coords) -> RowSlots:
        """The row slots of the tile's accumulator values (trace time). ``coords``: the tile's
        identity tensor partitioned and retiled like the accumulator (``tRS_acc``'s order);
        its layout maps a flat value index to the (row, col) offset from the thread's own
        base."""
        rows = [o[0] for o in _static_offsets(self, coords, cute.size(ep.tRS_acc))]
        distinct = sorted(set(rows))
        first = tuple(rows.index(r) for r in distinct)
        return RowSlots(first, tuple(distinct.index(r) for r in rows))

    @cute.jit
    def _load_row_probs(self, ep, coords, slots: RowSlots, probs, row_base):
        """Router probs of this thread's rows, one fp32 per slot: unpredicated loads clamped
        to the last row of ``probs`` (rows past the tile are never stored)."""
        r_p = cute.make_rmem_tensor((len(slots.first_index),), Float32)
        last_row = cute.size(probs) - 1
        for s in cutlass.range_constexpr(len(slots.first_index)):
            row = row_base + coords[slots.first_index[s]][0]
            r_p[s] = probs[cutlass.min(row, last_row)].to(Float32)
        return r_p

    @cute.jit
    def _per_value(self, ep, r_rows, slots: RowSlots, sub: int):
        """The per-row registers ``r_rows`` spread over subtile ``sub``'s values (rD's shape),
        as an SSA vector: register moves only, live while the subtile's maths uses them."""
        r = cute.make_rmem_tensor(ep.rD.shape, Float32)
        for v in cutlass.range_constexpr(cute.size(ep.rD)):
            r[v] = r_rows[slots.slot_of[self._sub_index(ep, sub, v)]]
        return r.load()

    @cute.jit
    def _add_to_rows(self, ep, r_rows, values, slots: RowSlots, sub: int):
        """r_rows[slot of v] += values[v] for subtile ``sub``'s values (an SSA vector of rD's
        shape), in value order."""
        r = cute.make_rmem_tensor(ep.rD.shape, Float32)
        r.store(values)
        for v in cutlass.range_constexpr(cute.size(ep.rD)):
            s = slots.slot_of[self._sub_index(ep, sub, v)]
            r_rows[s] = r_rows[s] + r[v]

    @cute.jit
    def _add_row_sums(self, ep, r_rows, coords, slots: RowSlots, rows_here, row_base, out):
        """out[row] += the per-row partial sums ``r_rows`` reduced over the 4 lanes that share
        each row (one atomic add per row of the tile below ``rows_here``)."""
        lane = cute.arch.lane_idx()
        for s in cutlass.range_constexpr(len(slots.first_index)):
            val = r_rows[s]
            val = val + cute.arch.shuffle_sync_bfly(val, 1)
            val = val + cute.arch.shuffle_sync_bfly(val, 2)
            r = coords[slots.first_index[s]][0]
            if (lane % 4 == 0) & (r < rows_here):
                cute.arch.atomic_add(out.iterator + (row_base + r), val)
