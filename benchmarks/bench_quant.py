"""The FP8 quantization kernels alone (``te_seq.kernels.cute``): ``quantize_spans`` (token-major,
one scale per (group, column)), ``quantize_rows_and_spans`` (both forms in one pass pair),
``quantize_rows`` (one scale per row), ``quantize_span_blocks`` (kind "blocks": token-major,
one scale per (128-token block, column), ``Float8BlockScaling``'s wgrad operands),
``quantize_rows_and_group_amax`` (kind "rows_group_amax": row-wise plus each group's column
maxima, one read of t), ``quantize_spans_from_group_amax`` (kind "spans_from_amax": the
token-major cast from those maxima, one read of t; the maxima made once, untimed) and
``quantize_spans_in_strips`` (kind "strips": token-major in one read and one launch, a CTA
holding a group's strip), bf16 in, E4M3 out, on the grouped MLP's operands.
"rows_group_amax" + "spans_from_amax" is the pair that replaces "rows" + "spans" (three reads
of t) when x is quantized token-major in backward; "rows" + "strips" replaces that pair where
the groups hold up to 512 tokens on average.

Per shape (benchmarks/mlp_case.py SHAPES; uniform groups but for Z's) the operands are x and
dy [M, H], the FC1 output gradient [M, 2F] and the activation [M, F]. Each call is timed with
CUDA events over bursts of 10 back-to-back calls (median of the runs, variants interleaved:
``_common.time_interleaved``); it prints ms per call and GB/s of the compulsory traffic (t read
once, every output written once: the span kernels read t twice, the second time partly from
L2, so 3 TB/s on an H100 is the ceiling of this figure; the block kernel reads it once).
``--torch`` also times the torch definitions (``fp8_wgrad.quantize_token_major``,
``fp8_reference.quantize``, ``fp8_wgrad.quantize_token_major_blocks``).

    python benchmarks/bench_quant.py [--shapes Q,A] [--iters 20] [--torch] [--json f]
    python benchmarks/bench_quant.py --weights [--shapes Q,B]   # the weights' two forms
        (with the cute pair's two launches and a row-wise pass alone over the same w, kinds
        "w:rows+amax", "w:cast along N", "w:rows alone": which half to speed up)
    python benchmarks/bench_quant.py --dry-run   # CPU: tiny shape, torch definitions only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, for te_seq

from _common import time_interleaved  # noqa: E402
from mlp_case import SHAPES, Shape, split_counts  # noqa: E402

BURST = 10
FP8 = torch.float8_e4m3fn
DRY_SHAPE = Shape(E=4, H=64, F=48, M=256)  # every width a multiple of 16, like the kernels ask
KINDS = ("spans", "rows_and_spans", "rows", "blocks", "rows_group_amax", "spans_from_amax",
         "strips")
TORCH_KINDS = KINDS[:4]  # the new kinds have no torch definition of their own


def operands(s: Shape) -> dict[str, int]:
    """The quantized operands' widths C (each t is [M, C])."""
    return {"x/dy [M,H]": s.H, "dh [M,2F]": 2 * s.F, "a [M,F]": s.F}


