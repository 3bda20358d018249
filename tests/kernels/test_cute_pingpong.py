"""Ping-pong consumer warpgroups in the CuTe DSL grouped GEMM (``Tiling(pingpong=True)``).

The two MMA warpgroups take alternate tiles, so the results must equal the cooperative kernel's
of the same tile width bit for bit (each output value is the same fp32 sum over K in the same
order, rounded once) and the float64 reference within bf16/fp16 rounding. Compile-only tests run
on CPU; GPU tests need sm_90+.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from cute_marks import ROOT, compile_for_sm90a, gpu, needs_cute, needs_dsl, needs_ptxas
from cute_marks import offsets as _offs

from te_seq.kernels import reference
from te_seq.kernels.cute import Tiling

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import torch
    from te_seq.kernels.cute.compile import GemmConfig, GluConfig, compile_gemm, compile_glu
    bf16, fp16 = torch.bfloat16, torch.float16
    configs = [
        GemmConfig("m", bf16, bf16, "k", 192, (1, 2), pingpong=True),
        GemmConfig("m", bf16, bf16, "n", 128, (2, 1), pingpong=True),
        GemmConfig("m", fp16, fp16, "k", 192, (1, 1), pingpong=True),
        # half tiles: a tile with <= 64 rows of its group runs one 64-row atom
        GemmConfig("m", bf16, bf16, "k", 128, (1, 2), pingpong=True, half_tiles=True),
        GemmConfig("m", bf16, bf16, "n", 192, (2, 1), pingpong=True, half_tiles=True),
    ]
    for cfg in configs:
        print(cfg, f"{compile_gemm(cfg).compile_s:.1f}s", flush=True)
    fp32 = torch.float32
    glu = [
        GluConfig("fc1", bf16, "k", "silu", None, fp32, (1, 2), tile_n=128, pingpong=True),
        GluConfig("fc1", bf16, "k", "relu", 32, None, (2, 1), tile_n=128, pingpong=True),
        GluConfig("dgrad", bf16, "n", "silu", None, fp32, (1, 2), tile_n=192, pingpong=True),
        GluConfig("dgrad", bf16, "n", "gelu", 64, bf16, (1, 2), tile_n=128, pingpong=True),
        # the default 16-bit GLU dgrad (launch.GLU_DGRAD_PINGPONG): 2x1, split tails
        GluConfig("dgrad", bf16, "n", "silu", None, fp32, (2, 1), tile_n=128, pingpong=True),
        # ... with 2 or 4 h pairs loaded ahead (TE_SEQ_GLU_DGRAD_H_PREFETCH)
        GluConfig("dgrad", bf16, "n", "silu", None, fp32, (2, 1), tile_n=128, pingpong=True,
                  h_prefetch=2),
        GluConfig("dgrad", bf16, "n", "silu", None, fp32, (2, 1), tile_n=128, pingpong=True,
                  h_prefetch=4),
        GluConfig("fc1", bf16, "k", "silu", None, fp32, (1, 2), tile_n=192, pingpong=True),
        # (64 x 32) epilogue subtiles
        GluConfig("fc1", bf16, "k", "silu", None, fp32, (1, 2), tile_n=128, pingpong=True,
                  epi_rows=64),
        GluConfig("fc1", bf16, "k", "relu", 32, None, (2, 1), tile_n=128, pingpong=True,
                  epi_rows=64),
        GluConfig("dgrad", bf16, "n", "silu", None, fp32, (1, 2), tile_n=192, pingpong=True,
                  epi_rows=64),
        GluConfig("dgrad", bf16, "n", "gelu", 64, bf16, (2, 1), tile_n=128, pingpong=True,
                  epi_rows=64),
        GluConfig("fc1", bf16, "k", "silu", None, fp32, (1, 2), tile_n=128, pingpong=True,
                  half_tiles=True),
        # 64-column epilogue subtiles (TE_SEQ_GLU_FC1_EPI_COLS=64), 64-column gate/up blocks
        GluConfig("fc1", bf16, "k", "relu", 64, None, (2, 1), tile_n=128, pingpong=True,
                  epi_cols=64),
    ]
    for cfg in glu:
        print(cfg, f"{compile_glu(cfg).compile_s:.1f}s", flush=True)
    print("ALL COMPILED")
    """
)


@pytest.mark.slow  # DSL compiles in a subprocess
@needs_dsl
def test_compile_pingpong_configs_for_sm90a():
    compile_for_sm90a(_COMPILE_SCRIPT, timeout=900)


