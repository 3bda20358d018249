"""The cute FP8 quantization kernels (te_seq/kernels/cute/quant.py) and their dispatch
(te_seq/kernels/fp8_quantize.py).

CPU: the span table read by the token-major kernels, checked by running the kernels' algorithm
in torch over it (bitwise `fp8_wgrad.quantize_token_major`); the dispatch reasons; every kernel
config compiles for sm_90a. GPU: both kernels bit for bit against the torch definitions on fresh
random data (bf16 and fp16, power-of-two scales, nan / inf / all-zero / tiny rows, empty groups,
one group, rows past the last group, unaligned and non-contiguous inputs) and under a CUDA
graph replayed with new offsets."""

import pytest
import torch
from cute_marks import compile_for_sm90a, gpu, needs_cute, needs_dsl, offsets

from te_seq.kernels import fp8_quantize, fp8_wgrad
from te_seq.kernels import fp8_reference as ref

E4M3 = ref.ScaleRule("E4M3")
E4M3_POW2 = ref.ScaleRule("E4M3", power_of_two=True)
E5M2 = ref.ScaleRule("E5M2")  # gradients under "HYBRID" recipes
SPAN_CASES = {  # group sizes, rows of t (>= their sum: the rest belong to no group)
    "uniform": ([256, 256, 256], 768),
    "empty_and_odd": ([0, 5, 130, 0, 1, 300], 436),
    "one_group": ([77], 77),
    "rows_past_the_end": ([40, 0, 90], 200),
    "all_empty": ([0, 0], 12),
    "groups_of_many_blocks": ([700, 0, 3, 1000], 1800),  # 6 and 8 blocks, read per column
}
ONE_BIG_GROUP = ([32768], 32768)  # one group of 256 blocks


def _offs(sizes: list[int], device="cpu") -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def _spans_by_table(t: torch.Tensor, table: torch.Tensor, groups: int, rule: ref.ScaleRule):
    """The two span kernels' algorithm in torch: per block, the max over its valid rows into
    its group's column maxima (nan as inf), then each block cast with its group's scales."""
    cols, pad = t.shape[1], fp8_wgrad.WGRAD_PAD
    span_amax = torch.zeros(groups + 1, cols)
    blocks = []
    for first_row, valid, group, _ in table.tolist():
        rows = t[first_row:first_row + valid].float()
        block = torch.cat([rows, rows.new_zeros(pad - valid, cols)])
        amax = rows.abs().amax(0) if valid else torch.zeros(cols)
        amax = torch.where(amax.isnan(), float("inf"), amax)
        span_amax[group] = torch.maximum(span_amax[group], amax)
        blocks.append((block, group))
    scales = ref.scales_from_amax(span_amax, rule)
    data = torch.cat([ref.scaled_cast(b, scales[g], rule.fp8_max, rule.dtype) for b, g in blocks])
    return data.t(), torch.reciprocal(scales[:groups])


def _spans_by_block_maxima(t: torch.Tensor, table: torch.Tensor, groups: int,
                           rule: ref.ScaleRule):
    """The bandwidth span kernels' algorithm in torch: the amax pass writes each block's
    column maxima and each group's (first, end) block from the blocks that start and end it
    (into buffers full of garbage); then `cast_from_block_maxima`. Garbage left anywhere shows
    in the result."""
    cols, rows = t.shape[1], table.tolist()
    block_amax = torch.full((len(rows), cols), -3.0)
    extents = torch.full((max(groups, 1), 2), 10**6, dtype=torch.long)
    for b, (first_row, valid, group, first) in enumerate(rows):
        if group < extents.shape[0]:
            if first:
                extents[group, 0] = b
            if (rows[b + 1][2] if b + 1 < len(rows) else -1) != group:
                extents[group, 1] = b + 1
        if valid:
            amax = t[first_row:first_row + valid].float().abs().amax(0)
            block_amax[b] = torch.where(amax.isnan(), float("inf"), amax)
    return cast_from_block_maxima(t, table, block_amax, extents.tolist(), groups, rule)


