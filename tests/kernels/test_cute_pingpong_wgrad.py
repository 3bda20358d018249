"""Ping-pong consumer warpgroups in the varlen-K grouped GEMM (``cute.grouped_wgrad`` with
``Tiling(..., pingpong=True)``).

Each output tile's fp32 sum over an expert's tokens runs the same k-tiles in the same order
whether one warpgroup or two compute it, so the ping-pong result equals the cooperative
kernel's of the same tile width bit for bit, and the float64 reference within rounding. The
accumulate form (old C added) too: in ping-pong each warpgroup loads its old C into its own
smem blocks, so one's loads before its mainloop never overwrite what the peer's epilogue reads.
Compile-only tests run on CPU; GPU tests need sm_90+.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from cute_marks import (
    check_wgrad,
    check_wgrad_graph_replays,
    compile_for_sm90a,
    gpu,
    needs_cute,
    needs_dsl,
    wgrad_operands,
)

from te_seq.kernels.cute import Tiling

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import torch
    from te_seq.kernels.cute.compile import GemmConfig, compile_gemm
    bf16, fp32 = torch.bfloat16, torch.float32
    for cfg in [
        GemmConfig("k", bf16, bf16, "n", 128, (1, 2), pingpong=True),
        GemmConfig("k", bf16, bf16, "n", 192, (2, 1), pingpong=True, epi_cols=64),
        GemmConfig("k", bf16, fp32, "n", 192, (2, 1), pingpong=True),
        GemmConfig("k", bf16, fp32, "n", 128, (1, 2), accumulate=True, pingpong=True),
    ]:
        print(cfg, f"{compile_gemm(cfg).compile_s:.1f}s", flush=True)
    print("ALL COMPILED")
    """
)


@pytest.mark.slow  # DSL compiles in a subprocess
@needs_dsl
def test_compile_pingpong_wgrad_configs_for_sm90a():
    compile_for_sm90a(_COMPILE_SCRIPT, timeout=900)


def test_wgrad_epilogue_columns_follow_the_groups_rows_unless_set(tiling_env):
    """64-column epilogue subtiles for fresh 16-bit outputs over groups of up to 384 rows on
    average; ``TE_SEQ_WGRAD_EPI_COLS`` sets them either way; never for wider outputs or when
    accumulating."""
    from te_seq.kernels.cute import wgrad_tiling

    tiling_env("TE_SEQ_WGRAD_SCHEDULE", "static")
    assert wgrad_tiling(2048, False, 256, out_bits=32).epi_cols == 32
    assert wgrad_tiling(2048, True, 256).epi_cols == 32
    tiling_env("TE_SEQ_WGRAD_EPI_COLS", "32")
    assert wgrad_tiling(2048, False, 256).epi_cols == 32
    tiling_env("TE_SEQ_WGRAD_EPI_COLS", "64")
    assert wgrad_tiling(4096, False, 512).epi_cols == 64
    assert wgrad_tiling(2048, True, 256).epi_cols == 32
    tiling_env("TE_SEQ_WGRAD_EPI_COLS", "128")
    with pytest.raises(ValueError, match="TE_SEQ_WGRAD_EPI_COLS must be one of"):
        wgrad_tiling(2048, False, 256)


