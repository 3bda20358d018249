"""The one-read token-major FP8 cast (te_seq/kernels/cute/strip_kernels.py, functional
`cute.quantize_spans_in_strips`) and the dispatch that takes it (`fp8_quantize.strips_reason`).

CPU: the host's rule (mean tokens per group), the dispatch reason, every config compiles for
sm_90a and assembles without spilling much. GPU: bit for bit `fp8_wgrad.quantize_token_major`
and the span pair on fresh random data (bf16 and fp16, E4M3 / E5M2, power-of-two scales, nan
and inf, empty groups, one group, groups of more than one 512-token strip, rows past the last
group, unaligned sizes, column counts that leave a partial 64-column chunk, a strided input),
the zeros past the last span over a garbage-filled allocator, and a CUDA graph replayed with new
offsets."""

import pytest
import torch
from cute_marks import (
    compile_quant_for_sm90a,
    gpu,
    needs_cute,
    needs_dsl,
    needs_ptxas,
    offsets,
    ptxas_usage,
)
from test_cute_quant import SPAN_CASES, eager_quantize, same_bits

from te_seq.kernels import cute, fp8_quantize, fp8_wgrad
from te_seq.kernels import fp8_reference as ref

E4M3 = ref.ScaleRule("E4M3")
RULES = {"scale": E4M3, "pow2": ref.ScaleRule("E4M3", power_of_two=True),
         "e5m2": ref.ScaleRule("E5M2")}
STRIP_CASES = {**SPAN_CASES,
               "two_strips_and_a_bit": ([1030, 512, 0, 513], 2100),  # 3, 1, 0 and 2 windows
               "many_small": ([int(n) for n in torch.randint(
                   0, 300, (128,), generator=torch.Generator().manual_seed(3))], 20000)}
# cases the dispatch takes the strips for (over 256 and up to 512 tokens a group on average)
DISPATCH_CASES = {"full_strips": ([512, 500, 512], 1530),
                  "windows_of_long_groups": ([1030, 600, 0, 400], 2040),  # 3, 2, 0, 1 windows
                  "rows_past_the_end": ([300, 0, 500, 400], 1500)}


def test_strips_fit_over_256_and_up_to_512_tokens_per_group_on_average():
    assert cute.strips_fit(512 * 128, 128)  # shape B: 512 a group
    assert cute.strips_fit(257 * 128, 128)
    assert not cute.strips_fit(256 * 128, 128)  # Q, Z (skewed, 256 on average)
    assert not cute.strips_fit(512 * 128 + 1, 128)
    assert not cute.strips_fit(4096 * 8, 8)  # A: the span pair
    assert not cute.strips_fit(10, 0)


def test_strips_reason_names_the_mean_group(monkeypatch):
    t = torch.randn(2000, 32, dtype=torch.bfloat16)
    assert "torch backend" in fp8_quantize.strips_reason(t, torch.tensor([9]), E4M3, "torch")
    monkeypatch.setattr(fp8_quantize, "reason", lambda *args: "")  # as on a GPU with the DSL

    def why(groups: int) -> str:
        return fp8_quantize.strips_reason(t, torch.zeros(groups, dtype=torch.int32), E4M3,
                                          "cute")

    assert why(5) == ""  # 400 a group
    for groups in (2, 16):  # 1000 and 125 a group
        assert why(groups).startswith(f"2000 tokens in {groups} groups: not over 256 and up "
                                      "to 512"), why(groups)


@needs_dsl
@pytest.mark.slow
def test_strip_cast_compiles_for_sm90a():
    compile_quant_for_sm90a("strip_cast")


@pytest.mark.slow  # DSL compile and ptxas in a subprocess
@needs_dsl
@needs_ptxas
def test_strip_cast_fits_two_ctas_an_sm(tmp_path):
    """At most 128 registers a thread (two 256-thread CTAs an SM hold each other's loads in
    flight), spilling no more than the few bytes measured when the cap was set."""
    regs, spilled = ptxas_usage(("quant_strip_cast",), tmp_path)["quant_strip_cast"]
    assert regs <= 128 and spilled <= 128, (regs, spilled)


# ---------------------------------------------------------------- GPU: bit for bit


def _input(rows: int, cols: int, dtype=torch.bfloat16) -> torch.Tensor:
    t = torch.randn(rows, cols, device="cuda") * torch.logspace(-2, 2, max(rows, 1),
                                                                device="cuda")[:rows, None]
    t = t.to(dtype)
    if rows > 600:
        t[7, 3] = float("nan")
        t[599, min(100, cols - 1)] = float("-inf")  # a column of a second-window row
    return t


