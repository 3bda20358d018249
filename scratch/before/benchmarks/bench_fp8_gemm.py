"""The FP8 mode of bench_grouped_gemm.py (``--fp8``): the grouped MLP's forward GEMMs (FC1
y1 = x W1ᵀ, FC2 y2 = a W2ᵀ) on E4M3 operands with row-wise dequantization scales, and its
weight gradients (dW1 = dHᵀ x, dW2 = dYᵀ a) on token-major E4M3 operands with one scale per
(expert, column) along the tokens.

Per shape and GEMM it times, interleaved in one run: ``cute.scaled_grouped_mm`` /
``cute.scaled_grouped_wgrad`` (te_seq's FP8 kernels), ``torch._scaled_grouped_mm`` (the peer,
same operands and scales; forward only), ``cute.block_scaled_grouped_mm`` on the same data
quantized in 1x128 / 128x128 blocks (forward; the wgrads: ``cute.block_scaled_grouped_wgrad``
on 1x128 blocks along each expert's tokens) and ``cute.grouped_mm`` /
``cute.grouped_wgrad`` on the bf16 operands the FP8 ones were quantized from; it prints
TFLOP/s, cute FP8 vs the peer and vs cute bf16, and the relative difference of the two FP8 outputs.

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
    amax = t.float().abs().amax(dim=-1) if t.shape[-1] else t.new_zeros(t.shape[:-1]).float()
    scale = torch.where(amax > 0, E4M3_MAX / amax.clamp_min(1e-30), torch.ones_like(amax))
    q = (t.float() * scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, (1.0 / scale).contiguous()


def quantize_blocks(t: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale_inv): t [..., R, C] quantized per ``rows`` x 128 block (1 x 128: activations;
    128 x 128: weights; a partial last block takes the amax of its real values), scale_inv
    [..., ceil(R / rows), ceil(C / 128)] in fp32 (the block-scaled kernel's layout)."""
    *lead, r, c = t.shape
    rb, cb = -(-r // rows), -(-c // 128)
    padded = torch.nn.functional.pad(t.float(), (0, cb * 128 - c, 0, rb * rows - r))
    blocks = padded.reshape(*lead, rb, rows, cb, 128)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True)
    scale = torch.where(amax > 0, E4M3_MAX / amax.clamp_min(1e-30), torch.ones_like(amax))
    q = (blocks * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(padded.shape)[..., :r, :c].contiguous()
    return q, (1.0 / scale).reshape(*lead, rb, cb).contiguous()


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
        (ba, bsa), (bw, bsw) = quantize_blocks(a, 1), quantize_blocks(w, 128)
        fns["cute_fp8_block"] = lambda ba=ba, bw=bw, bsa=bsa, bsw=bsw: (
            cute.block_scaled_grouped_mm(ba, bw, bsa, bsw, offs))
        if hasattr(torch, "_scaled_grouped_mm"):
            fns["torch_fp8"] = lambda qa=qa, qw=qw, sa=sa, sw=sw: torch._scaled_grouped_mm(
                qa, qw.transpose(1, 2), sa, sw, offs=offs, out_dtype=torch.bfloat16)
        yield label, 2 * m * a.shape[1] * w.shape[1], fns


def token_major(t: torch.Tensor, sizes: list[int], span: int = 128):
    """(q [C, P], scale_inv [G, C], padded ends [G] int32): t [M, C] quantized per (group,
    column) along the tokens, each group's tokens at the start of a span rounded up to
    ``span`` tokens (zeros after), as ``cute.scaled_grouped_wgrad`` takes them."""
    spans = [-(-c // span) * span for c in sizes]
    q = torch.zeros(t.shape[1], sum(spans) + span, dtype=torch.float8_e4m3fn, device=t.device)
    scale_inv, start, dst = [], 0, 0
    for c, width in zip(sizes, spans):
        qg, sg = quantize_rowwise(t[start:start + c].t())
        q[:, dst:dst + c] = qg
        scale_inv.append(sg)
        start, dst = start + c, dst + width
    ends = torch.tensor(spans).cumsum(0).to(torch.int32).to(t.device)
    return q, torch.stack(scale_inv), ends


def fp8_wgrad_cases(e: int, h: int, f: int, m: int, sizes: list[int], device: str = "cuda"):
    """(label, flops, {variant: fn}) for FC1 and FC2 weight gradients (bf16 outputs)."""
    from te_seq.kernels import cute, fp8_wgrad
    from te_seq.kernels.fp8_reference import ScaleRule

    rule = ScaleRule("E4M3", power_of_two=True)  # Float8BlockScaling's
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32).to(device)
    bf = dict(device=device, dtype=torch.bfloat16)
    gemms = {
        "fc1_wgrad": (torch.randn(m, 2 * f, **bf), torch.randn(m, h, **bf)),  # dH, x
        "fc2_wgrad": (torch.randn(m, h, **bf), torch.randn(m, f, **bf)),  # dY, a
    }
    for label, (dout, x) in gemms.items():
        (qd, sd, ends), (qx, sx, _) = token_major(dout, sizes), token_major(x, sizes)
        fns = {
            "cute_fp8": lambda qd=qd, qx=qx, sd=sd, sx=sx, ends=ends: cute.scaled_grouped_wgrad(
                qd, qx, sd, sx, ends),
            "cute_bf16": lambda dout=dout, x=x: cute.grouped_wgrad(dout, x, offs),
        }
        bd = fp8_wgrad.quantize_token_major_blocks(dout, offs, rule)
        bx = fp8_wgrad.quantize_token_major_blocks(x, offs, rule)
        fns["cute_fp8_block"] = lambda bd=bd, bx=bx: cute.block_scaled_grouped_wgrad(
            bd.data, bx.data, bd.scale_inv, bx.scale_inv, bd.offs)
        yield label, 2 * m * dout.shape[1] * x.shape[1], fns


def run_fp8_shape(name: str, shape: tuple, sizes: list[int], iters: int, time_ms, rel_err):
    """Rows of one shape: ms, TFLOP/s, ratios and the FP8 outputs' relative difference."""
    e, h, f, m = shape
    rows = []
    cases = [*fp8_cases(e, h, f, m, sizes), *fp8_wgrad_cases(e, h, f, m, sizes)]
    for label, flops, fns in cases:
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
    print(f"{'shape':5} {'gemm':9} {'cute fp8':>8} {'block':>6} {'torch fp8':>9} "
          f"{'cute bf16':>9} vs torch  vs bf16  rel diff")
    for r in rows:
        t = r["tflops"]
        print(f"{r['shape']:5} {r['gemm']:9} {t['cute_fp8']:8.0f} "
              f"{t.get('cute_fp8_block', 0):6.0f} {t.get('torch_fp8', 0):9.0f} "
              f"{t['cute_bf16']:9.0f} "
              f"{r.get('fp8_vs_torch', 0):8.2f} {r['fp8_vs_bf16']:7.2f} "
              f"{r.get('rel_diff_vs_torch', float('nan')):9.1e}")
    print("(TFLOP/s of real rows; block = cute block_scaled_grouped_mm (1x128 / 128x128 scales) "
          "or block_scaled_grouped_wgrad (1x128 along the tokens); "
          "ratios = their time / cute FP8 (row-wise) time)")