def cast_from_block_maxima(t: torch.Tensor, table: torch.Tensor, block_amax: torch.Tensor,
                           extents: list, groups: int, rule: ref.ScaleRule):
    """The span cast kernel's algorithm in torch: a block with rows reduces its group's block
    maxima block_amax[first..end-1] (`extents[group]`), the others cast zeros with scale 1;
    scale_inv is written on a group's first block, 1 for the groups without tokens around the
    group changes and after the last block (into a buffer of garbage)."""
    cols, pad, rows = t.shape[1], fp8_wgrad.WGRAD_PAD, table.tolist()
    scale_inv = torch.full((groups, cols), -5.0)
    blocks = []
    for b, (first_row, valid, group, first) in enumerate(rows):
        start, end = extents[group] if valid else (0, 0)
        amax = block_amax[start:end].amax(0) if valid else torch.zeros(cols)
        scales = ref.scales_from_amax(amax, rule)
        block = torch.cat([t[first_row:first_row + valid].float(),
                           torch.zeros(pad - valid, cols)])
        blocks.append(ref.scaled_cast(block, scales, rule.fp8_max, rule.dtype))
        if group < groups and first:
            scale_inv[group] = torch.reciprocal(scales)
        previous = rows[b - 1][2] if b else -1
        scale_inv[previous + 1:min(group, groups)] = 1.0
        if b == len(rows) - 1:
            scale_inv[group + 1:groups] = 1.0
    return torch.cat(blocks).t(), scale_inv


@pytest.mark.parametrize("case", [*sorted(SPAN_CASES), "one_big_group"])
def test_block_maxima_and_extents_give_quantize_token_major(case):
    sizes, rows = SPAN_CASES.get(case, ONE_BIG_GROUP)
    torch.manual_seed(7)
    t = torch.randn(rows, 16, dtype=torch.bfloat16) * torch.logspace(-2, 2, rows)[:, None]
    if rows > 10:
        t[7, 3] = float("nan")
        t[9, 5] = float("-inf")
    offs = _offs(sizes)
    table, _ = fp8_quantize.span_table(offs, rows)
    expected = fp8_wgrad.quantize_token_major(t, offs, E4M3_POW2)
    data, scale_inv = _spans_by_block_maxima(t, table, len(sizes), E4M3_POW2)
    assert same_bits(data, expected.data)
    assert torch.equal(scale_inv.nan_to_num(-1.0), expected.scale_inv.nan_to_num(-1.0))


@pytest.mark.parametrize("case", sorted(SPAN_CASES))
def test_span_table_gives_quantize_token_major(case):
    sizes, rows = SPAN_CASES[case]
    torch.manual_seed(1)
    t = torch.randn(rows, 32, dtype=torch.bfloat16) * 3
    if rows > 10:
        t[7, 3] = float("nan")
        t[9, 5] = float("inf")
    offs = _offs(sizes)
    table, padded = fp8_quantize.span_table(offs, rows)
    expected = fp8_wgrad.quantize_token_major(t, offs, E4M3)
    data, scale_inv = _spans_by_table(t, table, len(sizes), E4M3)
    assert torch.equal(padded, expected.offs)
    assert data.shape == expected.data.shape
    same = data.view(torch.uint8) == expected.data.view(torch.uint8)
    both_nan = data.float().isnan() & expected.data.float().isnan()
    assert bool((same | both_nan).all())
    assert torch.equal(scale_inv.nan_to_num(-1.0), expected.scale_inv.nan_to_num(-1.0))


def test_span_table_is_cached_per_offsets_and_version():
    offs = _offs([3, 200, 0])
    first = fp8_quantize.span_table(offs, 203)
    assert fp8_quantize.span_table(offs, 203)[0] is first[0]
    assert fp8_quantize.span_table(offs, 250)[0] is not first[0]  # other rows: rebuilt
    offs[0] = 5  # an in-place write bumps the version: rebuilt, not stale
    table = fp8_quantize.span_table(offs, 203)[0]
    assert table is not first[0]
    assert table[0].tolist() == [0, 5, 0, 1]


