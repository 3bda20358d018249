"""FC1 without its pre-activation (``store_h=False``): a forward whose backward never runs
(no_grad, inference, everything frozen) need not write h [M, 2F]. The activation a must equal
the h-writing kernel's bit for bit (the same accumulators, h rounded to bf16 before the
activation as always), and nothing may be stored through the kernel's h operand (the functional
passes a itself there, so a stray h store would corrupt a); ``TE_SEQ_FC1_KEEP_H=1`` writes h
all the same (the same h). 16-bit and row-wise FP8 operands, ping-pong and cooperative tilings,
rows gathered by index (the MoE block).
Compile-only tests run on CPU; GPU tests need sm_90+.
"""

from __future__ import annotations

import contextlib
import textwrap

import pytest
import torch
from cute_marks import compile_for_sm90a, gpu, needs_cute, needs_dsl
from cute_marks import offsets as _offs
from cute_marks import poison as _poison

from te_seq.kernels import fp8_reference as fp8ref

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import torch
    from te_seq.kernels.cute.compile import GluConfig, compile_glu
    bf16, fp32, fp8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
    for cfg in [
        GluConfig("fc1", bf16, "k", "silu", None, fp32, (1, 2), tile_n=128, pingpong=True,
                  store_h=False),
        GluConfig("fc1", bf16, "k", "gelu", 32, None, store_h=False),  # cooperative 256 wide
        GluConfig("fc1", fp8, "k", "silu", None, fp32, tile_n=128, scaled=True, pingpong=True,
                  store_h=False),
        GluConfig("fc1", bf16, "k", "silu", None, fp32, (2, 1), route="gather", store_h=False),
    ]:
        print(cfg, f"{compile_glu(cfg).compile_s:.1f}s", flush=True)
    refusals = [
        (GluConfig("dgrad", bf16, "n", "silu", None, fp32, store_h=False),
         "store_h=False is an fc1 option"),
        (GluConfig("fc1", fp8, "k", "silu", None, fp32, tile_n=128, block_scaled=True,
                   store_h=False), "h stored"),
    ]
    for bad, reason in refusals:
        try:
            compile_glu(bad)
        except ValueError as exc:
            assert reason in str(exc), exc
        else:
            raise AssertionError(f"{bad} compiled")
    print("ALL COMPILED")
    """
)


@pytest.mark.slow  # DSL compiles in a subprocess
@needs_dsl
def test_fc1_without_h_compiles_for_sm90a():
    compile_for_sm90a(_COMPILE_SCRIPT, timeout=600)


# (name, split sizes, extra rows past offs[-1], H, F)
_CASES = [
    ("one_expert", [300], 0, 256, 256),
    ("empty_experts_rows_past_end", [0, 77, 0, 0, 300, 5, 0], 40, 128, 384),
    ("unaligned", [1, 3, 129, 255, 257, 7, 513], 9, 192, 128),
]
# (act, interleave, probs dtype)
_CONFIGS = [("silu", None, torch.float32), ("silu", None, None), ("gelu", 32, torch.bfloat16)]
_TILINGS = ["pingpong", "cooperative"]


def _rows(case, dtype=torch.bfloat16):
    """(x [M, H] with rows H + 16 elements apart, w1 [E, 2F, H], split sizes, offs)."""
    _, sizes, extra, h, f = case
    m = sum(sizes) + extra
    x = torch.randn(m, h + 16, device="cuda", dtype=dtype)[:, :h]  # not contiguous
    w1 = torch.randn(len(sizes), 2 * f, h, device="cuda", dtype=dtype) / h**0.5
    return x, w1, sizes, _offs(sizes)


def _probs(m: int, dtype):
    return None if dtype is None else (torch.rand(m, device="cuda") + 0.25).to(dtype)


def _quantized_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 data, fp32 [rows] dequantization scales) of t [..., C], one scale per row."""
    q = fp8ref.quantize(t.reshape(-1, t.shape[-1]), fp8ref.ROWWISE, fp8ref.ScaleRule())
    return q.data.reshape(t.shape), q.scale_inv.reshape(t.shape[:-1]).contiguous()


