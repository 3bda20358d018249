"""The FP8 grouped GEMMs (sm_90a): E4M3 operands, fp32 accumulation, row-wise dequantization
scales applied in the store epilogue. Varlen M (forward, dgrad) and varlen K (wgrad).

Shape legend: M routed rows, E experts, K reduction dim, N output columns. A [M, K] and
B = W [E, N, K] seen as (N, K, E) are both K-major (FP8 WGMMA reads only K-major smem
operands); scale_a fp32 [M], scale_b fp32 [E, N] are the *dequantization* scales (te_seq's
``scale_inv``); the output is

    y[m, n] = scale_a[m] · scale_b[g(m), n] · Σ_k fp32(a[m, k]) · fp32(b[g(m), n, k])

rounded once to the output type (bf16), g(m) the expert of row m. The mainloop is the plain
kernel's with a 128-element k-tile (128-byte smem rows, as the 16-bit kernels' 64 elements;
``GroupedGemmKernel._setup``); the K tail (K a multiple of 16, not of 128) is zero-filled by the
TMA loads of both operands.

The epilogue multiplies each fp32 accumulator by its row's and column's scales before the
rounding. A tile's tm row scales and tn column scales are copied into an smem scratch by
cp.async before its mainloop (one 4-byte copy per consumer thread and kind; in ping-pong each
warpgroup has its own scratch block, so the next tile's copies never overwrite what the peer's
epilogue reads), so their latency hides behind the MMAs; reading them per value from global
memory (L1-cached) made each of the eight epilogue subtiles wait for a load round trip, and the
FP8 GEMMs slower than the bf16 ones on fine-grained experts. Loads past M, N or K are clamped
to the last element (TMA drops those stores anyway). Rows past offs[-1] form the virtual group
E: their accumulators are zero and they are written as zeros whatever the scales hold (no
NaN · 0).

Varlen K (the weight gradient, ``fp8.scaled_grouped_wgrad``): A = dY token-major (N, P) and
B = X token-major (K, P), both K-major (tokens contiguous), each group's tokens a span of P
that starts on a 128-token k-tile and is zero-padded to whole k-tiles (so the loads need no
ragged views: ``GroupedGemmKernel.ragged_k`` is off); scale_a fp32 [E, N], scale_b fp32 [E, K]:

    C[e][n, k] = scale_a[e, n] · scale_b[e, k] · Σ_{t in span e} fp32(a[n, t]) · fp32(b[k, t])

written to C (E, N, K) or, with ``accumulate``, added to the old C after the scaling (the store
epilogue's old-C loads). An empty span writes zeros (adds nothing) whatever its scales hold.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .grouped_gemm import GroupedGemmKernel
from .ragged import _ragged_group


class ScaleTile(NamedTuple):
    """One tile's scale context (trace-time bundle)."""

    scratch: object  # fp32 smem [tm + tn]: the tile's row scales, then its column scales
    coords: object  # (row, col) in the tile of each accumulator value, in tRS_acc's order
    # False: write zeros (the virtual group, an empty span); None: no select, the scratch of
    # an empty span holds zeros (varlen K: ``_zero_scales_of_empty_span``)
    live: object


