"""The fused FP8 (E4M3) GLU steps of the CuTe DSL backend: ``cute.scaled_glu_fc1_forward``
(h = diag(sx) x W1ᵀ diag(sw), a = act(gate)·up·probs) and ``cute.scaled_glu_fc2_dgrad`` (dh, a,
dprobs from dA = diag(sdy) dY W2 diag(sw)). A compile-only test runs without a GPU
(CUTE_DSL_ARCH=sm_90a, in a subprocess); CPU tests check the refusals and their reasons; GPU
tests compare with a float64 emulation (dequantized row-wise E4M3 operands, per-expert GEMM in
float64, then te_seq.kernels.reference's GLU maths) on fresh random data: empty experts,
unaligned group sizes, rows past offs[-1] (with NaN row scales there), H not a multiple of the
128-element k-tile, [gate | up] halves and interleaved blocks, with and without probs."""

from __future__ import annotations

import textwrap

import pytest
import torch
from cute_marks import compile_for_sm90a, gpu, needs_cute, needs_dsl
from cute_marks import offsets as _offs
from cute_marks import poison as _poison

from te_seq.kernels import cute, reference
from te_seq.kernels import fp8_reference as fp8ref

FP8 = torch.float8_e4m3fn

# ------------------------------------------------------------------ CPU: compile-only, errors

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import torch
    from te_seq.kernels.cute.compile import GluConfig, compile_glu
    fp8, bf16, fp32 = torch.float8_e4m3fn, torch.bfloat16, torch.float32
    for cfg in [
        GluConfig("fc1", fp8, "k", "silu", None, fp32, scaled=True),
        GluConfig("fc1", fp8, "k", "gelu", 32, None, scaled=True),
        GluConfig("dgrad", fp8, "k", "silu", None, fp32, scaled=True),
        GluConfig("dgrad", fp8, "k", "clamped_qgelu", 32, bf16, tile_n=192,
                  params=(0.9, 1.3, 0.5), scaled=True),
        # ping-pong FC1s: 64 gate + 64 up columns per tile, a scale scratch per warpgroup
        GluConfig("fc1", fp8, "k", "silu", None, fp32, tile_n=128, scaled=True, pingpong=True),
        GluConfig("fc1", fp8, "k", "gelu", 64, None, (2, 1), tile_n=128, scaled=True,
                  pingpong=True, half_tiles=True),
        GluConfig("dgrad", fp8, "k", "silu", None, fp32, tile_n=128, scaled=True,
                  pingpong=True),
        GluConfig("dgrad", fp8, "k", "gelu", 32, bf16, tile_n=128, scaled=True,
                  pingpong=True, epi_rows=64),  # (64 x 32) epilogue subtiles
        # the default dgrad: 2x1, two h pairs (glu.FP8_PINGPONG_DGRAD_H_PREFETCH); four
        GluConfig("dgrad", fp8, "k", "silu", None, fp32, (2, 1), tile_n=128, scaled=True,
                  pingpong=True, h_prefetch=2),
        GluConfig("dgrad", fp8, "k", "gelu", 32, bf16, (2, 1), tile_n=128, scaled=True,
                  pingpong=True, h_prefetch=4),
    ]:
        print(cfg, f"{compile_glu(cfg).compile_s:.1f}s", flush=True)
    for bad in [GluConfig("fc1", fp8, "n", "silu", None, None, scaled=True),
                GluConfig("fc1", bf16, "k", "silu", None, None, scaled=True),
                GluConfig("fc1", fp8, "k", "silu", None, None, bias_dtype=bf16, scaled=True),
                GluConfig("dgrad", fp8, "k", "silu", None, None, scaled=True,
                          route="gather")]:
        try:
            compile_glu(bad)
        except ValueError as exc:
            assert "E4M3 operands, K-major B, no bias or route" in str(exc), exc
        else:
            raise AssertionError(f"{bad} compiled")
    print("ALL COMPILED")
    """
)


@pytest.mark.slow  # ~10 s of DSL compiles; CI runs it, `-m "not slow"` quick runs skip it
@needs_dsl
def test_fp8_glu_kernels_compile_for_sm90a():
    compile_for_sm90a(_COMPILE_SCRIPT, timeout=600)


def _cpu_operands(m=16, e=2, h=64, f=128):
    """(x, w1, x_scale, w1_scale, w2t, w2t_scale) on the CPU, E4M3 and fp32."""
    x = torch.randn(m, h).to(FP8)
    w1, w2t = torch.randn(e, 2 * f, h).to(FP8), torch.randn(e, f, h).to(FP8)
    return x, w1, torch.rand(m) + 0.5, torch.rand(e, 2 * f) + 0.5, w2t, torch.rand(e, f) + 0.5


# (change of (x, w, x_scale, w_scale, act, interleave), reason); w is w1 or w2t
_REFUSALS = [
    (lambda x, w, sx, sw, act, il: (x, w, sx, sw, "geglu", il), "act 'geglu' has no fused"),
    (lambda x, w, sx, sw, act, il: (x.to(torch.bfloat16), w, sx, sw, act, il),
     "needs float8_e4m3fn operands"),
    (lambda x, w, sx, sw, act, il: (x, w.to(torch.float8_e5m2), sx, sw, act, il), "float8_e5m2"),
    (lambda x, w, sx, sw, act, il: (x[:, :32], w, sx, sw, act, il),
     "needs x [M, H] and w [E, N, H]"),
    (lambda x, w, sx, sw, act, il: (x[:, :40], w[..., :40], sx, sw, act, il),
     "H=40 must be a multiple of 16"),
    (lambda x, w, sx, sw, act, il: (x, w, sx, sw, act, 48), "glu_interleave_size=48 unsupported"),
    (lambda x, w, sx, sw, act, il: (x, w, sx.double(), sw, act, il),
     "x_scale must be float32 [16], got torch.float64"),
    (lambda x, w, sx, sw, act, il: (x, w, sx, sw[:1], act, il), "w_scale must be float32 [2, "),
    (lambda x, w, sx, sw, act, il: (x, w[:0], sx, sw[:0], act, il), "needs E, N and H > 0"),
    (lambda x, w, sx, sw, act, il: (x, w, sx, sw, act, il), "needs CUDA tensors on one device"),
]
_REFUSAL_IDS = ["act", "bf16_x", "e5m2_w", "h_mismatch", "h_unaligned", "interleave",
                "x_scale_dtype", "w_scale_shape", "no_experts", "cpu"]


@pytest.mark.parametrize("change, reason", _REFUSALS, ids=_REFUSAL_IDS)
def test_supports_names_the_problem(change, reason):
    x, w1, sx, sw1, w2t, sw2 = _cpu_operands()
    offs = torch.tensor([8, 16], dtype=torch.int32)
    cases = ((cute.scaled_glu_fc1_forward, w1, sw1, "cute scaled_glu_fc1_forward"),
             (cute.scaled_glu_fc2_dgrad, w2t, sw2, "cute scaled_glu_fc2_dgrad"))
    for fn, w, sw, name in cases:
        args = change(x, w, sx, sw, "silu", None)
        ok, why = fn.supports(*args)
        assert not ok and reason in why, why
        with pytest.raises(ValueError, match=name) as exc:
            if fn is cute.scaled_glu_fc1_forward:
                fn(*args[:4], offs, *args[4:])
            else:
                fn(*args[:4], offs, torch.zeros(16, 256, dtype=torch.bfloat16), *args[4:])
        assert reason in str(exc.value)


def test_fc1_rules_of_the_glu_layout_and_its_options():
    x, w1, sx, sw1, _, _ = _cpu_operands(f=96)
    ok, why = cute.scaled_glu_fc1_forward.supports(x, w1, sx, sw1, "silu", None)
    assert not ok and "F=96 must be a multiple of 128 for [gate | up] halves" in why
    x, w1, sx, sw1, _, _ = _cpu_operands()
    ok, why = cute.scaled_glu_fc1_forward.supports(x, w1[:, :255], sx, sw1[:, :255], "silu", None)
    assert not ok and "N = 2F" in why
    bias = torch.zeros(2, 256)
    ok, why = cute.scaled_glu_fc1_forward.supports(x, w1, sx, sw1, "silu", None, bias=bias)
    assert not ok and "no bias" in why
    ok, why = cute.scaled_glu_fc1_forward.supports(x, w1, sx, sw1, "silu", None, gather=True)
    assert not ok and "no gathered rows" in why


# ------------------------------------------------------------------ GPU correctness

# (name, split sizes, extra rows past offs[-1], H, F). H = 208: a k-tail (not a multiple of the
# 128-element FP8 k-tile); F = 384: the FC1 halves' last tile half past F, dgrad's 192 tiles.
_CASES = [
    ("one_expert", [300], 0, 256, 256),
    ("empty_experts_rows_past_end", [0, 77, 0, 0, 300, 5, 0], 40, 128, 384),
    ("unaligned_k_tail", [1, 3, 129, 255, 257, 7, 513], 9, 208, 128),
]
# (act, interleave, probs dtype, params)
_CONFIGS = [
    ("silu", None, torch.float32, ()),
    ("silu", None, None, ()),
    ("silu", 32, torch.float32, ()),
    ("gelu", 32, torch.bfloat16, ()),
]


def _quantized_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 data, fp32 dequantization scales, dequantized float64 values) of t [..., C],
    one scale per row (``fp8_reference.quantize``, row-wise E4M3)."""
    q = fp8ref.quantize(t.reshape(-1, t.shape[-1]), fp8ref.ROWWISE, fp8ref.ScaleRule())
    values = (q.data.double() * q.scale_inv.double()).reshape(t.shape)  # exact in float64
    return q.data.reshape(t.shape), q.scale_inv.reshape(t.shape[:-1]).clone(), values


