"""The FP8 grouped GEMM of the CuTe DSL backend: ``cute.scaled_grouped_mm`` (E4M3 operands,
fp32 accumulation, row-wise dequantization scales in the epilogue). A compile-only test runs
without a GPU (CUTE_DSL_ARCH=sm_90a, in a subprocess); CPU tests check the refusals and their
reasons; GPU tests compare with the float64 maths on the same FP8 data (empty experts, one
expert, rows past the last expert, unaligned row counts, K and N multiples of 16 but not of
128), with ``torch._scaled_grouped_mm`` and across CUDA-graph replays with new split sizes."""

from __future__ import annotations

import textwrap

import pytest
import torch
from cute_marks import ROOT, compile_for_sm90a, gpu, needs_cute, needs_dsl, poison
from cute_marks import offsets as _offs
from cute_marks import rel_err as _rel_err

from te_seq.kernels import cute

FP8 = torch.float8_e4m3fn

# ------------------------------------------------------------------ CPU: compile-only, errors

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import torch
    from te_seq.kernels.cute.compile import GemmConfig, compile_gemm
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    for tile_n, cluster in [(256, (1, 2)), (192, (1, 2)), (128, (2, 1))]:
        cfg = GemmConfig("m", fp8, bf16, "k", tile_n, cluster, scaled=True)
        print(cfg, f"{compile_gemm(cfg).compile_s:.1f}s", flush=True)
    for tile_n, cluster, half in [(128, (1, 2), False), (192, (1, 2), False),
                                  (128, (2, 1), True)]:  # ping-pong (and its half tiles)
        cfg = GemmConfig("m", fp8, bf16, "k", tile_n, cluster, scaled=True, pingpong=True,
                         half_tiles=half)
        print(cfg, f"{compile_gemm(cfg).compile_s:.1f}s", flush=True)
    for out, acc in [(bf16, False), (torch.float32, True), (torch.float32, False)]:  # wgrad
        cfg = GemmConfig("k", fp8, out, "k", 256, (1, 2), acc, scaled=True)
        print(cfg, f"{compile_gemm(cfg).compile_s:.1f}s", flush=True)
    for out, cluster in [(bf16, (2, 1)), (torch.float32, (1, 2))]:  # ping-pong wgrads
        cfg = GemmConfig("k", fp8, out, "k", 128, cluster, scaled=True, pingpong=True)
        print(cfg, f"{compile_gemm(cfg).compile_s:.1f}s", flush=True)
    try:
        compile_gemm(GemmConfig("m", fp8, bf16, "n", scaled=True))
    except ValueError as exc:
        assert "K-major" in str(exc), exc
    else:
        raise AssertionError("an N-major scaled config compiled")
    print("ALL COMPILED")
    """
)


@pytest.mark.slow  # ~6-10 s of DSL compiles; CI runs it, `-m "not slow"` quick runs skip it
@needs_dsl
def test_fp8_kernels_compile_for_sm90a():
    compile_for_sm90a(_COMPILE_SCRIPT, timeout=600)


def _operands(m=10, e=2, n=48, k=32, device="cpu"):
    a = torch.randn(m, k, device=device).to(FP8)
    b = torch.randn(e, n, k, device=device).to(FP8)
    return a, b, torch.rand(m, device=device) + 0.5, torch.rand(e, n, device=device) + 0.5


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda a, b, sa, sb: (a.to(torch.bfloat16), b, sa, sb),
         "needs a float8_e4m3fn or float8_e5m2 a and a float8_e4m3fn b"),
        (lambda a, b, sa, sb: (a, b.to(torch.float8_e5m2), sa, sb), "float8_e5m2"),
        (lambda a, b, sa, sb: (a[:, :16], b, sa, sb), "needs a [M, K] and b [E, N, K]"),
        (lambda a, b, sa, sb: (a, b[:, :40], sa, sb[:, :40]), "N=40 must be multiples of 16"),
        (lambda a, b, sa, sb: (a[:, :24], b[:, :, :24], sa, sb), "K=24 and N=48"),
        (lambda a, b, sa, sb: (a, b[:0], sa, sb[:0]), "E=0"),
        (lambda a, b, sa, sb: (a, b, sa.double(), sb), "a_scale must be float32 [10]"),
        (lambda a, b, sa, sb: (a, b, sa[:, None], sb), "got torch.float32 [10, 1]"),
        (lambda a, b, sa, sb: (a, b, sa, sb.t()), "b_scale must be float32 [2, 48]"),
        (lambda a, b, sa, sb: (a, b, sa, sb), "needs CUDA tensors on one device, got ['cpu']"),
    ],
    ids=["bf16_a", "e5m2_b", "k_mismatch", "n_unaligned", "k_unaligned", "no_experts",
         "scale_a_dtype", "scale_a_shape", "scale_b_shape", "cpu"],
)
def test_supports_scaled_names_the_problem(change, reason):
    a, b, sa, sb = change(*_operands())
    ok, why = cute.supports_scaled(a, b, sa, sb)
    assert not ok and reason in why, why
    with pytest.raises(ValueError, match="cute scaled_grouped_mm") as exc:
        cute.scaled_grouped_mm(a, b, sa, sb, torch.tensor([3, 10], dtype=torch.int32))
    assert reason in str(exc.value) and str(tuple(a.shape)) in str(exc.value)


def test_supports_scaled_outputs_bf16_only():
    ok, why = cute.supports_scaled(*_operands(), out_dtype=torch.float16)
    assert not ok and "out_dtype=torch.float16" in why


# ------------------------------------------------------------------ GPU correctness


def _ref(a, b, sa, sb, offs, absolute: bool = False):
    """float64 y[m, n] = sa[m] sb[g, n] Σ_k a[m, k] b[g, n, k]; rows past offs[-1] zero.
    ``absolute``: the same sum of |terms| (the magnitude the accumulation error scales with)."""
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        rows = slice(start, end)
        aa, bb = a[rows].double(), b[g].double()
        if absolute:
            aa, bb = aa.abs(), bb.abs()
        out[rows] = (aa @ bb.t()) * sa[rows, None].double().abs() if absolute else (
            (aa @ bb.t()) * sa[rows, None].double())
        out[rows] *= sb[g].double().abs() if absolute else sb[g].double()
        start = end
    return out


def _check(out, operands):
    """Against the float64 maths: norm-relative error below 4e-3, and per element within one
    bf16 ulp (2^-8 relative, the output rounding) plus 2^-11 of the summands' magnitude
    Σ_k |sa a_k sb b_k|: Hopper's FP8 WGMMA accumulates at less than fp32 precision (the
    reason DeepGEMM promotes partial sums), so an output that cancels to near zero carries an
    error set by its terms, not by itself. A wrong k-tile, scale or row is off by the order of
    the magnitude itself."""
    ref, mag = _ref(*operands), _ref(*operands, absolute=True)
    assert _rel_err(out, ref) < 4e-3
    err = (out.double() - ref).abs()
    bound = 2**-8 * ref.abs() + 2**-11 * mag
    worst = (err - bound).max().item()
    assert worst <= 0, f"element error exceeds the bound by {worst}"


# (name, split sizes, extra rows past offs[-1], K, N)
_CASES = [
    ("one_expert", [300], 0, 256, 256),
    ("empty_experts_rows_past_end", [0, 77, 0, 0, 300, 5, 0], 40, 128, 384),
    ("unaligned", [1, 3, 129, 255, 257, 7, 513], 0, 384, 144),
    ("k_n_tails", [130, 0, 250, 61], 17, 80, 208),  # K, N multiples of 16, not of 128
    ("k_tail_long", [200, 311], 0, 400, 768),
]


@gpu
@needs_cute
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_scaled_grouped_mm_matches_float64(case):
    _, sizes, extra, k, n = case
    m, e = sum(sizes) + extra, len(sizes)
    a, b, sa, sb = _operands(m, e, n, k, "cuda")
    offs = _offs(sizes)
    sa[sum(sizes):] = float("nan")  # rows past offs[-1] are zeros whatever their scales
    assert cute.supports_scaled(a, b, sa, sb) == (True, "")
    poison(((m, n), torch.bfloat16))
    out = cute.scaled_grouped_mm(a, b, sa, sb, offs)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    _check(out, (a, b, sa, sb, offs))
    assert (out[sum(sizes):] == 0).all()


@gpu
@needs_cute
@pytest.mark.parametrize("tiling", [cute.Tiling(128, (2, 1)), cute.Tiling(192, (1, 2)),
                                    cute.Tiling(256, (1, 1))], ids=str)
def test_scaled_grouped_mm_tilings(tiling):
    sizes, k, n = [90, 0, 300, 129, 1], 272, 400
    a, b, sa, sb = _operands(sum(sizes) + 9, len(sizes), n, k, "cuda")
    offs = _offs(sizes)
    out = cute.scaled_grouped_mm(a, b, sa, sb, offs, tiling=tiling)
    _check(out, (a, b, sa, sb, offs))


@gpu
@needs_cute
def test_scaled_grouped_mm_no_rows():
    a, b, sa, sb = _operands(0, 3, 64, 64, "cuda")
    out = cute.scaled_grouped_mm(a, b, sa, sb, _offs([0, 0, 0]))
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


@gpu
@needs_cute
@pytest.mark.skipif(not hasattr(torch, "_scaled_grouped_mm"), reason="torch lacks it")
def test_scaled_grouped_mm_matches_torch():
    sizes, k, n = [256, 0, 100, 413, 255], 512, 768
    a, b, sa, sb = _operands(sum(sizes), len(sizes), n, k, "cuda")
    offs = _offs(sizes)
    ours = cute.scaled_grouped_mm(a, b, sa, sb, offs)
    peer = torch._scaled_grouped_mm(a, b.transpose(1, 2), sa, sb, offs=offs,
                                    out_dtype=torch.bfloat16)
    # both run FP8 WGMMA and round once to bf16: each within the float64 bound, and close
    assert _rel_err(ours, peer) < 4e-3
    _check(ours, (a, b, sa, sb, offs))
    _check(peer, (a, b, sa, sb, offs))


@gpu
@needs_cute
def test_scaled_grouped_mm_cuda_graph_replays_with_new_split_sizes():
    k, n, m = 256, 384, 1024
    a, b, sa, sb = _operands(m, 4, n, k, "cuda")
    offs = _offs([256, 256, 256, 256])
    cute.scaled_grouped_mm(a, b, sa, sb, offs)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cute.scaled_grouped_mm(a, b, sa, sb, offs)
    for sizes in ([1000, 0, 24, 0], [0, 0, 0, 1024], [3, 500, 500, 1]):
        offs.copy_(_offs(sizes))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, (a, b, sa, sb, offs))


@gpu
@needs_cute
def test_scaled_grouped_mm_takes_an_e5m2_a():
    """A "HYBRID" dgrad: dy in E5M2 against E4M3 weights (mixed WGMMA), same maths."""
    sizes, k, n = [1, 0, 129, 255, 7], 384, 144
    m = sum(sizes) + 9
    a, b, sa, sb = _operands(m, len(sizes), n, k, "cuda")
    a = (a.float() * 64).to(torch.float8_e5m2)
    assert cute.supports_scaled(a, b, sa, sb) == (True, "")
    out = cute.scaled_grouped_mm(a, b, sa, sb, _offs(sizes))
    _check(out, (a, b, sa, sb, _offs(sizes)))
    assert (out[sum(sizes):] == 0).all()


# ------------------------------------------------------------------ ping-pong consumers


@needs_dsl
def test_pingpong_gives_each_warpgroup_its_own_scale_scratch():
    """A ping-pong warpgroup fills its tile's scales while its peer's epilogue reads its own:
    two scratch blocks of tm + tn words; cooperative kernels keep one of 128 + 256."""
    from te_seq.kernels.cute.scale_epilogue import ScaledGemmKernel

    for width, words in ((128, 256), (192, 320)):
        kernel = ScaledGemmKernel("m", (128, width), pingpong=True)
        assert kernel.epi_scratch_words == words and kernel._scratch_words() == 2 * words
    cooperative = ScaledGemmKernel("m", (128, 128))
    assert cooperative.epi_scratch_words == cooperative._scratch_words() == 384
    accumulating = ScaledGemmKernel("k", (128, 128), accumulate=True, pingpong=True)
    assert accumulating.epi_extra_buffers == accumulating.extra_barriers == 4  # 2 per warpgroup


def test_default_tiling_runs_pingpong_for_short_k_unless_turned_off(tiling_env):
    """scaled_grouped_mm's default is the plain GEMM's (``plain_mm_tiling``): ping-pong where
    K <= TE_SEQ_PINGPONG_MAX_K, cooperative with TE_SEQ_PINGPONG=0; the configs it compiles
    say so (stubbed kernels on the CPU)."""
    import sys

    sys.path.insert(0, f"{ROOT}/benchmarks")
    from profile_launch import stubbed_kernels

    a, b, sa, sb = _operands(64, 2, 512, 768)  # N = 512: 256-wide cooperative tiles
    offs = torch.tensor([40, 64], dtype=torch.int32)
    with stubbed_kernels() as stubs:
        cute.scaled_grouped_mm(a, b, sa, sb, offs)
        tiling_env("TE_SEQ_PINGPONG", "0")
        cute.scaled_grouped_mm(a, b, sa, sb, offs)
        tiling_env("TE_SEQ_PINGPONG", None)
        tiling_env("TE_SEQ_PINGPONG_MAX_K", "512")
        cute.scaled_grouped_mm(a, b, sa, sb, offs)  # K = 768: past the bound
    compiled = [(c.pingpong, c.tile_n) for c in stubs]
    assert compiled == [(True, 128), (False, 256)], compiled  # the third reused the second


_PINGPONG_TILINGS = [cute.Tiling(128, (1, 2), True), cute.Tiling(192, (1, 2), True),
                     cute.Tiling(128, (2, 1), True), cute.Tiling(192, (2, 1), True, epi_cols=64)]


@gpu
@needs_cute
@pytest.mark.parametrize("tiling", _PINGPONG_TILINGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_pingpong_equals_cooperative_bit_for_bit(case, tiling):
    """Each output is the same FP8 WGMMA sum in the same k order, scaled and rounded once:
    ping-pong and cooperative tiles of one width agree bit for bit (rows past offs[-1] with
    NaN scales: zeros), and both are within the float64 bound."""
    _, sizes, extra, k, n = case
    m = sum(sizes) + extra
    a, b, sa, sb = _operands(m, len(sizes), n, k, "cuda")
    offs = _offs(sizes)
    sa[sum(sizes):] = float("nan")
    poison(((m, n), torch.bfloat16))
    out = cute.scaled_grouped_mm(a, b, sa, sb, offs, tiling=tiling)
    cooperative = cute.Tiling(tiling.tile_n, tiling.cluster_mn)
    torch.testing.assert_close(out, cute.scaled_grouped_mm(a, b, sa, sb, offs, tiling=cooperative),
                               rtol=0, atol=0)
    _check(out, (a, b, sa, sb, offs))
    assert (out[sum(sizes):] == 0).all()


@gpu
@needs_cute
def test_pingpong_half_tiles_equal_full_tiles(tiling_env):
    """TE_SEQ_HALF_TILES=1: an expert's last tile with <= 64 rows runs one 64-row atom; the
    outputs are the full tiles' bit for bit."""
    sizes, k, n = [1, 64, 65, 0, 191, 300, 7], 384, 256
    a, b, sa, sb = _operands(sum(sizes), len(sizes), n, k, "cuda")
    offs = _offs(sizes)
    full = cute.scaled_grouped_mm(a, b, sa, sb, offs)
    tiling_env("TE_SEQ_HALF_TILES", "1")
    half = cute.scaled_grouped_mm(a, b, sa, sb, offs)
    torch.testing.assert_close(half, full, rtol=0, atol=0)
    _check(half, (a, b, sa, sb, offs))