def traffic_bytes(kind: str, m: int, c: int, groups: int, width: int) -> int:
    """Bytes read + written once: t (bf16) in; token-major data [C, width] and scale_inv
    [G, C] fp32 (spans) or [width / 128, C] (blocks), row-wise data [M, C] and scale_inv [M]
    fp32 (rows); the group maxima [G, C] fp32 written (rows_group_amax) or read
    (spans_from_amax) once."""
    spans = c * width + 4 * groups * c
    rows = m * c + 4 * m
    blocks = c * width + 4 * (width // 128) * c
    amax = 4 * groups * c
    out = {"spans": spans, "rows_and_spans": spans + rows, "rows": rows, "blocks": blocks,
           "rows_group_amax": rows + amax, "spans_from_amax": spans + amax,
           "strips": spans}[kind]
    return 2 * m * c + out


def calls(t: torch.Tensor, offs: torch.Tensor, use_torch: bool) -> dict[str, Callable[[], object]]:
    """{variant: call} for the kinds, on the cute backend (where it can run; the group-maxima
    kinds for C <= 16384) or as the torch definitions (the first four kinds)."""
    from te_seq.kernels import fp8_quantize, fp8_wgrad
    from te_seq.kernels import fp8_reference as ref

    rule = ref.ScaleRule("E4M3")
    if use_torch:
        return {
            "spans": lambda: fp8_wgrad.quantize_token_major(t, offs, rule),
            "rows_and_spans": lambda: (ref.quantize(t, ref.ROWWISE, rule),
                                       fp8_wgrad.quantize_token_major(t, offs, rule)),
            "rows": lambda: ref.quantize(t, ref.ROWWISE, rule),
            "blocks": lambda: fp8_wgrad.quantize_token_major_blocks(t, offs, rule),
        }
    from te_seq.kernels import cute

    table, padded = fp8_quantize.span_table(offs, t.shape[0])
    groups = offs.shape[0]
    fns = {
        "spans": lambda: cute.quantize_spans(t, table, groups),
        "strips": lambda: cute.quantize_spans_in_strips(t, offs, padded, table.shape[0]),
        "rows_and_spans": lambda: cute.quantize_rows_and_spans(t, table, groups),
        "rows": lambda: cute.quantize_rows(t),
        "blocks": lambda: cute.quantize_span_blocks(t, table),
    }
    if cute.group_amax_problem(t, FP8, 0) == "":  # C <= 16384
        group_amax = cute.quantize_rows_and_group_amax(t, table, groups)[2]
        fns["rows_group_amax"] = lambda: cute.quantize_rows_and_group_amax(t, table, groups)
        fns["spans_from_amax"] = lambda: cute.quantize_spans_from_group_amax(t, table,
                                                                           group_amax)
    return fns


def measure(name: str, s: Shape, args, device: torch.device) -> list[dict]:
    """The records of one shape: per operand, backend and kind, ms and GB/s (or the reason it
    was skipped)."""
    from te_seq.kernels import cute, fp8_wgrad

    sizes = split_counts(s)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32).to(device)
    width = fp8_wgrad.padded_width(s.M, s.E)
    records = []
    for operand, c in operands(s).items():
        t = torch.randn(s.M, c, device=device).to(torch.bfloat16)
        backends = (["torch"] if args.torch or args.dry_run else []) + ["cute"]
        for backend in backends:
            base = dict(shape=name, operand=operand, M=s.M, C=c, G=s.E, backend=backend)
            why = cute.quant_problem(t, FP8, 0) if backend == "cute" else ""
            if why:
                kinds = KINDS if backend == "cute" else TORCH_KINDS
                records += [dict(base, kind=k, status="skipped", reason=why) for k in kinds]
                continue
            fns = calls(t, offs, backend == "torch")
            runs = time_interleaved(fns, args.iters, args.warmup, device, burst=BURST)
            for kind, times in runs.items():
                ms = statistics.median(times)
                nbytes = traffic_bytes(kind, s.M, c, s.E, width)
                records.append(dict(base, kind=kind, status="ok", ms=ms, bytes=nbytes,
                                    gb_per_s=nbytes / ms / 1e6, runs=times))
        del t
    return records


def weight_records(name: str, s: Shape, args, device: torch.device) -> list[dict]:
    """`--weights`: the expert weights' two FP8 forms (along K for the forward, along N for the
    dgrad; `fp8_quantize.stacked_weight_rows`, what every optimizer step re-makes) of W1
    [E, 2F, H] and W2 [E, H, F], with the torch definitions and on the cute kernels. Traffic:
    w read once, both forms written once. Where the cute pair runs, also its two halves
    (`weight_halves`) and a row-wise pass alone over the same w, in the same interleaved run."""
    from te_seq.kernels import fp8_quantize
    from te_seq.kernels import fp8_reference as ref

    rule, records = ref.ScaleRule("E4M3"), []
    for operand, (n, k) in {"W1 [E,2F,H]": (2 * s.F, s.H), "W2 [E,H,F]": (s.H, s.F)}.items():
        w = torch.randn(s.E, n, k, device=device).to(torch.bfloat16)
        fns = {backend: (lambda b=backend, t=w: fp8_quantize.stacked_weight_rows(t, rule, b))
               for backend in ("torch", "cute")}
        halves, why = weight_halves(w, rule)
        fns.update(halves)
        runs = time_interleaved(fns, args.iters, args.warmup, device, burst=1)
        base = dict(shape=name, operand=operand, M=s.E * n, C=k, G=s.E)
        for variant, times in runs.items():
            backend, kind = (variant, "weights") if variant in ("torch", "cute") else \
                ("cute", variant)
            ms = statistics.median(times)
            nbytes = _weight_traffic(kind, s.E, n, k)
            records.append(dict(base, backend=backend, kind=kind, status="ok", ms=ms,
                                bytes=nbytes, gb_per_s=nbytes / ms / 1e6, runs=times))
        if why:
            records += [dict(base, backend="cute", kind=kind, status="skipped", reason=why)
                        for kind in WEIGHT_HALVES]
        del w
    return records


