"""The "torch" backend against the reference, on fresh random data (never zeros).

Grid axes and why:
- split sizes: one group, 128 groups, empty groups, sizes not multiples of 8 (the 2D×2D
  ``torch._grouped_mm`` needs 16-byte group boundaries on CUDA), zero rows, all rows in one of
  many groups — the cases a sync-free grid and a padded layout get wrong first;
- K/N multiples of 8 or not (``torch._grouped_mm`` wants 16-byte strides: the padding path);
- dtype: float64 (tiled path, judged exactly), float32 (native on CPU), bfloat16 (native, judged
  against the reference's own bf16 error versus float64);
- layout: transposed weight views (b = Wᵀ of a [E, N, K] weight) and non-contiguous inputs.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from te_seq.kernels import reference, torch_backend

requires_grouped_mm = pytest.mark.skipif(
    not torch_backend.available()[0], reason=torch_backend.available()[1]
)
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
requires_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs a CUDA GPU with sm_90+ (torch._grouped_mm bf16 fast path)",
)

SPLITS = {
    "one_group": [37],
    "many_groups": None,  # 128 random sizes, some zero, see _split_sizes
    "empty_groups": [0, 9, 0, 0, 14, 0],
    "unaligned": [3, 11, 5, 17, 1],
    "zero_rows": [0, 0, 0],
    "all_in_one": [0, 0, 29, 0],
}
DIMS = {"aligned": (16, 24), "unaligned": (13, 7)}  # (K, N)
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def _split_sizes(name: str, gen: torch.Generator) -> list[int]:
    if SPLITS[name] is not None:
        return SPLITS[name]
    sizes = torch.randint(0, 12, (128,), generator=gen)
    return sizes.tolist()


def _offs(sizes: list[int], device: str | torch.device = "cpu") -> Tensor:
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def _randn(*shape: int, gen: torch.Generator, dtype: torch.dtype, device: str = "cpu") -> Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


def _assert_matches(ours: Tensor, ref: Tensor, oracle: Tensor) -> None:
    """ours vs the reference in the same dtype; low precision judged by the reference's own error.

    float64/float32: elementwise close to ``ref``. bf16/fp16: ``ours`` may be off the float64
    ``oracle`` by at most twice the reference's own max error (plus one ulp of the output scale).
    """
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if ref.dtype == torch.float64:
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    elif ref.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    else:
        ref_err = (ref.double() - oracle).abs().max().item() if ref.numel() else 0.0
        ulp = torch.finfo(ref.dtype).eps * (oracle.abs().max().item() if oracle.numel() else 0.0)
        err = (ours.double() - oracle).abs().max().item() if ours.numel() else 0.0
        assert err <= 2 * ref_err + ulp, f"error {err} vs reference's own {ref_err}"


def _case(split: str, dims: str, dtype: torch.dtype, seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    sizes = _split_sizes(split, gen)
    k, n = DIMS[dims]
    m, e = sum(sizes), len(sizes)
    a = _randn(m, k, gen=gen, dtype=dtype, device=device)
    w = _randn(e, n, k, gen=gen, dtype=dtype, device=device)  # a weight [E, N, K]
    dy = _randn(m, n, gen=gen, dtype=dtype, device=device)
    return a, w, dy, _offs(sizes, device)


@requires_grouped_mm
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("split", SPLITS)
def test_grouped_mm_matches_reference(split: str, dims: str, dtype: torch.dtype) -> None:
    a, w, _, offs = _case(split, dims, dtype, seed=1)
    for b in (w.transpose(1, 2), w.transpose(1, 2).contiguous()):  # view and copy of Wᵀ
        ours = torch_backend.grouped_mm(a, b, offs)
        ref = reference.grouped_mm(a, b, offs)
        _assert_matches(ours, ref, reference.grouped_mm(a.double(), b.double(), offs))


@requires_grouped_mm
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("split", SPLITS)
def test_grouped_wgrad_matches_reference(split: str, dims: str, dtype: torch.dtype) -> None:
    a, _, dy, offs = _case(split, dims, dtype, seed=2)
    ours = torch_backend.grouped_wgrad(dy, a, offs)
    ref = reference.grouped_wgrad(dy, a, offs)
    _assert_matches(ours, ref, reference.grouped_wgrad(dy.double(), a.double(), offs))


@requires_grouped_mm
@pytest.mark.parametrize("row_align", [4, 8])
@pytest.mark.parametrize("split", SPLITS)
def test_padded_wgrad_matches_reference(split: str, row_align: int) -> None:
    """The CUDA wgrad path (groups moved to 16-byte boundaries), exercised on CPU in fp32."""
    a, _, dy, offs = _case(split, "aligned", torch.float32, seed=3)
    ours = torch_backend._native_wgrad(dy, a, offs, row_align)
    torch.testing.assert_close(ours, reference.grouped_wgrad(dy, a, offs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("align", [1, 8, 64])
def test_padded_layout_places_groups_on_boundaries(align: int) -> None:
    sizes = [3, 0, 17, 8, 1]
    layout = torch_backend._padded_layout(_offs(sizes), sum(sizes), align)
    assert layout.num_rows % align == 0 and layout.num_rows >= sum(sizes) + 4 * (align - 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), layout.padded_offs[:-1]])
    assert (starts % align == 0).all()
    rows = torch.arange(sum(sizes))
    group = torch.searchsorted(_offs(sizes).long(), rows, right=True)
    expected = starts[group] + rows - (_offs(sizes) - torch.tensor(sizes))[group]
    assert torch.equal(layout.dest, expected.long())


@requires_grouped_mm
def test_rows_past_last_offset_are_dropped_by_wgrad() -> None:
    """Rows after offs[-1] belong to no group: the padded layout sends them to the dump row."""
    a, _, dy, offs = _case("unaligned", "aligned", torch.float32, seed=4)
    short = offs.clone()
    short[-1] -= 1  # the last row now belongs to no group
    ref = reference.grouped_wgrad(dy, a, short)
    for row_align in (1, 8):
        ours = torch_backend._native_wgrad(dy, a, short, row_align)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        torch_backend._tiled_wgrad(dy.double(), a.double(), short),
        reference.grouped_wgrad(dy.double(), a.double(), short),
    )


@requires_grouped_mm
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_wgrad_into_fp32_out(dtype: torch.dtype, accumulate: bool) -> None:
    a, _, dy, offs = _case("unaligned", "aligned", dtype, seed=5)
    start = torch.randn(
        len(offs), dy.shape[1], a.shape[1], generator=torch.Generator().manual_seed(6)
    )
    ours = torch_backend.grouped_wgrad(dy, a, offs, out=start.clone(), accumulate=accumulate)
    ref = reference.grouped_wgrad(dy, a, offs, out=start.clone(), accumulate=accumulate)
    # bf16 inputs: the native path rounds the wgrad to bf16 before adding (module docstring).
    tol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps * ref.abs().max().item()
    torch.testing.assert_close(ours, ref, rtol=0, atol=tol)


@requires_grouped_mm
def test_out_dtype_and_noncontiguous_a() -> None:
    """out_dtype ≠ input dtype and a strided input both take a copy/tiled path, exactly."""
    a, w, _, offs = _case("empty_groups", "aligned", torch.bfloat16, seed=7)
    wide = torch.randn(a.shape[0], 3 * a.shape[1], generator=torch.Generator().manual_seed(8))
    strided = wide.to(a.dtype)[:, ::3]  # [M, K], column stride 3
    for x in (a, strided):
        ours = torch_backend.grouped_mm(x, w.transpose(1, 2), offs, out_dtype=torch.float32)
        ref = reference.grouped_mm(x, w.transpose(1, 2), offs, out_dtype=torch.float32)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    ours = torch_backend.grouped_mm(strided, w.transpose(1, 2), offs)
    _assert_matches(
        ours,
        reference.grouped_mm(strided, w.transpose(1, 2), offs),
        reference.grouped_mm(strided.double(), w.transpose(1, 2).double(), offs),
    )


def test_available_says_why() -> None:
    ok, reason = torch_backend.available()
    assert ok == hasattr(torch, "_grouped_mm")
    assert ok or "_grouped_mm" in reason


# --------------------------------------------------------------------------- GPU


@gpu
@requires_sm90
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("split", SPLITS)
def test_cuda_bf16_matches_reference(split: str, dims: str) -> None:
    a, w, dy, offs = _case(split, dims, torch.bfloat16, seed=11, device="cuda")
    b = w.transpose(1, 2)
    _assert_matches(
        torch_backend.grouped_mm(a, b, offs),
        reference.grouped_mm(a, b, offs),
        reference.grouped_mm(a.double(), b.double(), offs),
    )
    _assert_matches(
        torch_backend.grouped_wgrad(dy, a, offs),
        reference.grouped_wgrad(dy, a, offs),
        reference.grouped_wgrad(dy.double(), a.double(), offs),
    )


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_cuda_other_dtypes_take_tiled_path(dtype: torch.dtype) -> None:
    a, w, dy, offs = _case("unaligned", "unaligned", dtype, seed=12, device="cuda")
    b = w.transpose(1, 2)
    oracle_mm = reference.grouped_mm(a.double(), b.double(), offs)
    oracle_wg = reference.grouped_wgrad(dy.double(), a.double(), offs)
    _assert_matches(
        torch_backend.grouped_mm(a, b, offs), reference.grouped_mm(a, b, offs), oracle_mm
    )
    _assert_matches(
        torch_backend.grouped_wgrad(dy, a, offs), reference.grouped_wgrad(dy, a, offs), oracle_wg
    )


@gpu
@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_no_host_sync_and_graph_replay(dtype: torch.dtype) -> None:
    """Capture grouped_mm + wgrad in a CUDA graph, replay with new split sizes, no sync at all."""
    gen = torch.Generator().manual_seed(13)
    a = _randn(96, 32, gen=gen, dtype=dtype, device="cuda")
    b = _randn(4, 32, 24, gen=gen, dtype=dtype, device="cuda")
    dy = _randn(96, 24, gen=gen, dtype=dtype, device="cuda")
    offs = _offs([5, 40, 0, 51], "cuda")

    def step() -> tuple[Tensor, Tensor]:
        return torch_backend.grouped_mm(a, b, offs), torch_backend.grouped_wgrad(dy, a, offs)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside capture
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(stream)
    for sizes in ([5, 40, 0, 51], [0, 96, 0, 0], [17, 3, 61, 15]):
        offs.copy_(_offs(sizes, "cuda"))
        graph.replay()
        _assert_matches(
            outs[0],
            reference.grouped_mm(a, b, offs),
            reference.grouped_mm(a.double(), b.double(), offs),
        )
        _assert_matches(
            outs[1],
            reference.grouped_wgrad(dy, a, offs),
            reference.grouped_wgrad(dy.double(), a.double(), offs),
        )


@requires_grouped_mm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_cpu_path_choice(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32/bf16 on CPU run torch._grouped_mm (even for unaligned K/N); float64 runs tiled."""
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    a, w, dy, offs = _case("unaligned", "unaligned", dtype, seed=14)
    torch_backend.grouped_mm(a, w.transpose(1, 2), offs)
    torch_backend.grouped_wgrad(dy, a, offs)
    assert len(calls) == (0 if dtype == torch.float64 else 2)


