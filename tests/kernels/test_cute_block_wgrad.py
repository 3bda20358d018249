"""The FP8 block-scaled weight-gradient GEMM of the CuTe DSL backend:
``cute.block_scaled_grouped_wgrad`` (varlen K over zero-padded, 128-token aligned spans of
token-major E4M3 operands, one dequantization scale per (128-token block, column) promoted
into the fp32 accumulators every k-tile, written or accumulated into bf16 / fp32).

CPU: a compile-only test of every config (CUTE_DSL_ARCH=sm_90a, in a subprocess), the
trace-time grouping of accumulator values by row and column (which scale each value reads),
the refusals and their reasons. GPU: against a float64 emulation of the block-quantized
operands (``fp8_wgrad.quantize_token_major_blocks`` of random data: several experts with
random sizes including empty ones, one expert, sizes not multiples of 128, N and K of 768 /
2048 and multiples of 16 only, both clusters), accumulation into a random fp32 main_grad and a
bf16 buffer, and CUDA-graph replays with new split sizes."""

from __future__ import annotations

import textwrap

import pytest
import torch
from cute_marks import compile_for_sm90a, gpu, needs_cute, needs_dsl, poison
from cute_marks import rel_err as _rel_err

from te_seq.kernels import cute, fp8_wgrad
from te_seq.kernels.fp8_reference import ScaleRule

FP8 = torch.float8_e4m3fn
PAD = 128
RULE = ScaleRule("E4M3", power_of_two=True)  # Float8BlockScaling's default

# ------------------------------------------------------------------ CPU: compile-only, errors

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import torch
    from te_seq.kernels.cute.compile import GemmConfig, compile_gemm
    fp8, bf16, fp32 = torch.float8_e4m3fn, torch.bfloat16, torch.float32
    for out, accumulate in [(bf16, False), (fp32, False), (fp32, True), (bf16, True)]:
        for cluster in [(1, 2), (2, 1)]:
            cfg = GemmConfig("k", fp8, out, "k", 128, cluster, accumulate, block_wgrad=True)
            print(out, accumulate, cluster, f"{compile_gemm(cfg).compile_s:.1f}s", flush=True)
    for bad in [dict(tile_n=256), dict(scaled=True), dict(varlen="m"), dict(b_major="n"),
                dict(c_dtype=torch.float16), dict(block_scaled=True),
                dict(a_dtype=torch.float8_e5m2)]:
        cfg = dict(varlen="k", ab_dtype=fp8, c_dtype=bf16, tile_n=128, block_wgrad=True)
        cfg.update(bad)
        try:
            compile_gemm(GemmConfig(**cfg))
        except ValueError as exc:
            assert "block-scaled wgrad GEMMs take" in str(exc), exc
        else:
            raise AssertionError(f"a block-scaled wgrad config with {bad} compiled")
    # block_wgrad is out of the repr (the other configs' disk-cache keys stay as they were)
    # yet tells configs apart (the in-memory cache)
    plain = GemmConfig("k", fp8, bf16, "k", 128, scaled=True)
    block = GemmConfig("k", fp8, bf16, "k", 128, block_wgrad=True)
    assert "block_wgrad" not in repr(plain) and plain != block
    print("ALL COMPILED")
    """
)


@pytest.mark.slow  # ~10 s of DSL compiles; CI runs it, `-m "not slow"` quick runs skip it
@needs_dsl
def test_block_wgrad_kernels_compile_for_sm90a():
    compile_for_sm90a(_COMPILE_SCRIPT, timeout=600)


_SLOTS_SCRIPT = textwrap.dedent(
    """
    import torch
    from te_seq.kernels.cute import block_wgrad
    from te_seq.kernels.cute.compile import GemmConfig, compile_gemm
    seen = []
    real = block_wgrad.value_offsets
    def spy(coords, count):
        offsets = real(coords, count)
        seen.append(offsets)
        return offsets
    block_wgrad.value_offsets = spy
    cfg = GemmConfig("k", torch.float8_e4m3fn, torch.float32, "k", 128, (1, 2), True,
                     block_wgrad=True)
    compile_gemm(cfg)
    (offsets,) = seen
    # the sm90 accumulator of a 64 x 128 WGMMA: value i = c + 2 r + 4 v is at row 8 r and
    # column c + 8 v of the thread's base
    assert offsets == [(8 * r, c + 8 * v) for v in range(16) for r in range(2) for c in range(2)]
    rows, row_slot = block_wgrad.slots(offsets, 0)
    cols, col_slot = block_wgrad.slots(offsets, 1)
    assert [offsets[i][0] for i in rows] == [0, 8] and len(cols) == 32
    for i, (r, c) in enumerate(offsets):  # each value reads its own row's and column's scale
        assert offsets[rows[row_slot[i]]][0] == r and offsets[cols[col_slot[i]]][1] == c
    print("ALL COMPILED")
    """
)


@pytest.mark.slow
@needs_dsl
def test_block_wgrad_reads_the_scales_of_each_values_row_and_column():
    """The kernel's trace: which accumulator values share a row (a scale) and a column (b
    scale) is read off the accumulator's coordinate layout, and is what the sm90 layout says."""
    compile_for_sm90a(_SLOTS_SCRIPT, timeout=600)