class ScaleScratchMixin:
    """The row/column dequantization scales of a tile in an fp32 smem scratch, shared by the FP8
    GEMM (``ScaledGemmKernel``) and the FP8 GLU GEMM (``scaled_glu``): ``_before_mainloop``
    starts the cp.async copies of the tile's tm row and tn column scales, ``_wait_scales``
    waits for them before the epilogue, ``_scaled_at`` applies them to one accumulator.
    Hooks: ``scale_epi_index`` (where scale_a, scale_b sit in the epilogue state ``ep.epi``)
    and ``_scale_col`` (the scale column of tile column t)."""

    pingpong_ready = True  # in ping-pong each warpgroup fills its own scratch block
    scale_epi_index = 0

    @property
    def epi_scratch_words(self) -> int:
        """A tile's row and column scales: tm + tn words per ping-pong warpgroup (two blocks,
        ``GroupedGemmKernel._scratch_words``), else tm + the widest tn (128 + 256)."""
        tm, tn, _ = self.tile_mnk
        return tm + tn if self.pingpong else 128 + 256

    def _scale_col(self, n_tile, t, scale_b):
        """Column of scale_b [E, N] that tile column ``t`` of n-tile ``n_tile`` is scaled by
        (before the clamp to N - 1): the GEMM's own column here."""
        return n_tile * self.tile_mnk[1] + t

    @cute.jit
    def _before_mainloop(self, ep, group, m_tile, n_tile, row0, epi_count):
        """Start copying the tile's row and column scales into the smem scratch (cp.async,
        4-byte copies: a row and a column per tile thread, two columns where a ping-pong
        warpgroup's 128 threads hold a 192-wide tile); ``_wait_scales`` waits for them."""
        # explicit class: the DSL rewrites a bare super() to super(self.__class__, self)
        super(ScaleScratchMixin, self)._before_mainloop(ep, group, m_tile, n_tile, row0, epi_count)
        tm, tn, _ = self.tile_mnk
        i = self.scale_epi_index
        scale_a, scale_b, t = ep.epi[i], ep.epi[i + 1], ep.mma_tidx
        g = cutlass.min(group, cute.size(scale_b, mode=[0]) - 1)
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
        dst = cute.zipped_divide(ep.scratch, (1,))
        for c in self._scratch_columns(t):
            if c < tn:
                col = cutlass.min(self._scale_col(n_tile, c, scale_b),
                                  cute.size(scale_b, mode=[1]) - 1)
                cols = cute.zipped_divide(scale_b[g, None], (1,))
                cute.copy(atom, cols[(None, col)], dst[(None, tm + c)])
        if t < tm:
            if const_expr(self.varlen == "m"):
                row = cutlass.min(row0 + m_tile * tm + t, cute.size(scale_a) - 1)
                rows = cute.zipped_divide(scale_a, (1,))
            else:
                row = cutlass.min(m_tile * tm + t, cute.size(scale_a, mode=[1]) - 1)
                rows = cute.zipped_divide(scale_a[g, None], (1,))
            cute.copy(atom, rows[(None, row)], dst[(None, t)])
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _zero_scales_of_empty_span(self, ep, rows):
        """Varlen K, once this thread's copies have landed: where the tile's token span is
        empty, zero the scratch entries the thread copied (``_before_mainloop``), so that the
        epilogue needs no select per value (``ScaleTile.live`` None). The accumulators of an
        empty span are zero (``_mainloop`` fills them) and 0 · 0 is the select's +0, whatever
        an empty expert's scales hold. A select per value cost the FP8 wgrads 2-4 % on B and
        Q (one H200, 2026-11-30, kernel README section 28)."""
        if rows == 0:
            tm, tn, _ = self.tile_mnk
            t = ep.mma_tidx
            for c in self._scratch_columns(t):
                if c < tn:
                    ep.scratch[tm + c] = Float32(0.0)
            if t < tm:
                ep.scratch[t] = Float32(0.0)

    # Plain Python (inlined while the kernel is traced): no dynamic control flow below.

    def _scratch_columns(self, t):
        """The scratch's column entries thread ``t`` copies (and zeroes): t, t + threads, ...,
        one per tile_n / threads, rounded up; the callers skip those past tile_n."""
        n = self.num_mma_threads
        return [t if j == 0 else t + j * n for j in range(-(-self.tile_mnk[1] // n))]

    def _wait_scales(self, empty_span=None):
        """Before the epilogue reads the scratch: this thread's and every other thread's scale
        copies have landed. ``empty_span`` (varlen K: the epilogue state and the span's
        rows): first zero the scales of an empty span (``_zero_scales_of_empty_span``)."""
        cute.arch.cp_async_wait_group(0)
        if empty_span is not None:
            self._zero_scales_of_empty_span(*empty_span)
        self.epi_barrier.arrive_and_wait()

    def _scaled_at(self, st: ScaleTile, i: int, value):
        """``value`` (accumulator value ``i`` of this thread) times its row's and column's
        scales (the smem scratch); 0 where the tile is not live (``st.live`` None: the
        scratch of a dead tile holds zeros already)."""
        r, c = st.coords[i]
        scale = st.scratch[r] * st.scratch[self.tile_mnk[0] + c]
        if st.live is None:
            return value * scale
        return cutlass.select_(st.live, value * scale, Float32(0.0))


class ScaledGemmKernel(ScaleScratchMixin, GroupedGemmKernel):
    """Grouped GEMM whose epilogue applies row and column dequantization scales to the fp32
    accumulators. Varlen M: ``C[rows of e] = diag(sa) (A[rows of e] @ B[e]) diag(sb[e])``;
    varlen K: ``C[e] = diag(sa[e]) (A[:, span e] @ B[:, span e]ᵀ) diag(sb[e])`` (+ old C).
    """

    ragged_k = False  # varlen K: zero-padded, k-tile aligned token spans (module docstring)

    def __init__(
        self,
        varlen: str = "m",
        tile_mn: tuple[int, int] = (128, 256),
        cluster_mn: tuple[int, int] = (1, 2),
        accumulate: bool = False,
        pingpong: bool = False,
        half_tiles: bool = False,
        epi_cols: int | None = None,
    ):
        super().__init__(varlen, tile_mn, cluster_mn, accumulate, pingpong=pingpong,
                         half_tiles=half_tiles, epi_cols=epi_cols)

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,  # [M, K] (varlen M) or (N, P) (varlen K) E4M3, K-major
        b: cute.Tensor,  # (N, K, E) (varlen M) or (K, P) (varlen K) E4M3, K-major
        c: cute.Tensor,  # [M, N] bf16 (varlen M) or (N, K, E) bf16 / fp32 (varlen K)
        offs: cute.Tensor,  # int32 [E] cumulative row ends (varlen K: padded span ends)
        num_clusters: Int32,
        scale_a: cute.Tensor,  # fp32 [M] (varlen M) or [E, N] (varlen K)
        scale_b: cute.Tensor,  # fp32 [E, N] (varlen M) or [E, K] (varlen K)
        route: cute.Tensor,  # unused (no routed rows): a dummy, as the other GEMM kernels take
        stream,
    ):
        self._launch(a, b, c, offs, num_clusters, stream, b, (scale_a, scale_b), route)

    def _make_epi(self, c: cute.Tensor, epi_inputs: tuple) -> tuple:
        """(scale_a, scale_b) and, with ``accumulate``, the old C's TMA atom and tensor."""
        old = super()._make_epi(c, epi_inputs)
        return (*epi_inputs, *old) if self.accumulate else epi_inputs

    @cute.jit
    def _old_tile(self, ep, group, m_tile, n_tile):
        tm, tn, _ = self.tile_mnk
        tma_old, m_old = ep.epi[2], ep.epi[3]
        return tma_old, cute.local_tile(m_old[None, None, group], (tm, tn), (m_tile, n_tile))

    @cute.jit
    def _store_tile(self, ep, acc, group, m_tile, n_tile, row0, rows, epi_count):
        tm, tn, _ = self.tile_mnk
        c_tile = cute.make_identity_tensor((tm, tn))
        coords = ep.tiled_r2s.retile(ep.tiled_mma.get_slice(ep.mma_tidx).partition_C(c_tile))
        old = None
        if const_expr(self.varlen == "m"):
            self._wait_scales()
            st = ScaleTile(ep.scratch, coords, group < cute.size(ep.epi[1], mode=[0]))
            mC_g = _ragged_group(ep.mC, 0, row0, rows)
        else:
            self._wait_scales((ep, rows))
            st = ScaleTile(ep.scratch, coords, None)
            mC_g = ep.mC[None, None, group]
            if const_expr(self.accumulate):
                old = self._old_tile(ep, group, m_tile, n_tile)
        gC = cute.local_tile(mC_g, (tm, tn), (m_tile, n_tile))
        return self._epilogue(ep, gC, epi_count, old, scale_tile=st)
