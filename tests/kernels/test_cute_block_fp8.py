"""The FP8 block-scaled grouped GEMM of the CuTe DSL backend: ``cute.block_scaled_grouped_mm``
(E4M3 operands, 1×128 scales for A, 128×128 scales for B, promoted every 128 elements of K).
A compile-only test runs without a GPU (CUTE_DSL_ARCH=sm_90a, in a subprocess); CPU tests check
the refusals and their reasons and the maths the GPU tests compare with; GPU tests compare with
a float64 emulation of ``fp8_reference``'s block quantization of random bf16 data (empty
experts, one expert, skewed splits, rows past the last expert, M not a multiple of 128, K and
N not multiples of 128, non-contiguous operands, both clusters, CUDA-graph replays)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from cute_marks import compile_for_sm90a, gpu, needs_cute, needs_dsl, poison
from cute_marks import offsets as _offs
from cute_marks import rel_err as _rel_err

from te_seq.kernels import cute
from te_seq.kernels.fp8_reference import QuantBlock, ScaleRule, quantize

FP8 = torch.float8_e4m3fn
RULE = ScaleRule("E4M3", power_of_two=True)  # Float8BlockScaling's default
X_BLOCK, W_BLOCK = QuantBlock(1, 128), QuantBlock(128, 128)

# ------------------------------------------------------------------ CPU: compile-only, errors

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import torch
    from te_seq.kernels.cute.compile import GemmConfig, compile_gemm
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    for cluster in [(1, 2), (2, 1), (1, 1)]:
        cfg = GemmConfig("m", fp8, bf16, "k", 128, cluster, block_scaled=True)
        print(cfg, "block_scaled", f"{compile_gemm(cfg).compile_s:.1f}s", flush=True)
    for bad in [dict(tile_n=256), dict(scaled=True), dict(varlen="k"), dict(b_major="n")]:
        cfg = dict(varlen="m", ab_dtype=fp8, c_dtype=bf16, tile_n=128, block_scaled=True)
        cfg.update(bad)
        try:
            compile_gemm(GemmConfig(**cfg))
        except ValueError as exc:
            assert "block-scaled GEMMs take" in str(exc), exc
        else:
            raise AssertionError(f"a block-scaled config with {bad} compiled")
    # block_scaled is out of the repr (the disk-cache key: the other configs' keys stay as
    # they were) yet tells configs apart (the in-memory cache)
    plain = GemmConfig("m", fp8, bf16, "k", 128)
    block = GemmConfig("m", fp8, bf16, "k", 128, block_scaled=True)
    assert "block_scaled" not in repr(plain) and plain != block
    print("ALL COMPILED")
    """
)


@pytest.mark.slow  # a few seconds of DSL compiles; CI runs it, `-m "not slow"` quick runs skip it
@needs_dsl
def test_block_scaled_kernels_compile_for_sm90a():
    compile_for_sm90a(_COMPILE_SCRIPT, timeout=600)


def _quantized(m, e, n, k, device="cpu", seed=0):
    """Block-quantized random bf16 data whose blocks differ in magnitude (so every scale
    matters): (a [M, K] E4M3, b [E, N, K] E4M3, a_scale [M, KB], b_scale [E, NB, KB])."""
    gen = torch.Generator().manual_seed(seed)
    kb, nb = -(-k // 128), -(-n // 128)
    x_mag = torch.exp2(torch.randint(-6, 7, (m, kb), generator=gen).float())
    x = torch.randn(m, k, generator=gen) * x_mag.repeat_interleave(128, 1)[:, :k]
    w_mag = torch.exp2(torch.randint(-6, 7, (e, nb, kb), generator=gen).float())
    w = torch.randn(e, n, k, generator=gen)
    w = w * w_mag.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :n, :k]
    xq = quantize(x.to(torch.bfloat16).to(device), X_BLOCK, RULE)
    wq = [quantize(w[g].to(torch.bfloat16).to(device), W_BLOCK, RULE) for g in range(e)]
    a_scale, b_scale = xq.scale_inv, torch.stack([q.scale_inv for q in wq])
    return xq.data, torch.stack([q.data for q in wq]), a_scale, b_scale


def _emulate(a, b, a_scale, b_scale, offs, absolute=False):
    """float64: the operands dequantized as ``fp8_reference`` defines (each 1×128 / 128×128
    block's FP8 values times its scale_inv), multiplied per group; rows past offs[-1] zero.
    ``absolute``: the same with |values| (the magnitude the accumulation error scales with)."""
    k = a.shape[1]
    da = a.double() * a_scale.double().repeat_interleave(128, 1)[:, :k]
    db = b.double() * b_scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)[
        :, : b.shape[1], :k]
    if absolute:
        da, db = da.abs(), db.abs()
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = da[start:end] @ db[g].t()
        start = end
    return out