def test_wide_epilogue_tilings_are_refused_where_the_kernel_has_none():
    """A ``Tiling(epi_cols=64)`` runs the fresh 16-bit wgrads, the plain ping-pong varlen-M
    GEMMs and the 16-bit GLU FC1 in 128-wide ping-pong only: grouped_mm cooperative or with a
    bias, the GLU dgrad, an FC1 that cannot take it (FP8, a bias, gathered rows: not
    ``wide_fc1``) or 192 wide, an accumulating or float32-writing wgrad refuse it by name, as
    any width but 32 and 64."""
    from te_seq.kernels import cute
    from te_seq.kernels.cute.glu import _glu_tiling
    from te_seq.kernels.cute.launch import check_tiling

    wide = Tiling(192, (2, 1), True, epi_cols=64)
    bf16 = torch.bfloat16
    a, b = torch.zeros(4, 16, dtype=bf16), torch.zeros(1, 16, 16, dtype=bf16)
    for tiling, bias in ((Tiling(256, (1, 2), epi_cols=64), None),
                         (wide, torch.zeros(1, 16, dtype=bf16))):
        with pytest.raises(ValueError, match="cute grouped_mm: epilogue subtiles are 32 col"):
            cute.grouped_mm(a, b, torch.tensor([4], dtype=torch.int32), tiling=tiling,
                            bias=bias)
    with pytest.raises(ValueError, match="cute GLU dgrad: epilogue subtiles are 32"):
        _glu_tiling("dgrad", 256, False, wide)
    fc1_wide = Tiling(128, (2, 1), True, epi_cols=64)
    assert _glu_tiling("fc1", 256, False, fc1_wide, wide_fc1=True) is fc1_wide
    for tiling, wide_fc1 in ((fc1_wide, False), (wide, True),
                             (Tiling(128, (2, 1), True, 64, epi_cols=64), True)):
        with pytest.raises(ValueError, match="cute GLU fc1: epilogue subtiles are 32"):
            _glu_tiling("fc1", 256, False, tiling, wide_fc1=wide_fc1)
    grad_out, x = torch.randn(8, 16, dtype=bf16), torch.randn(8, 16, dtype=bf16)
    offs = torch.tensor([8], dtype=torch.int32)
    for out, accumulate in ((torch.zeros(1, 16, 16), False), (torch.zeros(1, 16, 16), True),
                            (torch.zeros(1, 16, 16, dtype=bf16), True)):
        with pytest.raises(ValueError, match=r"cute grouped_wgrad: .*got Tiling\(.*epi_cols=64"):
            cute.grouped_wgrad(grad_out, x, offs, out, accumulate, tiling=wide)
    with pytest.raises(ValueError, match="epilogue subtiles are 32 columns"):
        check_tiling(Tiling(192, (2, 1), True, epi_cols=16), "cute grouped_wgrad", wide_ok=True)
    assert check_tiling(wide, "cute scaled_grouped_wgrad", wide_ok=True) is wide


def test_glu_fc1_epilogue_columns_are_32_unless_set(tiling_env):
    """The 16-bit ping-pong FC1 keeps 32-column subtiles by default;
    ``TE_SEQ_GLU_FC1_EPI_COLS=64`` sets 64 where the FC1 can take it (``wide_fc1``: not FP8,
    no bias, rows not gathered) at 128 wide, never at 192 or for a cooperative FC1."""
    from te_seq.kernels.cute.glu import _glu_tiling
    from te_seq.kernels.cute.launch import GLU_FC1_EPI_COLS

    def fc1(k=2048, wide_fc1=True):
        return _glu_tiling("fc1", 1536, False, None, k, plain_fc1=True, wide_fc1=wide_fc1)

    assert GLU_FC1_EPI_COLS == 32
    assert fc1() == Tiling(128, (2, 1), True)
    tiling_env("TE_SEQ_GLU_FC1_EPI_COLS", "64")
    assert fc1() == Tiling(128, (2, 1), True, epi_cols=64)
    assert fc1(wide_fc1=False).epi_cols == 32
    assert fc1(k=8192).epi_cols == 32  # cooperative (K past the ping-pong bound)
    tiling_env("TE_SEQ_GLU_FC1_TILE_N", "192")
    assert fc1() == Tiling(192, (2, 1), True)
    tiling_env("TE_SEQ_GLU_FC1_TILE_N", "128")
    tiling_env("TE_SEQ_GLU_FC1_EPI_COLS", "48")
    with pytest.raises(ValueError, match="TE_SEQ_GLU_FC1_EPI_COLS must be one of"):
        fc1()


