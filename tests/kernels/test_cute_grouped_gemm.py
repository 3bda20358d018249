"""The CuTe DSL grouped GEMM against te_seq.kernels.reference.

Compile-only tests run on any machine with the CuTe DSL installed (CUTE_DSL_ARCH=sm_90a in a
subprocess, so the arch setting cannot leak into other tests); GPU tests need sm_90+.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from cute_marks import ROOT, compile_for_sm90a, gpu, needs_cute, needs_dsl
from cute_marks import offsets as _offs

from te_seq.kernels import reference

# ------------------------------------------------------------------ compile-only (CPU CI)

# Every kernel configuration the functionals can request: both problems, both B majors
# (forward uses W.transpose(1, 2), dgrad W itself), both 16-bit dtypes, and the wgrad outputs
# (new tensor, fp32 main_grad written, fp32 main_grad accumulated).
_COMPILE_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import torch
    from te_seq.kernels.cute import MM_TILING as M, WGRAD_TILING as W
    from te_seq.kernels.cute.compile import GemmConfig, compile_gemm
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    configs = [
        GemmConfig("m", bf16, bf16, "k", M.tile_n, M.cluster_mn),
        GemmConfig("m", bf16, bf16, "n", M.tile_n, M.cluster_mn),
        GemmConfig("m", fp16, fp16, "k", M.tile_n, M.cluster_mn),
        GemmConfig("m", bf16, bf16, "k", 256, (2, 1)),  # the other cluster shape
        GemmConfig("m", bf16, bf16, "k", 192, M.cluster_mn),  # narrower tiles (tile_n_for)
        GemmConfig("m", bf16, bf16, "n", 128, M.cluster_mn),
        GemmConfig("k", bf16, fp32, "n", 192, W.cluster_mn, accumulate=True),
        GemmConfig("k", bf16, bf16, "n", W.tile_n, W.cluster_mn),
        GemmConfig("k", bf16, fp32, "n", W.tile_n, W.cluster_mn),
        GemmConfig("k", bf16, fp32, "n", W.tile_n, W.cluster_mn, accumulate=True),
    ]
    for cfg in configs:
        print(cfg, f"{compile_gemm(cfg).compile_s:.1f}s", flush=True)
    print("ALL COMPILED")
    """
)


@pytest.mark.slow  # ~20 s of DSL compiles; CI runs it, `-m "not slow"` quick runs skip it
@needs_dsl
def test_compile_all_configs_for_sm90a():
    compile_for_sm90a(_COMPILE_SCRIPT, timeout=900)


@pytest.mark.slow  # one DSL compile in a subprocess
@needs_dsl
def test_dump_ptx_writes_and_compares_ptx(tmp_path):
    # benchmarks/dump_ptx.py is how a kernel refactor shows its device code is unchanged: it
    # must write real sm_90a PTX and fail (exit 1) when an earlier dump differs
    (tmp_path / "before").mkdir()
    (tmp_path / "before" / "mm128_nmajor.ptx").write_text("// not this kernel\n")
    cmd = [sys.executable, "benchmarks/dump_ptx.py", "--configs", "mm128_nmajor"]
    cmd += ["--out", str(tmp_path / "after"), "--compare", str(tmp_path / "before")]
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "mm128_nmajor" in proc.stdout and "DIFFERS" in proc.stdout
    ptx = (tmp_path / "after" / "mm128_nmajor.ptx").read_text()
    assert ".target sm_90a" in ptx and "GroupedGemmKernel" in ptx


@needs_dsl
@pytest.mark.parametrize(
    ("tile_n", "c_bits", "accumulate", "trade", "want"),
    [
        (192, 16, False, True, (3, 5)),  # the trade: one store slot for a fifth A/B stage
        (192, 16, False, False, (4, 4)),  # subclasses keep their 4-slot ring
        (128, 16, False, True, (4, 6)),  # a slot buys no stage: the ring stays
        (256, 16, False, True, (4, 4)),
        (192, 16, True, True, (4, 4)),  # the old-C blocks leave no room for another stage
        (192, 32, False, True, (2, 4)),  # fp32 outputs: a 2-slot ring, never traded
    ],
)
def test_store_ring_gives_a_slot_only_for_an_ab_stage(tile_n, c_bits, accumulate, trade, want):
    """``GroupedGemmKernel._setup``'s smem budget: (store-ring slots, A/B stages)."""
    pytest.importorskip("cutlass")
    import cutlass

    from te_seq.kernels.cute.grouped_gemm import GroupedGemmKernel

    kernel = GroupedGemmKernel("k", (128, tile_n), (2, 1), accumulate=accumulate,
                               trade_store_slot=trade)
    kernel.a_dtype = kernel.b_dtype = cutlass.BFloat16
    kernel.c_dtype = cutlass.BFloat16 if c_bits == 16 else cutlass.Float32
    ring = kernel._store_ring()
    assert (ring, kernel._ab_stages(ring)) == want