@needs_dsl
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"varlen": "m", "route": "scatter"}, "route 'scatter'"),
        ({"varlen": "m", "route": "gather", "cluster_mn": (1, 1)}, "route 'gather'"),
        ({"varlen": "m", "tile_mn": (128, 256)}, "tile width"),
    ],
)
def test_kernel_rejects_pingpong_it_cannot_run(kwargs, match):
    from te_seq.kernels.cute.grouped_gemm import GroupedGemmKernel

    with pytest.raises(ValueError, match=match):
        GroupedGemmKernel(pingpong=True, **kwargs)


@needs_dsl
@pytest.mark.parametrize("kwargs", [{"varlen": "k", "pingpong": True}, {"varlen": "m"}])
def test_kernel_rejects_half_tiles_outside_pingpong_varlen_m(kwargs):
    from te_seq.kernels.cute.grouped_gemm import GroupedGemmKernel

    with pytest.raises(ValueError, match="half tiles are for varlen 'm' in ping-pong"):
        GroupedGemmKernel(tile_mn=(128, 128), half_tiles=True, **kwargs)


@needs_dsl
def test_glu_kernel_pingpong_tiles():
    from te_seq.kernels.cute.glu_epilogue import GluGemmKernel

    assert GluGemmKernel("fc1", "silu", None, True, tile_n=128, pingpong=True).pingpong
    assert GluGemmKernel("fc1", "silu", None, True, tile_n=192, pingpong=True).pingpong
    with pytest.raises(ValueError, match=r"fc1: \(128, 192\); pingpong True"):
        GluGemmKernel("fc1", "silu", None, True, tile_n=256, pingpong=True)
    with pytest.raises(ValueError, match="interleave 64"):  # 96 gate columns: not whole blocks
        GluGemmKernel("fc1", "silu", 64, True, tile_n=192, pingpong=True)
    with pytest.raises(ValueError, match="bias"):
        GluGemmKernel("fc1", "silu", None, True, tile_n=128, has_bias=True, pingpong=True)
    with pytest.raises(ValueError, match="interleave 128"):
        GluGemmKernel("fc1", "silu", 128, True, tile_n=128, pingpong=True)
    kernel = GluGemmKernel("dgrad", "silu", None, True, tile_n=192, pingpong=True, epi_rows=64)
    assert kernel.epi_rows == 64
    with pytest.raises(ValueError, match="epi_rows 64 unsupported.*pingpong False"):
        GluGemmKernel("dgrad", "silu", None, True, tile_n=192, epi_rows=64)
    with pytest.raises(ValueError, match="epi_rows 32 unsupported"):
        GluGemmKernel("dgrad", "silu", None, True, tile_n=192, pingpong=True, epi_rows=32)
    # h pairs loaded ahead: 1, 2 or 4, dividing a dgrad tile's subtiles (tile_n / 32 per
    # row block of epi_rows)
    for width, rows, depth in [(128, 128, 4), (192, 128, 2), (192, 64, 4), (256, 128, 4)]:
        kernel = GluGemmKernel("dgrad", "silu", None, True, tile_n=width, pingpong=width < 256,
                               epi_rows=rows, h_prefetch=depth)
        assert kernel.h_prefetch == depth and kernel.extra_barriers == depth
    with pytest.raises(ValueError, match="h_prefetch 4 unsupported.*6 subtiles"):
        GluGemmKernel("dgrad", "silu", None, True, tile_n=192, pingpong=True, h_prefetch=4)
    with pytest.raises(ValueError, match="h_prefetch 3 unsupported"):
        GluGemmKernel("dgrad", "silu", None, True, tile_n=192, pingpong=True, h_prefetch=3)
    with pytest.raises(ValueError, match="h_prefetch 2 unsupported.*mode 'fc1'"):
        GluGemmKernel("fc1", "silu", None, True, tile_n=128, pingpong=True, h_prefetch=2)


@needs_dsl
def test_glu_act_and_accumulating_kernels_refuse_wide_epilogue_subtiles(monkeypatch):
    """The GLU and activation epilogues and the accumulating wgrads index their subtiles by
    32 columns: a class-level ``epi_cols`` of 64 (a timing variant of the fresh wgrads) is
    refused there, not mis-stored."""
    from te_seq.kernels.cute.act_epilogue import ActGemmKernel
    from te_seq.kernels.cute.glu_epilogue import GluGemmKernel
    from te_seq.kernels.cute.grouped_gemm import GroupedGemmKernel

    monkeypatch.setattr(GroupedGemmKernel, "epi_cols", 64)
    with pytest.raises(ValueError, match="32-column subtiles, got epi_cols=64"):
        GluGemmKernel("fc1", "silu", None, True, tile_n=192, pingpong=True)
    with pytest.raises(ValueError, match="32-column subtiles, got epi_cols=64"):
        ActGemmKernel("fc1", "relu", False)
    assert GroupedGemmKernel(varlen="k", tile_mn=(128, 192), pingpong=True).epi_cols == 64
    with pytest.raises(ValueError, match="accumulating into C stages 32-column"):
        GroupedGemmKernel(varlen="k", tile_mn=(128, 192), accumulate=True, pingpong=True)


