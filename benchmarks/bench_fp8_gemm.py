"""The FP8 mode of bench_grouped_gemm.py (``--fp8``): the grouped MLP's forward GEMMs (FC1
y1 = x W1ᵀ, FC2 y2 = a W2ᵀ) on E4M3 operands with row-wise dequantization scales.

Per shape and GEMM it times, interleaved in one run: ``cute.scaled_grouped_mm`` (te_seq's FP8
kernel), ``torch._scaled_grouped_mm`` (the peer, same operands and scales) and
``cute.grouped_mm`` on the bf16 operands the FP8 ones were quantized from; it prints TFLOP/s,
cute FP8 vs the peer and vs cute bf16, and the relative difference of the two FP8 outputs.

    python benchmarks/bench_grouped_gemm.py --fp8 [--shapes A,B,Q,Z] [--iters 20] [--json f]
"""

from __future__ import annotations

import json
import time

import torch

E4M3_MAX = 448.0


def quantize_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale_inv): q = fp8(t · s) per row of the last dim, s = 448 / amax (1 where the row
    is zero), scale_inv = 1 / s of shape t.shape[:-1] in fp32."""
    amax = t.float().abs().amax(dim=-1)
    scale = torch.where(amax > 0, E4M3_MAX / amax.clamp_min(1e-30), torch.ones_like(amax))
    q = (t.float() * scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, (1.0 / scale).contiguous()


def fp8_cases(e: int, h: int, f: int, m: int, sizes: list[int], device: str = "cuda"):
    """(label, flops, {variant: fn}) for FC1 and FC2 forward; variants "cute_fp8",
    "torch_fp8" (absent when torch lacks ``_scaled_grouped_mm``) and "cute_bf16"."""
    from te_seq.kernels import cute

    offs = torch.tensor(sizes).cumsum(0).to(torch.int32).to(device)
    bf = dict(device=device, dtype=torch.bfloat16)
    gemms = {
        "fc1_fwd": (torch.randn(m, h, **bf), torch.randn(e, 2 * f, h, **bf) * 0.02),
        "fc2_fwd": (torch.randn(m, f, **bf), torch.randn(e, h, f, **bf) * 0.02),
    }
    for label, (a, w) in gemms.items():
        (qa, sa), (qw, sw) = quantize_rowwise(a), quantize_rowwise(w)
        fns = {
            "cute_fp8": lambda qa=qa, qw=qw, sa=sa, sw=sw: cute.scaled_grouped_mm(
                qa, qw, sa, sw, offs),
            "cute_bf16": lambda a=a, w=w: cute.grouped_mm(a, w.transpose(1, 2), offs),
        }
        if hasattr(torch, "_scaled_grouped_mm"):
            fns["torch_fp8"] = lambda qa=qa, qw=qw, sa=sa, sw=sw: torch._scaled_grouped_mm(
                qa, qw.transpose(1, 2), sa, sw, offs=offs, out_dtype=torch.bfloat16)
        yield label, 2 * m * a.shape[1] * w.shape[1], fns


def run_fp8_shape(name: str, shape: tuple, sizes: list[int], iters: int, time_ms, rel_err):
    """Rows of one shape: ms, TFLOP/s, ratios and the FP8 outputs' relative difference."""
    e, h, f, m = shape
    rows = []
    for label, flops, fns in fp8_cases(e, h, f, m, sizes):
        first = {}
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            first[key] = round(time.perf_counter() - t0, 2)
        ms = time_ms(fns, iters)
        ours = fns["cute_fp8"]()
        row = dict(shape=name, gemm=label, first_call_s=first, ms=ms,
                   tflops={k: flops / v / 1e9 for k, v in ms.items()},
                   fp8_vs_bf16=ms["cute_bf16"] / ms["cute_fp8"])
        if "torch_fp8" in fns:
            row["fp8_vs_torch"] = ms["torch_fp8"] / ms["cute_fp8"]
            row["rel_diff_vs_torch"] = rel_err(ours, fns["torch_fp8"]())
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    day = time.strftime("%Y-%m-%d")
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  {day}")
    print(f"{'shape':5} {'gemm':8} {'cute fp8':>8} {'torch fp8':>9} {'cute bf16':>9} "
          "vs torch  vs bf16  rel diff")
    for r in rows:
        t = r["tflops"]
        print(f"{r['shape']:5} {r['gemm']:8} {t['cute_fp8']:8.0f} {t.get('torch_fp8', 0):9.0f} "
              f"{t['cute_bf16']:9.0f} {r.get('fp8_vs_torch', 0):8.2f} {r['fp8_vs_bf16']:7.2f} "
              f"{r.get('rel_diff_vs_torch', float('nan')):9.1e}")
    print("(TFLOP/s of real rows; ratios = their time / cute FP8 time)")