@needs_dsl
@pytest.mark.parametrize(
    ("tile_n", "ab_bits", "c_bits", "want_blocks", "want_stages"),
    [
        (256, 16, 32, 3, 3),  # the default 16-bit main_grad wgrad: a third block is free
        (256, 8, 32, 3, 3),  # FP8 row-wise into main_grad: the same A/B stage bytes
        (192, 16, 32, 2, 4),  # a third block would cost the fourth stage
        (128, 8, 32, 2, 5),  # the block-scaled FP8 wgrad: it would cost the fifth
        (256, 16, 16, 3, 3),  # accumulating into a bf16 buffer
    ],
)
def test_accumulate_takes_a_third_old_c_block_only_where_it_costs_no_stage(
        tile_n, ab_bits, c_bits, want_blocks, want_stages):
    """``GroupedGemmKernel._old_c_blocks``: old C subtiles in flight and the A/B stages left."""
    pytest.importorskip("cutlass")
    import cutlass

    from te_seq.kernels.cute.grouped_gemm import GroupedGemmKernel

    kernel = GroupedGemmKernel("k", (128, tile_n), (1, 2), accumulate=True)
    kernel.a_dtype = kernel.b_dtype = cutlass.BFloat16 if ab_bits == 16 else cutlass.Float8E4M3FN
    kernel.tile_mnk = (128, tile_n, 1024 // ab_bits)  # what _setup sets from the dtypes
    kernel.c_dtype = cutlass.BFloat16 if c_bits == 16 else cutlass.Float32
    blocks = kernel._old_c_blocks()
    kernel.epi_extra_buffers = blocks
    assert (blocks, kernel._ab_stages(kernel._store_ring())) == (want_blocks, want_stages)


def test_import_does_not_import_cutlass():
    code = "import sys, te_seq.kernels.cute as c; c.supports; print('cutlass' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "n, tile_n",
    [(768, 192), (384, 192), (2048, 256), (1536, 256), (14336, 256), (264, 192), (256, 128)],
)
def test_tile_width_leaves_fewest_columns_idle(n, tile_n):
    from te_seq.kernels import cute

    assert cute.tile_n_for(n) == tile_n
    assert cute.default_tiling(n, cute.MM_TILING) == cute.Tiling(tile_n, cute.MM_TILING.cluster_mn)


def test_supports_rejects_unaligned_rows():
    from te_seq.kernels import cute

    a = torch.randn(16, 12, dtype=torch.bfloat16)
    b = torch.randn(2, 12, 16, dtype=torch.bfloat16)
    ok, why = cute.supports(a, b)
    assert not ok and "K=12" in why
    with pytest.raises(ValueError, match="K=12 and N=16 must be multiples of 8"):
        cute.grouped_mm(a, b, torch.tensor([8, 16], dtype=torch.int32))


_BF16, _FP32 = torch.bfloat16, torch.float32


# One case per check of grouped_mm's and grouped_wgrad's shared ``supports`` body, in its order:
# dtype (one 16-bit dtype for both operands), shapes, 16-byte rows, device (CPU tensors here).
@pytest.mark.parametrize(
    ("fn", "shapes", "dtypes", "match"),
    [
        ("supports", [(16, 32), (2, 32, 64)], (_FP32, _FP32), "got torch.float32 and"),
        ("supports", [(16, 32), (2, 32, 64)], (_BF16, torch.float16), "of one dtype"),
        ("supports", [(16, 32), (2, 24, 64)], (_BF16, _BF16), r"a \[M, K\] and b \[E, K, N\]"),
        ("supports", [(16, 32), (2, 32, 60)], (_BF16, _BF16), "K=32 and N=60 must be"),
        ("supports", [(16, 32), (2, 32, 64)], (_BF16, _BF16), "needs CUDA tensors"),
        ("supports_wgrad", [(16, 64), (16, 32)], (_FP32, _BF16), "got torch.float32 and"),
        ("supports_wgrad", [(16, 64), (8, 32)], (_BF16, _BF16), r"grad_out \[M, N\] and x"),
        ("supports_wgrad", [(16, 64), (16, 36)], (_BF16, _BF16), "K=36 and N=64 must be"),
        ("supports_wgrad", [(16, 64), (16, 32)], (_BF16, _BF16), "needs CUDA tensors"),
    ],
)
def test_supports_says_why(fn, shapes, dtypes, match):
    import re

    from te_seq.kernels import cute

    first, second = (torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes))
    ok, why = getattr(cute, fn)(first, second)
    assert not ok and re.search(match, why), why