def _strips(t: torch.Tensor, offs: torch.Tensor, rule: ref.ScaleRule) -> fp8_wgrad.TokenMajor:
    table, padded = fp8_quantize.span_table(offs, t.shape[0])
    data, scale_inv = cute.quantize_spans_in_strips(t, offs, padded, table.shape[0],
                                                    rule.power_of_two, rule.dtype)
    return fp8_wgrad.TokenMajor(data, scale_inv, padded)


def _assert_same(got: fp8_wgrad.TokenMajor, want: fp8_wgrad.TokenMajor) -> None:
    assert torch.equal(got.offs, want.offs)
    assert same_bits(got.data, want.data)
    assert same_bits(got.scale_inv, want.scale_inv)


@gpu
@needs_cute
@pytest.mark.parametrize("case", sorted(STRIP_CASES))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_strips_are_bitwise_quantize_token_major(case, rule):
    sizes, rows = STRIP_CASES[case]
    torch.manual_seed(11)
    t = _input(rows, 2064)
    offs = offsets(sizes)
    _assert_same(_strips(t, offs, RULES[rule]),
                 fp8_wgrad.quantize_token_major(t, offs, RULES[rule]))


@gpu
@needs_cute
@pytest.mark.parametrize("cols", [16, 48, 112, 1040, 4096])  # partial 64-column chunks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_strips_take_any_column_count_and_equal_the_span_pair(cols, dtype):
    sizes, rows = STRIP_CASES["two_strips_and_a_bit"]
    torch.manual_seed(12)
    t = _input(rows, cols, dtype)
    offs = offsets(sizes)
    table, padded = fp8_quantize.span_table(offs, rows)
    data, scale_inv = cute.quantize_spans(t, table, len(sizes))
    got = _strips(t, offs, E4M3)
    _assert_same(got, fp8_wgrad.TokenMajor(data, scale_inv, padded))
    _assert_same(got, fp8_wgrad.quantize_token_major(t, offs, E4M3))


@gpu
@needs_cute
def test_strips_write_the_zeros_past_the_last_span():
    """Every element of data is written: over memory the allocator last held nonzero bytes
    in, the padding past the last span (G blocks and more) still reads zero."""
    sizes, rows = [3, 0, 130], 1000  # rows past the last group: a long zero tail
    offs = offsets(sizes)
    t = _input(rows, 272)
    junk = torch.full((272 * fp8_wgrad.padded_width(rows, 3),), 0x7E, dtype=torch.uint8,
                      device="cuda")
    del junk  # its block goes back to the caching allocator, bytes intact
    got = _strips(t, offs, E4M3)
    _assert_same(got, fp8_wgrad.quantize_token_major(t, offs, E4M3))


@gpu
@needs_cute
def test_strips_take_a_strided_input_and_replay_in_a_cuda_graph():
    torch.manual_seed(13)
    t = torch.randn(900, 2 * 256, device="cuda", dtype=torch.float16)[:, ::2]
    offs = offsets([100, 0, 600, 200])
    _strips(t, offs, E4M3)  # compile outside the capture
    table, padded = fp8_quantize.span_table(offs, 900)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        data, scale_inv = cute.quantize_spans_in_strips(t, offs, padded, table.shape[0])
    new = offsets([1, 699, 0, 200])
    offs.copy_(new)
    padded.copy_(fp8_quantize._build_table(new, 900)[1])
    graph.replay()
    want = fp8_wgrad.quantize_token_major(t, new, E4M3)
    assert same_bits(data, want.data)
    assert same_bits(scale_inv, want.scale_inv)


@gpu
@needs_cute
@pytest.mark.parametrize("case", sorted(DISPATCH_CASES))
def test_dispatch_takes_strips_and_rows_stay_bitwise(case):
    """`token_major` and `rows_and_token_major` take the strips where they fit; the row-wise
    form beside them is `quantize_rows`' bit for bit."""
    sizes, rows = DISPATCH_CASES[case]
    torch.manual_seed(14)
    t = _input(rows, 1040)
    offs = offsets(sizes)
    assert fp8_quantize.strips_reason(t, offs, E4M3, "cute") == ""
    along_rows, token_major = fp8_quantize.rows_and_token_major(t, offs, E4M3, "cute")
    want = fp8_wgrad.quantize_token_major(t, offs, E4M3)
    _assert_same(token_major, want)
    _assert_same(fp8_quantize.token_major(t, offs, E4M3, "cute"), want)
    grouped = sum(sizes)
    rows_want = eager_quantize(t[:grouped], E4M3)
    assert same_bits(along_rows.data[:grouped], rows_want.data)
    forward, amax = fp8_quantize.rows_keeping_group_amax(t, offs, E4M3, "cute")
    assert amax is None and same_bits(forward.data[:grouped], rows_want.data)
