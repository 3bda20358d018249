"""The tile scheduler of the grouped GEMM: which group, m-tile and n-tile a work unit is.

Work is cut into cluster units (``cluster_m`` m-tiles × ``cluster_n`` n-tiles of one group) that
persistent clusters walk with a fixed stride (unit = cluster id, + grid size, ...), m fastest
within a group. Varlen M finds a unit's group from the device prefix sums ``offs`` by a
warp-cooperative scan that only moves forward; varlen K has the same units in every group.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


class _Schedule(NamedTuple):
    """What the producer and the consumers need to walk the same work units (trace-time)."""

    offs: object  # int32 [E] cumulative group ends (device)
    num_rows: object  # M
    k_dim: object  # K (varlen M)
    n_tiles: object  # cluster n-units per group
    m_units_k: object  # cluster m-units per group (varlen K)
    cluster_coord: object  # this CTA's (m, n, 1) coordinate in its cluster


class TileSchedulerMixin:
    """Decodes work units (``_work``) for ``GroupedGemmKernel``; the producer and the consumers
    call it with the same units, so they walk the same tiles. Uses the kernel's ``varlen``,
    ``tile_mnk`` and ``cluster_m``.
    """

    @cute.jit
    def _scan_groups(self, offs: cute.Tensor, num_rows: Int32, n_tiles: Int32, unit: Int32, st):
        """Move the cached group forward until it holds ``unit`` (varlen M).

        ``st`` = (group, first unit, end unit, next group to scan, its first unit, row start,
        row count). Group E (one past the last) is virtual: rows past ``offs[-1]``, written as
        zeros.
        Each round loads 32 groups' sizes, one per lane, and finds the first whose units end past
        ``unit`` by an inclusive warp scan and a ballot.
        """
        group, first, end, nxt, nxt_first, row0, rows = st
        num_groups = cute.size(offs) + 1
        block_m = self.tile_mnk[0] * self.cluster_m
        lane = cute.arch.lane_idx()
        while (unit >= end) & (nxt < num_groups):
            g = nxt + lane
            g_begin = Int32(0)
            g_end = Int32(0)
            if g < num_groups:
                if g > 0:
                    g_begin = offs[g - 1]
                if g < num_groups - 1:
                    g_end = offs[g]
                else:
                    g_end = num_rows
            count = (g_end - g_begin + block_m - 1) // block_m * n_tiles
            incl = count
            for i in cutlass.range_constexpr(5):
                up = cute.arch.shuffle_sync_up(incl, 1 << i)
                if lane >= (1 << i):
                    incl = incl + up
            j = cute.arch.popc(cute.arch.vote_ballot_sync(nxt_first + incl <= unit))
            if j < 32:
                group = nxt + j
                end = nxt_first + cute.arch.shuffle_sync(incl, j)
                first = end - cute.arch.shuffle_sync(count, j)
                row0 = cute.arch.shuffle_sync(g_begin, j)
                rows = cute.arch.shuffle_sync(g_end, j) - row0
                nxt = group + 1
                nxt_first = end
            else:
                nxt = nxt + 32
                nxt_first = nxt_first + cute.arch.shuffle_sync(incl, 31)
        return group, first, end, nxt, nxt_first, row0, rows

    @cute.jit
    def _work(self, offs, num_rows, n_tiles, m_units_k, unit, st):
        """Decode ``unit``: (valid, group, m-unit, n-unit, row start, rows, new scan state)."""
        if const_expr(self.varlen == "m"):
            st = self._scan_groups(offs, num_rows, n_tiles, unit, st)
            group, first, end, _, _, row0, rows = st
            valid = unit < end
            block_m = self.tile_mnk[0] * self.cluster_m
            m_units = (rows + block_m - 1) // block_m
            local = unit - first
            m_units = cutlass.max(m_units, 1)
            return valid, group, local % m_units, local // m_units, row0, rows, st
        else:
            per_group = m_units_k * n_tiles
            group = unit // per_group
            local = unit - group * per_group
            valid = group < cute.size(offs)
            row0 = Int32(0)
            row1 = Int32(0)
            if valid:
                row1 = offs[group]
                if group > 0:
                    row0 = offs[group - 1]
            return valid, group, local % m_units_k, local // m_units_k, row0, row1 - row0, st
