"""The tile scheduler of the grouped GEMM: which group, m-tile and n-tile a work unit is.

Work is cut into cluster units (``cluster_m`` m-tiles × ``cluster_n`` n-tiles of one group).
Every role of a CTA (the producer warp, the MMA warpgroups) walks its cluster's units in the
same order through a cursor (``_first_cursor`` / ``_next_work``), one of two sources:

* **static** (every kernel): cluster c takes units c, c + grid, c + 2·grid, ..., m fastest
  within a group. Varlen M finds a unit's group from the device prefix sums ``offs`` by a
  warp-cooperative scan that only moves forward; varlen K has the same units in every group.
* **dynamic** (varlen K, ``dynamic_units``): the longest groups' units first, each cluster
  taking the next one when it is ready for it. One warp of the cluster's first CTA (the
  scheduler, ``_schedule_units``) fetches unit numbers from a device counter, decodes them
  through the groups' longest-first order and writes each unit into a small ring of smem
  records in every CTA of the cluster; the roles read the records (``_read_unit``). Under
  skewed split sizes a static stride leaves the clusters that drew a long group's units
  working long after the rest (a fixed assignment cannot even out units of unequal length);
  taking units as clusters free up, longest first, keeps them all busy to the end.
  The order and the counter come in one int32 tensor [E + 1] (``unit_order``: the groups
  sorted by rows, longest first, ties by index, then a zeroed counter).

**Split tails** (varlen M in 2×1 clusters, ``split_tail``): a 2×1 unit is two m-tiles of one
group sharing B by multicast, so a group whose last m-unit holds at most one tile's rows would
run its second CTA on rows past the group. Such a tail is cut the other way instead: each of
its units is the last m-tile over two neighbouring n-tiles, one per CTA, each CTA loading its
own B (``solo``). A 2×1 kernel then runs as many tiles as a 1×2 one on any split, and B is
multicast wherever a unit has two full tiles.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

# records of the dynamic schedule's smem ring: (group or -1 past the last unit, m-unit, n-unit, 0)
RECORD_WORDS = 4
RECORD_STAGES = 4  # a power of two: record r sits in slot r % 4, its phase is (r / 4) % 2
# the warps of a CTA that read every record: the producer warp and the two MMA warpgroups
RECORD_READERS = 1 + 8


class _Dynamic(NamedTuple):
    """The dynamic schedule's pieces (trace-time): the int32 [E + 1] order-and-counter tensor,
    the records' smem ring (RECORD_WORDS, RECORD_STAGES) and its full / empty mbarriers."""

    order: object
    records: object
    full: object  # pointer to RECORD_STAGES mbarriers: a record written (1 arrival + 16 bytes)
    empty: object  # pointer to RECORD_STAGES mbarriers of the cluster's first CTA: read by all


class _Schedule(NamedTuple):
    """What the producer and the consumers need to walk the same work units (trace-time)."""

    offs: object  # int32 [E] cumulative group ends (device)
    num_rows: object  # M
    k_dim: object  # K (varlen M)
    n_tiles: object  # cluster n-units per group
    m_units_k: object  # cluster m-units per group (varlen K)
    cluster_coord: object  # this CTA's (m, n, 1) coordinate in its cluster
    dynamic: object = None  # a `_Dynamic` (varlen K, ``dynamic_units``); None: static