def _spread_rows(*shape: int) -> torch.Tensor:
    """Random values whose rows differ in magnitude (0.25x to 4x), so every scale matters."""
    rows = torch.randn(*shape, device="cuda")
    return rows * torch.exp2(torch.rand(*shape[:-1], 1, device="cuda") * 4 - 2)


def _grouped_f64(a: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """float64 out[rows of g] = a[rows of g] @ w[g]ᵀ (w [E, N, K]); rows past the last zero."""
    out = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64, device=a.device)
    start = 0
    for g, size in enumerate(sizes):
        out[start : start + size] = a[start : start + size] @ w[g].t()
        start += size
    return out


def _max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (a NaN in out fails: unwritten)."""
    assert not torch.isnan(out).any(), "output has NaN (unwritten elements?)"
    ref = ref.double()
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _scales_nan_where_unread(x_scale, w_scale, sizes):
    """NaN row scales past offs[-1] and NaN column scales of empty experts: the kernel must not
    let them reach any output (rows past the end are zeros whatever their scales hold)."""
    x_scale[sum(sizes) :] = float("nan")
    for g, size in enumerate(sizes):
        if size == 0:
            w_scale[g] = float("nan")


def _fc1_operands(case, p_dtype):
    """((x, x_scale, x as float64), (w1, w1_scale, w1 as float64), probs) of a case: row-wise
    E4M3 x [M, H] and w1 [E, 2F, H] with rows of different magnitudes, NaN scales where the
    kernel must not read them, probs [M] in ``p_dtype`` (None: none)."""
    _, sizes, extra, h_dim, f = case
    m = sum(sizes) + extra
    x = _quantized_rows(_spread_rows(m, h_dim))
    w1 = _quantized_rows(_spread_rows(len(sizes), 2 * f, h_dim) / h_dim**0.5)
    _scales_nan_where_unread(x[1], w1[1], sizes)
    probs = None if p_dtype is None else torch.rand(m, device="cuda").to(p_dtype)
    return x, w1, probs


@gpu
@needs_cute
@pytest.mark.parametrize("config", _CONFIGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_scaled_fc1_forward_matches_float64(case, config):
    _, sizes, extra, h_dim, f = case
    act, il, p_dtype, params = config
    m, end = sum(sizes) + extra, sum(sizes)
    (x, sx, x64), (w1, sw1, w1_64), probs = _fc1_operands(case, p_dtype)
    fn = cute.scaled_glu_fc1_forward
    assert fn.supports(x, w1, sx, sw1, act, il) == (True, "")
    _poison(((m, 2 * f), torch.bfloat16), ((m, f), torch.bfloat16))
    h, a = fn(x, w1, sx, sw1, _offs(sizes), act, il, probs, params)
    assert h.dtype == a.dtype == torch.bfloat16 and h.shape == (m, 2 * f) and a.shape == (m, f)
    h_ref = _grouped_f64(x64, w1_64, sizes)
    assert _max_rel(h, h_ref) < 1e-2
    p64 = None if probs is None else probs.double()
    # a comes from the fp32 accumulators (one rounding, a's): the activation of the exact h,
    # and within the rounding of gate and up of the kernel's own bf16 h's
    assert _max_rel(a, reference.glu_forward(h_ref, act, il, p64, params)) < 1e-2
    assert _max_rel(a, reference.glu_forward(h.double(), act, il, p64, params)) < 1e-2
    assert (h[end:] == 0).all() and (a[end:] == 0).all()


@gpu
@needs_cute
@pytest.mark.parametrize("config", _CONFIGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_scaled_fc2_dgrad_matches_float64(case, config):
    _, sizes, extra, h_dim, f = case
    act, il, p_dtype, params = config
    m, end = sum(sizes) + extra, sum(sizes)
    dy, sdy, dy64 = _quantized_rows(_spread_rows(m, h_dim))
    w2t, sw2, w2t_64 = _quantized_rows(_spread_rows(len(sizes), f, h_dim) / h_dim**0.5)
    h = torch.randn(m, 2 * f, device="cuda").to(torch.bfloat16)  # rows past the end too
    probs = None if p_dtype is None else torch.rand(m, device="cuda").to(p_dtype)
    _scales_nan_where_unread(sdy, sw2, sizes)
    fn = cute.scaled_glu_fc2_dgrad
    assert fn.supports(dy, w2t, sdy, sw2, act, il) == (True, "")
    _poison(((m, 2 * f), torch.bfloat16), ((m, f), torch.bfloat16))
    dh, a, dprobs = fn(dy, w2t, sdy, sw2, _offs(sizes), h, act, il, probs, params)
    da = _grouped_f64(dy64, w2t_64, sizes)  # dA = dY W2 (unrounded, as the kernel keeps it)
    p64 = None if probs is None else probs.double()
    dh_ref, dp_ref = reference.glu_backward(h.double(), da, act, il, p64, params)
    assert dh.dtype == a.dtype == torch.bfloat16 and dh.shape == (m, 2 * f)
    assert _max_rel(dh, dh_ref) < 1e-2
    assert _max_rel(a, reference.glu_forward(h.double(), act, il, p64, params)) < 4e-3
    assert (dh[end:] == 0).all()
    if probs is None:
        assert dprobs is None
    else:
        assert dprobs.dtype == probs.dtype and dprobs.shape == (m,)
        assert _max_rel(dprobs, dp_ref) < 1e-2
        assert (dprobs[end:] == 0).all()


@gpu
@needs_cute
def test_fc1_then_dgrad_chain_rows_past_the_end_are_zero():
    """h from the FP8 FC1 fed to the FP8 dgrad (the fused MLP's order): rows past offs[-1] are
    zeros in h, a and dh; dgrad's re-emitted a (from the bf16 h) equals FC1's (from the fp32
    sums) up to the rounding of gate and up."""
    sizes, extra, h_dim, f = [0, 130, 61], 19, 144, 256
    m, end = sum(sizes) + extra, sum(sizes)
    x, sx, _ = _quantized_rows(_spread_rows(m, h_dim))
    w1, sw1, _ = _quantized_rows(_spread_rows(3, 2 * f, h_dim) / h_dim**0.5)
    dy, sdy, _ = _quantized_rows(_spread_rows(m, h_dim))
    w2t, sw2, _ = _quantized_rows(_spread_rows(3, f, h_dim) / h_dim**0.5)
    probs = torch.rand(m, device="cuda")
    offs = _offs(sizes)
    h, a = cute.scaled_glu_fc1_forward(x, w1, sx, sw1, offs, "silu", None, probs)
    dh, a2, dprobs = cute.scaled_glu_fc2_dgrad(dy, w2t, sdy, sw2, offs, h, "silu", None, probs)
    torch.testing.assert_close(a.float(), a2.float(), rtol=2e-2, atol=1e-3)
    for t in (h, a, dh):
        assert (t[end:] == 0).all()
    assert (dprobs[end:] == 0).all() and dprobs[:end].abs().sum() > 0


# (act, interleave, probs dtype, cluster): the ping-pong FC1's configs (64-column halves)
_PINGPONG_CONFIGS = [
    ("silu", None, torch.float32, (1, 2)),
    ("silu", None, None, (2, 1)),
    ("gelu", 64, torch.bfloat16, (1, 2)),
    ("relu", 32, None, (1, 2)),
]


@gpu
@needs_cute
@pytest.mark.parametrize("config", _PINGPONG_CONFIGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_pingpong_fc1_equals_cooperative_bit_for_bit(tiling_env, case, config):
    """The default FC1 with H <= TE_SEQ_PINGPONG_MAX_K runs ping-pong (64 gate + 64 up columns
    per tile, each warpgroup its own scale scratch): h and a equal the cooperative kernel's
    (TE_SEQ_PINGPONG=0: 128 + 128 columns) bit for bit, zeros past offs[-1] with NaN scales."""
    _, sizes, extra, h_dim, f = case
    act, il, p_dtype, cluster = config
    m, end = sum(sizes) + extra, sum(sizes)
    (x, sx, _), (w1, sw1, _), probs = _fc1_operands(case, p_dtype)
    offs = _offs(sizes)
    tiling_env("TE_SEQ_MM_CLUSTER", f"{cluster[0]}x{cluster[1]}")
    _poison(((m, 2 * f), torch.bfloat16), ((m, f), torch.bfloat16))
    h, a = cute.scaled_glu_fc1_forward(x, w1, sx, sw1, offs, act, il, probs)
    tiling_env("TE_SEQ_PINGPONG", "0")
    h_coop, a_coop = cute.scaled_glu_fc1_forward(x, w1, sx, sw1, offs, act, il, probs)
    torch.testing.assert_close(h, h_coop, rtol=0, atol=0)
    torch.testing.assert_close(a, a_coop, rtol=0, atol=0)
    assert (h[end:] == 0).all() and (a[end:] == 0).all()


@gpu
@needs_cute
@pytest.mark.parametrize(("half", "epi_rows"), [(False, None), (True, None), (False, 64)],
                         ids=["full_tiles", "half_tiles", "subtiles64"])
@pytest.mark.parametrize("config", _PINGPONG_CONFIGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_pingpong_dgrad_equals_cooperative_bit_for_bit(tiling_env, case, config, half, epi_rows):
    """The default FP8 GLU dgrad (ping-pong, 128 wide; ``epi_rows`` 64: an explicit tiling
    with (64 x 32) epilogue subtiles) against the cooperative 128-wide tile: dh and a bit for
    bit (TE_SEQ_HALF_TILES=1 too: an expert's last tile of <= 64 rows runs one 64-row atom),
    d(probs) within its atomics' summation order; zeros past offs[-1]."""
    _, sizes, extra, h_dim, f = case
    act, il, p_dtype, cluster = config
    m, end = sum(sizes) + extra, sum(sizes)
    dy, sdy, _ = _quantized_rows(_spread_rows(m, h_dim))
    w2t, sw2, _ = _quantized_rows(_spread_rows(len(sizes), f, h_dim) / h_dim**0.5)
    h = torch.randn(m, 2 * f, device="cuda").to(torch.bfloat16)
    probs = None if p_dtype is None else torch.rand(m, device="cuda").to(p_dtype)
    _scales_nan_where_unread(sdy, sw2, sizes)
    offs = _offs(sizes)
    tiling_env("TE_SEQ_MM_CLUSTER", f"{cluster[0]}x{cluster[1]}")
    tiling_env("TE_SEQ_HALF_TILES", "1" if half else "0")
    fn = cute.scaled_glu_fc2_dgrad
    tiling = None if epi_rows is None else cute.Tiling(128, cluster, True, epi_rows=epi_rows)
    dh, a, dprobs = fn(dy, w2t, sdy, sw2, offs, h, act, il, probs, tiling=tiling)
    same = fn(dy, w2t, sdy, sw2, offs, h, act, il, probs, tiling=cute.Tiling(128, cluster))
    torch.testing.assert_close(dh, same[0], rtol=0, atol=0)
    torch.testing.assert_close(a, same[1], rtol=0, atol=0)
    assert (dh[end:] == 0).all()
    if probs is not None:
        torch.testing.assert_close(dprobs.float(), same[2].float(), rtol=2e-2, atol=1e-3)