@needs_dsl
def test_slots_group_values_by_row_and_by_column():
    from te_seq.kernels.cute.block_wgrad import slots  # imports cutlass

    offsets = [(0, 0), (0, 1), (8, 0), (8, 1), (0, 8), (0, 9), (8, 8), (8, 9)]
    assert slots(offsets, 0) == ([0, 2], [0, 0, 1, 1, 0, 0, 1, 1])
    assert slots(offsets, 1) == ([0, 1, 4, 5], [0, 1, 0, 1, 2, 3, 2, 3])


def _plain_operands(n=48, k=32, p=256, blocks=None, device="cpu"):
    a = torch.randn(n, p, device=device).to(FP8)
    b = torch.randn(k, p, device=device).to(FP8)
    pb = blocks if blocks is not None else p // PAD
    sa = torch.rand(pb, n, device=device) + 0.5
    return a, b, sa, torch.rand(pb, k, device=device) + 0.5


_OFFS = torch.tensor([128, 256], dtype=torch.int32)


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda a, b, sa, sb: (a.to(torch.bfloat16), b, sa, sb), "needs float8_e4m3fn a and b"),
        (lambda a, b, sa, sb: (a.to(torch.float8_e5m2), b, sa, sb), "float8_e5m2"),
        (lambda a, b, sa, sb: (a[:, :128], b, sa, sb), "needs a [N, P] and b [K, P]"),
        (lambda a, b, sa, sb: (a[:40], b, sa[:, :40], sb), "N=40 and K=32 must be multiples"),
        (lambda a, b, sa, sb: (a[:, :200], b[:, :200], sa, sb), "P=200 of 128"),
        (lambda a, b, sa, sb: (a, b, sa.double(), sb), "a_scale must be float32 [2, 48]"),
        (lambda a, b, sa, sb: (a, b, sa[:1], sb), "got torch.float32 [1, 48]"),
        (lambda a, b, sa, sb: (a, b, sa, sb.t()), "b_scale must be float32 [2, 32]"),
        (lambda a, b, sa, sb: (a, b, sa, sb), "needs CUDA tensors on one device, got ['cpu']"),
    ],
    ids=["bf16_a", "e5m2_a", "p_mismatch", "n_unaligned", "p_unaligned", "scale_a_dtype",
         "scale_a_blocks", "scale_b_transposed", "cpu"],
)
def test_supports_block_scaled_wgrad_names_the_problem(change, reason):
    a, b, sa, sb = change(*_plain_operands())
    ok, why = cute.supports_block_scaled_wgrad(a, b, sa, sb, _OFFS)
    assert not ok and reason in why, why
    with pytest.raises(ValueError, match="cute block_scaled_grouped_wgrad") as exc:
        cute.block_scaled_grouped_wgrad(a, b, sa, sb, _OFFS)
    assert reason in str(exc.value) and str(tuple(a.shape)) in str(exc.value)


def test_supports_block_scaled_wgrad_needs_experts():
    ok, why = cute.supports_block_scaled_wgrad(*_plain_operands(), _OFFS[:0])
    assert not ok and "E=0" in why


# ------------------------------------------------------------------ GPU correctness


