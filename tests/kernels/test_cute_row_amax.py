"""Row-wise FP8 quantization with each group's column maxima in one read of t
(`cute.quantize_rows_and_group_amax`, te_seq/kernels/cute/row_amax_kernels.py) and the
token-major cast from those maxima (`cute.quantize_spans_from_group_amax`).

CPU: the two kernels' algorithm in torch over the span table (the row kernel's per-CTA column
maxima combined by max into group rows, then the span cast reading group g's maxima as the
blocks g..g+1 of the block-maxima buffer) is bitwise `fp8_wgrad.quantize_token_major`; the
checks that refuse inputs; the new kernel compiles for sm_90a. GPU: both functions bit for bit
against the torch definitions on fresh random data."""

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
from test_cute_quant import cast_from_block_maxima, eager_quantize, same_bits

from te_seq.kernels import fp8_quantize, fp8_wgrad
from te_seq.kernels import fp8_reference as ref

E4M3 = ref.ScaleRule("E4M3")
E4M3_POW2 = ref.ScaleRule("E4M3", power_of_two=True)
E5M2 = ref.ScaleRule("E5M2")
RULES = [E4M3, E4M3_POW2, E5M2]
RULE_IDS = ["scale", "pow2", "e5m2"]
CASES = {  # group sizes, rows of t (>= their sum: the rest belong to no group)
    "unaligned": ([37, 0, 1, 200, 130], 368),
    "one_group": ([300], 300),
    "rows_past_the_end": ([40, 0, 90], 200),
    "empty_groups_around": ([0, 0, 129, 0, 0], 129),
    "all_empty": ([0, 0], 12),
    "many_blocks": ([700, 0, 3, 1000], 1800),
}


def _offs(sizes: list[int], device="cpu") -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def _group_amax_by_table(t: torch.Tensor, table: torch.Tensor, groups: int,
                         slices: int = 2) -> torch.Tensor:
    """The row kernel's column maxima: each CTA (block, slice of its valid rows) takes max |t|
    of its rows per column (nan as inf, as before the atomics) and combines it by max into its
    group's row of a zeroed buffer."""
    group_amax = torch.zeros(groups, t.shape[1])
    per_slice = 128 // slices
    for first_row, valid, group, _ in table.tolist():
        for lo in range(0, valid, per_slice):
            rows = t[first_row + lo:first_row + min(valid, lo + per_slice)].float().abs()
            amax = rows.amax(0)
            amax = torch.where(amax.isnan(), float("inf"), amax)
            group_amax[group] = torch.maximum(group_amax[group], amax)
    return group_amax


def _spans_from_unit_extents(t: torch.Tensor, table: torch.Tensor, group_amax: torch.Tensor,
                             rule: ref.ScaleRule):
    """The span cast kernel's algorithm with block_amax = group_amax and extents[g] = (g, g+1):
    a block with rows reduces block_amax[first..end-1] of its group (one row)."""
    groups = group_amax.shape[0]
    extents = [(g, g + 1) for g in range(groups)]
    return cast_from_block_maxima(t, table, group_amax, extents, groups, rule)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("slices", [1, 2, 4])
def test_group_maxima_as_unit_extents_give_quantize_token_major(case, slices):
    sizes, rows = CASES[case]
    t = torch.randn(rows, 32, dtype=torch.bfloat16) * torch.logspace(-3, 3, rows)[:, None]
    t[7, 3] = float("nan")
    t[9, 5] = float("-inf")
    t[10] = 0.0
    offs = _offs(sizes)
    table, padded = fp8_quantize.span_table(offs, rows)
    group_amax = _group_amax_by_table(t, table, len(sizes), slices)
    grouped = t[:sum(sizes)].float().abs()
    ends = offs.tolist()
    for g, (lo, hi) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        want = grouped[lo:hi].amax(0) if hi > lo else torch.zeros(32)
        assert torch.equal(group_amax[g], torch.where(want.isnan(), float("inf"), want))
    for rule in RULES:
        expected = fp8_wgrad.quantize_token_major(t, offs, rule)
        data, scale_inv = _spans_from_unit_extents(t, table, group_amax, rule)
        assert torch.equal(padded, expected.offs)
        assert same_bits(data, expected.data)
        assert same_bits(scale_inv, expected.scale_inv)