def _units_walked(sizes: list[int], rows: int, n: int, tile_n: int, cluster_mn) -> int:
    """Cluster units the varlen-M kernel walks: ⌈rows of g / block_m⌉ per n-unit for every group,
    and for the virtual group of the rows past offs[-1]."""
    block_m, n_units = 128 * cluster_mn[0], -(-n // (tile_n * cluster_mn[1]))
    groups = [*sizes, rows - sum(sizes)]
    return sum(-(-g // block_m) for g in groups) * n_units


@pytest.mark.parametrize("cluster_mn", [(1, 2), (2, 1), (1, 1)])
@pytest.mark.parametrize("seed", range(4))
def test_varlen_m_grid_covers_every_unit(seed, cluster_mn):
    from te_seq.kernels.cute.launch import varlen_m_clusters

    gen = torch.Generator().manual_seed(seed)
    groups = int(torch.randint(1, 40, (1,), generator=gen))
    sizes = torch.randint(0, 700, (groups,), generator=gen).tolist()
    rows = sum(sizes) + int(torch.randint(0, 300, (1,), generator=gen))  # rows past offs[-1]
    n = 8 * int(torch.randint(1, 600, (1,), generator=gen))
    walked = _units_walked(sizes, rows, n, 192, cluster_mn)
    # with SMs to spare there is one cluster per unit the kernel can possibly walk (M, E bound)
    assert varlen_m_clusters(rows, groups, n, 192, cluster_mn, sms=10**9) >= max(walked, 1)
    cap = 132 // (cluster_mn[0] * cluster_mn[1])  # a full H100: persistent, one cluster per slot
    assert varlen_m_clusters(rows, groups, n, 192, cluster_mn, sms=132) == min(
        varlen_m_clusters(rows, groups, n, 192, cluster_mn, sms=10**9), cap
    )


def test_varlen_k_grid_counts_units():
    from te_seq.kernels.cute.launch import varlen_k_clusters

    # 3 groups of [N=300, K=1000]: ⌈300 / 128⌉ m-units · ⌈1000 / 512⌉ n-units each
    assert varlen_k_clusters(3, 300, 1000, 256, (1, 2), sms=10**9) == 3 * 3 * 2
    assert varlen_k_clusters(3, 300, 1000, 256, (2, 1), sms=10**9) == 3 * 2 * 4
    assert varlen_k_clusters(3, 300, 1000, 256, (1, 2), sms=8) == 4
    assert varlen_k_clusters(0, 300, 1000, 256, (1, 2), sms=8) == 1  # never an empty grid


# ------------------------------------------------------------------ GPU correctness



def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output has NaN (unwritten rows?)"
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}

# (name, split sizes, K, N): one group; many groups; empty groups incl. first/last; sizes not
# multiples of 8 or of the tile; K and N not multiples of the tile; everything in one group.
_MM_CASES = [
    ("one_group", [300], 256, 512),
    (
        "128_groups",
        [int(s) for s in torch.randint(0, 70, (128,), generator=torch.Generator().manual_seed(0))],
        512,
        384,
    ),
    ("empty_groups", [0, 77, 0, 0, 300, 5, 0], 128, 256),
    ("unaligned_sizes", [1, 3, 129, 255, 257, 7, 513], 192, 264),
    ("odd_k_n", [200, 130, 61], 200, 328),
    ("all_in_one", [0, 0, 1000, 0], 320, 256),
]


@gpu
@needs_cute
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b_major", ["k", "n"])
@pytest.mark.parametrize("case", _MM_CASES, ids=[c[0] for c in _MM_CASES])
def test_grouped_mm_matches_reference(case, b_major, dtype):
    from te_seq.kernels import cute

    _, sizes, k, n = case
    m, e = sum(sizes), len(sizes)
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    # forward passes W.transpose(1, 2) (K contiguous); dgrad passes W [E, K, N] itself
    w = (
        torch.randn(e, n, k, device="cuda", dtype=dtype)
        if b_major == "k"
        else torch.randn(e, k, n, device="cuda", dtype=dtype)
    )
    b = w.transpose(1, 2) if b_major == "k" else w
    offs = _offs(sizes)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    cute.grouped_mm(a, b, offs, out=out)
    ref = reference.grouped_mm(a.double(), b.double(), offs)
    assert _rel_err(out, ref) < _TOL[dtype]


@gpu
@needs_cute
def test_grouped_mm_noncontiguous_b_and_rows_past_end():
    from te_seq.kernels import cute

    sizes, k, n = [40, 0, 90], 128, 136
    big = torch.randn(3, k, n + 24, device="cuda", dtype=torch.bfloat16)
    b = big[:, :, 8 : 8 + n]  # row stride n + 24, offset base: a non-contiguous view
    a = torch.randn(
        sum(sizes) + 50, k, device="cuda", dtype=torch.bfloat16
    )  # 50 rows past offs[-1]
    offs = _offs(sizes)
    out = torch.full((a.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
    cute.grouped_mm(a, b, offs, out=out)
    ref = reference.grouped_mm(a.double(), b.double(), offs)
    assert _rel_err(out, ref) < 1e-2
    assert (out[sum(sizes) :] == 0).all()


@gpu
@needs_cute
def test_grouped_mm_zero_rows():
    from te_seq.kernels import cute

    a = torch.randn(0, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16)
    out = cute.grouped_mm(a, b, _offs([0, 0, 0, 0]))
    assert out.shape == (0, 128)


_WGRAD_CASES = [
    ("one_group", [300], 256, 512),
    (
        "128_groups",
        [int(s) for s in torch.randint(0, 70, (128,), generator=torch.Generator().manual_seed(1))],
        256,
        384,
    ),
    ("empty_and_unaligned", [0, 77, 0, 1, 300, 5, 0], 136, 200),
    ("all_in_one", [0, 0, 1000, 0], 320, 256),
    ("zero_rows", [0, 0], 64, 128),
]


@gpu
@needs_cute
@pytest.mark.parametrize("mode", ["new", "fp32_write", "fp32_accumulate", "bf16_out"])
@pytest.mark.parametrize("case", _WGRAD_CASES, ids=[c[0] for c in _WGRAD_CASES])
def test_grouped_wgrad_matches_reference(case, mode):
    from te_seq.kernels import cute

    _, sizes, n, k = case
    m, e = sum(sizes), len(sizes)
    grad_out = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    offs = _offs(sizes)
    ref = reference.grouped_wgrad(grad_out.double(), x.double(), offs)
    if mode == "new":
        out = cute.grouped_wgrad(grad_out, x, offs)
        assert out.dtype == torch.bfloat16
    elif mode == "fp32_accumulate":
        base = torch.randn(e, n, k, device="cuda", dtype=torch.float32)
        out = base.clone()
        cute.grouped_wgrad(grad_out, x, offs, out=out, accumulate=True)
        ref = ref + base.double()
    else:
        dtype = torch.float32 if mode == "fp32_write" else torch.bfloat16
        out = torch.full((e, n, k), float("nan"), device="cuda", dtype=dtype)
        cute.grouped_wgrad(grad_out, x, offs, out=out)
    tol = 1e-2 if out.dtype == torch.bfloat16 else 2e-3
    if ref.norm() == 0:
        assert not torch.isnan(out).any() and out.abs().max() == 0
    else:
        assert _rel_err(out, ref) < tol


@gpu
@needs_cute
def test_cuda_graph_replays_with_new_split_sizes():
    from te_seq.kernels import cute

    k, n, m = 256, 512, 1024
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4, k, n, device="cuda", dtype=torch.bfloat16)
    offs = _offs([256, 256, 256, 256])
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    cute.grouped_mm(a, b, offs, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute.grouped_mm(a, b, offs, out=out)
    for sizes in ([1000, 0, 24, 0], [0, 0, 0, 1024], [3, 500, 500, 21]):
        offs.copy_(_offs(sizes))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, reference.grouped_mm(a.double(), b.double(), offs)) < 1e-2


# The non-default tilings stay correct too (2x1 multicasts B; 1x1 multicasts nothing).
_OTHER_TILINGS = [(256, (2, 1)), (128, (1, 1))]


@gpu
@needs_cute
@pytest.mark.parametrize("tiling", _OTHER_TILINGS, ids=str)
def test_other_tilings_match_reference(tiling):
    from te_seq.kernels import cute

    t = cute.Tiling(tiling[0], tiling[1])
    sizes, k, n = [1, 0, 129, 255, 257, 0, 513], 192, 264
    a = torch.randn(sum(sizes), k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(sizes), n, k, device="cuda", dtype=torch.bfloat16)
    offs = _offs(sizes)
    out = torch.full((a.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
    cute.grouped_mm(a, w.transpose(1, 2), offs, out=out, tiling=t)
    assert _rel_err(out, reference.grouped_mm(a.double(), w.transpose(1, 2).double(), offs)) < 1e-2
    g = torch.randn(sum(sizes), n, device="cuda", dtype=torch.bfloat16)
    dw = cute.grouped_wgrad(g, a, offs, tiling=t)
    assert _rel_err(dw, reference.grouped_wgrad(g.double(), a.double(), offs)) < 1e-2
