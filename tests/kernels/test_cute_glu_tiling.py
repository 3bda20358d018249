"""The fused GLU steps' default tilings (`glu._glu_tiling`): which FC1 runs in ping-pong.

Host-only: no kernel is compiled or launched.
"""

from __future__ import annotations

import pytest

from te_seq.kernels.cute import Tiling
from te_seq.kernels.cute.glu import PINGPONG_FC1_TILE_N, _glu_tiling
from te_seq.kernels.cute.launch import MM_PINGPONG_CLUSTER, PINGPONG_MAX_K

PINGPONG_FC1 = Tiling(PINGPONG_FC1_TILE_N, MM_PINGPONG_CLUSTER, pingpong=True)


@pytest.fixture(autouse=True)
def _pingpong_default(tiling_env):
    """Every tiling variable unset (the `tiling_env` fixture)."""


@pytest.mark.parametrize("k", [64, 2048, 4096, PINGPONG_MAX_K])  # Q/Z and A/B: K = H
def test_short_mainloop_fc1_runs_in_pingpong(k):
    assert _glu_tiling("fc1", 1536, False, None, k, plain_fc1=True) == PINGPONG_FC1


@pytest.mark.parametrize(
    ("k", "plain", "gather"),
    [
        (PINGPONG_MAX_K + 8, True, False),  # a longer mainloop: cooperative
        (2048, False, False),  # a bias, block scales or an interleave ping-pong cannot take
        (2048, True, True),  # gathered rows: never multicast
    ],
)
def test_other_fc1_stays_cooperative(k, plain, gather):
    t = _glu_tiling("fc1", 1536, gather, None, k, plain_fc1=plain)
    assert not t.pingpong and t.tile_n == 256


def test_pingpong_off_keeps_fc1_cooperative(tiling_env):
    tiling_env("TE_SEQ_PINGPONG", "0")
    t = _glu_tiling("fc1", 1536, False, None, 2048, plain_fc1=True)
    assert not t.pingpong and t.tile_n == 256


def test_dgrad_and_explicit_tilings_are_unchanged():
    assert _glu_tiling("dgrad", 768, False, None, 2048, plain_fc1=True) == Tiling(192, (1, 2))
    chosen = Tiling(256, (2, 1))
    assert _glu_tiling("fc1", 1536, False, chosen, 2048, plain_fc1=True) is chosen


def test_max_k_from_the_environment_moves_the_bound(tiling_env):
    tiling_env("TE_SEQ_PINGPONG_MAX_K", "8192")
    assert _glu_tiling("fc1", 1536, False, None, 8192, plain_fc1=True) == PINGPONG_FC1
    tiling_env("TE_SEQ_PINGPONG_MAX_K", "1536")
    assert not _glu_tiling("fc1", 1536, False, None, 2048, plain_fc1=True).pingpong


def test_glu_fc1_width_from_the_environment(tiling_env):
    tiling_env("TE_SEQ_GLU_FC1_TILE_N", "192")
    assert _glu_tiling("fc1", 1536, False, None, 2048, plain_fc1=True) == Tiling(
        192, (2, 1), pingpong=True)
    narrow = _glu_tiling("fc1", 2048, False, None, 4096, plain_fc1=True)  # F = 1024: not 96s
    assert narrow == Tiling(128, (2, 1), pingpong=True)
    tiling_env("TE_SEQ_GLU_FC1_TILE_N", "256")
    with pytest.raises(ValueError, match=r"TE_SEQ_GLU_FC1_TILE_N must be one of \['128', '192'\]"):
        _glu_tiling("fc1", 1536, False, None, 2048, plain_fc1=True)


def test_varlen_m_cluster_from_the_environment(tiling_env):
    """TE_SEQ_MM_CLUSTER moves the ping-pong FC1's cluster (and only ping-pong tilings')."""
    assert MM_PINGPONG_CLUSTER == (2, 1)
    tiling_env("TE_SEQ_MM_CLUSTER", "1x2")
    assert _glu_tiling("fc1", 1536, False, None, 2048, plain_fc1=True) == Tiling(
        PINGPONG_FC1_TILE_N, (1, 2), pingpong=True)
    assert _glu_tiling("dgrad", 768, False, None, 2048, plain_fc1=True) == Tiling(192, (1, 2))
    tiling_env("TE_SEQ_MM_CLUSTER", "2x2")
    with pytest.raises(ValueError, match=r"TE_SEQ_MM_CLUSTER must be one of \['1x2', '2x1'\]"):
        _glu_tiling("fc1", 1536, False, None, 2048, plain_fc1=True)


@pytest.mark.parametrize("k", [768, 2048, PINGPONG_MAX_K])
def test_fp8_dgrad_runs_pingpong_for_short_k(k):
    """The row-wise FP8 GLU dgrad runs 128-wide ping-pong tiles in the ping-pong cluster; a
    dgrad that is neither (the block-scaled one) stays cooperative."""
    assert _glu_tiling("dgrad", 768, False, None, k, fp8_dgrad=True) == Tiling(
        128, (2, 1), pingpong=True)
    assert not _glu_tiling("dgrad", 768, False, None, k).pingpong