@needs_dsl
def test_glu_fc1_takes_64_column_subtiles_only_where_it_pairs_whole_blocks():
    """``GluGemmKernel(epi_cols=64)``: the 16-bit FC1 in ping-pong, 128 wide, with [gate | up]
    halves or 64-column blocks, 128-row subtiles, no bias, rows not gathered (a 2-slot ring of
    64 columns); anything else, and the FP8 GLU kernels, refuse it by name."""
    import cutlass

    from te_seq.kernels.cute.block_glu import BlockScaledGluGemmKernel
    from te_seq.kernels.cute.compile import GluConfig, compile_glu
    from te_seq.kernels.cute.glu_epilogue import GluGemmKernel
    from te_seq.kernels.cute.scaled_glu import ScaledGluGemmKernel

    for il in (None, 64):
        wide = GluGemmKernel("fc1", "silu", il, True, (2, 1), tile_n=128, pingpong=True,
                             epi_cols=64)
        wide.c_dtype = cutlass.BFloat16
        assert (wide.epi_cols, wide._default_ring()) == (64, 2)
    refused = (dict(mode="dgrad"), dict(tile_n=192), dict(pingpong=False, tile_n=256),
               dict(interleave=32), dict(has_bias=True, pingpong=False, tile_n=256),
               dict(epi_rows=64), dict(route="gather", pingpong=False, tile_n=256))
    for change in refused:
        args = dict(mode="fc1", interleave=None, tile_n=128, pingpong=True)
        args.update(change)
        mode, il = args.pop("mode"), args.pop("interleave")
        with pytest.raises(ValueError, match="GluGemmKernel: epi_cols 64 unsupported"):
            GluGemmKernel(mode, "silu", il, True, epi_cols=64, **args)
    assert not ScaledGluGemmKernel.wide_fc1_ok and not BlockScaledGluGemmKernel.wide_fc1_ok
    with pytest.raises(ValueError, match="epi_cols 64 unsupported"):
        compile_glu(GluConfig("fc1", torch.bfloat16, "k", "silu", None, None, (2, 1),
                              tile_n=192, pingpong=True, epi_cols=64))


@needs_dsl
def test_fresh_wgrads_take_64_column_subtiles_in_a_ring_of_the_same_bytes():
    """The ``epi_cols`` argument: 64 for the fresh kernels (a 2-slot ring: the bytes of the
    default 4 x 32 one), refused when accumulating and for widths other than 32 and 64, and
    by compile_gemm outside the fresh varlen-K configs."""
    import cutlass

    from te_seq.kernels.cute.compile import GemmConfig, compile_gemm
    from te_seq.kernels.cute.grouped_gemm import GroupedGemmKernel
    from te_seq.kernels.cute.scale_epilogue import ScaledGemmKernel

    wide = GroupedGemmKernel("k", (128, 192), (2, 1), pingpong=True, epi_cols=64)
    narrow = GroupedGemmKernel("k", (128, 192), (2, 1), pingpong=True)
    scaled = ScaledGemmKernel("k", (128, 192), (2, 1), pingpong=True, epi_cols=64)
    for kernel in (wide, narrow, scaled):
        kernel.c_dtype = cutlass.BFloat16
    assert (wide.epi_cols, wide._default_ring()) == (64, 2)
    assert (narrow.epi_cols, narrow._default_ring()) == (32, 4)
    assert (scaled.epi_cols, scaled._default_ring()) == (64, 2)
    with pytest.raises(ValueError, match="32 or 64 columns.*epi_cols=48"):
        GroupedGemmKernel("k", (128, 192), pingpong=True, epi_cols=48)
    with pytest.raises(ValueError, match="epi_cols=64, accumulate=True"):
        ScaledGemmKernel("k", (128, 128), (2, 1), True, pingpong=True, epi_cols=64)
    bf16 = torch.bfloat16
    for cfg in (GemmConfig("m", bf16, bf16, epi_cols=64),  # cooperative
                GemmConfig("m", bf16, bf16, pingpong=True, route="scatter", epi_cols=64),
                GemmConfig("k", bf16, torch.float32, "n", accumulate=True, epi_cols=64),
                GemmConfig("k", bf16, bf16, "n", epi_cols=48)):
        with pytest.raises(ValueError, match="fresh varlen-K GEMMs"):
            compile_gemm(cfg)