def _block_sums(a, b, a_scale, b_scale, offs):
    """float64, the kernel's order: per 128-wide K block a partial product, times the block's
    a and b scales, summed over the blocks (independent of ``_emulate``'s dequantization)."""
    m, n = a.shape[0], b.shape[1]
    out = torch.zeros(m, n, dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        for kb in range(a_scale.shape[1]):
            ks = slice(kb * 128, (kb + 1) * 128)
            part = a[start:end, ks].double() @ b[g, :, ks].double().t()
            sb = b_scale[g, :, kb].double().repeat_interleave(128)[:n]
            out[start:end] += part * a_scale[start:end, kb, None].double() * sb
        start = end
    return out


@pytest.mark.parametrize("k, n", [(256, 256), (1040, 144), (80, 208)])
def test_emulation_is_the_block_scaled_maths(k, n):
    """The GPU tests' reference: dequantize-then-multiply equals the per-block promoted sums
    the kernel computes (float64, exact up to summation order), and both recover the bf16
    product within the E4M3 quantization error."""
    sizes = [5, 0, 130, 1]
    a, b, sa, sb = _quantized(sum(sizes) + 3, len(sizes), n, k)
    kb, nb = -(-k // 128), -(-n // 128)
    assert sa.shape == (sum(sizes) + 3, kb) and sb.shape == (4, nb, kb)
    offs = torch.tensor(sizes).cumsum(0)
    ref = _emulate(a, b, sa, sb, offs)
    assert torch.allclose(_block_sums(a, b, sa, sb, offs), ref, rtol=1e-12, atol=1e-12)
    assert (ref[sum(sizes):] == 0).all()
    assert sb.unique().numel() > 1 and sa.unique().numel() > 1  # scales vary across blocks
    wrong = sb.clone()
    wrong[:, :, -1] *= 2  # a wrong scale for the last K block changes the result
    assert not torch.allclose(_emulate(a, b, sa, wrong, offs), ref, rtol=1e-3)


def _operands(m=10, e=2, n=48, k=32, device="cpu"):
    a = torch.randn(m, k, device=device).to(FP8)
    b = torch.randn(e, n, k, device=device).to(FP8)
    kb, nb = -(-k // 128), -(-n // 128)
    sa = torch.rand(m, kb, device=device) + 0.5
    return a, b, sa, torch.rand(e, nb, kb, device=device) + 0.5


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda a, b, sa, sb: (a.to(torch.bfloat16), b, sa, sb), "needs float8_e4m3fn a and b"),
        (lambda a, b, sa, sb: (a.to(torch.float8_e5m2), b, sa, sb), "float8_e5m2"),
        (lambda a, b, sa, sb: (a, b.to(torch.float8_e5m2), sa, sb), "float8_e5m2"),
        (lambda a, b, sa, sb: (a[:, :16], b, sa, sb), "needs a [M, K] and b [E, N, K]"),
        (lambda a, b, sa, sb: (a, b[:, :40], sa, sb), "N=40 must be multiples of 16"),
        (lambda a, b, sa, sb: (a[:, :24], b[:, :, :24], sa, sb), "K=24 and N=48"),
        (lambda a, b, sa, sb: (a, b[:0], sa, sb[:0]), "E=0"),
        (lambda a, b, sa, sb: (a, b, sa.double(), sb), "a_scale must be float32 [10, 1]"),
        (lambda a, b, sa, sb: (a, b, sa[:, 0], sb), "got torch.float32 [10]"),
        (lambda a, b, sa, sb: (a, b, sa, sb[:, :, 0]), "b_scale must be float32 [2, 1, 1]"),
        (lambda a, b, sa, sb: (a, b, sa, sb.expand(2, 3, 1)), "got torch.float32 [2, 3, 1]"),
        (lambda a, b, sa, sb: (a, b, sa, sb), "needs CUDA tensors on one device, got ['cpu']"),
    ],
    ids=["bf16_a", "e5m2_a", "e5m2_b", "k_mismatch", "n_unaligned", "k_unaligned", "no_experts",
         "scale_a_dtype", "scale_a_rowwise", "scale_b_rank", "scale_b_blocks", "cpu"],
)
def test_supports_block_scaled_names_the_problem(change, reason):
    a, b, sa, sb = change(*_operands())
    ok, why = cute.supports_block_scaled(a, b, sa, sb)
    assert not ok and reason in why, why
    with pytest.raises(ValueError, match="cute block_scaled_grouped_mm") as exc:
        cute.block_scaled_grouped_mm(a, b, sa, sb, torch.tensor([3, 10], dtype=torch.int32))
    assert reason in str(exc.value) and str(tuple(a.shape)) in str(exc.value)


