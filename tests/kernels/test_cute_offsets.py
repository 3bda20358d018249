"""The one-launch group offsets of the cute backend (te_seq/kernels/cute/offsets.py) against
the torch definition (te_seq/kernels/offsets.py).

CPU: the kernel compiles for sm_90a for int32 and int64 split sizes; off the GPU the backend's
`group_offsets` runs the torch ops (same values, same checks). GPU: offsets bitwise equal to
torch's cumsum on fresh random split sizes (1 to 1000 groups: one chunk of 32, several, a
partial last one; empty groups), the check flag for negative sizes and wrong sums, no groups,
CUDA-graph replay with new sizes, and the device-side assert through a GroupedLinear."""

import subprocess
import sys
import textwrap

import pytest
import torch
from cute_marks import compile_for_sm90a, gpu, needs_cute, needs_dsl

from te_seq.kernels import get_backend
from te_seq.kernels import offsets as offsets_maths

GROUP_COUNTS = [1, 7, 32, 33, 128, 1000]


@needs_dsl
def test_offsets_kernel_compiles_for_sm90a():
    compile_for_sm90a(textwrap.dedent("""
        import torch
        from te_seq.kernels.cute.offsets_kernel import compile_offsets
        for dtype in (torch.int32, torch.int64):
            compile_offsets(dtype)
        print("ALL COMPILED")
    """), timeout=600)


def test_cute_backend_offsets_off_the_gpu_are_the_torch_ones():
    torch.manual_seed(0)
    splits = torch.randint(0, 50, (9,))
    rows = int(splits.sum())
    offs = get_backend("cute").group_offsets(splits, rows, torch.device("cpu"))
    assert offs.dtype == torch.int32
    assert torch.equal(offs, torch.cumsum(splits, 0).to(torch.int32))


def _splits(groups: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Fresh random sizes on the GPU, about a quarter of the groups empty."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 300, (groups,), generator=g)
    sizes[torch.rand(groups, generator=g) < 0.25] = 0
    return sizes.to(dtype).cuda()


def _run(splits: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
    from te_seq.kernels import cute

    assert cute.offsets_problem(splits) == ""
    offs, ok = cute.group_offsets(splits, rows)
    return offs, int(ok.item())


@gpu
@needs_cute
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("groups", GROUP_COUNTS)
def test_offsets_equal_torch_cumsum(groups, dtype):
    splits = _splits(groups, dtype, seed=groups)
    expected = torch.cumsum(splits, 0, dtype=torch.int32)
    offs, ok = _run(splits, int(expected[-1]))
    assert torch.equal(offs, expected)
    assert ok == 1


@gpu
@needs_cute
@pytest.mark.parametrize("groups", [5, 40])
def test_offsets_flag_negative_sizes_and_wrong_sums(groups):
    """The flag is 0 and the offsets all zeros (every group empty: a GEMM launched on them
    before the assert reads no row)."""
    splits = _splits(groups, torch.int64, seed=3)
    total = int(splits.sum())
    zeros = torch.zeros(groups, dtype=torch.int32, device="cuda")
    for rows in (total + 1, total - 1):  # sums to fewer / more rows than the input has
        offs, ok = _run(splits, rows)
        assert ok == 0 and torch.equal(offs, zeros)
    splits[groups - 2] = -5
    splits[groups - 1] += 5  # same total, one negative size
    offs, ok = _run(splits, total)
    assert ok == 0 and torch.equal(offs, zeros)


@gpu
@needs_cute
def test_offsets_of_no_groups():
    splits = torch.zeros(0, dtype=torch.int64, device="cuda")
    offs, ok = _run(splits, 0)
    assert offs.numel() == 0 and ok == 1
    assert _run(splits, 3)[1] == 0


@gpu
@needs_cute
def test_offsets_replay_in_a_cuda_graph_with_new_sizes():
    from te_seq.kernels import cute

    splits = _splits(100, torch.int64, seed=5)
    rows = int(splits.sum())
    cute.group_offsets(splits, rows)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        offs, ok = cute.group_offsets(splits, rows)
    new = _splits(100, torch.int64, seed=6)
    new[:2] = 0
    new[2] = rows - int(new[3:].sum())  # same total, other sizes: still valid
    for sizes, valid in ((new, new[2] >= 0), (_splits(100, torch.int64, seed=7), False)):
        splits.copy_(sizes)
        graph.replay()
        good = bool(valid) and int(sizes.sum()) == rows
        want = torch.cumsum(sizes, 0, dtype=torch.int32) if good else torch.zeros_like(offs)
        assert torch.equal(offs, want)
        assert int(ok.item()) == int(good)


@gpu
@needs_cute
def test_bad_device_split_sizes_trip_the_assert_on_the_cute_backend():
    """Through GroupedLinear on the cute backend: one launch computes the flag, the assert is
    torch's device-side assert with the message (its own process: the assert poisons it)."""
    script = textwrap.dedent("""
        import torch, te_seq
        from te_seq import ops
        lin = te_seq.Sequential(ops.GroupedLinear(3, 64, 64, device="cuda", dtype=torch.bfloat16))
        x = torch.randn(10, 64, device="cuda", dtype=torch.bfloat16)
        with te_seq.backend("cute"):
            lin(x, torch.tensor([3, 3, 3], device="cuda"))
        torch.cuda.synchronize()
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    assert offsets_maths.SPLITS_MESSAGE in result.stderr or "device-side assert" in result.stderr
