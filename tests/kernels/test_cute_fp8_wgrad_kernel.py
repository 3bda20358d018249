"""The FP8 weight-gradient GEMM of the CuTe DSL backend: ``cute.scaled_grouped_wgrad`` (varlen
K over zero-padded, 128-token aligned spans of token-major E4M3 operands, per-group row-wise
dequantization scales in the epilogue, written or accumulated into bf16 / fp32). CPU tests
check the refusals; GPU tests compare with the float64 maths on the same FP8 data (empty
groups, a one-token group, spans of one and several k-tiles, N and K multiples of 16 but not of
the tile, fp32 accumulation into an existing buffer, NaN scales of an empty group) and across
CUDA-graph replays with new spans. The compile-only check is in test_cute_fp8.py."""

from __future__ import annotations

import pytest
import torch
from cute_marks import gpu, needs_cute, poison
from cute_marks import rel_err as _rel_err

from te_seq.kernels import cute

FP8 = torch.float8_e4m3fn
SPAN = 128


def _operands(counts, n, k, device="cpu", seed=0):
    """Token-major a [N, P], b [K, P] with group g's counts[g] tokens at the start of its span
    (spans rounded up to 128, zeros in the padding), scales [G, N] / [G, K], padded ends."""
    gen = torch.Generator(device=device).manual_seed(seed)
    spans = [-(-c // SPAN) * SPAN for c in counts]
    p = max(SPAN, sum(spans) + SPAN)  # one spare tile past the last span, as a bound leaves
    a = torch.zeros(n, p, device=device)
    b = torch.zeros(k, p, device=device)
    start = 0
    for c, s in zip(counts, spans):
        a[:, start:start + c] = torch.randn(n, c, device=device, generator=gen) * 40
        b[:, start:start + c] = torch.randn(k, c, device=device, generator=gen) * 40
        start += s
    a[:, start:] = 7.0  # past the last span: never read
    b[:, start:] = 7.0
    g = len(counts)
    sa = torch.rand(g, n, device=device, generator=gen) + 0.5
    sb = torch.rand(g, k, device=device, generator=gen) + 0.5
    ends = torch.tensor(spans, device=device).cumsum(0).to(torch.int32)
    return a.to(FP8), b.to(FP8), sa, sb, ends


def _spans(ends):
    """[G, 2] (start, end) of each span from the padded cumulative ends [G]."""
    return torch.stack([torch.cat([ends.new_zeros(1), ends[:-1]]), ends], 1)


def _ref(a, b, sa, sb, spans, absolute=False):
    """float64 out[g] = diag(sa[g]) a[:, span g] b[:, span g]ᵀ diag(sb[g]), spans [G, 2]
    (``absolute``: the same of |terms|, the magnitude the accumulation error scales with)."""
    out = torch.zeros(len(spans), a.shape[0], b.shape[0], dtype=torch.float64, device=a.device)
    for g, (start, end) in enumerate(spans.tolist()):
        aa, bb = a[:, start:end].double(), b[:, start:end].double()
        fa, fb = sa[g].double(), sb[g].double()
        if absolute:
            aa, bb, fa, fb = aa.abs(), bb.abs(), fa.abs(), fb.abs()
        out[g] = fa[:, None] * (aa @ bb.t()) * fb[None, :]
    return out


def _check(out, operands, old=None):
    """Norm-relative error below 4e-3 and, per element, within 2^-8 |ref| (one bf16 rounding)
    plus 2^-11 of Σ|terms| (FP8 WGMMA accumulates below fp32 precision: test_cute_fp8.py)."""
    ref, mag = _ref(*operands), _ref(*operands, absolute=True)
    if old is not None:
        ref = ref + old.double()
    assert _rel_err(out, ref) < 4e-3
    bound = 2**-8 * ref.abs() + 2**-11 * mag + 1e-6
    worst = ((out.double() - ref).abs() - bound).max().item()
    assert worst <= 0, f"element error exceeds the bound by {worst}"


def test_supports_scaled_wgrad_names_the_problem():
    a, b, sa, sb, ends = _operands([5, 130], 32, 48)
    assert "needs CUDA tensors" in cute.supports_scaled_wgrad(a, b, sa, sb, ends)[1]
    why = cute.supports_scaled_wgrad(a[:, :200], b[:, :200], sa, sb, ends)[1]
    assert "P=200 of 128" in why
    why = cute.supports_scaled_wgrad(a, b, sa[:1], sb, ends)[1]
    assert "a_scale must be float32 [2, 32]" in why
    with pytest.raises(ValueError, match="cute scaled_grouped_wgrad: .*float8_e5m2"):
        cute.scaled_grouped_wgrad(a, b.to(torch.float8_e5m2), sa, sb, ends)


# (name, token counts per group, N, K)
_CASES = [
    ("one_group", [300], 256, 256),
    ("empty_and_one_token", [0, 1, 77, 0, 129], 128, 384),
    ("n_k_tails", [200, 0, 411, 64], 144, 208),  # multiples of 16, not of the tiles
    ("many_groups", [37 * g % 301 for g in range(24)], 512, 768),
]


@gpu
@needs_cute
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_scaled_grouped_wgrad_matches_float64(case):
    _, counts, n, k = case
    a, b, sa, sb, ends = _operands(counts, n, k, "cuda")
    for g, c in enumerate(counts):
        if c == 0:  # an empty span writes zeros whatever its scales hold
            sa[g], sb[g] = float("nan"), float("inf")
    assert cute.supports_scaled_wgrad(a, b, sa, sb, ends) == (True, "")
    poison(((len(counts), n, k), torch.bfloat16))
    out = cute.scaled_grouped_wgrad(a, b, sa, sb, ends)
    assert out.shape == (len(counts), n, k) and out.dtype == torch.bfloat16
    ok = [g for g, c in enumerate(counts) if c]
    _check(out[ok], (a, b, sa[ok], sb[ok], _spans(ends)[ok]))
    assert all((out[g] == 0).all() for g, c in enumerate(counts) if c == 0)


@gpu
@needs_cute
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scaled_grouped_wgrad_accumulates(out_dtype):
    counts, n, k = [130, 0, 256, 3], 256, 512
    a, b, sa, sb, ends = _operands(counts, n, k, "cuda", seed=3)
    old = torch.randn(len(counts), n, k, device="cuda").to(out_dtype)
    out = old.clone()
    cute.scaled_grouped_wgrad(a, b, sa, sb, ends, out=out, accumulate=True)
    _check(out, (a, b, sa, sb, _spans(ends)), old=old)
    written = torch.full_like(old, float("nan"))
    cute.scaled_grouped_wgrad(a, b, sa, sb, ends, out=written)
    _check(written, (a, b, sa, sb, _spans(ends)))


@gpu
@needs_cute
def test_scaled_grouped_wgrad_cuda_graph_replays_with_new_spans():
    n, k = 256, 256
    a, b, sa, sb, ends = _operands([256, 256, 256, 256], n, k, "cuda", seed=5)
    out = torch.empty(4, n, k, device="cuda", dtype=torch.float32)
    cute.scaled_grouped_wgrad(a, b, sa, sb, ends, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute.scaled_grouped_wgrad(a, b, sa, sb, ends, out=out)
    for spans in ([768, 0, 128, 128], [0, 0, 0, 1024], [128, 384, 384, 128]):
        ends.copy_(torch.tensor(spans, device="cuda").cumsum(0))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, (a, b, sa, sb, _spans(ends)))


@gpu
@needs_cute
def test_scaled_grouped_wgrad_takes_an_e5m2_a():
    """A "HYBRID" wgrad: dY token-major in E5M2 against X in E4M3 (mixed WGMMA)."""
    counts = [0, 1, 77, 300]
    a, b, sa, sb, ends = _operands(counts, 144, 208, "cuda")
    a = (a.float() * 16).to(torch.float8_e5m2)
    out = cute.scaled_grouped_wgrad(a, b, sa, sb, ends, out=torch.zeros(4, 144, 208,
                                                                        device="cuda"))
    ok = [g for g, c in enumerate(counts) if c]
    _check(out[ok], (a, b, sa[ok], sb[ok], _spans(ends)[ok]))
    assert (out[0] == 0).all()


# ------------------------------------------------------------------ ping-pong consumers


def test_default_tiling_is_the_16_bit_wgrads_with_static_units(tiling_env):
    """Without accumulation the wgrad runs ping-pong in the 16-bit wgrad's cluster (2x1 for
    spans of <= 512 tokens on average), static units. Accumulating into main_grad it runs
    the scaled ping-pong accumulate (128 wide, 2x1) over groups of up to 512 tokens on
    average (spans of up to 640: a span pads its group by up to 128), cooperative over longer
    ones; TE_SEQ_PINGPONG=0 keeps every default cooperative."""
    from te_seq.kernels.cute.fp8 import SCALED_ACCUMULATE_TILING, _wgrad_tiling

    assert _wgrad_tiling(768, False, 256.0) == cute.Tiling(192, (2, 1), True, epi_cols=64)
    assert _wgrad_tiling(768, False, 256.0, torch.float32) == cute.Tiling(192, (2, 1), True)
    assert _wgrad_tiling(2048, False, 4096.0) == cute.Tiling(128, (1, 2), True)
    assert SCALED_ACCUMULATE_TILING == cute.Tiling(128, (2, 1), True)
    assert _wgrad_tiling(768, True, 256.0) == SCALED_ACCUMULATE_TILING
    assert _wgrad_tiling(2048, True, 640.0) == SCALED_ACCUMULATE_TILING
    assert not _wgrad_tiling(2048, True, 641.0).pingpong
    assert not _wgrad_tiling(2048, True, 4096.0).pingpong
    tiling_env("TE_SEQ_PINGPONG", "0")
    assert not _wgrad_tiling(768, False, 256.0).pingpong
    assert not _wgrad_tiling(768, True, 256.0).pingpong


_PINGPONG = [cute.Tiling(128, (2, 1), True), cute.Tiling(192, (1, 2), True)]


def _pingpong_equal_to_cooperative(operands, start, tiling, accumulate):
    """The ping-pong result (``out`` starting as ``start``), checked bit for bit against the
    cooperative kernel of the same tile width and cluster."""
    out, same = start.clone(), start.clone()
    cute.scaled_grouped_wgrad(*operands, out=out, accumulate=accumulate, tiling=tiling)
    cooperative = cute.Tiling(tiling.tile_n, tiling.cluster_mn)
    cute.scaled_grouped_wgrad(*operands, out=same, accumulate=accumulate, tiling=cooperative)
    torch.testing.assert_close(out, same, rtol=0, atol=0)
    return out


def _on_pingpong_cases(test):
    """A GPU test over every ping-pong tiling, both output dtypes and every case."""
    for mark in (pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES]),
                 pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str),
                 pytest.mark.parametrize("tiling", _PINGPONG, ids=str), needs_cute, gpu):
        test = mark(test)
    return test


