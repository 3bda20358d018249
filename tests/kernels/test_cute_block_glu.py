"""The FP8 block-scaled GLU steps of the CuTe DSL backend: ``cute.block_scaled_glu_fc1_forward``
(``Float8BlockScaling``'s x in 1×128 blocks and W1 in 128×128 blocks, promoted every 128
elements of H; the gated activation and router probs in the epilogue) and
``cute.block_scaled_glu_fc2_dgrad`` (dA = dY W2 from dY's 1×128 and W2ᵀ's 128×128 blocks, then
dh, a and d(probs) from h in the epilogue). A compile-only test runs
without a GPU (CUTE_DSL_ARCH=sm_90a, in a subprocess); CPU tests check the refusals; GPU tests
compare h bit for bit with ``cute.block_scaled_grouped_mm`` on the same operands (the same
promotions in the same order; the gate and up halves read different weight block rows) and
with a float64 emulation, and a with the reference GLU maths on the kernel's h: empty experts,
one expert, unaligned sizes, rows past offs[-1], H not a multiple of 128, halves and
interleaved blocks, with and without probs. The dgrad: dh and d(probs) against the reference
GLU backward of the float64 emulation's dA, a bit for bit the FC1's a."""

from __future__ import annotations

import textwrap

import pytest
import torch
from cute_marks import compile_for_sm90a, gpu, needs_cute, needs_dsl, poison
from cute_marks import offsets as _offs
from cute_marks import rel_err as _rel_err
from test_cute_block_fp8 import _emulate, _quantized

from te_seq.kernels import cute, reference

FP8 = torch.float8_e4m3fn
fc1 = cute.block_scaled_glu_fc1_forward

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import torch
    from te_seq.kernels.cute.compile import GluConfig, compile_glu
    fp8, bf16, fp32 = torch.float8_e4m3fn, torch.bfloat16, torch.float32
    for cfg in [
        GluConfig("fc1", fp8, "k", "silu", None, fp32, tile_n=128, block_scaled=True),
        GluConfig("fc1", fp8, "k", "gelu", 32, None, tile_n=128, block_scaled=True),
        GluConfig("fc1", fp8, "k", "clamped_qgelu", 64, bf16, (2, 1), tile_n=128,
                  params=(0.9, 1.3, 0.5), block_scaled=True),
        GluConfig("dgrad", fp8, "k", "silu", None, fp32, tile_n=128, block_scaled=True),
        GluConfig("dgrad", fp8, "k", "gelu", 64, None, tile_n=128, block_scaled=True),
    ]:
        print(cfg, "block_glu", f"{compile_glu(cfg).compile_s:.1f}s", flush=True)
    for bad in [dict(tile_n=256), dict(h_prefetch=2), dict(pingpong=True), dict(scaled=True)]:
        cfg = dict(mode="fc1", ab_dtype=fp8, b_major="k", act="silu", interleave=None,
                   probs_dtype=None, tile_n=128, block_scaled=True)
        cfg.update(bad)
        try:
            compile_glu(GluConfig(**cfg))
        except ValueError as exc:
            assert "block-scaled GLU kernel is a cooperative E4M3 fc1 or dgrad" in str(exc), exc
        else:
            raise AssertionError(f"compiled {bad}")
    print("ALL COMPILED")
    """
)


@pytest.mark.slow  # a few seconds of DSL compiles
@needs_dsl
def test_block_glu_kernels_compile_for_sm90a():
    compile_for_sm90a(_COMPILE_SCRIPT, timeout=600)


def _operands(m=10, e=2, f=128, h=256):
    x, w1, sx, sw = _quantized(m, e, 2 * f, h)
    return x, w1, sx, sw


@pytest.mark.parametrize(("change", "reason"), [
    (dict(act="tanh"), "act 'tanh' has no fused epilogue"),
    (dict(f=64), "F=64 must be a multiple of 128"),
    (dict(interleave=128), "glu_interleave_size=128 unsupported"),
    (dict(x_dtype=torch.bfloat16), "needs float8_e4m3fn operands"),
    (dict(h=272), "a_scale must be float32 [10, 3]"),  # the scales of H = 256 given for 272
    (dict(sw_shape=(2, 1, 2)), "b_scale must be float32 [2, 2, 2]"),
])
def test_supports_names_the_problem(change, reason):
    x, w1, sx, sw = _operands(f=change.get("f", 128))
    if "h" in change:
        x = torch.zeros(10, change["h"], dtype=FP8)
        w1 = torch.zeros(2, w1.shape[1], change["h"], dtype=FP8)
    if "x_dtype" in change:
        x = x.to(torch.float32).to(change["x_dtype"])
    if "sw_shape" in change:
        sw = torch.ones(*change["sw_shape"])
    ok, why = fc1.supports(x, w1, sx, sw, change.get("act", "silu"),
                           change.get("interleave"))
    assert not ok and reason in why, why
    offs = torch.tensor([5, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cute block_scaled_glu_fc1_forward"):
        fc1(x, w1, sx, sw, offs, change.get("act", "silu"), change.get("interleave"))


# ------------------------------------------------------------------ GPU

# (name, split sizes, rows past offs[-1], H, F)
_CASES = [
    ("one_expert", [300], 0, 256, 128),
    ("empty_and_unaligned", [0, 77, 0, 129, 5, 0], 11, 384, 256),
    ("h_not_128s", [200, 1, 63], 0, 208, 384),
    ("many_experts", [(37 * i + 11) % 90 if i % 7 else 0 for i in range(32)], 5, 256, 256),
]
# (act, interleave, probs dtype)
_CONFIGS = [("silu", None, torch.float32), ("gelu", 32, None), ("relu", 64, torch.bfloat16)]


def _data(case, probs_dtype):
    _, sizes, extra, h, f = case
    m = sum(sizes) + extra
    x, w1, sx, sw = (t.cuda() for t in _quantized(m, len(sizes), 2 * f, h, seed=len(sizes)))
    sx[sum(sizes):] = float("nan")  # rows past offs[-1]: their scales are never applied
    probs = None if probs_dtype is None else torch.rand(m, device="cuda").to(probs_dtype)
    return x, w1, sx, sw, probs, _offs(sizes)


@gpu
@needs_cute
@pytest.mark.parametrize("config", _CONFIGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_block_glu_fc1_matches_the_block_gemm_and_float64(case, config):
    act, il, p_dtype = config
    x, w1, sx, sw, probs, offs = _data(case, p_dtype)
    end, (m, f) = int(offs[-1]), (x.shape[0], w1.shape[1] // 2)
    poison(((m, 2 * f), torch.bfloat16), ((m, f), torch.bfloat16))  # h, a: unwritten shows
    h, a = fc1(x, w1, sx, sw, offs, act, il, probs)
    assert h.dtype == a.dtype == torch.bfloat16 and not torch.isnan(h).any()
    plain = cute.block_scaled_grouped_mm(x, w1, torch.nan_to_num(sx), sw, offs)
    torch.testing.assert_close(h[:end], plain[:end], rtol=0, atol=0)
    want = _emulate(x, w1, torch.nan_to_num(sx), sw, offs)
    assert _rel_err(h[:end], want[:end]) < 1e-2
    p64 = None if probs is None else probs[:end].double()
    a_ref = reference.glu_forward(h[:end].double(), act, il, p64)
    assert _rel_err(a[:end], a_ref) < 4e-3
    assert (h[end:] == 0).all() and (a[end:] == 0).all()


@gpu
@needs_cute
def test_block_glu_fc1_gate_and_up_blocks_scale_apart():
    """Gate and up halves whose weight blocks differ by 2^12 in scale: a half promoted with
    the other half's scale is off by that factor, far outside the tolerance."""
    x, w1, sx, sw, _, offs = _data(("two", [130, 70], 0, 256, 128), None)
    sw[:, 1] = sw[:, 1] * 4096.0  # W1 rows F.. (the up half) in their own block row
    h, _ = fc1(x, w1, sx, sw, offs, "silu", None)
    want = _emulate(x, w1, sx, sw, offs)
    assert _rel_err(h[:, :128], want[:, :128]) < 1e-2
    assert _rel_err(h[:, 128:], want[:, 128:]) < 1e-2