def test_plain_mm_epilogue_columns_are_32_unless_set(tiling_env):
    """The ping-pong varlen-M GEMMs keep 32-column subtiles by default; ``TE_SEQ_MM_EPI_COLS``
    sets 64 for 16-bit outputs (never for wider ones or cooperative tilings)."""
    from te_seq.kernels.cute.launch import MM_EPI_COLS, plain_mm_tiling

    assert MM_EPI_COLS == 32
    assert plain_mm_tiling(2048, 768) == Tiling(192, (2, 1), True)
    tiling_env("TE_SEQ_MM_EPI_COLS", "64")
    assert plain_mm_tiling(2048, 768) == Tiling(192, (2, 1), True, epi_cols=64)
    assert plain_mm_tiling(2048, 768, out_bits=32).epi_cols == 32
    assert plain_mm_tiling(2048, 8192).epi_cols == 32  # cooperative (K > the ping-pong bound)


def test_grouped_wgrad_takes_pingpong_accumulate_and_gives_each_warpgroup_its_blocks():
    pytest.importorskip("cutlass")
    from te_seq.kernels.cute import gemm
    from te_seq.kernels.cute.grouped_gemm import GroupedGemmKernel

    gemm._check_pingpong(Tiling(128, (1, 2), pingpong=True), None, "accumulate")
    gemm._check_pingpong(Tiling(256, (1, 2)), None, "accumulate")  # cooperative
    with pytest.raises(ValueError, match="neither a bias nor routed rows"):
        gemm._check_pingpong(Tiling(128, (1, 2), pingpong=True), None, "gather")
    pingpong = GroupedGemmKernel("k", (128, 128), (1, 2), accumulate=True, pingpong=True)
    cooperative = GroupedGemmKernel("k", (128, 256), (1, 2), accumulate=True)
    assert (pingpong.epi_extra_buffers, pingpong.extra_barriers) == (4, 4)  # 2 per warpgroup
    assert (cooperative.epi_extra_buffers, cooperative.extra_barriers) == (2, 2)  # until _setup


def test_wgrad_default_tiling_is_pingpong_unless_turned_off(tiling_env):
    from te_seq.kernels.cute import wgrad_tiling

    tiling_env("TE_SEQ_WGRAD_SCHEDULE", "static")  # the units: test_cute_dynamic_wgrad.py
    tiling_env("TE_SEQ_PINGPONG", "0")
    assert wgrad_tiling(2048, False) == Tiling(256, (1, 2))  # turned off: cooperative
    tiling_env("TE_SEQ_PINGPONG", None)  # the default
    # Q's 256 rows per expert: 2x1, 192 wide (2112 columns, < 5 % more), 64-column epilogue
    # subtiles; B's 512: 32-column ones; A's 4096: 1x2
    assert wgrad_tiling(2048, False, 256) == Tiling(192, (2, 1), True, epi_cols=64)
    assert wgrad_tiling(2048, False, 384) == Tiling(192, (2, 1), True, epi_cols=64)
    assert wgrad_tiling(2048, False, 385) == Tiling(192, (2, 1), True)
    assert wgrad_tiling(4096, False, 512) == Tiling(192, (2, 1), True)
    assert wgrad_tiling(4096, False, 4096) == Tiling(192, (1, 2), True)
    assert wgrad_tiling(2048, False, 513) == Tiling(128, (1, 2), True)  # 192 would pad to 2304
    tiling_env("TE_SEQ_WGRAD_CLUSTER", "1x2")
    assert wgrad_tiling(2048, False, 256) == Tiling(128, (1, 2), True, epi_cols=64)
    tiling_env("TE_SEQ_WGRAD_CLUSTER", None)
    # accumulate: ping-pong 128 wide, no cluster, over groups of <= 512 rows on average (the
    # accumulate is memory-bound there); cooperative over longer ones (compute-bound: A)
    assert wgrad_tiling(2048, True, 256) == Tiling(128, (1, 1), True)
    assert wgrad_tiling(768, True, 512) == Tiling(128, (1, 1), True)
    assert wgrad_tiling(2048, True, 513) == Tiling(256, (1, 2))
    assert wgrad_tiling(768, True, 4096) == Tiling(192, (1, 2))
    tiling_env("TE_SEQ_PINGPONG", "0")
    assert wgrad_tiling(2048, True) == Tiling(256, (1, 2))  # turned off: cooperative
    assert wgrad_tiling(768, True) == Tiling(192, (1, 2))