def test_dispatch_reasons_name_the_problem():
    t = torch.randn(8, 32, dtype=torch.bfloat16)
    assert "torch backend" in fp8_quantize.reason(t, ref.ROWWISE, E4M3, "torch")
    assert "row-wise" in fp8_quantize.reason(t, ref.PER_TENSOR, E4M3, "cute")
    from te_seq.kernels import cute

    assert "multiple of 16" in cute.quant_problem(torch.randn(4, 24, dtype=torch.bfloat16),
                                                  torch.float8_e4m3fn, 0)
    assert "margin 0" in cute.quant_problem(t, torch.float8_e4m3fn, 1)
    assert "float8_e4m3fn or float8_e5m2" in cute.quant_problem(t, torch.int8, 0)
    assert "bf16/fp16" in cute.quant_problem(t.float(), torch.float8_e4m3fn, 0)
    if not torch.cuda.is_available():
        assert "CUDA" in cute.quant_problem(t, torch.float8_e4m3fn, 0)
    # whatever the reason, the torch definition runs and gives its numbers
    q = fp8_quantize.rows(t, ref.ROWWISE, E4M3, "cute" if not torch.cuda.is_available() else "x")
    assert torch.equal(q.dequantize(), ref.qdq(t, ref.ROWWISE, E4M3))


def _span_blocks_by_table(t: torch.Tensor, table: torch.Tensor, rule: ref.ScaleRule):
    """The block-scaled span kernel's algorithm in torch: each padded block (its valid rows,
    zeros after) scaled by its own column maxima (nan as inf), written with its scale_inv into
    buffers full of garbage (an element the kernel would not write shows in the result)."""
    cols, pad, rows = t.shape[1], fp8_wgrad.WGRAD_PAD, table.tolist()
    data = torch.full((len(rows) * pad, cols), -7.0)
    scale_inv = torch.full((len(rows), cols), -5.0)
    for b, (first_row, valid, _, _) in enumerate(rows):
        block = torch.cat([t[first_row:first_row + valid].float(),
                           torch.zeros(pad - valid, cols)])
        amax = block.abs().amax(0)
        scales = ref.scales_from_amax(torch.where(amax.isnan(), float("inf"), amax), rule)
        data[b * pad:(b + 1) * pad] = ref.scaled_cast(block, scales, rule.fp8_max,
                                                      rule.dtype).float()
        scale_inv[b] = torch.reciprocal(scales)
    return data.to(rule.dtype).t(), scale_inv


@pytest.mark.parametrize("case", [*sorted(SPAN_CASES), "one_big_group"])
@pytest.mark.parametrize("rule", [E4M3, E4M3_POW2, E5M2], ids=["scale", "pow2", "e5m2"])
def test_block_span_algorithm_gives_quantize_token_major_blocks(case, rule):
    sizes, rows = SPAN_CASES.get(case, ONE_BIG_GROUP)
    torch.manual_seed(10)
    t = torch.randn(rows, 16, dtype=torch.bfloat16) * torch.logspace(-3, 3, rows)[:, None]
    if rows > 10:
        t[7, 3] = float("nan")
        t[9, 5] = float("-inf")
        t[10] = 0.0
    offs = _offs(sizes)
    table, padded = fp8_quantize.span_table(offs, rows)
    expected = fp8_wgrad.quantize_token_major_blocks(t, offs, rule)
    data, scale_inv = _span_blocks_by_table(t, table, rule)
    assert torch.equal(padded, expected.offs)
    assert same_bits(data, expected.data)
    assert same_bits(scale_inv, expected.scale_inv)


class _RecordingSpanBlocks:
    """Stands in for `cute.quantize_span_blocks` on CPU: records its calls and computes the
    kernel's algorithm (`_span_blocks_by_table`)."""

    def __init__(self):
        self.calls = []

    def __call__(self, t, table, power_of_two=False, fp8_dtype=torch.float8_e4m3fn):
        self.calls.append((t, table, power_of_two, fp8_dtype))
        rule = ref.ScaleRule("E4M3" if fp8_dtype == torch.float8_e4m3fn else "E5M2",
                             power_of_two=power_of_two)
        return _span_blocks_by_table(t, table, rule)


