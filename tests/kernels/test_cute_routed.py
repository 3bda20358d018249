"""Routed rows in the CuTe DSL grouped GEMMs (``te_seq/kernels/cute/routed.py``): A rows gathered
from a token matrix by index (``grouped_mm`` / ``glu_fc1_forward`` / ``act_fc1_forward`` with
``gather_rows``) and C rows scattered by index (``grouped_mm(..., scatter_rows=)``).

Compile-only tests run without a GPU (CUTE_DSL_ARCH=sm_90a, in a subprocess); GPU tests compare
with float64 references of the same maths on the explicitly permuted rows, on fresh random data
with repeated token rows (top-k routing), empty experts, rows past the last expert, one expert and
unaligned row counts."""

from __future__ import annotations

import textwrap

import pytest
import torch
from cute_marks import compile_for_sm90a, gpu, needs_cute, needs_dsl
from cute_marks import offsets as _offs
from cute_marks import poison as _poison
from cute_marks import rel_err as _rel_err

from te_seq.kernels import reference
from te_seq.kernels.cute.launch import route_problem, route_rows

# ------------------------------------------------------------------ CPU: compile-only, errors

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import torch
    from te_seq.kernels.cute.compile import (
        ActConfig, GemmConfig, GluConfig, compile_act, compile_gemm, compile_glu)
    bf16, f32 = torch.bfloat16, torch.float32
    for cfg in [
        GemmConfig("m", bf16, bf16, "k", 256, (1, 1), route="gather"),
        GemmConfig("m", bf16, bf16, "n", 128, (2, 1), route="gather"),
        GemmConfig("m", bf16, bf16, "k", 192, (1, 2), route="scatter"),
        GemmConfig("m", bf16, bf16, "k", bias_dtype=f32, bias_scales=True, route="scatter"),
    ]:
        print(cfg, f"{compile_gemm(cfg).compile_s:.1f}s", flush=True)
    cfg = GluConfig("fc1", bf16, "k", "silu", None, f32, (1, 1), route="gather")
    print(cfg, f"{compile_glu(cfg).compile_s:.1f}s", flush=True)
    cfg = ActConfig("fc1", bf16, "k", "relu", None, (1, 1), route="gather")
    print(cfg, f"{compile_act(cfg).compile_s:.1f}s", flush=True)
    print("ALL COMPILED")
    """
)


@pytest.mark.slow  # ~20-40 s of DSL compiles; CI runs it, `-m "not slow"` quick runs skip it
@needs_dsl
def test_routed_kernels_compile_for_sm90a():
    compile_for_sm90a(_COMPILE_SCRIPT, timeout=900)


def test_route_checks_name_the_problem():
    assert route_problem("gather", 128) == ""
    assert "multiple of 64" in route_problem("gather", 200)
    assert route_problem("scatter", 200) == ""
    assert "unknown route" in route_problem("sideways", 64)
    idx = torch.tensor([3, 1, 2])
    assert route_rows(idx, 3, 4, "op", "gather").dtype == torch.int32
    with pytest.raises(ValueError, match="gather_rows must be a 1-D integer"):
        route_rows(idx.float(), 3, 4, "op", "gather")
    with pytest.raises(ValueError, match="scatter_rows has 3 entries, expected 5"):
        route_rows(idx, 5, None, "op", "scatter")


def test_grouped_mm_refuses_gather_and_scatter_together():
    from te_seq.kernels import cute

    a, b = torch.empty(4, 64, dtype=torch.bfloat16), torch.empty(1, 64, 64, dtype=torch.bfloat16)
    idx = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="cannot be combined"):
        cute.grouped_mm(a, b, torch.tensor([4]), gather_rows=idx, scatter_rows=idx)


# ------------------------------------------------------------------ GPU correctness

# (name, split sizes, extra rows past offs[-1], K, N)
_CASES = [
    ("one_expert", [300], 0, 256, 256),
    ("empty_experts_rows_past_end", [0, 77, 0, 0, 300, 5, 0], 40, 128, 384),
    ("unaligned", [1, 3, 129, 255, 257, 7, 513], 0, 192, 136),
]


def _token_rows(m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [T, K] token matrix (T = ceil(M / 2): each token feeds ~2 rows, as top-2 routing does)
    and the token index of each of M routed rows, shuffled."""
    t = max(1, (m + 1) // 2)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    idx = torch.arange(m, device="cuda") % t
    return x, idx[torch.randperm(m, device="cuda")]


@gpu
@needs_cute
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_grouped_mm_gathers_rows(case):
    from te_seq.kernels import cute

    _, sizes, extra, k, n = case
    m, e = sum(sizes) + extra, len(sizes)
    x, idx = _token_rows(m, k)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    offs = _offs(sizes)
    _poison(((m, n), torch.bfloat16))
    out = cute.grouped_mm(x, w.transpose(1, 2), offs, gather_rows=idx)
    ref = reference.grouped_mm(x[idx].double(), w.transpose(1, 2).double(), offs)
    assert out.shape == (m, n)
    assert _rel_err(out, ref) < 1e-2
    assert (out[offs[-1]:] == 0).all()
    direct = cute.grouped_mm(x[idx], w.transpose(1, 2), offs)  # same GEMM on the copied rows
    assert torch.equal(out, direct)


@gpu
@needs_cute
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_grouped_mm_scatters_rows(case, with_bias):
    from te_seq.kernels import cute

    _, sizes, extra, k, n = case
    m, e = sum(sizes) + extra, len(sizes)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    bias = 3 * torch.randn(e, n, device="cuda") if with_bias else None
    perm = torch.randperm(m, device="cuda")
    offs = _offs(sizes)
    _poison(((m, n), torch.bfloat16))
    out = cute.grouped_mm(a, w.transpose(1, 2), offs, bias=bias, scatter_rows=perm)
    plain = cute.grouped_mm(a, w.transpose(1, 2), offs, bias=bias)
    assert torch.equal(out[perm], plain)  # every row lands where the route says, bit for bit
    b64 = None if bias is None else bias.double()
    ref = reference.grouped_mm(a.double(), w.transpose(1, 2).double(), offs, bias=b64)
    assert _rel_err(out[perm], ref) < 1e-2


@gpu
@needs_cute
@pytest.mark.parametrize("config", [("silu", None, torch.float32), ("gelu", 64, None)], ids=str)
@pytest.mark.parametrize("case", _CASES[:2], ids=[c[0] for c in _CASES[:2]])
def test_glu_fc1_gathers_rows(case, config):
    from te_seq.kernels import cute

    act, il, p_dtype = config
    _, sizes, extra, h, f = case
    m, e = sum(sizes) + extra, len(sizes)
    x, idx = _token_rows(m, h)
    w1t = (torch.randn(e, 2 * f, h, device="cuda", dtype=torch.bfloat16) / h**0.5).transpose(1, 2)
    probs = None if p_dtype is None else torch.rand(m, device="cuda").to(p_dtype)
    offs = _offs(sizes)
    assert cute.glu_fc1_forward.supports(x, w1t, act, il, gather=True) == (True, "")
    h_out, a = cute.glu_fc1_forward(x, w1t, offs, act, il, probs, gather_rows=idx)
    h_dir, a_dir = cute.glu_fc1_forward(x[idx], w1t, offs, act, il, probs)
    assert torch.equal(h_out, h_dir) and torch.equal(a, a_dir)
    assert _rel_err(h_out, reference.grouped_mm(x[idx].double(), w1t.double(), offs)) < 1e-2


@gpu
@needs_cute
def test_act_fc1_gathers_rows():
    from te_seq.kernels import cute

    sizes, h, f = [0, 77, 300, 5, 0], 128, 192
    m, e = sum(sizes), len(sizes)
    x, idx = _token_rows(m, h)
    w1t = (torch.randn(e, f, h, device="cuda", dtype=torch.bfloat16) / h**0.5).transpose(1, 2)
    offs = _offs(sizes)
    h_out, a = cute.act_fc1_forward(x, w1t, offs, "relu", gather_rows=idx)
    h_dir, a_dir = cute.act_fc1_forward(x[idx], w1t, offs, "relu")
    assert torch.equal(h_out, h_dir) and torch.equal(a, a_dir)


@gpu
@needs_cute
def test_gather_refuses_k_off_the_k_tile():
    from te_seq.kernels import cute

    x = torch.randn(10, 136, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, 136, 64, device="cuda", dtype=torch.bfloat16)
    idx = torch.zeros(12, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="K=136 to be a multiple of 64"):
        cute.grouped_mm(x, w, _offs([6, 6]), gather_rows=idx)