@gpu
@needs_cute
@pytest.mark.parametrize("config", _CONFIGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_block_glu_fc2_dgrad_matches_float64(case, config):
    """dA from block-quantized dY [M, H] and W2ᵀ [E, F, H]; dh and d(probs) against the
    reference GLU backward on the float64 emulation's dA; the re-emitted a is the activation
    of the saved (rounded) h, so it differs from the FC1's a (from its fp32 accumulators) by
    the rounding of h only; rows past offs[-1] zero."""
    act, il, p_dtype = config
    _, sizes, extra, hid, f = case
    x, w1, sx, sw, probs, offs = _data(case, p_dtype)
    h, a_fwd = fc1(x, w1, sx, sw, offs, act, il, probs)
    dy, w2t, sdy, sw2 = (t.cuda() for t in _quantized(x.shape[0], len(sizes), f, hid, seed=5))
    end = int(offs[-1])
    sdy[end:] = float("nan")  # rows past offs[-1]: their scales are never applied
    m = x.shape[0]
    poison(((m, 2 * f), torch.bfloat16), ((m, f), torch.bfloat16))
    dh, a, dprobs = cute.block_scaled_glu_fc2_dgrad(dy, w2t, sdy, sw2, offs, h, act, il, probs)
    assert dh.dtype == a.dtype == torch.bfloat16 and dh.shape == (m, 2 * f)
    da = _emulate(dy, w2t, torch.nan_to_num(sdy), sw2, offs)[:end]
    p64 = None if probs is None else probs[:end].double()
    dh_ref, dp_ref = reference.glu_backward(h[:end].double(), da, act, il, p64)
    assert _rel_err(dh[:end], dh_ref) < 1e-2
    assert _rel_err(a[:end], reference.glu_forward(h[:end].double(), act, il, p64)) < 4e-3
    assert _rel_err(a[:end], a_fwd[:end].double()) < 1e-2
    assert (dh[end:] == 0).all() and (a[end:] == 0).all()
    if probs is None:
        assert dprobs is None
    else:
        assert dprobs.dtype == probs.dtype and _rel_err(dprobs[:end], dp_ref) < 1e-2
        assert (dprobs[end:] == 0).all()


def test_dgrad_supports_names_the_problem():
    dy, w2t, sdy, sw2 = _quantized(10, 2, 128, 256)
    ok, why = cute.block_scaled_glu_fc2_dgrad.supports(dy, w2t, sdy, sw2, "tanh", None)
    assert not ok and "act 'tanh' has no fused epilogue" in why
    dy, w2t, sdy, sw2 = _quantized(10, 2, 64, 256)
    ok, why = cute.block_scaled_glu_fc2_dgrad.supports(dy, w2t, sdy, sw2, "silu", None)
    assert not ok and "F=64 must be a multiple of 128" in why
    h = torch.zeros(10, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cute block_scaled_glu_fc2_dgrad"):
        cute.block_scaled_glu_fc2_dgrad(dy, w2t, sdy, sw2, torch.tensor([5, 10], dtype=torch.int32),
                                        h, "silu", None)
