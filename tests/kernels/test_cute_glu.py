"""The fused GLU grouped-MLP kernels of the CuTe DSL backend against te_seq.kernels.reference.

glu_fc1_forward: (h, a) = (x_e W1_eᵀ, act(gate)·up·probs); glu_fc2_dgrad: (dh, a, dprobs) from
dA = dY_e W2_e. Compile-only tests run without a GPU (CUTE_DSL_ARCH=sm_90a, in a subprocess);
GPU tests need sm_90+ and compare with float64 references on fresh random data.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from cute_marks import compile_for_sm90a, gpu, needs_cute, needs_dsl
from cute_marks import offsets as _offs
from cute_marks import poison as _poison
from cute_marks import rel_err as _rel_err

from te_seq.kernels import reference
from te_seq.kernels.activations import epilogue_activations

# ------------------------------------------------------------------ CPU: compile-only, errors

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import torch
    from te_seq.kernels.cute.compile import GluConfig, compile_glu
    bf16 = torch.bfloat16
    for cfg in [
        GluConfig("fc1", bf16, "k", "silu", None, torch.float32),
        GluConfig("dgrad", bf16, "n", "gelu", 64, bf16),
        GluConfig("dgrad", bf16, "n", "silu", None, torch.float32, tile_n=192),
        # parameterized activations with interleaved blocks and narrower dgrad tiles
        GluConfig("fc1", bf16, "k", "situ", 64, None, params=(1.5, 2.0)),
        GluConfig("dgrad", bf16, "n", "clamped_qgelu", 32, bf16, tile_n=128,
                  params=(0.9, 1.3, 0.5)),
    ]:
        print(cfg, f"{compile_glu(cfg).compile_s:.1f}s", flush=True)
    print("ALL COMPILED")
    """
)


@pytest.mark.slow  # ~10 s of DSL compiles; CI runs it, `-m "not slow"` quick runs skip it
@needs_dsl
def test_glu_kernels_compile_for_sm90a():
    compile_for_sm90a(_COMPILE_SCRIPT, timeout=600)


def _operands(h: int, f: int, dtype=torch.bfloat16, device="cpu"):
    x = torch.randn(16, h, dtype=dtype, device=device)
    w1t = torch.randn(2, h, 2 * f, dtype=dtype, device=device)
    w2 = torch.randn(2, h, f, dtype=dtype, device=device)
    return x, w1t, w2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(act="geglu"), "act 'geglu' has no fused epilogue"),
        (dict(dtype=torch.float32), "needs bf16/fp16 operands"),
        (dict(f=200), "F=200 must be a multiple of 128"),
        (dict(h=100), "H=100 must be a multiple of 8"),
        (dict(interleave=48), "glu_interleave_size=48 unsupported"),
    ],
)
def test_supports_says_why(kwargs, match):
    from te_seq.kernels import cute

    x, w1t, w2 = _operands(
        kwargs.get("h", 64), kwargs.get("f", 128), kwargs.get("dtype", torch.bfloat16)
    )
    act, il = kwargs.get("act", "silu"), kwargs.get("interleave")
    for fn, w in ((cute.glu_fc1_forward, w1t), (cute.glu_fc2_dgrad, w2)):
        ok, why = fn.supports(x, w, act, il)
        assert not ok and match in why


