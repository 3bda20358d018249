"""te_seq's kernels as custom ops (te_seq/kernels/traced.py): schemas, fake implementations and
results checked with `torch.library.opcheck`, on CPU for the reference and torch backends (the
GPU file test_compile_gpu.py runs the same ops on CUDA, cute included)."""

from __future__ import annotations

import pytest
import torch

from te_seq.kernels import reference, traced

E, M, K, N = 3, 10, 8, 16
SPLITS = [4, 0, 6]


def _operands(dtype=torch.float32):
    torch.manual_seed(0)
    offs = torch.cumsum(torch.tensor(SPLITS), 0, dtype=torch.int32)
    a = torch.randn(M, K, dtype=dtype)
    b = torch.randn(E, K, N, dtype=dtype)
    dy = torch.randn(M, N, dtype=dtype)
    return a, b, dy, offs


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_grouped_ops_pass_opcheck(backend):
    a, b, dy, offs = _operands()
    torch.library.opcheck(traced.grouped_mm_op.op, (a, b, offs, backend))
    torch.library.opcheck(traced.grouped_wgrad_op.op, (dy, a, offs, backend))
    out = torch.randn(E, N, K)
    torch.library.opcheck(traced.grouped_wgrad_into_op.op, (dy, a, offs, out, True, backend))


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_traced_backend_matches_the_backend(backend):
    a, b, dy, offs = _operands(torch.float64)
    inner = traced.get_backend(backend)
    wrapped = traced.traced(inner)
    assert traced.traced(inner) is wrapped and wrapped.name == backend
    assert torch.equal(wrapped.grouped_mm(a, b, offs), inner.grouped_mm(a, b, offs))
    assert torch.equal(wrapped.grouped_wgrad(dy, a, offs), inner.grouped_wgrad(dy, a, offs))
    for accumulate in (False, True):
        out1, out2 = (torch.ones(E, N, K, dtype=torch.float64) for _ in range(2))
        wrapped.grouped_wgrad(dy, a, offs, out=out1, accumulate=accumulate)
        inner.grouped_wgrad(dy, a, offs, out=out2, accumulate=accumulate)
        assert torch.equal(out1, out2)
    torch.testing.assert_close(wrapped.grouped_mm(a, b, offs), reference.grouped_mm(a, b, offs))


def test_glu_ops_reach_the_backend_with_spec_fields():
    """The GLU-epilogue ops take the GluSpec's fields as scalars and rebuild it (no CPU backend
    has these kernels: a backend without them raises the backend's own error)."""
    a, b, _, offs = _operands()
    with pytest.raises(NotImplementedError, match="glu_fc1_forward"):
        traced.glu_fc1_forward_op(a, b, offs, "silu", None, None, [], "reference")
    with pytest.raises(NotImplementedError, match="glu_fc2_dgrad"):
        traced.glu_fc2_dgrad_op(a, b, offs, a, "silu", 32, None, [], "torch")


class _Recorder:
    """A stand-in backend that records the GluSpec its GLU kernels get."""

    name = "recorder"

    def __init__(self) -> None:
        self.specs = []

    def glu_fc1_forward(self, x, w1t, offs, glu, probs=None):
        self.specs.append(glu)
        return x.new_zeros(x.shape[0], w1t.shape[2]), x.new_zeros(x.shape[0], w1t.shape[2] // 2)

    def glu_fc2_dgrad(self, dy, w2, offs, h, glu, probs=None):
        self.specs.append(glu)
        rows, f = dy.shape[0], w2.shape[2]
        return dy.new_zeros(rows, 2 * f), dy.new_zeros(rows, f), None


def test_glu_ops_carry_the_activation_parameters(monkeypatch):
    """A parameterized activation's values reach the backend through the custom ops (a dropped
    value would run the kernel with the defaults)."""
    from te_seq.kernels.activations import GluSpec

    recorder = _Recorder()
    monkeypatch.setattr(traced, "get_backend", lambda name: recorder)
    wrapped = traced.TracedBackend(recorder)
    a, b, _, offs = _operands()
    glu = GluSpec("clamped_qgelu", 4, (0.75, 1.25, 0.5))
    wrapped.glu_fc1_forward(a, b, offs, glu)
    wrapped.glu_fc2_dgrad(a, b, offs, a.new_zeros(M, 2 * N), glu)
    assert recorder.specs == [glu, glu]


class _ActRecorder:
    """A stand-in backend that records what its non-gated epilogue kernels get."""

    name = "act_recorder"

    def __init__(self) -> None:
        self.calls = []

    def act_fc1_forward(self, x, w1t, offs, act, probs=None):
        self.calls.append(("fc1", act, probs))
        return x.new_zeros(x.shape[0], w1t.shape[2]), x.new_ones(x.shape[0], w1t.shape[2])

    def act_fc2_dgrad(self, dy, w2, offs, h, act, probs=None):
        self.calls.append(("dgrad", act, probs))
        rows, f = dy.shape[0], w2.shape[2]
        dprobs = None if probs is None else probs + 1
        return dy.new_zeros(rows, f), dy.new_ones(rows, f), dprobs


def test_act_epilogue_ops_reach_the_backend(monkeypatch):
    """The non-gated epilogue kernels go through their custom ops with the activation's name
    and the probs; a missing d(probs) comes back as None, and a backend without the kernels
    raises its own error."""
    a, b, _, offs = _operands()
    with pytest.raises(NotImplementedError, match="act_fc1_forward"):
        traced.act_fc1_forward_op(a, b, offs, "gelu", None, "reference")
    recorder = _ActRecorder()
    monkeypatch.setattr(traced, "get_backend", lambda name: recorder)
    wrapped = traced.TracedBackend(recorder)
    probs = torch.rand(M, dtype=torch.float64)
    h, act_out = wrapped.act_fc1_forward(a, b, offs, "srelu", probs)
    assert h.shape == act_out.shape == (M, N) and torch.equal(act_out, torch.ones(M, N))
    dh, act_out, dprobs = wrapped.act_fc2_dgrad(a, b, offs, h, "relu")
    assert dh.shape == (M, N) and dprobs is None
    _, _, dprobs = wrapped.act_fc2_dgrad(a, b, offs, h, "relu", probs)
    assert torch.equal(dprobs, probs + 1)
    names = [c[:2] for c in recorder.calls]
    assert names == [("fc1", "srelu"), ("dgrad", "relu"), ("dgrad", "relu")]
    assert recorder.calls[0][2] is probs and recorder.calls[1][2] is None
