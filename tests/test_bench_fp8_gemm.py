"""The FP8 mode of benchmarks/bench_grouped_gemm.py on the CPU: its row-wise quantizer and the
cases it times (built, not run: the kernels need a GPU), so a broken benchmark shows in CI."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_fp8_gemm  # noqa: E402


def test_quantize_rowwise_dequantizes_within_e4m3_precision():
    t = torch.randn(6, 64, dtype=torch.bfloat16) * torch.rand(6, 1, dtype=torch.bfloat16) * 50
    t[2] = 0
    q, scale_inv = bench_fp8_gemm.quantize_rowwise(t)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (6,)
    assert scale_inv.dtype == torch.float32 and scale_inv[2] == 1
    assert q.float().abs().amax(-1)[[0, 1, 3, 4, 5]].eq(448).all()  # each row's amax -> 448
    deq = q.float() * scale_inv[:, None]
    # 3 mantissa bits (relative 2^-4), subnormals spaced 2^-9 (in the scaled units)
    bound = t.float().abs() * 2**-4 + scale_inv[:, None] * 2**-9
    assert ((deq - t.float()).abs() <= bound).all()


def test_fp8_cases_build_every_variant():
    cases = list(bench_fp8_gemm.fp8_cases(3, 32, 48, 40, [10, 0, 30], device="cpu"))
    assert [c[0] for c in cases] == ["fc1_fwd", "fc2_fwd"]
    assert [c[1] for c in cases] == [2 * 40 * 32 * 96, 2 * 40 * 48 * 32]
    for _, _, fns in cases:
        expected = {"cute_fp8", "cute_fp8_block", "cute_bf16"} | (
            {"torch_fp8"} if hasattr(torch, "_scaled_grouped_mm") else set())
        assert set(fns) == expected


def test_quantize_blocks_dequantizes_within_e4m3_precision():
    # partial blocks along both dims (R = 200 rows in 128-row blocks, C = 208 columns)
    t = torch.randn(3, 200, 208) * torch.rand(3, 200, 1) * 20
    for rows in (1, 128):
        q, scale_inv = bench_fp8_gemm.quantize_blocks(t, rows)
        rb = -(-200 // rows)
        assert q.shape == t.shape and scale_inv.shape == (3, rb, 2)
        full = scale_inv.repeat_interleave(rows, 1)[:, :200].repeat_interleave(128, 2)[..., :208]
        deq = q.float() * full
        bound = t.abs() * 2**-4 + full * 2**-9
        assert ((deq - t).abs() <= bound).all()
        assert q.float().abs().amax().eq(448)