@needs_dsl
def test_epilogue_subclasses_reject_pingpong():
    from te_seq.kernels.cute.bias_epilogue import BiasGemmKernel
    from te_seq.kernels.cute.grouped_gemm import GroupedGemmKernel

    kernel = BiasGemmKernel((128, 192), (1, 2), False, None)
    with pytest.raises(ValueError, match="BiasGemmKernel: ping-pong"):
        GroupedGemmKernel.__init__(kernel, "m", (128, 192), pingpong=True)


def test_grouped_mm_rejects_pingpong_with_bias_or_narrow_list():
    from te_seq.kernels.cute import gemm

    with pytest.raises(ValueError, match="neither a bias nor routed rows"):
        gemm._check_pingpong(Tiling(192, (1, 2), pingpong=True), torch.zeros(2, 4), None)
    with pytest.raises(ValueError, match="neither a bias nor routed rows"):
        gemm._check_pingpong(Tiling(192, (1, 2), pingpong=True), None, "gather")
    with pytest.raises(ValueError, match="epilogue subtiles are 128 rows"):  # GLU only
        gemm._check_pingpong(Tiling(192, (1, 2), pingpong=True, epi_rows=64), None, None)
    with pytest.raises(ValueError, match=r"tile_n in \(128, 192\)"):
        gemm._check_pingpong(Tiling(256, (1, 2), pingpong=True), None, None)
    gemm._check_pingpong(Tiling(256, (1, 2)), torch.zeros(2, 4), "gather")  # not ping-pong


# ------------------------------------------------------------------ GPU correctness

_TILINGS = [(192, (1, 2)), (128, (2, 1)), (192, (1, 1)), (128, (1, 2))]

# (name, split sizes, K, N): one group; 128 groups (several 32-group scan rounds per warp);
# empty groups first/last; unaligned sizes and widths; one big group; many tiles per CTA with a
# long K (the A/B ring wraps with skips that are not a multiple of its depth).
_CASES = [
    ("one_group", [300], 256, 512),
    (
        "128_groups",
        [int(s) for s in torch.randint(0, 300, (128,), generator=torch.Generator().manual_seed(3))],
        512,
        384,
    ),
    ("empty_groups", [0, 77, 0, 0, 300, 5, 0], 128, 256),
    ("unaligned", [1, 3, 129, 255, 257, 7, 513], 192, 264),
    ("all_in_one", [0, 0, 1000, 0], 320, 256),
    ("many_tiles_long_k", [1100, 900, 0, 2000, 77, 1500, 640, 1300], 4160, 1536),
]


