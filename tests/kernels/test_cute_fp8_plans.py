"""The FP8 functionals' per-call planning caches, on the CPU with the kernels stubbed
(benchmarks/profile_launch.py: ``stubbed_kernels``): the cute FP8 GEMMs' launch plans
(``cute.fp8``), the FP8 GLU steps' checks (``cute.fp8_glu``) and the quantization kernels'
choice (``fp8_quantize.reason``). Each is taken on a repeated identical call (counted, not
timed), not taken after a change of shape or dtype, and launches what a fresh plan launches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install "
                    "'te_seq[cute]')")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from aten_log import counting_calls
from profile_launch import stubbed_kernels, stubbed_step  # noqa: E402

from te_seq.core import fp8_gemm  # noqa: E402
from te_seq.kernels import cute, fp8_quantize  # noqa: E402
from te_seq.kernels import fp8_reference as ref  # noqa: E402
from te_seq.kernels.cute import fp8, fp8_glu  # noqa: E402
from te_seq.kernels.cute.launch_plan import clear_plans  # noqa: E402

E, K, N, M = 4, 128, 256, 96
FP8 = torch.float8_e4m3fn


def _offs(rows: int = M) -> torch.Tensor:
    return torch.tensor([rows // 4, rows // 2, rows // 2, rows], dtype=torch.int32)


def _facts(args: tuple) -> list:
    """A launch's arguments as comparable facts (tensors: dtype, shape, strides)."""
    return [(a.dtype, tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a
            for a in args]




def _mm_operands(rows: int = M, k: int = K, a_dtype=FP8):
    a = torch.randn(rows, k).to(a_dtype)
    b = torch.randn(E, N, k).to(FP8)
    return a, b, torch.rand(rows) + 0.5, torch.rand(E, N) + 0.5


def test_scaled_mm_plan_is_taken_on_identical_calls_only(monkeypatch):
    checks = counting_calls(monkeypatch, fp8, "supports_scaled")
    with stubbed_kernels() as stubs:
        a, b, sa, sb = _mm_operands()
        for _ in range(3):
            cute.scaled_grouped_mm(a, b, sa, sb, _offs())
        assert len(checks) == 1 and len(fp8._MM_PLANS) == 1
        cute.scaled_grouped_mm(*_mm_operands(rows=M + 32), _offs(M + 32))  # new M
        cute.scaled_grouped_mm(*_mm_operands(k=K + 16), _offs())  # new K
        cute.scaled_grouped_mm(*_mm_operands(a_dtype=torch.float8_e5m2), _offs())  # new dtype
        assert len(checks) == 4 and len(fp8._MM_PLANS) == 4
        (stub,) = [s for cfg, s in stubs.items() if cfg.a_dtype is None and s.calls]
        launches = stub.calls[:3]
        clear_plans()
        cute.scaled_grouped_mm(a, b, sa, sb, _offs())  # planned afresh: the same launch
        assert len(checks) == 5
    assert _facts(launches[0]) == _facts(launches[2]) == _facts(stub.calls[-1])
    # the operands are passed as they are: the planned call reads the caller's tensors
    assert launches[2][0].data_ptr() == a.data_ptr() and launches[2][6].data_ptr() == sb.data_ptr()


def test_scaled_mm_plan_never_skips_a_failing_check():
    with stubbed_kernels():
        a, b, sa, sb = _mm_operands()
        for _ in range(2):
            with pytest.raises(ValueError, match="b_scale must be float32"):
                cute.scaled_grouped_mm(a, b, sa, sb.double(), _offs())
        assert len(fp8._MM_PLANS) == 0


def _wgrad_operands(n: int = N):
    p = 512  # padded token spans of 128
    a, b = torch.randn(n, p).to(FP8), torch.randn(K, p).to(FP8)
    offs = torch.tensor([128, 256, 384, 512], dtype=torch.int32)
    return a, b, torch.rand(E, n), torch.rand(E, K), offs


def test_scaled_wgrad_plan_is_taken_on_identical_calls_only(monkeypatch):
    checks = counting_calls(monkeypatch, fp8, "supports_scaled_wgrad")
    with stubbed_kernels() as stubs:
        ops = _wgrad_operands()
        for _ in range(3):
            cute.scaled_grouped_wgrad(*ops)
        assert len(checks) == 1
        out = torch.zeros(E, N, K)
        cute.scaled_grouped_wgrad(*ops, out=out, accumulate=True)  # new out dtype, accumulate
        cute.scaled_grouped_wgrad(*_wgrad_operands(n=N + 16))  # new N
        assert len(checks) == 3 and len(fp8._WGRAD_PLANS) == 3
        accumulating = [cfg for cfg, s in stubs.items() if s.calls and cfg.accumulate]
        assert len(accumulating) == 1 and accumulating[0].c_dtype == torch.float32
        with pytest.raises(ValueError, match="out must be a contiguous"):
            cute.scaled_grouped_wgrad(*ops, out=torch.zeros(E, N, K + 16))


def test_fp8_glu_checks_are_cached_per_signature(monkeypatch):
    checks = counting_calls(monkeypatch, fp8_glu, "_check")
    x, w1 = torch.randn(M, K).to(FP8), torch.randn(E, N, K).to(FP8)
    xs, ws = torch.rand(M), torch.rand(E, N)
    with stubbed_kernels():
        for _ in range(3):
            cute.scaled_glu_fc1_forward(x, w1, xs, ws, _offs(), "silu", None)
        assert len(checks) == 1
        cute.scaled_glu_fc1_forward(x[: M // 2], w1, xs[: M // 2], ws, _offs(M // 2), "silu",
                                    None)  # new M
        assert len(checks) == 2
        for _ in range(2):  # a failing check is made on every call
            with pytest.raises(ValueError, match="x_scale must be float32"):
                cute.scaled_glu_fc1_forward(x, w1, xs.double(), ws, _offs(), "silu", None)
        assert len(checks) == 4


def test_quantization_choice_is_decided_once_per_facts(monkeypatch):
    problems = counting_calls(monkeypatch, cute, "quant_problem")
    rule = ref.ScaleRule("E4M3", 0, False)
    t = torch.randn(8, 64).to(torch.bfloat16)
    first = fp8_quantize.reason(t, ref.ROWWISE, rule, "cute")
    assert fp8_quantize.reason(torch.randn(16, 64).to(torch.bfloat16), ref.ROWWISE, rule,
                               "cute") == first  # other rows: the same facts
    assert len(problems) == 1 and "CUDA" in first
    fp8_quantize.reason(torch.randn(8, 48).to(torch.bfloat16), ref.ROWWISE, rule, "cute")
    fp8_quantize.reason(t.half(), ref.ROWWISE, rule, "cute")
    fp8_quantize.reason(t, ref.ROWWISE, ref.ScaleRule("E5M2", 0, False), "cute")
    assert len(problems) == 4
    assert fp8_quantize.reason(t, ref.ROWWISE, rule, "torch") == \
        "the torch backend quantizes with torch"
    fp8_gemm.clear_decisions()  # what tests faking a GPU rely on
    fp8_quantize.reason(t, ref.ROWWISE, rule, "cute")
    assert len(problems) == 5


def test_span_table_is_cached_on_the_offsets_until_they_change():
    offs = _offs()
    table = fp8_quantize.span_table(offs, M)
    assert fp8_quantize.span_table(offs, M) is table
    assert fp8_quantize.span_table(_offs(), M) is not table  # another tensor
    assert fp8_quantize.span_table(offs, M + 8) is not table  # other rows
    offs[1] += 1  # an in-place write: its version changes
    rebuilt = fp8_quantize.span_table(offs, M)
    assert rebuilt is not table and torch.equal(rebuilt[0], fp8_quantize._build_table(offs, M)[0])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes (FP8 tensors compare bitwise, nan included)."""
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()


def test_scaled_mm_plan_copies_what_each_layout_needs():
    """A strided a, an N-major b, strided scales and int64 offsets are made contiguous int32 by
    the plan, on its first call and on the planned ones: the launch reads what a call with
    contiguous operands reads (layout and values); contiguous operands are passed as given."""
    with stubbed_kernels() as stubs:
        a, b, sa, sb = _mm_operands()
        wide_a = torch.cat([a.view(torch.uint8), a.view(torch.uint8)], 1).view(FP8)[:, :K]
        n_major_b = b.transpose(1, 2).contiguous().transpose(1, 2)  # [E, N, K], N contiguous
        strided_sa, strided_sb = torch.stack([sa, sa], 1)[:, 0], torch.stack([sb, sb], 2)[..., 0]
        cute.scaled_grouped_mm(a, b, sa, sb, _offs())
        (stub,) = [s for s in stubs.values() if s.calls]
        plain = stub.calls[-1]
        for _ in range(2):
            cute.scaled_grouped_mm(wide_a, n_major_b, strided_sa, strided_sb, _offs().long())
            got = stub.calls[-1]
            assert _facts(got) == _facts(plain)
            for i in (0, 1, 3, 5, 6):  # a, b's view, offs, the scales (2: the new output)
                assert torch.equal(_bits(got[i]), _bits(plain[i]))
        assert len(fp8._MM_PLANS) == 2
        cute.scaled_grouped_mm(a, b, sa, sb, _offs())
        assert stub.calls[-1][0] is a and stub.calls[-1][5] is sa  # passed as given


def test_scaled_mm_and_wgrad_refuse_bad_offsets_on_every_call():
    """offs that do not fit are refused on every call, with the same message, and never
    planned (the plan is made only after every check passed)."""
    with stubbed_kernels():
        a, b, sa, sb = _mm_operands()
        for _ in range(2):
            with pytest.raises(ValueError, match=r"offs must be 1-D of length 4, got shape \(3,\)"):
                cute.scaled_grouped_mm(a, b, sa, sb, _offs()[:3])
        assert len(fp8._MM_PLANS) == 0
        a, b, sa, sb, offs = _wgrad_operands()
        for _ in range(2):
            with pytest.raises(ValueError, match="offs must be 1-D"):
                cute.scaled_grouped_wgrad(a, b, sa, sb, offs[:, None])
        assert len(fp8._WGRAD_PLANS) == 0


def test_scaled_wgrad_plan_copies_strided_operands():
    """Token-major operands given as strided views are copied row-major by the plan: the
    launch reads what contiguous ones give; a new layout is a new plan."""
    with stubbed_kernels() as stubs:
        a, b, sa, sb, offs = _wgrad_operands()
        cute.scaled_grouped_wgrad(a, b, sa, sb, offs)
        (stub,) = [s for s in stubs.values() if s.calls]
        plain = stub.calls[-1]
        wide_b = torch.cat([b.view(torch.uint8)] * 2, 1).view(FP8)[:, : b.shape[1]]
        for _ in range(2):
            cute.scaled_grouped_wgrad(a, wide_b, sa, sb, offs.long())
            assert _facts(stub.calls[-1]) == _facts(plain)
            assert torch.equal(_bits(stub.calls[-1][1]), _bits(plain[1]))
        assert len(fp8._WGRAD_PLANS) == 2


def test_fp8_glu_copies_an_n_major_weight_as_before(monkeypatch):
    """The FP8 GLU FC1's checked signature keeps whether w must be copied K-major: an N-major
    w1 launches as a contiguous one does (first and planned calls alike), and the checks run
    once per signature."""
    checks = counting_calls(monkeypatch, fp8_glu, "_check")
    x, w1 = torch.randn(M, K).to(FP8), torch.randn(E, N, K).to(FP8)
    xs, ws = torch.rand(M), torch.rand(E, N)
    n_major = w1.transpose(1, 2).contiguous().transpose(1, 2)
    with stubbed_kernels() as stubs:
        cute.scaled_glu_fc1_forward(x, w1, xs, ws, _offs(), "silu", None)
        (stub,) = [s for s in stubs.values() if s.calls]
        plain = stub.calls[-1]
        for _ in range(2):
            cute.scaled_glu_fc1_forward(x, n_major, xs, ws, _offs(), "silu", None)
            assert _facts(stub.calls[-1]) == _facts(plain)
            assert torch.equal(_bits(stub.calls[-1][1]), _bits(plain[1]))
        assert len(checks) == 2


def test_span_quantization_plan_per_signature():
    """`quantize_spans` plans its kernels per signature of t: a strided t is copied row-major
    (the launch reads what a contiguous t gives, planned or not), another width is another
    plan; a call that launches nothing (no tokens) makes none."""
    from te_seq.kernels.cute import quant

    t = torch.randn(M, K).to(torch.bfloat16)
    table, _ = fp8_quantize.span_table(_offs(), M)
    with stubbed_step(record=True) as stubs:
        quant.quantize_spans(t, table, E)
        launched = [s for s in stubs.values() if s.calls]
        plain = [s.calls[-1] for s in launched]
        strided = torch.cat([t, t], 1)[:, :K]
        for _ in range(2):
            quant.quantize_spans(strided, table, E)
            got = [s.calls[-1] for s in launched]
            assert [_facts(g) for g in got] == [_facts(p) for p in plain]
            assert all(torch.equal(g[0], p[0]) for g, p in zip(got, plain))
        assert len(quant._QUANT_PLANS) == 2
        quant.quantize_spans(torch.randn(M, K + 16).to(torch.bfloat16), table, E)
        assert len(quant._QUANT_PLANS) == 3
        quant.quantize_spans(t[:, :0], table, E)  # no columns: no kernel
        quant.quantize_spans(t, table[:0], E)  # no blocks: no kernel
        assert len(quant._QUANT_PLANS) == 3


@pytest.mark.parametrize("kind", ["rows", "rows_group_amax", "spans_from_amax"])
def test_row_quantization_plans_copy_strided_inputs(kind):
    """The row-wise quantizers plan their kernel (and the group-amax kernel its CTA slices)
    per signature of t: a strided t launches as a contiguous one does, on its first and its
    planned calls; a new width is a new plan."""
    from te_seq.kernels.cute import quant

    table, _ = fp8_quantize.span_table(_offs(), M)

    def call(t):
        if kind == "rows":
            return quant.quantize_rows(t)
        if kind == "rows_group_amax":
            return quant.quantize_rows_and_group_amax(t, table, E)
        return quant.quantize_spans_from_group_amax(t, table, torch.rand(E, t.shape[1]))

    t = torch.randn(M, K).to(torch.bfloat16)
    with stubbed_step(record=True) as stubs:
        call(t)
        (stub,) = [s for s in stubs.values() if s.calls]
        plain = stub.calls[-1]
        for _ in range(2):
            call(torch.cat([t, t], 1)[:, :K])
            assert _facts(stub.calls[-1]) == _facts(plain)
            assert torch.equal(stub.calls[-1][0], plain[0])
        assert len(quant._QUANT_PLANS) == 2
        call(torch.randn(M, K + 16).to(torch.bfloat16))
        assert len(quant._QUANT_PLANS) == 3


@pytest.mark.parametrize("strided", [False, True])
def test_a_prepared_row_quantization_launches_what_the_functional_launches(strided):
    """`quant.quantize_rows_launch` launches `quantize_rows`' kernel with the same arguments
    (a strided t copied row-major the same way), also after `clear_plans`; an empty t
    launches nothing."""
    from te_seq.kernels.cute import quant
    from te_seq.kernels.cute.launch_plan import clear_plans

    t = torch.randn(M, K).to(torch.bfloat16)
    if strided:
        t = torch.cat([t, t], 1)[:, :K]
    with stubbed_step(record=True) as stubs:
        launch = quant.quantize_rows_launch(t)
        quant.quantize_rows(t)
        (stub,) = [s for s in stubs.values() if s.calls]
        direct = stub.calls[-1]
        data, scale_inv = launch(t)
        prepared = stub.calls[-1]
        clear_plans()
        launch(t)
        again = stub.calls[-1]
        empty = t[:0]
        launched = len(stub.calls)
        none_data, none_scales = quant.quantize_rows_launch(empty)(empty)
        assert len(stub.calls) == launched
    assert _facts(direct) == _facts(prepared) == _facts(again)
    assert all(torch.equal(a, b) for a, b in zip(direct[:1], prepared[:1]))
    assert data.shape == (M, K) and data.dtype == torch.float8_e4m3fn
    assert scale_inv.shape == (M, 1) and none_data.shape == (0, K) and none_scales.shape == (0, 1)
