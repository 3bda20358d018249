"""FC1 / FC2 biases in the fused grouped MLP: the GEMM kernels add them (``grouped_mm(...,
bias=, bias_scales=)``, ``glu_fc1_forward(..., bias=)``) and their gradients are one segmented
column sum (``Backend.group_col_sums``). CPU, float64: the kernel maths against explicit
per-expert loops, and the fused op against the unfused chain on the reference and torch
backends (outputs and every gradient), with empty experts and row-scaled biases."""

import pytest
import torch

import te_seq
from te_seq import ops
from te_seq.kernels import bias as bias_maths
from te_seq.kernels import get_backend
from te_seq.ops.basic.grouped_linear import GroupedLinear

F64 = torch.float64
SPLITS = torch.tensor([3, 0, 5, 1])  # an empty expert in the middle


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _loop_mm(a, b, offs, bias, scales):
    """a_e @ b_e + s_t b_e per expert, rows past the end zero."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=F64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        rows = a[start:end] @ b[e] + bias[e]
        if scales is not None:
            rows = a[start:end] @ b[e] + scales[start:end, None] * bias[e]
        out[start:end] = rows
        start = end
    return out


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("scaled", [False, True])
def test_grouped_mm_adds_the_bias_of_each_expert(backend, scaled):
    offs = torch.cumsum(SPLITS, 0).to(torch.int32)
    rows = int(SPLITS.sum()) + 2  # two rows past the last expert stay zero
    a, b, bias = _rand(rows, 6, seed=1), _rand(4, 6, 5, seed=2), _rand(4, 5, seed=3)
    scales = _rand(rows, seed=4) if scaled else None
    got = get_backend(backend).grouped_mm(a, b, offs, bias=bias, bias_scales=scales)
    torch.testing.assert_close(got, _loop_mm(a, b, offs, bias, scales), rtol=1e-12, atol=1e-12)
    assert torch.equal(got[-2:], torch.zeros(2, 5, dtype=F64))


def test_group_col_sums_is_the_bias_gradient():
    offs = torch.cumsum(SPLITS, 0).to(torch.int32)
    rows = int(SPLITS.sum()) + 1  # a row past the end is dropped
    dout, scales = _rand(rows, 7, seed=5), _rand(rows, seed=6)
    sums = get_backend("reference").group_col_sums(dout, offs, scales)
    bounds = [0, *offs.tolist()]
    for e in range(4):
        part = slice(bounds[e], bounds[e + 1])
        want = (dout[part] * scales[part, None]).sum(0)
        torch.testing.assert_close(sums[e], want, rtol=1e-12, atol=1e-12)
    assert torch.equal(sums[1], torch.zeros(7, dtype=F64))  # the empty expert
    plain = bias_maths.group_col_sums(dout, offs)
    torch.testing.assert_close(plain[2], dout[3:8].sum(0), rtol=1e-12, atol=1e-12)


def _mlp(single_bias: bool, scale_bias: bool):
    fc1 = ops.GroupedLinear(4, 8, 32, bias=True, single_grouped_bias=single_bias, dtype=F64)
    fc2 = ops.GroupedLinear(4, 16, 8, bias=True, scale_bias=scale_bias, dtype=F64)
    with torch.no_grad():  # non-zero biases (they initialise to zero)
        for i, (_, p) in enumerate(fc1.named_biases() + fc2.named_biases()):
            p.copy_(_rand(*p.shape, seed=20 + i))
    return te_seq.Sequential(fc1, ops.ScaledSwiGLU(), fc2)


def _run(seq, x, probs, scale_bias):
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    for p in seq.parameters():
        p.grad = None
    fc2_extra = (SPLITS, probs) if scale_bias else (SPLITS,)
    y = seq(x, SPLITS, probs, *fc2_extra)
    y.backward(_rand(*y.shape, seed=9))
    return [y.detach(), x.grad, probs.grad] + [p.grad for p in seq.parameters()]


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("single_bias", [False, True])
@pytest.mark.parametrize("scale_bias", [False, True])
def test_fused_mlp_with_biases_matches_the_unfused_chain(backend, single_bias, scale_bias):
    seq = _mlp(single_bias, scale_bias)
    x, probs = _rand(9, 8, seed=7), _rand(9, seed=8)
    with te_seq.backend(backend):
        fused = _run(seq, x, probs, scale_bias)
        (step,) = seq.fusion_plan().forward
        assert type(step.op).__name__ == "GroupedMLP"
        with te_seq.fusions_disabled("grouped_mlp"):
            unfused = _run(seq, x, probs, scale_bias)
    assert len(fused) == len(unfused)
    for i, (u, v) in enumerate(zip(fused, unfused)):
        assert u is not None and v is not None, i
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12, msg=f"output/grad {i}")


def test_fused_mlp_builds_no_bias_rows(monkeypatch):
    """The fused op hands the [G, N] biases to the kernels: GroupedLinear's [T, N] bias rows and
    its per-row bias gradient are never used."""

    def refuse(*args, **kwargs):
        raise AssertionError("the fused MLP must not build per-row bias tensors")

    seq = _mlp(single_bias=False, scale_bias=False)
    x, probs = _rand(9, 8, seed=7), _rand(9, seed=8)
    want = _run(seq, x, probs, False)  # plan built before the patch; values to compare
    monkeypatch.setattr(GroupedLinear, "bias_rows", refuse)
    monkeypatch.setattr(GroupedLinear, "bias_grads", refuse)
    got = _run(seq, x, probs, False)
    for u, v in zip(got, want):
        assert torch.equal(u, v)


def test_bias_problems_are_named():
    from te_seq.kernels.cute.launch import bias_problem

    cpu = torch.device("cpu")
    assert bias_problem(None, 4, 8, cpu) == ""
    assert bias_problem(torch.zeros(4, 8, dtype=torch.bfloat16), 4, 8, cpu) == ""
    assert "bias dtype torch.float64 unsupported" in bias_problem(torch.zeros(4, 8, dtype=F64), 4,
                                                                  8, cpu)
    assert "bias must be [E, N] = [4, 8], got (4, 16)" in bias_problem(torch.zeros(4, 16), 4, 8,
                                                                       cpu)