@pytest.mark.parametrize("backend_name", ["cute", "torch"])
def test_block_scaled_wgrad_operands_dispatch_to_the_block_span_kernel(monkeypatch, backend_name):
    """Float8BlockScaling's token-major operands (core/fp8.py) go through
    `fp8_quantize.token_major_blocks`: the cute kernel where the cute backend and the data
    allow (faked here: CPU data), else the torch definition; the same bits either way."""
    from te_seq import recipe
    from te_seq.core import fp8
    from te_seq.kernels import cute

    recorder = _RecordingSpanBlocks()
    monkeypatch.setattr(cute, "quantize_span_blocks", recorder)
    monkeypatch.setattr(cute, "quant_problem", lambda t, dtype, margin, fp32=False: "")
    block = recipe.Float8BlockScaling()
    torch.manual_seed(11)
    sizes = [130, 0, 77]
    x = torch.randn(220, 48, dtype=torch.bfloat16)
    dy = torch.randn(220, 32, dtype=torch.bfloat16)
    offs = _offs(sizes)
    along_n = fp8.grad_quantized(block, dy)
    got = {"grad": fp8.grad_token_major(block, dy, offs, along_n, backend_name),
           "input": fp8.input_token_major(block, x, x, offs, None, backend_name)}
    assert len(recorder.calls) == (2 if backend_name == "cute" else 0)
    for role, t in (("grad", dy), ("input", x)):
        want = fp8_wgrad.quantize_token_major_blocks(t, offs, block.rule(role))
        assert isinstance(got[role], fp8_wgrad.BlockTokenMajor)
        assert same_bits(got[role].data, want.data)
        assert torch.equal(got[role].scale_inv, want.scale_inv)
        assert torch.equal(got[role].offs, want.offs)


def test_block_span_dispatch_reasons():
    t = torch.randn(8, 32, dtype=torch.bfloat16)
    assert "torch backend" in fp8_quantize.blocks_reason(t, E4M3, "torch")
    assert "bf16/fp16/fp32" in fp8_quantize.blocks_reason(t.double(), E4M3, "cute")
    assert "multiple of 16" in fp8_quantize.blocks_reason(t[:, :24], E4M3, "cute")
    assert "margin 0" in fp8_quantize.blocks_reason(t, ref.ScaleRule("E4M3", margin=1), "cute")
    if not torch.cuda.is_available():
        assert "CUDA" in fp8_quantize.blocks_reason(t, E4M3, "cute")
    offs = _offs([3, 5])  # whatever the reason, the torch definition's bits
    got = fp8_quantize.token_major_blocks(t.float(), offs, E4M3, "cute")
    want = fp8_wgrad.quantize_token_major_blocks(t.float(), offs, E4M3)
    assert same_bits(got.data, want.data) and torch.equal(got.scale_inv, want.scale_inv)


@needs_dsl
@pytest.mark.slow
def test_quant_kernels_compile_for_sm90a():
    script = (
        "import torch\n"
        "from te_seq.kernels.cute.compile_quant import QuantConfig, compile_quant\n"
        "for kind in ('rows', 'span_amax', 'span_cast'):\n"
        "    for dtype in (torch.bfloat16, torch.float16):\n"
        "        for pow2 in (False, True):\n"
        "            compile_quant(QuantConfig(kind, dtype, pow2))\n"
        "for kind in ('span_amax', 'span_cast'):  # the row-wise form too; E5M2\n"
        "    compile_quant(QuantConfig(kind, torch.bfloat16, False, True))\n"
        "    compile_quant(QuantConfig(kind, torch.float16, True, True, torch.float8_e5m2))\n"
        "compile_quant(QuantConfig('span_table', torch.bfloat16))\n"
        "for lanes in (4, 8, 16):  # rows of up to 4096 columns in registers\n"
        "    compile_quant(QuantConfig('rows', torch.bfloat16, False, False,\n"
        "                              torch.float8_e4m3fn, lanes))\n"
        "compile_quant(QuantConfig('rows', torch.float16, True, False, torch.float8_e5m2, 16))\n"
        "for dtype in (torch.bfloat16, torch.float16):  # the block-scaled token-major kernel\n"
        "    for pow2 in (False, True):\n"
        "        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):\n"
        "            compile_quant(QuantConfig('span_block_cast', dtype, pow2, False, fp8))\n"
        "compile_quant(QuantConfig('span_block_cast', torch.float32))\n"
        "print('ALL COMPILED')\n"
    )
    compile_for_sm90a(script, timeout=600)


