"""The host side of the cute FP8 quantization functionals (te_seq/kernels/cute/quant.py), on the
CPU with the kernels stubbed (benchmarks/profile_launch.py: ``stubbed_step``): which buffers each
launch receives. The kernels' bits are tests/kernels/test_cute_quant.py's (GPU); here, that the
span cast kernel without a row-wise form gets constant dummies (never an output, never cached
while a CUDA graph is captured) and that the outputs stay fresh, disjoint and 16-byte aligned."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install "
                    "'te_seq[cute]')")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: its helper modules
from aten_log import AtenLog  # noqa: E402
from profile_launch import stubbed_step  # noqa: E402

from te_seq.kernels import cute, fp8_quantize  # noqa: E402
from te_seq.kernels.cute import quant  # noqa: E402
from te_seq.kernels.cute.compile_quant import QuantConfig  # noqa: E402

ROWS, COLS, SIZES = 300, 64, [0, 5, 130, 0, 1, 100]  # empty groups, rows past the last group


def _operands():
    t = torch.randn(ROWS, COLS).to(torch.bfloat16)
    offs = torch.tensor(SIZES).cumsum(0).to(torch.int32)
    table, _ = fp8_quantize.span_table(offs, ROWS)  # torch ops on the CPU: no kernel
    return t, table, offs


def _launches(stubs, kind: str) -> list[tuple]:
    return [args for cfg, stub in stubs.items()
            if isinstance(cfg, QuantConfig) and cfg.kind == kind for args in stub.calls]


def _bytes(t: torch.Tensor) -> range:
    start = t.data_ptr()
    return range(start, start + t.numel() * t.element_size())


def _disjoint(tensors) -> bool:
    spans = sorted((r.start, r.stop) for r in map(_bytes, tensors) if len(r))
    return all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))


def test_span_cast_without_row_form_reads_cached_dummies():
    t, table, offs = _operands()
    amax = torch.rand(len(SIZES), COLS)
    with stubbed_step(record=True) as stubs:
        outs = [cute.quantize_spans(t, table, len(SIZES)),
                cute.quantize_spans(t, table, len(SIZES)),
                cute.quantize_spans_from_group_amax(t, table, amax)]
        casts = _launches(stubs, "span_cast")
    assert len(casts) == 3
    dummies = [args[6:9] for args in casts]  # row_amax, row_data, row_scale_inv
    assert all(d[i] is dummies[0][i] for d in dummies for i in range(3))  # one set, reused
    row_amax, row_data, row_scale_inv = dummies[0]
    assert (row_amax.shape, row_data.shape, row_scale_inv.shape) == ((1,), (1, COLS), (1,))
    assert row_data.dtype == torch.float8_e4m3fn and row_amax.dtype == torch.float32
    kept = [x for data, scale_inv in outs for x in (data, scale_inv)]
    assert not any(d.data_ptr() == x.data_ptr() for d in dummies[0] for x in kept)
    assert outs[0][0].data_ptr() != outs[1][0].data_ptr()  # outputs are new on every call


def test_dummies_are_not_cached_while_a_graph_is_captured(monkeypatch):
    monkeypatch.setattr(quant, "_DUMMIES", {})
    monkeypatch.setattr(quant, "_capturing", lambda device: True)
    first = quant._span_dummies(COLS, torch.float8_e4m3fn, torch.device("cpu"))
    second = quant._span_dummies(COLS, torch.float8_e4m3fn, torch.device("cpu"))
    assert first[1] is not second[1] and quant._DUMMIES == {}
    monkeypatch.setattr(quant, "_capturing", lambda device: False)
    cached = quant._span_dummies(COLS, torch.float8_e4m3fn, torch.device("cpu"))
    assert quant._span_dummies(COLS, torch.float8_e4m3fn, torch.device("cpu"))[1] is cached[1]


@pytest.mark.parametrize("rows", [False, True], ids=["spans", "rows_and_spans"])
def test_span_buffers_are_fresh_disjoint_aligned_and_as_compiled(rows):
    """Every tensor the two span kernels receive: the shapes, dtypes and contiguous strides
    the kernels were compiled for, 16-byte aligned starts (their assumed_align), no two
    buffers of one call overlapping (the dummies aside, which no kernel touches)."""
    t, table, _ = _operands()
    groups, blocks = len(SIZES), table.shape[0]
    with stubbed_step(record=True) as stubs:
        if rows:
            cute.quantize_rows_and_spans(t, table, groups)
        else:
            cute.quantize_spans(t, table, groups)
        (amax_args,), (cast_args,) = _launches(stubs, "span_amax"), _launches(stubs, "span_cast")
    _, _, block_amax, extents, data, scale_inv, row_amax, row_data, row_scale_inv = cast_args
    assert amax_args[2] is block_amax and amax_args[3] is extents and amax_args[4] is row_amax
    want = {"block_amax": (block_amax, (blocks, COLS), torch.float32),
            "extents": (extents, (groups, 2), torch.int32),
            "data": (data, (COLS, blocks * 128), torch.float8_e4m3fn),
            "scale_inv": (scale_inv, (groups, COLS), torch.float32)}
    if rows:
        want.update(row_amax=(row_amax, (ROWS,), torch.float32),
                    row_data=(row_data, (ROWS, COLS), torch.float8_e4m3fn),
                    row_scale_inv=(row_scale_inv, (ROWS,), torch.float32))
        assert not row_amax.any()  # zeroed for the atomic max
    for name, (x, shape, dtype) in want.items():
        assert (tuple(x.shape), x.dtype, x.is_contiguous()) == (shape, dtype, True), name
        assert x.data_ptr() % 16 == 0, name
    assert _disjoint([x for x, _, _ in want.values()])


def test_row_blocks_are_the_rows_kernel_on_views_of_their_final_outputs(monkeypatch):
    """1 x 128 blocks (Float8BlockScaling's x and dy) on the cute backend: one launch of the
    row-wise kernel on t, data and scale_inv seen as [R·C/128, 128] / [R·C/128]; with that
    kernel faked by its torch definition the result is `fp8_reference.quantize`'s, bitwise."""
    from te_seq.kernels import fp8_reference as ref

    rule, block = ref.ScaleRule("E4M3", power_of_two=True), ref.QuantBlock(1, 128)
    launches = []

    def rows_kernel(t, data, scale_inv):  # the kernel's maths: one scale per row of t
        launches.append((t, data, scale_inv))
        with _disable_current_modes():  # not the host path's ops
            q = ref.quantize(t, ref.ROWWISE, rule)
            data.copy_(q.data)
            scale_inv.copy_(q.scale_inv.reshape(-1))

    monkeypatch.setattr(quant, "_kernel", lambda kind, *args: rows_kernel)
    monkeypatch.setattr(fp8_quantize, "reason", lambda *args: "")
    t = (torch.randn(40, 384) * torch.logspace(-3, 3, 384)).to(torch.bfloat16)
    with AtenLog() as ops:
        got = fp8_quantize.rows(t, block, rule, "cute")
    assert ops.names == ["empty", "empty", "view", "view", "view"]  # outputs, kernel views
    want = ref.quantize(t, block, rule)
    (kt, kdata, kscale), = launches
    assert kt.shape == kdata.shape == (40 * 3, 128) and kscale.shape == (40 * 3,)
    assert kdata.data_ptr() == got.data.data_ptr() and kscale.data_ptr() == got.scale_inv.data_ptr()
    assert got.data.shape == (40, 384) and got.scale_inv.shape == (40, 3)
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(got.scale_inv, want.scale_inv) and got.block == block


def _bank_words(addresses) -> dict[int, set[int]]:
    """The 4-byte shared-memory words that byte ``addresses`` touch, by bank (32 banks)."""
    banks: dict[int, set[int]] = {}
    for address in addresses:
        banks.setdefault(address // 4 % 32, set()).add(address // 4)
    return banks


def test_span_cast_staging_is_one_to_one_and_free_of_bank_conflicts():
    """The span cast kernels' FP8 staging (span_kernels._staged_byte): every (column, token) of
    a tile has its own byte; each byte-store instruction of a warp touches one word per bank
    (lanes sharing a word write its different bytes); each quarter-warp's 16-byte reads of the
    store passes cover the 32 banks once. A mutated swizzle or lane mapping fails here."""
    from te_seq.kernels.cute import span_kernels as sk

    cells = {sk._staged_byte(c, r) for c in range(sk.SPAN_COLS) for r in range(sk.SPAN_BLOCK)}
    assert cells == set(range(sk.SPAN_COLS * sk.SPAN_BLOCK))
    values = [(v * sk.VEC + k, row0 + i * sk.ROWS_PER_PASS)
              for v, row0 in map(sk._stage_coords, range(sk.THREADS))
              for i in range(sk.PASSES) for k in range(sk.VEC)]
    assert sorted(values) == [(c, r) for c in range(sk.SPAN_COLS) for r in range(sk.SPAN_BLOCK)]
    for warp in range(sk.WARPS):
        lanes = [sk._stage_coords(32 * warp + lane) for lane in range(32)]
        for i in range(sk.PASSES):
            for k in range(sk.VEC):
                touched = _bank_words(sk._staged_byte(v * sk.VEC + k, row0 + i * sk.ROWS_PER_PASS)
                                      for v, row0 in lanes)
                assert all(len(words) == 1 for words in touched.values()), (warp, i, k)
    for p in range(sk.STORE_PASSES):
        for first in range(0, sk.THREADS, 8):
            quarter = range(first, first + 8)
            chunks = [sk._staged_chunk(*sk._store_coords(tid, p)) for tid in quarter]
            touched = _bank_words(16 * chunk + b for chunk in chunks for b in range(0, 16, 4))
            assert sorted(touched) == list(range(32)), (p, first)
    stored = {sk._store_coords(tid, p) for tid in range(sk.THREADS) for p in range(sk.STORE_PASSES)}
    assert stored == {(c, j) for c in range(sk.SPAN_COLS) for j in range(sk.STORES_PER_COLUMN)}
