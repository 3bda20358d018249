"""The fused non-gated activation kernels of the CuTe DSL backend against te_seq.kernels.reference.

act_fc1_forward: (h, a) = (x_e W1_eᵀ, act(h)·probs); act_fc2_dgrad: (dh, a, dprobs) from
dA = dY_e W2_e with dh = dA·probs·act'(h), a = act(h)·probs, dprobs = Σ_j dA·act(h).
Compile-only tests run without a GPU (CUTE_DSL_ARCH=sm_90a, in a subprocess); GPU tests need
sm_90+ and compare with float64 references on fresh random data.
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
from te_seq.kernels.activations import act_epilogue_activations

# ------------------------------------------------------------------ CPU: compile-only, errors

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import torch
    from te_seq.kernels.cute.compile import ActConfig, compile_act
    bf16, fp16 = torch.bfloat16, torch.float16
    for cfg in [
        ActConfig("fc1", bf16, "k", "gelu", None),
        ActConfig("fc1", fp16, "n", "srelu", torch.float32, tile_n=192),
        ActConfig("dgrad", bf16, "n", "silu", None, tile_n=128),
        ActConfig("dgrad", bf16, "k", "relu", bf16),
        ActConfig("dgrad", fp16, "n", "qgelu", torch.float32, tile_n=192),
    ]:
        print(cfg, f"{compile_act(cfg).compile_s:.1f}s", flush=True)
    print("ALL COMPILED")
    """
)


@pytest.mark.slow  # ~8 s of DSL compiles; CI runs it, `-m "not slow"` quick runs skip it
@needs_dsl
def test_act_kernels_compile_for_sm90a():
    compile_for_sm90a(_COMPILE_SCRIPT, timeout=600)


def test_kernel_refuses_what_it_has_no_epilogue_for():
    pytest.importorskip("cutlass")
    from te_seq.kernels.cute.act_epilogue import ActGemmKernel

    with pytest.raises(ValueError, match="ActGemmKernel: act must be one of"):
        ActGemmKernel("fc1", "gelu_erf", False)
    with pytest.raises(ValueError, match="ActGemmKernel: mode must be 'fc1' or 'dgrad'"):
        ActGemmKernel("wgrad", "gelu", False)
    with pytest.raises(ValueError, match="ActGemmKernel: tile_n must be 128, 192 or 256"):
        ActGemmKernel("dgrad", "gelu", False, tile_n=64)


def _operands(h: int, f: int, dtype=torch.bfloat16):
    x = torch.randn(16, h, dtype=dtype)
    return x, torch.randn(2, h, f, dtype=dtype)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(act="gelu_erf"), "act 'gelu_erf' has no fused non-gated epilogue"),
        (dict(act="clamped_qgelu"), "act 'clamped_qgelu' has no fused non-gated epilogue"),
        (dict(dtype=torch.float32), "needs bf16/fp16 operands"),
        (dict(f=100), "F=100 must be a multiple of 8"),
        (dict(h=100), "H=100 must be a multiple of 8"),
        (dict(), "needs CUDA tensors"),
    ],
)
def test_supports_says_why(kwargs, match):
    from te_seq.kernels import cute

    x, w = _operands(kwargs.get("h", 64), kwargs.get("f", 96), kwargs.get("dtype", torch.bfloat16))
    for fn in (cute.act_fc1_forward, cute.act_fc2_dgrad):
        ok, why = fn.supports(x, w, kwargs.get("act", "gelu"))
        assert not ok and match in why, why