@gpu
@requires_sm90
def test_cuda_wgrad_groups_start_on_any_row() -> None:
    """The wgrad runs torch._grouped_mm on groups that start on odd rows (no row padding):
    many 128-row tiles, group starts at every residue mod 8, an empty group, fresh data."""
    sizes = [1, 3, 129, 0, 255, 257, 7, 513]
    gen = torch.Generator().manual_seed(21)
    m, k, n = sum(sizes), 192, 136
    a = _randn(m, k, gen=gen, dtype=torch.bfloat16, device="cuda")
    dy = _randn(m, n, gen=gen, dtype=torch.bfloat16, device="cuda")
    offs = _offs(sizes).cuda()
    ours = torch_backend.grouped_wgrad(dy, a, offs)
    ref = reference.grouped_wgrad(dy.double(), a.double(), offs)
    assert ((ours.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert (ours[3] == 0).all()  # the empty group


def test_wgrad_pads_rows_only_for_column_major_operands() -> None:
    """Row-major operands run unpadded; an operand contiguous along the rows (where torch's CUDA
    kernel asserts 16-byte group spans) takes the 8-row padded layout; CPU never pads."""
    rows = torch.empty(10, 16, dtype=torch.bfloat16, device="meta")
    cols = torch.empty(16, 10, dtype=torch.bfloat16, device="meta").t()
    fake_cuda = type("T", (), {})  # stride/element_size/device as a CUDA tensor reports them

    def cuda_like(t):
        obj = fake_cuda()
        obj.stride, obj.element_size = t.stride, t.element_size
        obj.device = torch.device("cuda")
        return obj

    assert torch_backend._wgrad_row_align(cuda_like(rows), cuda_like(rows)) == 1
    assert torch_backend._wgrad_row_align(cuda_like(cols), cuda_like(rows)) == 8
    assert torch_backend._wgrad_row_align(cuda_like(rows), cuda_like(cols)) == 8
    cpu_cols = torch.empty(16, 10, dtype=torch.bfloat16).t()
    assert torch_backend._wgrad_row_align(cpu_cols, cpu_cols) == 1