def test_calls_raise_with_the_reason():
    from te_seq.kernels import cute

    x, w1t, w2 = _operands(64, 128)
    offs = torch.tensor([8, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="cute glu_fc1_forward: .*needs CUDA tensors"):
        cute.glu_fc1_forward(x, w1t, offs, "silu", None, None)
    with pytest.raises(ValueError, match=r"cute glu_fc2_dgrad: .*act 'gelu_erf'"):
        cute.glu_fc2_dgrad(x, w2, offs, torch.randn(16, 256), "gelu_erf", None, None)


def test_probs_are_checked_and_normalised():
    from te_seq.kernels.cute.glu import _check_probs

    with pytest.raises(ValueError, match=r"cute glu_fc2_dgrad: probs must hold one float per row"):
        _check_probs(torch.rand(5), 6, "glu_fc2_dgrad")
    with pytest.raises(ValueError, match=r"probs must hold one float per row \(4\)"):
        _check_probs(torch.ones(4, dtype=torch.int64), 4, "glu_fc1_forward")
    p64 = torch.rand(4, 1, dtype=torch.float64)
    out = _check_probs(p64, 4, "glu_fc1_forward")
    assert (
        out.shape == (4,) and out.dtype == torch.float32 and torch.equal(out, p64.flatten().float())
    )
    p16 = torch.rand(8, dtype=torch.bfloat16)[::2]
    out = _check_probs(p16, 4, "glu_fc1_forward")
    assert out.is_contiguous() and out.dtype == torch.bfloat16 and torch.equal(out, p16)


# ------------------------------------------------------------------ GPU correctness





_H_READER_SCRIPT = textwrap.dedent(
    """
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode
    from cutlass.tensor_utils import LayoutEnum

    from te_seq.kernels.cute.glu_h_loads import ldmatrix_mirror
    from te_seq.kernels.cute.mainloop import stmatrix_tiled_copy

    @cute.jit
    def check():
        # ping-pong (one warpgroup) and cooperative (two), the dgrads' widths, 16-bit h
        for wgs in (1, 2):
            for tn in (128, 192, 256):
                for dtype in (cutlass.BFloat16, cutlass.Float16):
                    mma = sm90_utils.make_trivial_tiled_mma(
                        dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32,
                        (wgs, 1, 1), tiler_mn=(64, tn))
                    store = stmatrix_tiled_copy(LayoutEnum.ROW_MAJOR, dtype, cutlass.Float32, mma)
                    load = ldmatrix_mirror(store, LayoutEnum.ROW_MAJOR, dtype)
                    pair = (wgs, tn, dtype)
                    assert str(load.layout_dst_tv_tiled) == str(store.layout_src_tv_tiled), pair
                    assert str(load.layout_src_tv_tiled) == str(store.layout_dst_tv_tiled), pair
                    assert str(load.tiler_mn) == str(store.tiler_mn), pair

    cute.compile(check)
    print("ALL COMPILED")
    """
)


@pytest.mark.slow  # the DSL in a subprocess
@needs_dsl
def test_dgrad_h_reads_are_the_stores_inverse(tmp_path):
    """The dgrad epilogues read h's subtiles with ldmatrix (`glu_h_loads.ldmatrix_mirror`) into
    registers in the accumulators' order: the read's register and smem thread-value layouts
    are the epilogue's stmatrix store's, swapped, on the same tiler, for every warpgroup
    count, tile width and 16-bit type the dgrads run, so value v read lies where value v of
    the accumulators would be stored."""
    check = tmp_path / "h_reader_check.py"  # the DSL compiles functions from their source file
    check.write_text(_H_READER_SCRIPT)
    compile_for_sm90a(f"import runpy; runpy.run_path({str(check)!r})", timeout=300)


# (name, split sizes, extra rows past offs[-1], H, F). dgrad's tile width follows F
# (``tile_n_for``): 128 for F = 256 and 128, 192 for F = 384, 256 for F = 512.
_CASES = [
    ("one_expert", [300], 0, 256, 256),
    ("empty_experts_rows_past_end", [0, 77, 0, 0, 300, 5, 0], 40, 128, 384),
    ("unaligned", [1, 3, 129, 255, 257, 7, 513], 0, 192, 128),
    ("wide_f", [200, 0, 321], 3, 64, 512),
]
# Parameter values of the parameterized activations: h ~ N(0, 1) in these tests, so a limit of
# 0.9 clamps about a third of gate and up values (the defaults, 7.0, would clamp none) and caps
# of 1.5 / 2.0 bend tanh well away from the identity.
_PARAMS = {"clamped_qgelu": (0.9, 1.3, 0.5), "situ": (1.5, 2.0)}
# (act, interleave, probs dtype, params): each config compiles once per kernel, so cover, don't
# multiply: every activation the table gives the epilogue once, then layouts and probs dtypes.
_CONFIGS = [(act, None, torch.float32, _PARAMS.get(act, ())) for act in epilogue_activations()]
_CONFIGS += [
    ("silu", None, None, ()),
    ("silu", 32, torch.float32, ()),
    ("gelu", 64, torch.bfloat16, ()),
    ("clamped_qgelu", 32, torch.bfloat16, _PARAMS["clamped_qgelu"]),
    ("situ", 64, None, _PARAMS["situ"]),
]


def _check_clamps_hit(act: str, params: tuple[float, ...], h: torch.Tensor) -> None:
    """The data must reach the clamped branch (else a wrong clamp would pass unnoticed)."""
    if act == "clamped_qgelu":
        assert (h.float().abs() > params[0]).float().mean() > 0.1


def _data(case, probs_dtype, dtype=torch.bfloat16):
    _, sizes, extra, h, f = case
    m = sum(sizes) + extra
    x = torch.randn(m, h, device="cuda", dtype=dtype)
    w1 = torch.randn(len(sizes), 2 * f, h, device="cuda", dtype=dtype) / h**0.5
    w2 = torch.randn(len(sizes), h, f, device="cuda", dtype=dtype) / h**0.5
    probs = None if probs_dtype is None else torch.rand(m, device="cuda").to(probs_dtype)
    return x, w1, w2, probs, _offs(sizes)


@gpu
@needs_cute
@pytest.mark.parametrize("config", _CONFIGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_fc1_forward_matches_reference(case, config):
    from te_seq.kernels import cute

    act, il, p_dtype, params = config
    x, w1, _, probs, offs = _data(case, p_dtype)
    w1t = w1.transpose(1, 2)
    assert cute.glu_fc1_forward.supports(x, w1t, act, il) == (True, "")
    m, f = x.shape[0], w1.shape[1] // 2
    _poison(((m, 2 * f), x.dtype), ((m, f), x.dtype))
    h, a = cute.glu_fc1_forward(x, w1t, offs, act, il, probs, params)
    h_ref = reference.grouped_mm(x.double(), w1t.double(), offs)
    assert _rel_err(h, h_ref) < 1e-2
    _check_clamps_hit(act, params, h[: offs[-1]])
    # a is computed from the fp32 accumulators (one rounding, a's), so it is compared with the
    # activation of the exact h
    p64 = None if probs is None else probs.double()
    a_ref = reference.glu_forward(h_ref, act, il, p64, params)
    assert _rel_err(a, a_ref) < 1e-2
    assert (h[offs[-1] :] == 0).all() and (a[offs[-1] :] == 0).all()


@gpu
@needs_cute
@pytest.mark.parametrize("config", _CONFIGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_fc2_dgrad_matches_reference(case, config):
    from te_seq.kernels import cute

    act, il, p_dtype, params = config
    x, _, w2, probs, offs = _data(case, p_dtype)
    m, f = x.shape[0], w2.shape[2]
    dy = torch.randn_like(x)
    h = torch.randn(m, 2 * f, device="cuda", dtype=x.dtype)
    _check_clamps_hit(act, params, h)
    assert cute.glu_fc2_dgrad.supports(dy, w2, act, il) == (True, "")
    _poison(((m, 2 * f), x.dtype), ((m, f), x.dtype))
    dh, a, dprobs = cute.glu_fc2_dgrad(dy, w2, offs, h, act, il, probs, params)
    da = reference.grouped_mm(dy.double(), w2.double(), offs)
    p64 = None if probs is None else probs.double()
    dh_ref, dp_ref = reference.glu_backward(h.double(), da, act, il, p64, params)
    assert _rel_err(dh, dh_ref) < 1e-2
    assert _rel_err(a, reference.glu_forward(h.double(), act, il, p64, params)) < 1e-2
    if probs is None:
        assert dprobs is None
    else:
        assert dprobs.dtype == probs.dtype and dprobs.shape == (m,)
        assert _rel_err(dprobs, dp_ref) < 1e-2
        assert (dprobs[offs[-1] :] == 0).all()


@gpu
@needs_cute
def test_fp16_and_functional_dispatch():
    """fp16 operands; te_seq.kernels' functionals on the cute backend run the fused kernels and
    agree with the reference backend's GEMM followed by its GLU maths."""
    from te_seq import kernels

    cute, ref = kernels.get_backend("cute"), kernels.get_backend("reference")
    glu = kernels.GluSpec("silu")
    x, w1, w2, probs, offs = _data(_CASES[2], torch.float32, dtype=torch.float16)
    h, a = kernels.glu_fc1_forward(x, w1.transpose(1, 2), offs, glu, probs, cute)
    h2 = kernels.grouped_mm(x, w1.transpose(1, 2), offs, ref)
    a2 = ref.glu_forward(h2, glu, probs)
    assert _rel_err(h, h2) < 2e-3 and _rel_err(a, a2) < 2e-3
    dy = torch.randn_like(x)
    dh, a, dp = kernels.glu_fc2_dgrad(dy, w2, offs, h, glu, probs, cute)
    dh2, dp2 = ref.glu_backward(h, kernels.grouped_mm(dy, w2, offs, ref), glu, probs)
    a2 = ref.glu_forward(h, glu, probs)
    assert _rel_err(dh, dh2) < 5e-3 and _rel_err(a, a2) < 2e-3 and _rel_err(dp, dp2) < 5e-3


@gpu
@needs_cute
def test_cuda_graph_replays_with_new_split_sizes():
    from te_seq.kernels import cute

    h_dim, f, m = 128, 256, 1024
    x = torch.randn(m, h_dim, device="cuda", dtype=torch.bfloat16)
    w1t = (torch.randn(4, 2 * f, h_dim, device="cuda", dtype=torch.bfloat16) / 12).transpose(1, 2)
    offs = _offs([256, 256, 256, 256])
    cute.glu_fc1_forward(x, w1t, offs, "silu", None, None)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, a = cute.glu_fc1_forward(x, w1t, offs, "silu", None, None)
    for sizes in ([1000, 0, 24, 0], [0, 0, 0, 1024], [3, 500, 500, 21]):
        offs.copy_(_offs(sizes))
        h.fill_(float("nan"))
        a.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(h, reference.grouped_mm(x.double(), w1t.double(), offs)) < 1e-2
        assert _rel_err(a, reference.glu_forward(h.double(), "silu")) < 1e-2


@gpu
@needs_cute
@pytest.mark.parametrize("config", [c for c in _CONFIGS if c[0] in ("silu", "gelu")], ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_fc2_dgrad_h_prefetch_equals_one_pair(case, config):
    # two h buffer pairs (h_prefetch=2): subtile e's pair and mbarrier parity come from the
    # CTA's running subtile count (tiles of 4, 6 or 8 subtiles, several tiles per CTA)
    from te_seq.kernels import cute

    act, il, p_dtype, params = config
    x, _, w2, probs, offs = _data(case, p_dtype)
    dy = torch.randn_like(x)
    h = torch.randn(x.shape[0], 2 * w2.shape[2], device="cuda", dtype=x.dtype)
    one = cute.glu_fc2_dgrad(dy, w2, offs, h, act, il, probs, params, h_prefetch=1)
    two = cute.glu_fc2_dgrad(dy, w2, offs, h, act, il, probs, params, h_prefetch=2)
    torch.testing.assert_close(two[0], one[0], rtol=0, atol=0)
    torch.testing.assert_close(two[1], one[1], rtol=0, atol=0)
    if probs is not None:  # atomics may add in another order
        torch.testing.assert_close(two[2].float(), one[2].float(), rtol=2e-2, atol=1e-3)


@gpu
@needs_cute
def test_fc2_dgrad_h_prefetch_many_tiles_per_cta():
    # far more tiles than SMs: the running count crosses many tiles of 6 subtiles (F = 768)
    from te_seq.kernels import cute

    sizes, hid, f = [3000, 0, 2500, 1, 4000, 777], 512, 768
    x, _, w2, probs, offs = _data(("big", sizes, 5, hid, f), torch.float32)
    dy = torch.randn_like(x)
    h = torch.randn(x.shape[0], 2 * f, device="cuda", dtype=x.dtype)
    one = cute.glu_fc2_dgrad(dy, w2, offs, h, "silu", None, probs, h_prefetch=1)
    two = cute.glu_fc2_dgrad(dy, w2, offs, h, "silu", None, probs, h_prefetch=2)
    torch.testing.assert_close(two[0], one[0], rtol=0, atol=0)
    torch.testing.assert_close(two[1], one[1], rtol=0, atol=0)


@needs_dsl
@pytest.mark.parametrize("pingpong", [False, True])
def test_h_pair_parity_follows_every_fill_of_each_pair(pingpong):
    # replays the fills of the h pairs over a CTA's tiles: cooperative, every tile is the
    # CTA's; ping-pong, the warpgroups take alternate tiles, warpgroup 0 first. Subtile e of
    # a tile must wait for the parity of its pair's fill count (0 for its first fill, 1 for
    # its second, ...), computed from what the kernel knows: its own earlier subtiles and its
    # warpgroup index.
    from te_seq.kernels.cute.glu_h_loads import h_pair_parity

    for n in (4, 6, 8, 12, 16):  # subtiles per tile: 128/192/256 wide, 128 or 64 rows
        for depth in (d for d in (1, 2, 4) if n % d == 0):
            fills = [0] * depth
            own = [0, 0]  # subtiles each warpgroup ran before its current tile
            for tile in range(11):
                wg = tile % 2 if pingpong else None
                before = own[wg] if pingpong else tile * n
                for e in range(n):
                    want = fills[e % depth] % 2
                    got = h_pair_parity(before, e, depth, n, wg)
                    assert got == want, (n, depth, pingpong, tile, e)
                    fills[e % depth] += 1
                if pingpong:
                    own[wg] += n


def test_dgrad_h_prefetch_default(tiling_env):
    from te_seq.kernels.cute import Tiling, glu

    assert glu._dgrad_h_prefetch(Tiling(192, (1, 2)), scaled=False) == 2
    assert glu._dgrad_h_prefetch(Tiling(128, (1, 2)), scaled=False) == 2
    assert glu._dgrad_h_prefetch(Tiling(256, (1, 2)), scaled=False) == 1  # a stage fewer
    assert glu._dgrad_h_prefetch(Tiling(192, (1, 2)), scaled=True) == 1  # cooperative FP8
    pingpong = Tiling(128, (2, 1), pingpong=True)
    assert glu._dgrad_h_prefetch(pingpong, scaled=False) == 1  # 16-bit: level with 2
    assert glu._dgrad_h_prefetch(pingpong, scaled=True) == glu.FP8_PINGPONG_DGRAD_H_PREFETCH == 2
    # the setting wins where it divides the tile's subtiles (4 here; 6 at 192 wide; 12 with
    # 64-row subtiles at 192)
    tiling_env("TE_SEQ_GLU_DGRAD_H_PREFETCH", "4")
    assert glu._dgrad_h_prefetch(pingpong, scaled=False) == 4
    assert glu._dgrad_h_prefetch(Tiling(192, (1, 2), pingpong=True), scaled=True) == 2
    assert glu._dgrad_h_prefetch(Tiling(192, (1, 2), pingpong=True, epi_rows=64),
                                 scaled=False) == 4
    tiling_env("TE_SEQ_GLU_DGRAD_H_PREFETCH", "1")
    assert glu._dgrad_h_prefetch(pingpong, scaled=True) == 1
    tiling_env("TE_SEQ_GLU_DGRAD_H_PREFETCH", "3")
    with pytest.raises(ValueError, match=r"TE_SEQ_GLU_DGRAD_H_PREFETCH must be one of .*'3'"):
        glu._dgrad_h_prefetch(pingpong, scaled=True)