# ---------------------------------------------------------------- GPU: bit for bit


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes, a nan anywhere in one matching a nan in the other (nan's sign may differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    same = a.view(torch.uint8) == b.view(torch.uint8) if a.element_size() == 1 else a == b
    return bool((same | (a.float().isnan() & b.float().isnan())).all())


def _rows_input(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    t = torch.randn(rows, cols, device="cuda") * torch.logspace(-3, 3, rows, device="cuda")[:, None]
    t = t.to(dtype)
    t[1, 4] = float("nan")
    t[2, 7] = float("inf")
    t[3] = 0.0  # an all-zero row: scale 1
    if dtype == torch.bfloat16:  # tiny values: fp8_max / amax overflows, clamped to fp32's max
        t[4] = torch.randn(cols, device="cuda").to(dtype) * 1e-38
    return t


@gpu
@needs_cute
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rule", [E4M3, E4M3_POW2, E5M2], ids=["scale", "pow2", "e5m2"])
@pytest.mark.parametrize("shape", [(37, 16), (50, 768), (64, 1024), (300, 2064), (1, 4096),
                                   (9, 4112)])  # in registers (4, 8, 16 vectors a lane); 2 passes
def test_rows_kernel_is_bitwise_the_reference(dtype, rule, shape):
    torch.manual_seed(2)
    t = _rows_input(max(shape[0], 5), shape[1], dtype)[: shape[0]]
    got = fp8_quantize.rows(t, ref.ROWWISE, rule, "cute")
    want = eager_quantize(t, rule)
    assert same_bits(got.data, want.data)
    assert same_bits(got.scale_inv, want.scale_inv)


@gpu
@needs_cute
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rule", [E4M3, E4M3_POW2, E5M2], ids=["scale", "pow2", "e5m2"])
@pytest.mark.parametrize("shape", [(37, 128), (300, 2048), (5, 4096)])
def test_1x128_blocks_on_the_rows_kernel_are_bitwise_the_reference(dtype, rule, shape):
    """`Float8BlockScaling`'s x and dy (1x128 blocks along whole rows) on the row-wise kernel,
    against the per-block formula run op by op."""
    torch.manual_seed(4)
    t = _rows_input(max(shape[0], 5), shape[1], dtype)[: shape[0]]
    block = ref.QuantBlock(1, 128)
    got = fp8_quantize.rows(t, block, rule, "cute")
    r, c = t.shape
    scale = ref.scales_from_amax(ref.block_amax(t, block), rule)
    want = (t.float() * scale.repeat_interleave(128, 1)).clamp(-rule.fp8_max, rule.fp8_max)
    assert got.scale_inv.shape == (r, c // 128)
    assert same_bits(got.data, want.to(rule.dtype))
    assert same_bits(got.scale_inv, torch.reciprocal(scale))


def eager_quantize(t: torch.Tensor, rule: ref.ScaleRule) -> ref.QuantizedTensor:
    """The definition run op by op: the compiled region (Triton) may divide approximately."""
    from te_seq import config

    before = config.compile_elementwise()
    config.set_compile_elementwise(False)
    try:
        return ref.quantize(t, ref.ROWWISE, rule)
    finally:
        config.set_compile_elementwise(before)


@gpu
@needs_cute
def test_rows_kernel_takes_strided_and_unaligned_inputs():
    torch.manual_seed(3)
    base = torch.randn(65, 2 * 528, device="cuda", dtype=torch.bfloat16)
    for t in (base[:, ::2], base[1:, :528], base.t()[:528, :64]):
        got = fp8_quantize.rows(t, ref.ROWWISE, E4M3, "cute")
        assert same_bits(got.data, eager_quantize(t, E4M3).data)


@gpu
@needs_cute
@pytest.mark.parametrize("case", sorted(SPAN_CASES))
@pytest.mark.parametrize("rule", [E4M3, E4M3_POW2, E5M2], ids=["scale", "pow2", "e5m2"])
def test_span_kernels_are_bitwise_quantize_token_major(case, rule):
    sizes, rows = SPAN_CASES[case]
    torch.manual_seed(4)
    t = torch.randn(rows, 2064, device="cuda", dtype=torch.bfloat16) * 5
    if rows > 10:
        t[7, 3] = float("nan")
        t[9, 100] = float("-inf")
    offs = offsets(sizes)
    got = fp8_quantize.token_major(t, offs, rule, "cute")
    want = fp8_wgrad.quantize_token_major(t, offs, rule)
    assert torch.equal(got.offs, want.offs)
    assert same_bits(got.data, want.data)
    assert same_bits(got.scale_inv, want.scale_inv)


@gpu
@needs_cute
def test_span_kernels_take_a_strided_input_and_replay_in_a_cuda_graph():
    torch.manual_seed(5)
    t = torch.randn(600, 2 * 256, device="cuda", dtype=torch.float16)[:, ::2]
    offs = offsets([100, 0, 300, 200])
    fp8_quantize.token_major(t, offs, E4M3, "cute")  # compile outside the capture
    table, _ = fp8_quantize.span_table(offs, 600)
    graph = torch.cuda.CUDAGraph()
    from te_seq.kernels import cute

    with torch.cuda.graph(graph):
        data, scale_inv = cute.quantize_spans(t, table, 4)
    table.copy_(fp8_quantize._build_table(offsets([1, 299, 0, 300]), 600)[0])
    graph.replay()
    want = fp8_wgrad.quantize_token_major(t, offsets([1, 299, 0, 300]), E4M3)
    assert same_bits(data, want.data)
    assert same_bits(scale_inv, want.scale_inv)


@gpu
@needs_cute
@pytest.mark.parametrize("case", sorted(SPAN_CASES))
@pytest.mark.parametrize("rule", [E4M3, E4M3_POW2, E5M2], ids=["scale", "pow2", "e5m2"])
@pytest.mark.parametrize("cols", [2064, 16400], ids=["group_maxima", "maxima_pass"])
def test_rows_and_token_major_are_bitwise_both_definitions(case, rule, cols):
    """`rows_and_token_major` on the cute kernels: the row cast with group maxima, then the
    cast from them (C <= 16384), else the maxima pass and one cast writing both forms."""
    sizes, rows = SPAN_CASES[case]
    torch.manual_seed(6)
    t = _rows_input(max(rows, 5), cols, torch.bfloat16)[:rows] if rows else \
        torch.zeros(0, cols, device="cuda", dtype=torch.bfloat16)
    offs = offsets(sizes)
    along_rows, token_major = fp8_quantize.rows_and_token_major(t, offs, rule, "cute")
    _assert_rows_and_token_major(t, sizes, rule, along_rows, token_major)


@gpu
@needs_cute
@pytest.mark.parametrize("case", sorted(SPAN_CASES))
def test_rows_and_spans_in_one_pass_pair_are_bitwise_both_definitions(case):
    """`cute.quantize_rows_and_spans` itself, at a width `rows_and_token_major` gives to the
    group-maxima pair."""
    from te_seq.kernels import cute

    sizes, rows = SPAN_CASES[case]
    torch.manual_seed(6)
    t = _rows_input(max(rows, 5), 2064, torch.bfloat16)[:rows] if rows else \
        torch.zeros(0, 2064, device="cuda", dtype=torch.bfloat16)
    offs = offsets(sizes)
    table, padded = fp8_quantize.span_table(offs, t.shape[0])
    data, scale_inv, row_data, row_scale_inv = cute.quantize_rows_and_spans(t, table,
                                                                            len(sizes))
    _assert_rows_and_token_major(t, sizes, E4M3, ref.QuantizedTensor(
        row_data, row_scale_inv, ref.ROWWISE, E4M3), fp8_wgrad.TokenMajor(data, scale_inv,
                                                                          padded))


def _assert_rows_and_token_major(t, sizes, rule, along_rows, token_major) -> None:
    offs = offsets(sizes)
    want_tm = fp8_wgrad.quantize_token_major(t, offs, rule)
    assert torch.equal(token_major.offs, want_tm.offs)
    assert same_bits(token_major.data, want_tm.data)
    assert same_bits(token_major.scale_inv, want_tm.scale_inv)
    grouped = sum(sizes)  # rows past the last group's end are unspecified
    want = eager_quantize(t[:grouped], rule)
    assert same_bits(along_rows.data[:grouped], want.data)
    assert same_bits(along_rows.scale_inv[:grouped], want.scale_inv)


@gpu
@needs_cute
@pytest.mark.parametrize("case", sorted(SPAN_CASES))
def test_span_table_kernel_is_the_torch_table(case):
    from te_seq.kernels import cute

    sizes, rows = SPAN_CASES[case]
    offs = offsets(sizes)
    blocks = fp8_wgrad.padded_width(rows, len(sizes)) // fp8_wgrad.WGRAD_PAD
    table, padded = cute.span_table(offs, blocks)
    want_table, want_padded = fp8_quantize._build_table(offs, rows)
    assert torch.equal(table, want_table) and torch.equal(padded, want_padded)


@gpu
@needs_cute
@pytest.mark.parametrize("cols", [16, 48, 112, 1040])  # 64-column chunks: 16 or 48 left over
@pytest.mark.parametrize("rows_too", [False, True], ids=["spans", "rows_and_token_major"])
def test_span_kernels_take_any_column_count(cols, rows_too):
    sizes, rows = SPAN_CASES["groups_of_many_blocks"]
    torch.manual_seed(8)
    t = _rows_input(rows, cols, torch.bfloat16)
    offs = offsets(sizes)
    want_tm = fp8_wgrad.quantize_token_major(t, offs, E4M3)
    if rows_too:
        along_rows, token_major = fp8_quantize.rows_and_token_major(t, offs, E4M3, "cute")
        grouped = sum(sizes)
        want = eager_quantize(t[:grouped], E4M3)
        assert same_bits(along_rows.data[:grouped], want.data)
        assert same_bits(along_rows.scale_inv[:grouped], want.scale_inv)
    else:
        token_major = fp8_quantize.token_major(t, offs, E4M3, "cute")
    assert same_bits(token_major.data, want_tm.data)
    assert same_bits(token_major.scale_inv, want_tm.scale_inv)


@gpu
@needs_cute
@pytest.mark.parametrize("rows_too", [False, True], ids=["spans", "rows_and_token_major"])
def test_span_kernels_quantize_one_group_of_many_blocks(rows_too):
    sizes, rows = ONE_BIG_GROUP
    torch.manual_seed(9)
    t = torch.randn(rows, 2064, device="cuda", dtype=torch.bfloat16)
    t[rows - 1, 2063] = 900.0  # the column's max sits in the group's last block
    t[5, 2000] = float("nan")
    offs = offsets(sizes)
    want_tm = fp8_wgrad.quantize_token_major(t, offs, E4M3)
    if rows_too:
        along_rows, token_major = fp8_quantize.rows_and_token_major(t, offs, E4M3, "cute")
        assert same_bits(along_rows.data, eager_quantize(t, E4M3).data)
    else:
        token_major = fp8_quantize.token_major(t, offs, E4M3, "cute")
    assert same_bits(token_major.data, want_tm.data)
    assert same_bits(token_major.scale_inv, want_tm.scale_inv)


# ---------------------------------------------------------------- GPU: the block-scaled form

MANY_GROUPS = [int(n) for n in torch.randint(0, 300, (128,), generator=torch.Generator()
                                             .manual_seed(12))]  # G=128, some near-empty


def _assert_blocks_bitwise(t: torch.Tensor, offs: torch.Tensor, rule: ref.ScaleRule) -> None:
    """The cute block-scaled token-major kernel (through its dispatch) against the torch
    definition: data, scale_inv and padded offsets bit for bit."""
    assert fp8_quantize.blocks_reason(t, rule, "cute") == ""  # the kernel really runs
    got = fp8_quantize.token_major_blocks(t, offs, rule, "cute")
    want = fp8_wgrad.quantize_token_major_blocks(t, offs, rule)
    assert isinstance(got, fp8_wgrad.BlockTokenMajor)
    assert torch.equal(got.offs, want.offs)
    assert same_bits(got.data, want.data)
    assert same_bits(got.scale_inv, want.scale_inv)


@gpu
@needs_cute
@pytest.mark.parametrize("case", [*sorted(SPAN_CASES), "many_groups", "no_rows"])
@pytest.mark.parametrize("rule", [E4M3, E4M3_POW2, E5M2], ids=["scale", "pow2", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_block_span_kernel_is_bitwise_quantize_token_major_blocks(case, rule, dtype):
    sizes, rows = {**SPAN_CASES, "no_rows": ([0, 0], 0)}.get(
        case, (MANY_GROUPS, sum(MANY_GROUPS) + 50))
    torch.manual_seed(13)
    # nan / inf / all-zero / tiny rows (bf16), magnitudes over six decades
    t = _rows_input(max(rows, 5), 2064, dtype)[:rows]
    _assert_blocks_bitwise(t, offsets(sizes), rule)


@gpu
@needs_cute
@pytest.mark.parametrize("cols", [16, 48, 112, 1040])  # 64-column chunks: 16 or 48 left over
def test_block_span_kernel_takes_any_column_count(cols):
    sizes, rows = SPAN_CASES["groups_of_many_blocks"]
    torch.manual_seed(14)
    _assert_blocks_bitwise(_rows_input(rows, cols, torch.bfloat16), offsets(sizes), E4M3)


@gpu
@needs_cute
def test_block_span_kernel_quantizes_one_group_of_many_blocks():
    sizes, rows = ONE_BIG_GROUP
    torch.manual_seed(15)
    t = torch.randn(rows, 2064, device="cuda", dtype=torch.bfloat16)
    t[rows - 1, 2063] = 900.0  # a maximum in the last block only: its scale alone changes
    t[5, 2000] = float("nan")  # the first block's column 2000: nan there, finite elsewhere
    _assert_blocks_bitwise(t, offsets(sizes), E4M3_POW2)


@gpu
@needs_cute
def test_block_span_kernel_takes_strided_inputs():
    torch.manual_seed(16)
    base = torch.randn(601, 2 * 528, device="cuda", dtype=torch.bfloat16)
    offs = offsets([100, 0, 300, 200])
    for t in (base[:600, ::2], base[1:, :528], base.t()[:528, :600].t()):
        _assert_blocks_bitwise(t, offs, E4M3)


@gpu
@needs_cute
def test_block_span_kernel_replays_in_a_cuda_graph_with_new_offsets():
    from te_seq.kernels import cute

    torch.manual_seed(17)
    t = torch.randn(600, 2 * 256, device="cuda", dtype=torch.float16)[:, ::2]
    offs = offsets([100, 0, 300, 200])
    fp8_quantize.token_major_blocks(t, offs, E4M3, "cute")  # compile outside the capture
    table, _ = fp8_quantize.span_table(offs, 600)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        data, scale_inv = cute.quantize_span_blocks(t, table)
    new_offs = offsets([1, 299, 0, 300])
    table.copy_(fp8_quantize._build_table(new_offs, 600)[0])
    graph.replay()
    want = fp8_wgrad.quantize_token_major_blocks(t, new_offs, E4M3)
    assert same_bits(data, want.data)
    assert same_bits(scale_inv, want.scale_inv)