@_on_pingpong_cases
def test_pingpong_equals_cooperative_bit_for_bit(case, out_dtype, tiling):
    """Ping-pong and cooperative tiles of one width sum each output over the same k-tiles in
    the same order: bit for bit equal (empty groups with NaN scales: zeros)."""
    _, counts, n, k = case
    a, b, sa, sb, ends = _operands(counts, n, k, "cuda", seed=5)
    for g, c in enumerate(counts):
        if c == 0:
            sa[g], sb[g] = float("nan"), float("inf")
    start = torch.full((len(counts), n, k), float("nan"), device="cuda", dtype=out_dtype)
    out = _pingpong_equal_to_cooperative((a, b, sa, sb, ends), start, tiling, accumulate=False)
    ok = [g for g, c in enumerate(counts) if c]
    _check(out[ok], (a, b, sa[ok], sb[ok], _spans(ends)[ok]))


@_on_pingpong_cases
def test_pingpong_accumulate_equals_cooperative_bit_for_bit(case, out_dtype, tiling):
    """Adding into a random old C (every group's block, empty groups' too): each ping-pong
    warpgroup loads its old C into its own smem blocks; the sums equal the cooperative
    kernel's bit for bit and the float64 reference plus the old C."""
    _, counts, n, k = case
    a, b, sa, sb, ends = _operands(counts, n, k, "cuda", seed=6)
    old = torch.randn(len(counts), n, k, device="cuda").to(out_dtype)
    out = _pingpong_equal_to_cooperative((a, b, sa, sb, ends), old, tiling, accumulate=True)
    _check(out, (a, b, sa, sb, _spans(ends)), old=old)