def test_calls_raise_with_the_reason():
    from te_seq.kernels import cute

    x, w = _operands(64, 96)
    offs = torch.tensor([8, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="cute act_fc1_forward: .*needs CUDA tensors"):
        cute.act_fc1_forward(x, w, offs, "silu")
    with pytest.raises(ValueError, match=r"cute act_fc2_dgrad: .*act 'sigmoid_erf'"):
        cute.act_fc2_dgrad(x, w, offs, torch.randn(16, 96), "sigmoid_erf")


# ------------------------------------------------------------------ GPU correctness





# (name, split sizes, extra rows past offs[-1], H, F). The tile width follows F (``tile_n_for``):
# 128 for F = 96 and 136, 192 for F = 384, 256 for F = 512; F = 136 and 200 leave a partial
# 32-column block, F = 96 is narrower than every tile.
_CASES = [
    ("one_expert", [300], 0, 256, 256),
    ("empty_experts_rows_past_end", [0, 77, 0, 0, 300, 5, 0], 40, 128, 384),
    ("unaligned", [1, 3, 129, 255, 257, 7, 513], 0, 192, 136),
    ("narrow_f", [200, 0, 321], 3, 64, 96),
    ("wide_f", [17, 400], 0, 72, 512),
    ("partial_block", [64, 130], 5, 128, 200),
]
# (act, probs dtype): every activation once with fp32 probs, then without and with bf16 probs
_CONFIGS = [(act, torch.float32) for act in act_epilogue_activations()]
_CONFIGS += [("gelu", None), ("srelu", torch.bfloat16), ("silu", None)]


def _data(case, probs_dtype, dtype=torch.bfloat16):
    _, sizes, extra, h, f = case
    m = sum(sizes) + extra
    x = torch.randn(m, h, device="cuda", dtype=dtype)
    w1 = torch.randn(len(sizes), f, h, device="cuda", dtype=dtype) / h**0.5
    w2 = torch.randn(len(sizes), h, f, device="cuda", dtype=dtype) / h**0.5
    probs = None if probs_dtype is None else torch.rand(m, device="cuda").to(probs_dtype)
    return x, w1, w2, probs, _offs(sizes)


def _scaled(y: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    return y if probs is None else y * probs.double()[:, None]


@gpu
@needs_cute
@pytest.mark.parametrize("config", _CONFIGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_fc1_forward_matches_reference(case, config):
    from te_seq.kernels import cute

    act, p_dtype = config
    x, w1, _, probs, offs = _data(case, p_dtype)
    w1t = w1.transpose(1, 2)
    assert cute.act_fc1_forward.supports(x, w1t, act) == (True, "")
    m, f = x.shape[0], w1.shape[1]
    _poison(((m, f), x.dtype), ((m, f), x.dtype))
    h, a = cute.act_fc1_forward(x, w1t, offs, act, probs)
    h_ref = reference.grouped_mm(x.double(), w1t.double(), offs)
    assert _rel_err(h, h_ref) < 1e-2
    # a is computed from the fp32 accumulators (one rounding, a's): the activation of the
    # exact h
    a_ref = _scaled(reference.act_forward(h_ref, act), probs)
    assert _rel_err(a, a_ref) < 1e-2
    end = offs[-1]
    assert (h[end:] == 0).all()
    torch.testing.assert_close(a[end:].double(), a_ref[end:], rtol=1e-2, atol=0)  # act(0)·p


@gpu
@needs_cute
@pytest.mark.parametrize("config", _CONFIGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_fc2_dgrad_matches_reference(case, config):
    from te_seq.kernels import cute

    act, p_dtype = config
    x, _, w2, probs, offs = _data(case, p_dtype)
    m, f = x.shape[0], w2.shape[2]
    dy = torch.randn_like(x)
    h = torch.randn(m, f, device="cuda", dtype=x.dtype)
    assert cute.act_fc2_dgrad.supports(dy, w2, act) == (True, "")
    _poison(((m, f), x.dtype), ((m, f), x.dtype))
    dh, a, dprobs = cute.act_fc2_dgrad(dy, w2, offs, h, act, probs)
    da = reference.grouped_mm(dy.double(), w2.double(), offs)
    fh = reference.act_forward(h.double(), act)
    assert _rel_err(dh, reference.act_backward(h.double(), _scaled(da, probs), act)) < 1e-2
    assert _rel_err(a, _scaled(fh, probs)) < 1e-2
    if probs is None:
        assert dprobs is None
    else:
        assert dprobs.dtype == probs.dtype and dprobs.shape == (m,)
        assert _rel_err(dprobs, (da * fh).sum(-1)) < 1e-2
        assert (dprobs[offs[-1] :] == 0).all()


@gpu
@needs_cute
def test_fp16_non_contiguous_input_and_functional_dispatch():
    """fp16 operands, a non-contiguous x and a K-major w2; te_seq.kernels' functionals on the
    cute backend agree with the reference backend's GEMM followed by its activation maths."""
    from te_seq import kernels

    cute, ref = kernels.get_backend("cute"), kernels.get_backend("reference")
    x, w1, w2, probs, offs = _data(_CASES[2], torch.float32, dtype=torch.float16)
    x_nc = torch.cat([x, torch.randn_like(x)], dim=1)[:, : x.shape[1]]  # row stride 2H
    assert not x_nc.is_contiguous()
    h, a = kernels.act_fc1_forward(x_nc, w1.transpose(1, 2), offs, "gelu", probs, cute)
    h2 = kernels.grouped_mm(x, w1.transpose(1, 2), offs, ref)
    a2 = ref.act_forward(h2, "gelu") * probs[:, None]
    assert _rel_err(h, h2) < 2e-3 and _rel_err(a, a2) < 2e-3
    dy = torch.randn_like(x)
    w2_k = w2.transpose(1, 2).contiguous().transpose(1, 2)  # same values, H contiguous
    dh, a, dp = kernels.act_fc2_dgrad(dy, w2_k, offs, h, "gelu", probs, cute)
    da = kernels.grouped_mm(dy, w2, offs, ref).float()
    dh2 = ref.act_backward(h.float(), da * probs[:, None], "gelu")
    fh = ref.act_forward(h, "gelu").float()
    assert _rel_err(dh, dh2) < 5e-3 and _rel_err(a, fh * probs[:, None]) < 2e-3
    assert _rel_err(dp, (da * fh).sum(-1)) < 5e-3


@gpu
@needs_cute
def test_cuda_graph_replays_with_new_split_sizes():
    from te_seq.kernels import cute

    h_dim, f, m = 128, 256, 1024
    x = torch.randn(m, h_dim, device="cuda", dtype=torch.bfloat16)
    w1t = (torch.randn(4, f, h_dim, device="cuda", dtype=torch.bfloat16) / 12).transpose(1, 2)
    offs = _offs([256, 256, 256, 256])
    cute.act_fc1_forward(x, w1t, offs, "relu")  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h, a = cute.act_fc1_forward(x, w1t, offs, "relu")
    for sizes in ([1000, 0, 24, 0], [0, 0, 0, 1024], [3, 500, 500, 21]):
        offs.copy_(_offs(sizes))
        h.fill_(float("nan"))
        a.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(h, reference.grouped_mm(x.double(), w1t.double(), offs)) < 1e-2
        assert _rel_err(a, reference.act_forward(h.double(), "relu")) < 1e-2