class TileSchedulerMixin:
    """Decodes work units (``_work``) for ``GroupedGemmKernel``; the producer and the consumers
    walk the same units through ``_next_work``. Uses the kernel's ``varlen``, ``tile_mnk``,
    ``cluster_m`` / ``cluster_size`` and ``dynamic_units``.
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
            count = self._group_units(g_end - g_begin, n_tiles)
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
    def _group_units(self, rows, n_tiles):
        """Cluster units of a varlen-M group of ``rows`` rows: ⌈rows / block_m⌉ per n-unit;
        with ``split_tail`` a last m-unit of at most one tile's rows is ⌈n_tiles / 2⌉ units
        (its one m-tile over two n-tiles each) instead of ``n_tiles``."""
        block_m = self.tile_mnk[0] * self.cluster_m
        units = (rows + block_m - 1) // block_m * n_tiles
        if const_expr(self.split_tail):
            whole = self._whole_m_units(rows)
            tail_units = cutlass.select_(rows > whole * block_m, (n_tiles + 1) // 2, Int32(0))
            units = whole * n_tiles + tail_units
        return units

    def _whole_m_units(self, rows):
        """``split_tail``: the m-units of a group of ``rows`` rows with rows in both m-tiles
        (the last may be part-filled); rows past them, at most one tile's, are its tail."""
        block_m = self.tile_mnk[0] * self.cluster_m
        whole = rows // block_m
        return whole + cutlass.select_(rows - whole * block_m > self.tile_mnk[0], 1, 0)

    @cute.jit
    def _unit_tile(self, local, rows, n_tiles, cluster_coord):
        """This CTA's (m-tile, n-tile, solo) of unit ``local`` of a varlen-M group of ``rows``
        rows: m fastest over the group's whole m-units, then (``split_tail``) the tail's
        units, where the cluster's two CTAs take neighbouring n-tiles of the last m-tile and
        each loads its own B (``solo`` 1; B is multicast otherwise)."""
        block_m = self.tile_mnk[0] * self.cluster_m
        if const_expr(not self.split_tail):
            m_units = cutlass.max((rows + block_m - 1) // block_m, 1)
            m_tile, n_tile = self._cta_tile(local % m_units, local // m_units, cluster_coord)
            return m_tile, n_tile, Int32(0)
        whole = self._whole_m_units(rows)
        tail = local - whole * n_tiles  # >= 0: a unit of the tail
        m_units = cutlass.max(whole, 1)
        m_tile, n_tile = self._cta_tile(local % m_units, local // m_units, cluster_coord)
        solo = cutlass.select_(tail >= 0, Int32(1), Int32(0))
        m_tile = cutlass.select_(tail >= 0, whole * self.cluster_m, m_tile)
        n_tile = cutlass.select_(tail >= 0, tail * self.cluster_m + cluster_coord[0], n_tile)
        return m_tile, n_tile, solo

    @cute.jit
    def _work(self, sched, unit, st):
        """Decode ``unit`` for this CTA: (valid, group, m-tile, n-tile, row start, rows, solo,
        new scan state); ``solo`` is 1 where B is not multicast (``_unit_tile``)."""
        offs, num_rows, _, n_tiles, m_units_k, cluster_coord, _ = sched
        if const_expr(self.varlen == "m"):
            st = self._scan_groups(offs, num_rows, n_tiles, unit, st)
            group, first, end, _, _, row0, rows = st
            valid = unit < end
            m_tile, n_tile, solo = self._unit_tile(unit - first, rows, n_tiles, cluster_coord)
            return valid, group, m_tile, n_tile, row0, rows, solo, st
        else:
            per_group = m_units_k * n_tiles
            group = unit // per_group
            local = unit - group * per_group
            valid = group < cute.size(offs)
            row0, rows = self._group_rows(offs, group, valid)
            m_tile, n_tile = self._cta_tile(local % m_units_k, local // m_units_k, cluster_coord)
            return valid, group, m_tile, n_tile, row0, rows, Int32(0), st

    def _cta_tile(self, m_unit, n_unit, cluster_coord):
        """This CTA's (m-tile, n-tile) of the cluster unit (``m_unit``, ``n_unit``)."""
        return (
            m_unit * self.cluster_m + cluster_coord[0],
            n_unit * self.cluster_n + cluster_coord[1],
        )

    @cute.jit
    def _group_rows(self, offs, group, valid):
        """(first row, rows) of a varlen-K ``group`` ((0, 0) unless ``valid``)."""
        row0 = Int32(0)
        row1 = Int32(0)
        if valid:
            row1 = offs[group]
            if group > 0:
                row0 = offs[group - 1]
        return row0, row1 - row0

    # ------------------------------------------------------------ the roles' cursor

    @cute.jit
    def _first_cursor(self, sched):
        """Where this cluster's sequence of units starts, for ``_next_work``: static, (the
        next unit, the varlen-M scan state); dynamic, (the next record, 1 once a record past
        the last unit was read)."""
        zero = Int32(0)
        if const_expr(sched.dynamic is None):
            return (cute.arch.block_idx()[2], zero, zero, zero, zero, zero, zero, zero)
        return (zero, zero)

    @cute.jit
    def _next_work(self, sched, cursor):
        """The next unit of this cluster's sequence and the cursor after it:
        ((valid, group, m-tile, n-tile, row start, rows, solo), cursor), the tiles this CTA's.
        Past the last unit every call answers not valid (dynamic: without reading records the
        scheduler never writes)."""
        if const_expr(sched.dynamic is None):
            unit, *st = cursor
            valid, group, m_tile, n_tile, row0, rows, solo, st = self._work(
                sched, unit, tuple(st)
            )
            return (valid, group, m_tile, n_tile, row0, rows, solo), (
                unit + cute.arch.grid_dim()[2], *st
            )
        record, ended = cursor
        group = Int32(-1)
        m_unit = Int32(0)
        n_unit = Int32(0)
        if ended == 0:
            group, m_unit, n_unit = self._read_unit(sched.dynamic, record)
            record = record + 1
        valid = group >= 0
        ended = cutlass.select_(valid, Int32(0), Int32(1))
        row0, rows = self._group_rows(sched.offs, group, valid)
        m_tile, n_tile = self._cta_tile(m_unit, n_unit, sched.cluster_coord)
        return (valid, group, m_tile, n_tile, row0, rows, Int32(0)), (record, ended)

    # ------------------------------------------------------------ the dynamic schedule

    @cute.jit
    def _read_unit(self, dynamic: _Dynamic, record):
        """One warp reads record number ``record`` (group, m-unit, n-unit) and releases its
        slot to the scheduler (one arrival per warp, on the cluster's first CTA)."""
        slot, phase = _slot_phase(record)
        cute.arch.mbarrier_wait(dynamic.full + slot, phase)
        group = dynamic.records[0, slot]
        m_unit = dynamic.records[1, slot]
        n_unit = dynamic.records[2, slot]
        # the reads are done before the release lets the slot be written again (st.async
        # writes through the async proxy)
        cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            if const_expr(self.cluster_size == 1):
                cute.arch.mbarrier_arrive(dynamic.empty + slot)
            else:
                cute.arch.mbarrier_arrive(dynamic.empty + slot, 0)
        return group, m_unit, n_unit

    @cute.jit
    def _schedule_units(self, sched):
        """The scheduler warp of the cluster's first CTA: hand out every unit, then one past
        the last (group -1) that ends each role's walk; waits until all records are read."""
        offs, _, _, n_tiles, m_units_k, _, dynamic = sched
        groups = cute.size(offs)
        per_group = m_units_k * n_tiles
        total = groups * per_group
        clusters = cute.arch.grid_dim()[2]
        counter = dynamic.order.iterator + groups
        record = Int32(0)
        unit = cute.arch.block_idx()[2]  # the first unit of each cluster is its own
        live = Int32(1)
        while live > 0:
            valid = unit < total
            pos = unit // per_group
            local = unit - pos * per_group
            group = Int32(-1)
            fetched = Int32(0)
            if valid:
                group = dynamic.order[pos]
                if cute.arch.lane_idx() == 0:  # the next unit, fetched before the wait
                    fetched = cute.arch.atomic_add(counter, Int32(1))
            self._wait_slot_free(dynamic, record)
            self._write_unit(dynamic, _slot_phase(record)[0], group, local % m_units_k,
                             local // m_units_k)
            record = record + 1
            unit = clusters + cute.arch.shuffle_sync(fetched, 0)
            live = cutlass.select_(valid, Int32(1), Int32(0))
        for i in cutlass.range_constexpr(RECORD_STAGES):  # every record read: safe to exit
            self._wait_slot_free(dynamic, record + i)

    @cute.jit
    def _wait_slot_free(self, dynamic: _Dynamic, record):
        """Wait until the slot of record number ``record`` is free: its previous record (if
        any) was read by every reader of the cluster."""
        slot, phase = _slot_phase(record)
        cute.arch.mbarrier_wait(dynamic.empty + slot, phase ^ 1)

    @cute.jit
    def _write_unit(self, dynamic: _Dynamic, slot, group, m_unit, n_unit):
        """Write one record into ring slot ``slot`` of every CTA of the cluster (lane r: CTA
        r's), completing its full barrier."""
        lane = cute.arch.lane_idx()
        if const_expr(self.cluster_size == 1):
            if lane == 0:
                dynamic.records[0, slot] = group
                dynamic.records[1, slot] = m_unit
                dynamic.records[2, slot] = n_unit
                cute.arch.mbarrier_arrive(dynamic.full + slot)
        else:
            if lane < self.cluster_size:
                full = dynamic.full + slot
                cute.arch.mbarrier_arrive_and_expect_tx(full, RECORD_WORDS * 4, lane)
                _store_remote_v4(
                    dynamic.records[None, slot].iterator, full, lane, group, m_unit, n_unit
                )


@cute.jit
def _slot_phase(record: Int32):
    """(ring slot, mbarrier phase parity) of record number ``record`` (>= 0)."""
    return record & (RECORD_STAGES - 1), (record >> (RECORD_STAGES.bit_length() - 1)) & 1


@cute.jit
def _store_remote_v4(smem_ptr, mbar_ptr, rank, a: Int32, b: Int32, c: Int32):
    """st.async of (a, b, c, 0) to ``smem_ptr`` in CTA ``rank`` of the cluster, completing 16
    bytes on that CTA's ``mbar_ptr``."""
    remote = cute.arch.map_dsmem_ptr(smem_ptr, rank).toint()
    remote_bar = cute.arch.map_dsmem_ptr(mbar_ptr, rank).toint()
    cute.arch.inline_ptx(
        "{\n\t.reg .v4 .s32 rec;\n\t"
        "mov.s32 rec.x, {$r2};\n\tmov.s32 rec.y, {$r3};\n\t"
        "mov.s32 rec.z, {$r4};\n\tmov.s32 rec.w, 0;\n\t"
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.s32 [{$r0}], rec, [{$r1}];"
        "\n\t}\n",
        read_only_args=[Int32(remote), Int32(remote_bar), Int32(a), Int32(b), Int32(c)],
    )
