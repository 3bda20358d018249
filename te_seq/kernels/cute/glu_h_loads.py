"""The fused GLU dgrad's loads of h (FC1's saved pre-activation) into shared memory.

Per dgrad epilogue subtile (``epi_rows`` x 32 columns of dA), the gate and up columns of h
that the subtile's maths needs are TMA-loaded into a pair of smem buffers behind the store
ring, one mbarrier per pair (``h_prefetch`` pairs, 1, 2 or 4: a tile's first ``h_prefetch``
subtiles are loaded as its epilogue starts, each later one as soon as its pair is read).
`HLoadMixin` holds the column mapping, the buffers' barriers and phases and the loads;
``GluGemmKernel._dgrad_epilogue`` drives them.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .launch import epilogue_subtiles


def h_pair_parity(own_before, e: int, depth: int, subtiles: int, wg=None):
    """The phase parity that dgrad subtile ``e`` of a tile waits for on its h pair (e % d, d =
    ``depth`` pairs dividing the tile's ``subtiles`` n): pair p is filled for the subtiles p,
    p + d, ..., n / d times per tile, so the fill that subtile e waits for is the pair's
    (subtiles of the CTA before the tile + e) // d-th, and its parity that count % 2.
    ``own_before``: the subtiles this warpgroup's earlier tiles ran; ``wg`` (ping-pong): its
    index, the warpgroups' epilogues alternating over the shared pairs, warpgroup 0 first, so
    the CTA ran 2 own_before + wg n before the tile; None: cooperative (own_before is the
    CTA's). One pair: n is even (4, 6 or 8; twice that with 64-row subtiles), so e % 2. Plain
    ints or the kernel's Int32 values alike."""
    if depth == 1:
        return e % 2
    before = own_before if wg is None else 2 * own_before + wg * subtiles
    return ((before + e) // depth) % 2


class HLoadMixin:
    """h's subtile loads for the GLU dgrad epilogue (module docstring)."""

    @cute.jit
    def _h_partitions(self, ep, tma_h, m_h, row_base):
        """TMA partitions (smem, gmem) of h's subtile blocks for the tile at ``row_base``."""
        g_h = cute.zipped_divide(cute.domain_offset((row_base, 0), m_h), self.epi_tile)
        return cute.nvgpu.cpasync.tma_partition(
            tma_h, 0, cute.make_layout(1), cute.group_modes(ep.sC, 0, 2), g_h
        )

    @cute.jit
    def _h_cols(self, n_tile, f_dim, e: int):
        """(j0, gate column, up column) of dgrad subtile ``e``: dA columns [j0, j0 + 32)."""
        j0 = n_tile * self.tile_mnk[1] + 32 * e
        if const_expr(self.interleave is None):
            g_col = j0
            u_col = f_dim + j0
        else:
            s = self.interleave
            g_col = (j0 // s) * (2 * s) + j0 % s
            u_col = g_col + s
        return j0, g_col, u_col

    def _h_bar(self, ep, e: int):
        """The mbarrier of dgrad subtile ``e``'s h pair (e % ``h_prefetch``)."""
        pair = e % self.h_prefetch
        return ep.extra_bar if pair == 0 else ep.extra_bar + pair

    def _h_parity(self, count0, e: int):
        """The mbarrier phase parity of dgrad subtile ``e``'s h pair (`h_pair_parity`): this
        warpgroup's subtiles before the tile are ``count0`` / 3 (three stores each); in
        ping-pong its warpgroup index too."""
        wg = None
        if self.pingpong and self.h_prefetch > 1:
            wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4 - 1
        return h_pair_parity(count0 // 3, e, self.h_prefetch, self._dgrad_subtiles(), wg)

    def _dgrad_subtiles(self) -> int:
        """Epilogue subtiles of one dgrad tile (`launch.epilogue_subtiles`)."""
        return epilogue_subtiles(self.tile_mnk[1], self.epi_rows)

    @cute.jit
    def _issue_h(self, ep, tma_h, s_l, g_l, n_tile, f_dim, e: int):
        """TMA-load the gate and up (epi_rows x 32) blocks of h for dgrad subtile ``e`` (column
        block e // halves, row half e % halves) into buffer pair e % ``h_prefetch`` (its own
        mbarrier) (rows past M and columns past 2F are zero-filled; other out-of-tile values
        are masked by the reader)."""
        col, half = divmod(e, self._halves())
        _, g_col, u_col = self._h_cols(n_tile, f_dim, col)
        warp = ep.warp
        bar = self._h_bar(ep, e)
        g_buf = self.epi_stage + 2 * (e % self.h_prefetch)
        if warp == self.epi_store_warp:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(
                    bar, 2 * self.epi_tile[0] * self.epi_tile[1] * self.c_dtype.width // 8
                )
            cute.copy(
                tma_h, g_l[(None, (half, g_col // 32))], s_l[(None, g_buf)], tma_bar_ptr=bar
            )
            cute.copy(
                tma_h, g_l[(None, (half, u_col // 32))], s_l[(None, g_buf + 1)], tma_bar_ptr=bar
            )

    @cute.jit
    def _h_reader(self, ep):
        """(tiled copy, this thread's partition of the smem ring) that reads a (epi_rows x 32)
        block of the ring with ldmatrix into registers in ``ep.rD``'s order: the inverse of the
        stmatrix copy (``ep.tiled_r2s``) that stages the stores, on its own register layout, so
        value v of a block read lies where value v of the subtile's accumulators does (eight
        values per instruction where a per-value read needs its own swizzled address)."""
        tiled = ldmatrix_mirror(ep.tiled_r2s, self.c_layout, self.c_dtype)
        return tiled, tiled.get_slice(ep.mma_tidx).partition_S(ep.sC)

    @cute.jit
    def _read_h(self, ep, reader, buf, ok, out):
        """``out`` (fp32, ``ep.rD``'s shape) = ring block ``buf`` read by ``reader``
        (`_h_reader`), or zeros where ``ok`` is False (a block past the activation's columns;
        ``True``: no mask)."""
        tiled, part = reader
        raw = cute.make_rmem_tensor(ep.rD.shape, self.c_dtype)
        cute.copy(tiled, part[(None, None, None, buf)], tiled.retile(raw))
        for v in cutlass.range_constexpr(cute.size(out)):
            value = raw[v].to(Float32)
            if const_expr(ok is not True):
                value = cutlass.select_(ok, value, Float32(0.0))
            out[v] = value


def ldmatrix_mirror(tiled_r2s, c_layout, c_dtype):
    """The ldmatrix tiled copy that reads what the stmatrix copy ``tiled_r2s`` writes, value
    for value: its register (destination) thread-value layout is ``tiled_r2s``'s register
    (source) one, on the same tiler (ldmatrix's reference layout is its destination's, so
    `make_tiled_copy_S` hands it the stores' register layout)."""
    atom = cute.make_copy_atom(
        cute.nvgpu.warp.LdMatrix8x8x16bOp(c_layout.is_m_major_c(), 4), c_dtype
    )
    return cute.make_tiled_copy_S(atom, tiled_r2s)