def _quantized(counts, n, k, seed=0):
    """Token-major block-quantized (dY, X) of random data whose 64-token bands differ in
    magnitude (every block scale matters), with NaN scales in the blocks no span reads."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(counts)

    def data(cols):
        mag = torch.exp2(torch.randint(-6, 7, (-(-max(rows, 1) // 64), cols), generator=gen))
        t = torch.randn(rows, cols, generator=gen) * mag.float().repeat_interleave(64, 0)[:rows]
        return t.to(torch.bfloat16).cuda()

    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    a = fp8_wgrad.quantize_token_major_blocks(data(n), offs, RULE)
    b = fp8_wgrad.quantize_token_major_blocks(data(k), offs, RULE)
    unused = torch.ones(a.scale_inv.shape[0], dtype=torch.bool)
    start = 0
    for c in counts:
        span = -(-c // PAD) * PAD
        unused[start // PAD:(start + span) // PAD] = False
        start += span
    a.scale_inv[unused.cuda()], b.scale_inv[unused.cuda()] = float("nan"), float("inf")
    return a, b


def _emulate(a, b, absolute=False):
    """float64 out[e] = dequant(a)[:, span e] @ dequant(b)[:, span e]ᵀ (each 128-token block's
    data times its scales; ``absolute``: the same of |values|, the magnitude the accumulation
    error scales with)."""
    ends = a.offs.tolist()
    out = torch.zeros(len(ends), a.data.shape[0], b.data.shape[0], dtype=torch.float64,
                      device=a.data.device)
    da = a.data.double() * a.scale_inv.double().t().repeat_interleave(PAD, 1)
    db = b.data.double() * b.scale_inv.double().t().repeat_interleave(PAD, 1)
    if absolute:
        da, db = da.abs(), db.abs()
    for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        out[e] = da[:, start:end] @ db[:, start:end].t()
    return out


def _check(out, a, b, old=None):
    """Norm-relative error below 4e-3 and, per element, within 2^-8 |ref| (one rounding into
    bf16) plus 2^-10 of Σ|terms| (the FP8 WGMMA's reduced-precision accumulation inside a
    128-token block: on an H100, 2026-11-25, the worst element of "many_experts" was 2^-10.8
    of Σ|terms| off before its bf16 rounding). A wrong block scale, row, column or k-tile is
    off by the order of the magnitude itself."""
    ref, mag = _emulate(a, b), _emulate(a, b, absolute=True)
    if old is not None:
        ref = ref + old.double()
    assert _rel_err(out, ref) < 4e-3
    bound = 2**-8 * ref.abs() + 2**-10 * mag + 1e-6
    worst = ((out.double() - ref).abs() - bound).max().item()
    assert worst <= 0, f"element error exceeds the bound by {worst}"


def _args(a, b):
    return a.data, b.data, a.scale_inv, b.scale_inv, a.offs


# (name, tokens per expert, N, K)
_CASES = [
    ("one_expert", [300], 768, 2048),
    ("random_with_empty", [0, 77, 0, 513, 1, 129, 0, 260], 2048, 768),
    ("n_k_tails", [200, 0, 411, 64], 144, 208),  # multiples of 16, not of the tile
    ("many_experts", [37 * g % 301 for g in range(24)], 768, 768),
]


@gpu
@needs_cute
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_block_scaled_grouped_wgrad_matches_float64(case):
    _, counts, n, k = case
    a, b = _quantized(counts, n, k, seed=len(counts) + n)
    assert cute.supports_block_scaled_wgrad(*_args(a, b)) == (True, "")
    poison(((len(counts), n, k), torch.bfloat16))
    out = cute.block_scaled_grouped_wgrad(*_args(a, b))
    assert out.shape == (len(counts), n, k) and out.dtype == torch.bfloat16
    _check(out, a, b)
    assert all((out[e] == 0).all() for e, c in enumerate(counts) if c == 0)


@gpu
@needs_cute
@pytest.mark.parametrize("cluster", [(2, 1), (1, 1)], ids=str)
def test_block_scaled_grouped_wgrad_clusters(cluster):
    counts = [90, 0, 300, 129, 1]
    a, b = _quantized(counts, 384, 640, seed=7)
    out = cute.block_scaled_grouped_wgrad(*_args(a, b), cluster_mn=cluster)
    _check(out, a, b)


@gpu
@needs_cute
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_block_scaled_grouped_wgrad_accumulates_into_main_grad(out_dtype):
    counts, n, k = [130, 0, 700, 3], 768, 2048
    a, b = _quantized(counts, n, k, seed=3)
    scale = _emulate(a, b).abs().mean().item()
    old = (torch.randn(len(counts), n, k, device="cuda") * scale).to(out_dtype)
    out = old.clone()
    got = cute.block_scaled_grouped_wgrad(*_args(a, b), out=out, accumulate=True)
    assert got is out
    _check(out, a, b, old=old)
    assert torch.equal(out[1], old[1])  # an empty expert adds nothing
    written = torch.full_like(old, float("nan"))
    cute.block_scaled_grouped_wgrad(*_args(a, b), out=written)
    _check(written, a, b)


@gpu
@needs_cute
def test_block_scaled_grouped_wgrad_cuda_graph_replays_with_new_split_sizes():
    """Captured once; each replay reads new split sizes from the device: new spans of the
    same operand buffers, quantized again in place."""
    n, k, rows = 256, 384, 1024
    gen = torch.Generator().manual_seed(5)
    dy = torch.randn(rows, n, generator=gen).bfloat16().cuda()
    x = torch.randn(rows, k, generator=gen).bfloat16().cuda()
    offs = torch.tensor([256, 512, 768, 1024], dtype=torch.int32, device="cuda")
    a = fp8_wgrad.quantize_token_major_blocks(dy, offs, RULE)
    b = fp8_wgrad.quantize_token_major_blocks(x, offs, RULE)
    out = torch.empty(4, n, k, device="cuda", dtype=torch.float32)
    cute.block_scaled_grouped_wgrad(*_args(a, b), out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute.block_scaled_grouped_wgrad(*_args(a, b), out=out)
    for sizes in ([1000, 0, 24, 0], [0, 0, 0, 1024], [3, 500, 500, 21]):
        new_offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
        for tm, t in ((a, dy), (b, x)):
            fresh = fp8_wgrad.quantize_token_major_blocks(t, new_offs, RULE)
            tm.data.copy_(fresh.data)
            tm.scale_inv.copy_(fresh.scale_inv)
            tm.offs.copy_(fresh.offs)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, a, b)