def _fc1_call(operands: str, case, act: str, il, p_dtype):
    """(fc1(store_h) -> (h, a), a's shape, a's dtype, rows in groups) on fresh random data:
    the 16-bit functional on a non-contiguous bf16 x, or the FP8 one on row-wise E4M3
    operands."""
    from te_seq.kernels import cute

    if operands == "bf16":
        x, w1, sizes, offs = _rows(case)
        probs = _probs(x.shape[0], p_dtype)
        w1t = w1.transpose(1, 2)

        def fc1(store_h):
            return cute.glu_fc1_forward(x, w1t, offs, act, il, probs, store_h=store_h)
    else:
        x16, w16, sizes, offs = _rows(case, torch.float32)
        (x, sx), (w1, sw1) = _quantized_rows(x16.contiguous()), _quantized_rows(w16)
        probs = _probs(x.shape[0], p_dtype)

        def fc1(store_h):
            return cute.scaled_glu_fc1_forward(x, w1, sx, sw1, offs, act, il, probs,
                                               store_h=store_h)
    return fc1, (x.shape[0], w1.shape[1] // 2), torch.bfloat16, sum(sizes)


@gpu
@needs_cute
@pytest.mark.parametrize("operands", ["bf16", "fp8"])
@pytest.mark.parametrize("tiling", _TILINGS)
@pytest.mark.parametrize("config", _CONFIGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_fc1_without_h_gives_the_same_a(tiling_env, case, config, tiling, operands):
    """a bit for bit (no h store landed in it, since the h-less kernel's h operand is a), and
    no h."""
    tiling_env("TE_SEQ_PINGPONG", "0" if tiling == "cooperative" else None)
    fc1, a_shape, a_dtype, end = _fc1_call(operands, case, *config)
    h, a = fc1(True)
    _poison((a_shape, a_dtype))  # a of the next call starts as NaN
    no_h, a_only = fc1(False)
    assert no_h is None
    assert torch.equal(a_only, a)
    assert (a_only[end:] == 0).all() and a_only[:end].abs().sum() > 0
    assert h[:end].abs().sum() > 0  # the reference call did write h


@gpu
@needs_cute
@pytest.mark.parametrize("p_dtype", [torch.float32, None], ids=["probs", "no_probs"])
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_gathered_fc1_without_h_gives_the_same_a(case, p_dtype):
    """FC1 over gathered rows (x a token matrix, row r of the GEMM x[gather_rows[r]], tokens
    repeated and skipped as a top-k routing does): a bit for bit with and without h, no h."""
    from te_seq.kernels import cute

    _, sizes, extra, h, f = case
    rows = sum(sizes) + extra
    tokens = torch.randn(rows // 2 + 3, h + 16, device="cuda", dtype=torch.bfloat16)[:, :h]
    gather = torch.randint(0, tokens.shape[0], (rows,), device="cuda", dtype=torch.int32)
    w1t = (torch.randn(len(sizes), 2 * f, h, device="cuda", dtype=torch.bfloat16)
           / h**0.5).transpose(1, 2)
    probs, offs = _probs(rows, p_dtype), _offs(sizes)

    def fc1(store_h):
        return cute.glu_fc1_forward(tokens, w1t, offs, "silu", None, probs, gather_rows=gather,
                                    store_h=store_h)

    hh, a = fc1(True)
    _poison(((rows, f), torch.bfloat16))  # a of the next call starts as NaN
    no_h, a_only = fc1(False)
    assert no_h is None
    assert torch.equal(a_only, a)
    end = sum(sizes)
    assert (a_only[end:] == 0).all() and a_only[:end].abs().sum() > 0
    assert hh[:end].abs().sum() > 0


@gpu
@needs_cute
def test_keep_h_setting_writes_h_all_the_same(tiling_env):
    """``TE_SEQ_FC1_KEEP_H=1``: an FC1 asked not to write h writes (and returns) it, equal to
    the h of a call that wanted it; the setting is read into the plans' signatures."""
    from te_seq.kernels import cute

    x, w1, sizes, offs = _rows(_CASES[1])
    probs = _probs(x.shape[0], torch.float32)
    w1t = w1.transpose(1, 2)
    h, a = cute.glu_fc1_forward(x, w1t, offs, "silu", None, probs)
    tiling_env("TE_SEQ_FC1_KEEP_H", "1")
    kept, a_kept = cute.glu_fc1_forward(x, w1t, offs, "silu", None, probs, store_h=False)
    assert torch.equal(kept, h) and torch.equal(a_kept, a)
    tiling_env("TE_SEQ_FC1_KEEP_H", None)
    assert cute.glu_fc1_forward(x, w1t, offs, "silu", None, probs, store_h=False)[0] is None


def _mlp(e: int, hidden: int, ffn: int):
    import te_seq
    from te_seq import ops

    kw = {"device": "cuda", "dtype": torch.bfloat16, "single_grouped_weight": True}
    return te_seq.Sequential(ops.GroupedLinear(e, hidden, 2 * ffn, bias=False, **kw),
                             ops.ScaledSwiGLU(),
                             ops.GroupedLinear(e, ffn, hidden, bias=False, **kw))


@gpu
@needs_cute
@pytest.mark.parametrize("recipe", [None, "Float8RowwiseScaling"])
def test_fused_mlp_without_grad_equals_its_training_forward(recipe):
    """The fused MLP under no_grad (FC1 without h, on the full path and the fast path) gives
    the training forward's y bit for bit, and a training step after it still has its h."""
    import te_seq

    torch.manual_seed(0)
    sizes = [0, 77, 300, 5, 129, 0, 257, 256]
    mlp = _mlp(len(sizes), 256, 128)
    x = torch.randn(sum(sizes), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(sum(sizes), device="cuda", requires_grad=True)
    splits = torch.tensor(sizes, device="cuda")
    fp8 = te_seq.autocast(recipe=getattr(te_seq.recipe, recipe)()) if recipe \
        else contextlib.nullcontext()

    def run():
        with te_seq.backend("cute"), fp8:
            return mlp(x, splits, probs, splits)

    trained = run()
    trained.sum().backward()
    for _ in range(2):  # full path, then fast path
        with torch.no_grad():
            assert torch.equal(run(), trained.detach())
    again = run()
    again.sum().backward()  # the grad signature's steady FC1 still saves h for backward
    assert torch.equal(again, trained)


@gpu
@needs_cute
def test_moe_block_without_grad_equals_its_training_forward():
    """The MoE block under no_grad (its gathered FC1 without h) gives the training forward's
    y bit for bit, and a training step after it still has its h."""
    import te_seq
    from te_seq import ops

    torch.manual_seed(0)
    e, hidden, ffn, t, k = 8, 256, 128, 300, 2
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    block = te_seq.Sequential(ops.ExpertDispatch(e),
                              ops.GroupedLinear(e, hidden, 2 * ffn, bias=False, **kw),
                              ops.ScaledSwiGLU(),
                              ops.GroupedLinear(e, ffn, hidden, bias=False, **kw),
                              ops.ExpertCombine())
    logits = torch.randn(t, e, device="cuda")
    logits[:, 3] = -1e9  # expert 3 never chosen: an empty group
    probs, indices = torch.softmax(logits, -1).topk(k)
    probs = probs.bfloat16().requires_grad_()
    x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def run():
        with te_seq.backend("cute"):
            return block(x, indices, probs)

    trained = run()
    trained.sum().backward()
    assert [s.name for s in block.fusion_plan().forward] == ["MoeBlock"]
    for _ in range(2):
        with torch.no_grad():
            assert torch.equal(run(), trained.detach())
    again = run()
    again.sum().backward()
    assert torch.equal(again, trained)