def _run(a, b, offs, tiling, pingpong, epi_cols=32):
    from te_seq.kernels import cute

    out = torch.full((a.shape[0], b.shape[2]), float("nan"), device="cuda", dtype=a.dtype)
    t = Tiling(tiling[0], tiling[1], pingpong, epi_cols=epi_cols)
    cute.grouped_mm(a, b, offs, out=out, tiling=t)
    return out


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output has NaN (unwritten rows?)"
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@gpu
@needs_cute
@pytest.mark.parametrize("epi_cols", [32, 64])
@pytest.mark.parametrize("tiling", _TILINGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_pingpong_equals_cooperative_and_reference(case, tiling, epi_cols):
    """Ping-pong tiles (32- or 64-column epilogue subtiles) equal the cooperative ones of the
    same width bit for bit, and the float64 reference within bf16 rounding."""
    _, sizes, k, n = case
    m, e = sum(sizes), len(sizes)
    torch.manual_seed(len(sizes) + k)
    a = torch.randn(m + 37, k, device="cuda", dtype=torch.bfloat16)  # 37 rows past offs[-1]
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
    offs = _offs(sizes)
    out = _run(a, w.transpose(1, 2), offs, tiling, pingpong=True, epi_cols=epi_cols)
    same_tile = _run(a, w.transpose(1, 2), offs, tiling, pingpong=False)
    torch.testing.assert_close(out, same_tile, rtol=0, atol=0)
    ref = reference.grouped_mm(a.double(), w.transpose(1, 2).double(), offs)
    assert _rel_err(out, ref) < 1e-2
    assert (out[m:] == 0).all()


# Groups whose last 2x1 unit (256 rows) holds no rows (0, 256, 512), 1-128 rows (a split tail:
# 1, 77, 128, 129 = 128 + 1, 384, 385, 640) or 129-255 rows (a whole unit: 255, 511, 200); N of
# three 128-wide tiles, so a tail's last pair of n-tiles has its second past N.
_TAIL_SIZES = [1, 128, 129, 255, 256, 0, 257, 384, 385, 511, 512, 640, 77, 200]


@gpu
@needs_cute
@pytest.mark.parametrize(("width", "n"), [(128, 384), (192, 448)], ids=str)
@pytest.mark.parametrize("pingpong", [True, False], ids=["pingpong", "cooperative"])
def test_2x1_split_tails_equal_1x2(width, n, pingpong):
    """A 2x1 kernel runs each group's tail of <= 128 rows as one m-tile over two n-tiles,
    each CTA loading its own B (tile_scheduler.py): the outputs equal the 1x2 kernel's of the
    same tile bit for bit, near float64, zeros past offs[-1], on every kind of tail."""
    sizes, k = _TAIL_SIZES, 320
    torch.manual_seed(5)
    a = torch.randn(sum(sizes) + 45, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(sizes), n, k, device="cuda", dtype=torch.bfloat16)
    offs = _offs(sizes)
    out = _run(a, w.transpose(1, 2), offs, (width, (2, 1)), pingpong)
    torch.testing.assert_close(out, _run(a, w.transpose(1, 2), offs, (width, (1, 2)), pingpong),
                               rtol=0, atol=0)
    ref = reference.grouped_mm(a.double(), w.transpose(1, 2).double(), offs)
    assert _rel_err(out, ref) < 1e-2
    assert (out[sum(sizes):] == 0).all()


@gpu
@needs_cute
@pytest.mark.parametrize("tiling", [(128, (1, 2)), (192, (2, 1))], ids=str)
def test_half_tiles_equal_full_tiles(tiling_env, tiling):
    """With TE_SEQ_HALF_TILES=1 every expert's last tile of <= 64 rows (1, 3, 7, 5, 64 rows
    here; 129 and 257 leave one) runs one 64-row atom: the outputs equal the cooperative
    kernel's bit for bit, rows past offs[-1] stay zero."""
    sizes, k, n = [1, 3, 129, 0, 257, 7, 64, 65, 5, 300], 512, 256
    torch.manual_seed(11)
    a = torch.randn(sum(sizes) + 9, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(sizes), n, k, device="cuda", dtype=torch.bfloat16)
    offs = _offs(sizes)
    full = _run(a, w.transpose(1, 2), offs, tiling, pingpong=False)
    tiling_env("TE_SEQ_HALF_TILES", "1")
    half = _run(a, w.transpose(1, 2), offs, tiling, pingpong=True)
    torch.testing.assert_close(half, full, rtol=0, atol=0)
    assert (half[sum(sizes):] == 0).all()


@gpu
@needs_cute
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pingpong_n_major_b_and_fp16(dtype):
    sizes, k, n = [0, 513, 129, 0, 1000, 1], 256, 392
    a = torch.randn(sum(sizes), k, device="cuda", dtype=dtype)
    b = torch.randn(len(sizes), k, n, device="cuda", dtype=dtype)  # W [E, K, N]: N contiguous
    offs = _offs(sizes)
    out = _run(a, b, offs, (192, (1, 2)), pingpong=True)
    torch.testing.assert_close(out, _run(a, b, offs, (192, (1, 2)), False), rtol=0, atol=0)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert _rel_err(out, reference.grouped_mm(a.double(), b.double(), offs)) < tol


@gpu
@needs_cute
def test_pingpong_cuda_graph_replays_with_new_split_sizes():
    from te_seq.kernels import cute

    k, n, m = 512, 768, 3000
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4, k, n, device="cuda", dtype=torch.bfloat16)
    offs = _offs([750, 750, 750, 750])
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    tiling = Tiling(192, (1, 2), pingpong=True)
    cute.grouped_mm(a, b, offs, out=out, tiling=tiling)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute.grouped_mm(a, b, offs, out=out, tiling=tiling)
    for sizes in ([2900, 0, 100, 0], [0, 0, 0, 3000], [3, 1500, 1000, 21]):
        offs.copy_(_offs(sizes))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, reference.grouped_mm(a.double(), b.double(), offs)) < 1e-2


# ------------------------------------------------------------------ GLU epilogues in ping-pong

# (name, split sizes, rows past offs[-1], H, F); F a multiple of 128 ([gate | up] halves)
_GLU_CASES = [
    ("one_expert", [300], 0, 256, 256),
    ("empty_experts_rows_past_end", [0, 77, 0, 0, 300, 5, 0], 40, 128, 384),
    ("many_tiles", [700, 1500, 0, 900, 1, 1300], 0, 1024, 768),
    # 128 small unaligned experts (some empty), rows past the end: many partial 64-row halves
    ("128_experts", [(37 * i + 11) % 53 if i % 9 else 0 for i in range(128)], 13, 256, 384),
]
# (act, interleave, probs dtype, fc1 cluster, dgrad tile width)
_GLU_CONFIGS = [
    ("silu", None, torch.float32, (1, 2), 192),
    ("silu", None, None, (2, 1), 128),
    ("gelu", 32, torch.bfloat16, (1, 2), 128),
    ("relu", 64, torch.float32, (2, 1), 192),
]