def test_fp32_bits_order_nonnegative_floats_as_unsigned_ints():
    """The kernel combines column maxima by an unsigned atomic max on the fp32 bits: for
    non-negative floats (0, subnormals, normals, inf) the bit order is the numeric order."""
    values = torch.tensor([0.0, 1e-45, 1e-38, 1.5, 448.0, 3e38, float("inf")])
    values = torch.cat([values, torch.rand(1000) * torch.logspace(-40, 38, 1000)])
    bits = values.view(torch.int32).long()  # non-negative: the sign bit is clear
    assert torch.equal(torch.argsort(bits, stable=True), torch.argsort(values, stable=True))


def test_group_amax_checks_name_the_problem():
    from te_seq.kernels import cute

    wide = torch.randn(4, 16400, dtype=torch.bfloat16)
    assert "C <= 16384" in cute.group_amax_problem(wide, torch.float8_e4m3fn, 0)
    assert "multiple of 16" in cute.group_amax_problem(wide[:, :24], torch.float8_e4m3fn, 0)
    with pytest.raises(ValueError, match="quantize_rows_and_group_amax.*16384"):
        cute.quantize_rows_and_group_amax(wide, torch.zeros(1, 4, dtype=torch.int32), 1)
    t = torch.randn(8, 32, dtype=torch.bfloat16)
    table = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="quantize_spans_from_group_amax.*fp32"):
        cute.quantize_spans_from_group_amax(t, table, torch.zeros(2, 48))
    with pytest.raises(ValueError, match="quantize_spans_from_group_amax.*fp32"):
        cute.quantize_spans_from_group_amax(t, table, torch.zeros(2, 32, dtype=torch.bfloat16))


