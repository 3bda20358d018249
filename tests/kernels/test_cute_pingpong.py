"""Ping-pong consumer warpgroups in the CuTe DSL grouped GEMM (``Tiling(pingpong=True)``).

The two MMA warpgroups take alternate tiles, so the results must equal the cooperative kernel's
of the same tile width bit for bit (each output value is the same fp32 sum over K in the same
order, rounded once) and the float64 reference within bf16/fp16 rounding. Compile-only tests run
on CPU; GPU tests need sm_90+.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from cute_marks import compile_for_sm90a, gpu, needs_cute, needs_dsl
from cute_marks import offsets as _offs

from te_seq.kernels import reference
from te_seq.kernels.cute import Tiling

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import torch
    from te_seq.kernels.cute.compile import GemmConfig, compile_gemm
    bf16, fp16 = torch.bfloat16, torch.float16
    configs = [
        GemmConfig("m", bf16, bf16, "k", 192, (1, 2), pingpong=True),
        GemmConfig("m", bf16, bf16, "n", 128, (2, 1), pingpong=True),
        GemmConfig("m", fp16, fp16, "k", 192, (1, 1), pingpong=True),
    ]
    for cfg in configs:
        print(cfg, f"{compile_gemm(cfg).compile_s:.1f}s", flush=True)
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
        ({"varlen": "k"}, "varlen 'm'"),
        ({"varlen": "m", "route": "scatter"}, "route 'scatter'"),
        ({"varlen": "m", "tile_mn": (128, 256)}, "tile width"),
    ],
)
def test_kernel_rejects_pingpong_it_cannot_run(kwargs, match):
    from te_seq.kernels.cute.grouped_gemm import GroupedGemmKernel

    with pytest.raises(ValueError, match=match):
        GroupedGemmKernel(pingpong=True, **kwargs)


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


def _run(a, b, offs, tiling, pingpong):
    from te_seq.kernels import cute

    out = torch.full((a.shape[0], b.shape[2]), float("nan"), device="cuda", dtype=a.dtype)
    cute.grouped_mm(a, b, offs, out=out, tiling=Tiling(tiling[0], tiling[1], pingpong))
    return out


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output has NaN (unwritten rows?)"
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@gpu
@needs_cute
@pytest.mark.parametrize("tiling", _TILINGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_pingpong_equals_cooperative_and_reference(case, tiling):
    _, sizes, k, n = case
    m, e = sum(sizes), len(sizes)
    torch.manual_seed(len(sizes) + k)
    a = torch.randn(m + 37, k, device="cuda", dtype=torch.bfloat16)  # 37 rows past offs[-1]
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
    offs = _offs(sizes)
    out = _run(a, w.transpose(1, 2), offs, tiling, pingpong=True)
    same_tile = _run(a, w.transpose(1, 2), offs, tiling, pingpong=False)
    torch.testing.assert_close(out, same_tile, rtol=0, atol=0)
    ref = reference.grouped_mm(a.double(), w.transpose(1, 2).double(), offs)
    assert _rel_err(out, ref) < 1e-2
    assert (out[m:] == 0).all()


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