def _glu_data(case, probs_dtype):
    _, sizes, extra, h, f = case
    m = sum(sizes) + extra
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(len(sizes), 2 * f, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    w2 = torch.randn(len(sizes), h, f, device="cuda", dtype=torch.bfloat16) / h**0.5
    probs = None if probs_dtype is None else torch.rand(m, device="cuda").to(probs_dtype)
    return x, w1, w2, probs, _offs(sizes)


def _fc1_matches_cooperative(case, config, tiling):
    """The FC1 at ``tiling`` gives h and a bit for bit as the cooperative 256-wide kernel (an
    explicit tiling: the default is ping-pong for these K), h near the float64 reference, and
    zeros past offs[-1]."""
    from te_seq.kernels import cute

    act, il, p_dtype, _, _ = config
    x, w1, _, probs, offs = _glu_data(case, p_dtype)
    w1t = w1.transpose(1, 2)
    h, a = cute.glu_fc1_forward(x, w1t, offs, act, il, probs, tiling=tiling)
    h_coop, a_coop = cute.glu_fc1_forward(x, w1t, offs, act, il, probs,
                                          tiling=Tiling(256, (1, 2)))
    torch.testing.assert_close(h, h_coop, rtol=0, atol=0)
    torch.testing.assert_close(a, a_coop, rtol=0, atol=0)
    assert _rel_err(h, reference.grouped_mm(x.double(), w1t.double(), offs)) < 1e-2
    end = int(offs[-1])
    assert (h[end:] == 0).all() and (a[end:] == 0).all()


# (case, config, FC1 tile width): every case and config at 128 (64 gate + 64 up columns); at
# 192 (96 + 96; not yet run on a GPU when written, 2026-11-25) where F is a multiple of 96
# with halves, or interleave 32 (three gate/up block pairs per tile; 64 is refused)
_FC1_PP = [(c, k, 128) for c in _GLU_CASES for k in _GLU_CONFIGS] + [
    (c, k, 192) for c in _GLU_CASES for k in _GLU_CONFIGS
    if k[1] == 32 or (k[1] is None and c[4] % 96 == 0)]


@gpu
@needs_cute
@pytest.mark.parametrize("epi_rows", [128, 64])
@pytest.mark.parametrize(("case", "config", "width"), _FC1_PP,
                         ids=[f"{c[0]}-{k[0]}-{k[1]}-{k[3]}-w{w}" for c, k, w in _FC1_PP])
def test_glu_fc1_pingpong_equals_cooperative(case, config, width, epi_rows):
    _fc1_matches_cooperative(case, config, Tiling(width, config[3], pingpong=True,
                                                  epi_rows=epi_rows))


# (case, config, store_h) of the FC1's 64-column subtiles ([gate | up] halves or 64-column
# blocks): h written, and a only (a forward without backward) in the default 2x1 cluster
_FC1_WIDE = [(c, k, True) for c in _GLU_CASES for k in _GLU_CONFIGS if k[1] in (None, 64)] + [
    (c, _GLU_CONFIGS[1], False) for c in _GLU_CASES]


@gpu
@needs_cute
@pytest.mark.parametrize(("case", "config", "store_h"), _FC1_WIDE,
                         ids=[f"{c[0]}-{k[0]}-{k[1]}-{k[3]}-{'h' if s else 'noh'}"
                              for c, k, s in _FC1_WIDE])
def test_glu_fc1_64_column_subtiles_equal_32(case, config, store_h):
    """``Tiling(epi_cols=64)``: the 16-bit ping-pong FC1 stages a tile's 64 gate, 64 up and 64
    a columns in one ring slot each (3 TMA stores a tile instead of 6); h and a bit for bit the
    32-column kernel's (empty experts, rows past the end, unaligned sizes, probs fp32 / bf16 /
    none), zeros past offs[-1]."""
    from te_seq.kernels import cute

    act, il, p_dtype, cluster, _ = config
    x, w1, _, probs, offs = _glu_data(case, p_dtype)
    w1t = w1.transpose(1, 2)
    runs = {cols: cute.glu_fc1_forward(x, w1t, offs, act, il, probs, store_h=store_h,
                                       tiling=Tiling(128, cluster, True, epi_cols=cols))
            for cols in (32, 64)}
    (h32, a32), (h64, a64) = runs[32], runs[64]
    torch.testing.assert_close(a64, a32, rtol=0, atol=0)
    end = int(offs[-1])
    assert (a64[end:] == 0).all()
    if store_h:
        torch.testing.assert_close(h64, h32, rtol=0, atol=0)
    else:
        assert h64 is None and h32 is None


@gpu
@needs_cute
@pytest.mark.parametrize("config", _GLU_CONFIGS[:2], ids=str)
@pytest.mark.parametrize("case", _GLU_CASES[1:], ids=[c[0] for c in _GLU_CASES[1:]])
def test_glu_fc1_half_tiles_equal_cooperative(tiling_env, case, config):
    """TE_SEQ_HALF_TILES=1: the ping-pong FC1's last tiles of <= 64 rows run one 64-row atom,
    bit for bit the cooperative kernel (h, a; zeros past offs[-1])."""
    tiling_env("TE_SEQ_HALF_TILES", "1")
    _fc1_matches_cooperative(case, config, Tiling(128, config[3], pingpong=True))


@gpu
@needs_cute
@pytest.mark.parametrize("epi_rows", [128, 64])
@pytest.mark.parametrize("config", _GLU_CONFIGS, ids=str)
@pytest.mark.parametrize("case", _GLU_CASES, ids=[c[0] for c in _GLU_CASES])
def test_glu_dgrad_pingpong_equals_cooperative(case, config, epi_rows):
    from te_seq.kernels import cute

    act, il, p_dtype, cluster, tile_n = config
    x, _, w2, probs, offs = _glu_data(case, p_dtype)
    m, f = x.shape[0], w2.shape[2]
    dy = torch.randn_like(x)
    h = torch.randn(m, 2 * f, device="cuda", dtype=x.dtype)
    tiling = Tiling(tile_n, cluster, pingpong=True, epi_rows=epi_rows)
    dh, a, dprobs = cute.glu_fc2_dgrad(dy, w2, offs, h, act, il, probs, tiling=tiling)
    same = cute.glu_fc2_dgrad(dy, w2, offs, h, act, il, probs, tiling=Tiling(tile_n, cluster))
    torch.testing.assert_close(dh, same[0], rtol=0, atol=0)
    torch.testing.assert_close(a, same[1], rtol=0, atol=0)
    da = reference.grouped_mm(dy.double(), w2.double(), offs)
    p64 = None if probs is None else probs.double()
    dh_ref, dp_ref = reference.glu_backward(h.double(), da, act, il, p64)
    assert _rel_err(dh, dh_ref) < 1e-2  # both tilings near float64, not only alike
    if probs is None:
        assert dprobs is None
    else:  # sums of per-tile atomics: the order of the additions may differ
        assert _rel_err(dprobs, dp_ref) < 1e-2
        torch.testing.assert_close(dprobs.float(), same[2].float(), rtol=2e-2, atol=1e-3)


@gpu
@needs_cute
@pytest.mark.parametrize(("h_prefetch", "epi_rows"), [(2, 128), (4, 128), (4, 64)])
@pytest.mark.parametrize("config", _GLU_CONFIGS[:3], ids=str)
@pytest.mark.parametrize("case", _GLU_CASES, ids=[c[0] for c in _GLU_CASES])
def test_glu_dgrad_pingpong_h_prefetch_equals_one_pair(case, config, h_prefetch, epi_rows):
    # the warpgroups' epilogues alternate over shared h pairs: with 4 pairs and 4 subtiles a
    # tile fills each pair once, so a pair's phase parity is the warpgroup's (many_tiles and
    # 128_experts give each CTA several tiles of each warpgroup)
    from te_seq.kernels import cute

    act, il, p_dtype, cluster, _ = config
    x, _, w2, probs, offs = _glu_data(case, p_dtype)
    dy = torch.randn_like(x)
    h = torch.randn(x.shape[0], 2 * w2.shape[2], device="cuda", dtype=x.dtype)
    tiling = Tiling(128, cluster, pingpong=True, epi_rows=epi_rows)
    one = cute.glu_fc2_dgrad(dy, w2, offs, h, act, il, probs, tiling=tiling, h_prefetch=1)
    ahead = cute.glu_fc2_dgrad(dy, w2, offs, h, act, il, probs, tiling=tiling,
                               h_prefetch=h_prefetch)
    torch.testing.assert_close(ahead[0], one[0], rtol=0, atol=0)
    torch.testing.assert_close(ahead[1], one[1], rtol=0, atol=0)
    if probs is not None:  # atomics may add in another order
        torch.testing.assert_close(ahead[2].float(), one[2].float(), rtol=2e-2, atol=1e-3)
    dh_ref, _ = reference.glu_backward(
        h.double(), reference.grouped_mm(dy.double(), w2.double(), offs), act, il,
        None if probs is None else probs.double())
    assert _rel_err(ahead[0], dh_ref) < 1e-2


def test_plain_gemm_default_tiling_is_pingpong_for_short_k_unless_turned_off(tiling_env):
    from te_seq.kernels.cute import plain_mm_tiling

    tiling_env("TE_SEQ_PINGPONG_MAX_K", None)
    tiling_env("TE_SEQ_PINGPONG", "0")
    assert plain_mm_tiling(2048, 768) == Tiling(256, (1, 2))  # turned off: cooperative
    tiling_env("TE_SEQ_PINGPONG", None)  # the default: 2x1 clusters, 192 wide within 5 %
    assert plain_mm_tiling(2048, 768) == Tiling(192, (2, 1), True)  # 2112 columns
    assert plain_mm_tiling(4096, 1024) == Tiling(192, (2, 1), True)  # 4224 columns
    assert plain_mm_tiling(2048, 1536) == Tiling(192, (2, 1), True)  # Q's FC1 dgrad
    assert plain_mm_tiling(4096, 2048) == Tiling(192, (2, 1), True)  # B's FC1 dgrad
    assert plain_mm_tiling(1536, 4096) == Tiling(192, (2, 1), True)  # a plain FC1 of B
    assert plain_mm_tiling(1408, 1024) == Tiling(128, (2, 1), True)  # 192 would pad to 1536
    tiling_env("TE_SEQ_MM_CLUSTER", "1x2")
    assert plain_mm_tiling(2048, 768) == Tiling(128, (1, 2), True)  # 192 would pad to 2304
    tiling_env("TE_SEQ_MM_CLUSTER", None)
    assert plain_mm_tiling(4096, 14336) == Tiling(256, (1, 2))  # A's FC2: cooperative
    assert plain_mm_tiling(768, 4097) == Tiling(192, (1, 2))


def test_glu_default_tilings_stay_cooperative(tiling_env):
    from te_seq.kernels.cute import glu, launch

    tiling = glu._glu_tiling
    assert tiling("fc1", 1536, False, None) == Tiling(256, (1, 2))
    assert tiling("fc1", 1536, True, None) == Tiling(256, (2, 1))  # gathered rows
    assert tiling("dgrad", 768, False, None) == Tiling(192, (1, 2))
    given = Tiling(128, (1, 2), True)
    assert tiling("fc1", 1536, False, given) is given
    tiling_env("TE_SEQ_PINGPONG", None)  # the plain GEMM's default: not GLU's
    assert tiling("fc1", 1536, False, None) == Tiling(256, (1, 2))
    assert launch.plain_mm_tiling(2048, 768).pingpong


# ------------------------------------------------------------------ registers (ptxas, CPU)

# ping-pong configs that must assemble without register spills (kernel README, "Why the
# fused GLU dgrad loses in ping-pong"): the GLU's (64 x 32) subtiles with per-row probs, and
# the FP8 row-wise kernels
_NO_SPILL_CONFIGS = ("glu_dgrad_silu128_pp64", "glu_fc1_silu_probs_pp64", "glu_fc1_relu_il32_pp64",
                     # FP8 row-wise in ping-pong (each warpgroup its scale scratch)
                     "fp8_rowwise_pp192", "fp8_glu_fc1_silu_probs_pp", "fp8_wgrad_pp192_2x1",
                     # the fresh wgrads' 64-column subtiles (short groups' default)
                     "fp8_wgrad_pp192_2x1_c64", "wgrad_pp192_dyn_c64",
                     "mm192_pp_2x1_c64", "fp8_rowwise_pp192_2x1_c64",
                     "glu_fc1_silu_probs_pp_2x1_c64", "glu_fc1_silu_pp_2x1_noh_c64",
                     # the default varlen-M clusters: 2x1 with split tails (two B atoms)
                     # (the default 16-bit GLU dgrad, glu_dgrad_silu_probs_pp_2x1, spills 36 / 64 B
                     # at 128-row subtiles and still ran faster than 64-row ones: section 25)
                     "mm192_pp_2x1", "glu_fc1_silu_probs_pp_2x1")


@pytest.mark.slow  # DSL compiles and ptxas in a subprocess
@needs_dsl
@needs_ptxas
def test_pingpong_glu_epilogues_do_not_spill(tmp_path):
    cmd = [sys.executable, "benchmarks/dump_ptx.py", "--configs", ",".join(_NO_SPILL_CONFIGS)]
    cmd += ["--out", str(tmp_path), "--ptxas"]
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    too_old = re.search(r".*Unsupported \.version.*", proc.stdout + proc.stderr)
    if proc.returncode and too_old:  # the GPU host's CUDA 13.0 ptxas reads PTX ISA <= 9.0
        pytest.skip(f"this ptxas cannot read the DSL's PTX: {too_old.group(0).strip()}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "spill stores" in line]
    assert len(lines) == len(_NO_SPILL_CONFIGS), proc.stdout
    for line in lines:
        assert "spill stores     0 B loads     0 B" in line, line