@needs_dsl
def test_host_width_limit_is_the_kernels():
    """The host's C limit (no cutlass import) is what the kernel's CTA can hold, and the
    layouts and row slices are those the docs name."""
    from te_seq.kernels.cute import quant, row_amax_kernels

    assert quant.GROUP_AMAX_MAX_COLS == row_amax_kernels.MAX_COLS == 16384
    for cols in (16, 768, 1024, 2048, 4096, 4112, 8192, 8208, 16384):
        for blocks in (1, 264, 640, 2176):
            vecs, rows_in_flight, slices = quant._group_amax_layout(cols, blocks)
            vecs = vecs or row_amax_kernels.MAX_VECS
            assert vecs * rows_in_flight == 8 and slices in (1, 2, 4)  # 8 loads in flight
            assert -(-cols // (256 * vecs)) * 32 <= row_amax_kernels.MAX_THREADS
    # 2 x 4 where 4 x 2 would launch < 2048 warps unsliced (C <= 4096), sliced to 2048 warps;
    # else 4 x 2 (8 x 1 past 8192 columns), the fewest slices launching 4096 warps, at most
    # 4 / 2 / 1 for CTAs of 1 / 2 / more warps
    cases = {(2048, 384): (2, 4, 2), (1536, 384): (2, 4, 2), (768, 384): (2, 4, 4),
             (4096, 264): (2, 4, 1), (2048, 640): (2, 4, 1), (1024, 640): (2, 4, 2),
             (16, 1): (2, 4, 4), (4096, 640): (4, 2, 1), (768, 2176): (4, 2, 2),
             (2048, 1664): (4, 2, 2), (4096, 2176): (4, 2, 1), (4112, 1): (4, 2, 1),
             (14336, 264): (0, 1, 1), (8208, 1): (0, 1, 1)}
    assert {key: quant._group_amax_layout(*key) for key in cases} == cases


@needs_dsl
@pytest.mark.slow
def test_row_group_amax_kernel_compiles_for_sm90a():
    compile_quant_for_sm90a("rows_group_amax", ((0, 1), (4, 2), (2, 4)))  # vecs x rows


@pytest.mark.slow  # DSL compiles and ptxas in a subprocess
@needs_dsl
@needs_ptxas
def test_row_group_amax_layouts_do_not_spill(tmp_path):
    """The layouts the host picks assemble for sm_90a without spills, 4 x 2 and 2 x 4 in at
    most 128 registers a thread (what lets more CTAs share an SM than 8 x 1's ~182)."""
    configs = ("quant_rows_group_amax", "quant_rows_group_amax_v4r2",
               "quant_rows_group_amax_v2r4")
    usage = ptxas_usage(configs, tmp_path)
    assert all(spilled == 0 for _, spilled in usage.values()), usage
    for name in configs[1:]:
        assert usage[name][0] <= 128, usage


# ---------------------------------------------------------------- GPU: bit for bit


def _rows_input(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows over six decades with a nan, an inf, an all-zero row and (bf16) a row of
    tiny values (fp8_max / amax overflows fp32: the scale is clamped to fp32's max)."""
    t = torch.randn(rows, cols, device="cuda") * torch.logspace(-3, 3, rows, device="cuda")[:, None]
    t = t.to(dtype)
    t[1, 4 % cols] = float("nan")
    t[2, 7 % cols] = float("inf")
    t[3] = 0.0
    if dtype == torch.bfloat16:
        t[4] = torch.randn(cols, device="cuda").to(dtype) * 1e-38
    return t


def _group_maxima(t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """max |t| per (group, column) over each group's rows, nan as inf, 0 for an empty group."""
    out = torch.zeros(len(sizes), t.shape[1], device=t.device)
    start = 0
    for g, n in enumerate(sizes):
        if n:
            amax = t[start:start + n].float().abs().amax(0)
            out[g] = torch.where(amax.isnan(), float("inf"), amax)
        start += n
    return out


def _assert_both_forms(t: torch.Tensor, sizes: list[int], rule: ref.ScaleRule) -> None:
    """Rows (in groups), group maxima, and the token-major form cast from them, against the
    torch definitions bit for bit."""
    from te_seq.kernels import cute

    assert cute.group_amax_problem(t, rule.dtype, 0) == ""  # the kernel really runs
    offs = offsets(sizes)
    table, padded = fp8_quantize.span_table(offs, t.shape[0])
    row_data, row_scale_inv, group_amax = cute.quantize_rows_and_group_amax(
        t, table, len(sizes), rule.power_of_two, rule.dtype)
    grouped = sum(sizes)  # rows past the last group's end are unspecified
    want = eager_quantize(t[:grouped], rule)
    assert row_data.shape == t.shape and row_scale_inv.shape == (t.shape[0], 1)
    assert same_bits(row_data[:grouped], want.data)
    assert same_bits(row_scale_inv[:grouped], want.scale_inv)
    assert torch.equal(group_amax, _group_maxima(t, sizes))
    data, scale_inv = cute.quantize_spans_from_group_amax(t, table, group_amax,
                                                          rule.power_of_two, rule.dtype)
    want_tm = fp8_wgrad.quantize_token_major(t, offs, rule)
    assert torch.equal(padded, want_tm.offs)
    assert same_bits(data, want_tm.data)
    assert same_bits(scale_inv, want_tm.scale_inv)


@gpu
@needs_cute
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("rule", RULES, ids=RULE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rows_and_group_amax_are_bitwise_the_definitions(case, rule, dtype):
    sizes, rows = CASES[case]
    torch.manual_seed(21)
    # nan / inf / all-zero / tiny rows (bf16), magnitudes over six decades
    _assert_both_forms(_rows_input(rows, 2064, dtype), sizes, rule)


@gpu
@needs_cute
@pytest.mark.parametrize("cols", [16, 48, 80, 1040, 2048, 2064, 4096, 6160, 8192, 8208, 16384])
def test_rows_and_group_amax_take_any_width(cols):
    """Widths across the CTA sizes (1 to 8 warps, partial last warps), both register layouts
    (4 x 2 up to 8192 columns, 8 x 1 above) and the row slices the host picks."""
    torch.manual_seed(22)
    sizes, rows = CASES["unaligned"]
    _assert_both_forms(_rows_input(rows, cols, torch.bfloat16), sizes, E4M3)


@gpu
@needs_cute
def test_rows_and_group_amax_take_strided_and_unaligned_inputs():
    torch.manual_seed(23)
    base = torch.randn(401, 2 * 528, device="cuda", dtype=torch.bfloat16) * 7
    sizes = [100, 0, 150, 150]
    for t in (base[:400, ::2], base[1:, :528], base.t()[:528, :400].t()):
        _assert_both_forms(t, sizes, E4M3_POW2)


@gpu
@needs_cute
def test_rows_and_group_amax_one_group_of_many_blocks():
    torch.manual_seed(24)
    rows = 32768
    t = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    t[rows - 1, 1023] = 900.0  # the column's max in the group's last block and slice
    t[5, 1000] = float("nan")
    _assert_both_forms(t, [rows], E4M3)


@gpu
@needs_cute
def test_rows_and_group_amax_replay_in_a_cuda_graph_with_new_offsets():
    from te_seq.kernels import cute

    torch.manual_seed(25)
    t = torch.randn(600, 256, device="cuda", dtype=torch.float16) * 3
    offs = offsets([100, 0, 300, 200])
    table, _ = fp8_quantize.span_table(offs, 600)
    cute.quantize_spans_from_group_amax(t, table, cute.quantize_rows_and_group_amax(
        t, table, 4)[2])  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        row_data, row_scale_inv, group_amax = cute.quantize_rows_and_group_amax(t, table, 4)
        data, scale_inv = cute.quantize_spans_from_group_amax(t, table, group_amax)
    new_sizes = [1, 299, 0, 300]
    table.copy_(fp8_quantize._build_table(offsets(new_sizes), 600)[0])
    graph.replay()
    want = eager_quantize(t, E4M3)
    assert same_bits(row_data, want.data) and same_bits(row_scale_inv, want.scale_inv)
    assert torch.equal(group_amax, _group_maxima(t, new_sizes))
    want_tm = fp8_wgrad.quantize_token_major(t, offsets(new_sizes), E4M3)
    assert same_bits(data, want_tm.data) and same_bits(scale_inv, want_tm.scale_inv)


@gpu
@needs_cute
@pytest.mark.parametrize("layout", [(8, 1), (4, 2), (4, 1), (2, 4), (1, 3)])
@pytest.mark.parametrize("slices", [1, 2, 4])
def test_every_kernel_layout_and_slicing_is_bitwise_the_definitions(layout, slices):
    """Any (vectors per thread, rows in flight) and slicing gives the same bits: groups whose
    slices hold a row count that is no multiple of the rows in flight (the clamped loads), a
    width that leaves the last warp partial, empty groups."""
    from te_seq.kernels.cute.compile_quant import QuantConfig, compile_quant

    torch.manual_seed(26)
    sizes = [37, 0, 1, 200, 131, 0]
    vecs, rows_in_flight = layout
    cols = 16 * 33 * vecs  # 33 vectors per row for each lane-group: a partial last warp
    t = _rows_input(sum(sizes) + 5, cols, torch.bfloat16)
    table, _ = fp8_quantize.span_table(offsets(sizes), t.shape[0])
    kernel = compile_quant(QuantConfig("rows_group_amax", torch.bfloat16, False, False,
                                       torch.float8_e4m3fn, vecs, rows_in_flight)).fn
    row_data = torch.empty(t.shape, dtype=torch.float8_e4m3fn, device="cuda")
    row_scale_inv = torch.empty(t.shape[0], device="cuda")
    group_amax = torch.zeros(len(sizes), cols, device="cuda")
    kernel(t, table, row_data, row_scale_inv, group_amax, slices)
    grouped = sum(sizes)
    want = eager_quantize(t[:grouped], E4M3)
    assert same_bits(row_data[:grouped], want.data)
    assert same_bits(row_scale_inv[:grouped, None], want.scale_inv)
    assert torch.equal(group_amax, _group_maxima(t, sizes))