WEIGHT_HALVES = ("w:rows+amax", "w:cast along N", "w:rows alone")


def weight_halves(w: torch.Tensor, rule) -> tuple[dict[str, Callable[[], object]], str]:
    """({kind: call}, "") for the cute pair's two launches on w [G, N, K] seen as [G·N, K]
    with each expert a group: the forward form with the experts' column maxima
    (`rows_keeping_group_amax`), the dgrad form cast from those maxima (`token_major_from_amax`,
    the maxima made once, untimed), and `RowQuantKernel` over the same rows (the row-wise
    pass without maxima: what one read and one FP8 write of w cost); ({}, why) where the pair
    does not run on the cute kernels."""
    from te_seq.kernels import fp8_quantize
    from te_seq.kernels import fp8_reference as ref

    why = fp8_quantize.stacked_weight_reason(w, rule, "cute")
    if why:
        return {}, why
    g, n, k = w.shape
    flat = w.reshape(g * n, k)
    offs = fp8_quantize._expert_ends(g, n, w.device)
    amax = fp8_quantize.rows_keeping_group_amax(flat, offs, rule, "cute")[1]
    return {
        "w:rows+amax": lambda: fp8_quantize.rows_keeping_group_amax(flat, offs, rule, "cute"),
        "w:cast along N": lambda: fp8_quantize.token_major_from_amax(flat, offs, amax, rule),
        "w:rows alone": lambda: fp8_quantize.rows(flat, ref.ROWWISE, rule, "cute"),
    }, ""


def _weight_traffic(kind: str, g: int, n: int, k: int) -> int:
    """Bytes of one weight quantization: w (bf16) read once and the forms written once (both
    for "weights", one for a half), with their fp32 scales; the maxima [G, K] fp32 written by
    "w:rows+amax" and read by "w:cast along N"."""
    elems, amax = g * n * k, 4 * g * k
    forward, dgrad = elems + 4 * g * n, elems + 4 * g * k
    out = {"weights": forward + dgrad, "w:rows+amax": forward + amax,
           "w:cast along N": dgrad + amax, "w:rows alone": forward}[kind]
    return 2 * elems + out


def print_table(records: list[dict]) -> None:
    print(f"{'shape':5} {'operand':12} {'C':>6} {'backend':7} {'kind':15} {'ms':>8} {'GB/s':>7}")
    for r in records:
        head = f"{r['shape']:5} {r['operand']:12} {r['C']:>6} {r['backend']:7} {r['kind']:15}"
        if r["status"] == "ok":
            print(f"{head} {r['ms']:8.4f} {r['gb_per_s']:7.0f}")
        else:
            print(f"{head} skipped: {r['reason']}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="Q,A", help="comma-separated mlp_case SHAPES names")
    p.add_argument("--iters", type=int, default=20, help="timed bursts per variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--torch", action="store_true", help="also time the torch definitions")
    p.add_argument("--json", default="benchmarks/measured/bench_quant.json")
    p.add_argument("--weights", action="store_true",
                   help="time the expert weights' two FP8 forms instead (torch vs cute)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: a tiny shape, the torch definitions timed, cute skipped")
    args = p.parse_args(argv)
    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    if args.iters < 1 or args.warmup < 0:
        p.error(f"--iters must be >= 1 and --warmup >= 0, got {args.iters}, {args.warmup}")
    args.shape_list = [("dry", DRY_SHAPE)] if args.dry_run else [(n, SHAPES[n]) for n in names]
    if args.dry_run:
        args.iters, args.warmup = min(args.iters, 2), min(args.warmup, 1)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    records = []
    for name, s in args.shape_list:
        records += (weight_records if args.weights else measure)(name, s, args, device)
    print_table(records)
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                burst=BURST, iters=args.iters, torch=torch.__version__, dry_run=args.dry_run)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"meta": meta, "results": records}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