def test_fp8_dgrad_pingpong_off_long_k_and_cluster(tiling_env):
    assert not _glu_tiling("dgrad", 768, False, None, PINGPONG_MAX_K + 8, fp8_dgrad=True).pingpong
    tiling_env("TE_SEQ_MM_CLUSTER", "1x2")
    assert _glu_tiling("dgrad", 768, False, None, 2048, fp8_dgrad=True) == Tiling(
        128, (1, 2), pingpong=True)
    tiling_env("TE_SEQ_PINGPONG", "0")
    assert _glu_tiling("dgrad", 768, False, None, 2048, fp8_dgrad=True) == Tiling(192, (1, 2))


def test_16_bit_dgrad_runs_pingpong_unless_turned_off(tiling_env):
    """By default (``GLU_DGRAD_PINGPONG``) the 16-bit GLU dgrad (``plain_dgrad``) with a short
    mainloop runs like the row-wise FP8 one: 128 wide in the ping-pong cluster; gathered rows,
    long mainloops and the block-scaled dgrad stay cooperative; TE_SEQ_GLU_DGRAD_PINGPONG=0
    and TE_SEQ_PINGPONG=0 turn it off."""
    from te_seq.kernels.cute.launch import GLU_DGRAD_PINGPONG

    assert GLU_DGRAD_PINGPONG
    assert _glu_tiling("dgrad", 768, False, None, 2048, plain_dgrad=True) == Tiling(
        128, (2, 1), pingpong=True)
    tiling_env("TE_SEQ_GLU_DGRAD_EPI_ROWS", "64")
    assert _glu_tiling("dgrad", 768, False, None, 2048, plain_dgrad=True) == Tiling(
        128, (2, 1), pingpong=True, epi_rows=64)
    assert _glu_tiling("dgrad", 768, False, None, 2048, fp8_dgrad=True).epi_rows == 128
    tiling_env("TE_SEQ_GLU_DGRAD_EPI_ROWS", None)
    tiling_env("TE_SEQ_GLU_DGRAD_PINGPONG", "0")
    assert _glu_tiling("dgrad", 768, False, None, 2048, plain_dgrad=True) == Tiling(192, (1, 2))
    tiling_env("TE_SEQ_GLU_DGRAD_PINGPONG", "1")
    tiling_env("TE_SEQ_PINGPONG", "0")
    assert not _glu_tiling("dgrad", 768, False, None, 2048, plain_dgrad=True).pingpong
    tiling_env("TE_SEQ_PINGPONG", None)
    assert not _glu_tiling("dgrad", 768, True, None, 2048, plain_dgrad=True).pingpong
    assert not _glu_tiling("dgrad", 768, False, None, PINGPONG_MAX_K + 8,
                           plain_dgrad=True).pingpong
    assert not _glu_tiling("dgrad", 768, False, None, 2048).pingpong  # block-scaled
    tiling_env("TE_SEQ_MM_CLUSTER", "1x2")
    assert _glu_tiling("dgrad", 768, False, None, 2048, plain_dgrad=True) == Tiling(
        128, (1, 2), pingpong=True)
    tiling_env("TE_SEQ_GLU_DGRAD_PINGPONG", "yes")
    with pytest.raises(ValueError, match=r"TE_SEQ_GLU_DGRAD_PINGPONG must be one of \['0', '1'\]"):
        _glu_tiling("dgrad", 768, False, None, 2048, plain_dgrad=True)


def test_cooperative_cluster_from_the_environment(tiling_env):
    """TE_SEQ_COOP_CLUSTER moves the cooperative tilings of rows not gathered (the 16-bit GLU
    dgrad, the FC1 past the ping-pong bound, the plain GEMM's long mainloops), never the
    gathered FC1's (GATHER_CLUSTER) nor the ping-pong ones."""
    from te_seq.kernels.cute.launch import COOP_CLUSTER, GATHER_CLUSTER, plain_mm_tiling

    assert COOP_CLUSTER == (1, 2)
    long_k = PINGPONG_MAX_K + 8
    tiling_env("TE_SEQ_COOP_CLUSTER", "2x1")
    assert _glu_tiling("dgrad", 768, False, None, long_k, plain_dgrad=True) == Tiling(256, (2, 1))
    assert _glu_tiling("fc1", 1536, False, None, long_k, plain_fc1=True) == Tiling(256, (2, 1))
    assert _glu_tiling("fc1", 1536, True, None, 2048, plain_fc1=True).cluster_mn == GATHER_CLUSTER
    assert _glu_tiling("fc1", 1536, False, None, 2048, plain_fc1=True) == PINGPONG_FC1
    assert plain_mm_tiling(4096, long_k) == Tiling(256, (2, 1))
    assert plain_mm_tiling(2048, 768) == Tiling(192, (2, 1), True)  # ping-pong: unchanged
    tiling_env("TE_SEQ_COOP_CLUSTER", "1x2")
    assert plain_mm_tiling(4096, long_k) == Tiling(256, (1, 2))
    tiling_env("TE_SEQ_COOP_CLUSTER", "2x2")
    with pytest.raises(ValueError, match=r"TE_SEQ_COOP_CLUSTER must be one of \['1x2', '2x1'\]"):
        plain_mm_tiling(4096, long_k)