# (name, tokens per expert, N, K): one expert; 128 experts with empty ones; unaligned token
# counts and widths; many tiles per CTA with long spans (the A/B ring wraps with skips of
# every length, including the zero of an empty expert's tiles).
_CASES = [
    ("one_expert", [300], 256, 512),
    (
        "128_experts",
        [int(s) for s in torch.randint(0, 300, (128,), generator=torch.Generator().manual_seed(5))],
        384,
        256,
    ),
    ("empty_and_unaligned", [0, 77, 0, 1, 300, 5, 0], 136, 200),
    ("long_spans", [1100, 0, 2000, 77, 4100, 640], 768, 1536),
]
_TILINGS = [(128, (1, 2)), (192, (2, 1)), (128, (1, 1))]


def _wgrad(grad_out, x, offs, tiling, pingpong, out_dtype, start=None, dynamic=False):
    """The wgrad into a NaN-filled output, or added to a copy of ``start`` (accumulate)."""
    from te_seq.kernels import cute

    e, n, k = offs.shape[0], grad_out.shape[1], x.shape[1]
    out = torch.full((e, n, k), float("nan"), device="cuda", dtype=out_dtype)
    if start is not None:
        out.copy_(start)
    t = Tiling(tiling[0], tiling[1], pingpong, dynamic=dynamic)
    cute.grouped_wgrad(grad_out, x, offs, out=out, accumulate=start is not None, tiling=t)
    return out


@gpu
@needs_cute
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tiling", _TILINGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_pingpong_wgrad_equals_cooperative_and_reference(case, tiling, out_dtype):
    _, sizes, n, k = case
    grad_out, x, offs = wgrad_operands(sizes, n, k)
    out = _wgrad(grad_out, x, offs, tiling, True, out_dtype)
    same_tile = _wgrad(grad_out, x, offs, tiling, False, out_dtype)
    check_wgrad(out, same_tile, grad_out, x, offs, sizes)


@gpu
@needs_cute
@pytest.mark.parametrize(("out_dtype", "dynamic"),
                         [(torch.float32, True), (torch.float32, False), (torch.bfloat16, False)],
                         ids=["fp32_dynamic", "fp32_static", "bf16_static"])
@pytest.mark.parametrize("tiling", _TILINGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_pingpong_accumulate_equals_cooperative_and_reference(case, tiling, out_dtype, dynamic):
    """Old C (random, every expert's block, empty experts' too) plus the wgrad: ping-pong
    (each warpgroup its own old-C blocks) against the cooperative kernel of the same tile."""
    _, sizes, n, k = case
    grad_out, x, offs = wgrad_operands(sizes, n, k)
    start = torch.randn(len(sizes), n, k, device="cuda").to(out_dtype)
    out = _wgrad(grad_out, x, offs, tiling, True, out_dtype, start, dynamic)
    same_tile = _wgrad(grad_out, x, offs, tiling, False, out_dtype, start, dynamic)
    check_wgrad(out, same_tile, grad_out, x, offs, sizes, start)


@gpu
@needs_cute
def test_pingpong_wgrad_cuda_graph_replays_with_new_split_sizes():
    check_wgrad_graph_replays(Tiling(128, (1, 2), pingpong=True))