def test_supports_block_scaled_outputs_bf16_only():
    ok, why = cute.supports_block_scaled(*_operands(), out_dtype=torch.float16)
    assert not ok and "out_dtype=torch.float16" in why


# ------------------------------------------------------------------ GPU correctness


def _check(out, operands):
    """Against the float64 emulation: norm-relative error below 4e-3, and per element within
    one bf16 ulp (2^-8 relative, the output rounding) plus 2^-11 of the summands' magnitude
    (the FP8 WGMMA's reduced-precision accumulation inside a 128-element block). A wrong
    block scale, k-tile or row is off by the order of the magnitude itself."""
    ref, mag = _emulate(*operands), _emulate(*operands, absolute=True)
    assert _rel_err(out, ref) < 4e-3
    err = (out.double() - ref).abs()
    worst = (err - (2**-8 * ref.abs() + 2**-11 * mag)).max().item()
    assert worst <= 0, f"element error exceeds the bound by {worst}"


# (name, split sizes, extra rows past offs[-1], K, N)
_CASES = [
    ("one_expert", [300], 0, 256, 256),
    ("empty_experts_rows_past_end", [0, 77, 0, 0, 300, 5, 0], 40, 4096, 768),
    ("unaligned_k_tail", [1, 3, 129, 255, 257, 7, 513], 0, 1040, 2048),
    ("skewed", [1500, 1, 0, 30], 0, 4096, 2048),
    ("k_n_tails", [130, 0, 250, 61], 17, 80, 208),  # K, N multiples of 16, not of 128
]


@gpu
@needs_cute
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_block_scaled_grouped_mm_matches_float64(case):
    _, sizes, extra, k, n = case
    m, e = sum(sizes) + extra, len(sizes)
    a, b, sa, sb = _quantized(m, e, n, k, "cuda", seed=len(sizes) + k)
    offs = _offs(sizes)
    sa[sum(sizes):] = float("nan")  # rows past offs[-1] are zeros whatever their scales
    assert cute.supports_block_scaled(a, b, sa, sb) == (True, "")
    poison(((m, n), torch.bfloat16))
    out = cute.block_scaled_grouped_mm(a, b, sa, sb, offs)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    _check(out, (a, b, sa.nan_to_num(0.0), sb, offs))
    assert (out[sum(sizes):] == 0).all()


@gpu
@needs_cute
@pytest.mark.parametrize("cluster", [(2, 1), (1, 1)], ids=str)
def test_block_scaled_grouped_mm_clusters(cluster):
    sizes, k, n = [90, 0, 300, 129, 1], 1040, 768
    a, b, sa, sb = _quantized(sum(sizes) + 9, len(sizes), n, k, "cuda", seed=7)
    offs = _offs(sizes)
    out = cute.block_scaled_grouped_mm(a, b, sa, sb, offs, cluster_mn=cluster)
    _check(out, (a, b, sa, sb, offs))


@gpu
@needs_cute
def test_block_scaled_grouped_mm_takes_non_contiguous_operands():
    """Strided a and b (a column slice, a transposed weight stack) and strided scales give the
    bits of their contiguous copies."""
    sizes, k, n = [100, 0, 156], 384, 256
    a, b, sa, sb = _quantized(sum(sizes), len(sizes), n, k, "cuda", seed=3)
    offs = _offs(sizes)
    wide = torch.zeros(a.shape[0], k + 32, dtype=FP8, device="cuda")
    wide[:, 16:16 + k] = a
    b_t = b.transpose(1, 2).contiguous().transpose(1, 2)  # [E, N, K] with N contiguous
    sa_t = sa.t().contiguous().t()
    ours = cute.block_scaled_grouped_mm(wide[:, 16:16 + k], b_t, sa_t, sb, offs)
    assert torch.equal(ours, cute.block_scaled_grouped_mm(a, b, sa, sb, offs))
    _check(ours, (a, b, sa, sb, offs))


@gpu
@needs_cute
def test_block_scaled_grouped_mm_no_rows():
    a, b, sa, sb = _operands(0, 3, 64, 256, "cuda")
    out = cute.block_scaled_grouped_mm(a, b, sa, sb, _offs([0, 0, 0]))
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


@gpu
@needs_cute
def test_block_scaled_grouped_mm_cuda_graph_replays_with_new_split_sizes():
    k, n, m = 512, 384, 1024
    a, b, sa, sb = _quantized(m, 4, n, k, "cuda", seed=11)
    offs = _offs([256, 256, 256, 256])
    cute.block_scaled_grouped_mm(a, b, sa, sb, offs)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cute.block_scaled_grouped_mm(a, b, sa, sb, offs)
    for sizes in ([1000, 0, 24, 0], [0, 0, 0, 1024], [3, 500, 500, 1]):
        offs.copy_(_offs(sizes))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, (a, b, sa, sb, offs))
