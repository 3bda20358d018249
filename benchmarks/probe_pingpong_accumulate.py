"""Probe: the fp32 main_grad accumulate (varlen-K wgrad added into its output) in ping-pong
against cooperative tilings, for speed and for shared-memory races.

``--speed SHAPES``: ms and TB/s of FC1's and FC2's wgrads accumulated into a random fp32
main_grad, the cooperative 256-wide tiling against ping-pong ones (the default is 128 wide,
1x2), each checked against float64 first.
``--fp8-speed SHAPES``: the same for the FP8 row-wise wgrad (``cute.scaled_grouped_wgrad``
on token-major E4M3 operands, static units: the scaled kernel has no dynamic schedule), its
cooperative default against ping-pong tilings, each checked against the cooperative result;
with ``--fresh`` the wgrad written as a new bf16 gradient (the MLP's fresh-grads step), over
more tilings (cooperative 2x1, 192 wide, 2x2 clusters).
``--race``: per variant (ping-pong and cooperative, 128 and 192 wide, clusters 1x2 / 2x1 /
1x1, static and dynamic units), six calls on the ping-pong tests' cases, the count of values
off the float64 reference per call and the first one (its value, the expected one, its old C).
``--locate CASE,TILE_N,CM,CN,dyn|static``: per wrong value, its place in the tile and where
the value it added instead of its old C sits (old C, output, reference).

  python benchmarks/probe_pingpong_accumulate.py --speed Q,Z,B
  python benchmarks/probe_pingpong_accumulate.py --fp8-speed Q,Z,B [--fresh]
  python benchmarks/probe_pingpong_accumulate.py --race
  python benchmarks/probe_pingpong_accumulate.py --locate long_spans,128,1,2,dyn
  compute-sanitizer --tool racecheck --racecheck-report hazard \
      python benchmarks/probe_pingpong_accumulate.py --locate long_spans,128,1,2,dyn --calls 1

Recorded in the kernel README (section 18): without a proxy fence between the old-C reads and
the block's next TMA load, the ping-pong accumulate read stale old C in about half the calls.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from bench_grouped_gemm import SHAPES, rel_err, split_sizes, time_ms

from te_seq.kernels import cute, reference
from te_seq.kernels.cute import Tiling

TILINGS = {"coop256": Tiling(256, (1, 2), dynamic=True),
           "pp192_2x1": Tiling(192, (2, 1), True, dynamic=True),
           "pp128_2x1": Tiling(128, (2, 1), True, dynamic=True),
           "pp128_1x1": Tiling(128, (1, 1), True, dynamic=True),
           "default": None}


def speed(shapes: str) -> None:
    for name in shapes.split(","):
        e, h, f, m = SHAPES[name]
        offs = torch.tensor(split_sizes(name, e, m, torch.Generator().manual_seed(0)))
        offs = offs.cumsum(0).to(torch.int32).cuda()
        bf = dict(device="cuda", dtype=torch.bfloat16)
        for label, (dout, x) in {"fc1": (torch.randn(m, 2 * f, **bf), torch.randn(m, h, **bf)),
                                 "fc2": (torch.randn(m, h, **bf), torch.randn(m, f, **bf))}.items():
            main_grad = torch.randn(e, dout.shape[1], x.shape[1], device="cuda")
            start = main_grad.clone()
            ref = reference.grouped_wgrad(dout.double(), x.double(), offs) + start.double()
            fns, errs = {}, {}
            for t, tiling in TILINGS.items():
                main_grad.copy_(start)
                cute.grouped_wgrad(dout, x, offs, out=main_grad, accumulate=True, tiling=tiling)
                errs[t] = rel_err(main_grad, ref)
                fns[t] = (lambda c, tl: lambda: cute.grouped_wgrad(
                    dout, x, offs, out=c, accumulate=True, tiling=tl))(main_grad, tiling)
            del ref
            ms = time_ms(fns, 10)
            gb = (2 * main_grad.numel() * 4 + (dout.numel() + x.numel()) * 2) / 1e9
            print(name, label, "  ".join(f"{t} {ms[t]:.3f}ms {gb / ms[t]:.2f}TB/s "
                                         f"err {errs[t]:.1e}" for t in TILINGS), flush=True)
            del main_grad, start
            torch.cuda.empty_cache()


FP8_TILINGS = {"coop256": Tiling(256, (1, 2)),
               "pp128_1x1": Tiling(128, (1, 1), True),
               "pp128_2x1": Tiling(128, (2, 1), True),
               "pp128_1x2": Tiling(128, (1, 2), True),
               "pp192_1x2": Tiling(192, (1, 2), True),
               "default": None}
# --fresh: the tilings of a wgrad written fresh (bf16 out): wider tiles and the 2x2 cluster too
FP8_FRESH_TILINGS = {**FP8_TILINGS,
                     "coop256_2x1": Tiling(256, (2, 1)),
                     "coop128_1x2": Tiling(128, (1, 2)),
                     "pp192_1x1": Tiling(192, (1, 1), True),
                     "pp192_2x1": Tiling(192, (2, 1), True),
                     "pp128_2x2": Tiling(128, (2, 2), True),
                     "pp192_2x2": Tiling(192, (2, 2), True)}


def fp8_speed(shapes: str, fresh: bool = False) -> None:
    """The FP8 row-wise wgrads of ``shapes`` under each tiling, checked against the cooperative
    256-wide result: added into a random fp32 main_grad, or (``fresh``) written as a new bf16
    gradient, as the MLP's fresh-grads step does (ms, TB/s of the compulsory traffic, TFLOP/s)."""
    from bench_fp8_gemm import token_major

    tilings = FP8_FRESH_TILINGS if fresh else FP8_TILINGS
    for name in shapes.split(","):
        e, h, f, m = SHAPES[name]
        sizes = split_sizes(name, e, m, torch.Generator().manual_seed(0))
        bf = dict(device="cuda", dtype=torch.bfloat16)
        for label, (dout, x) in {"fc1": (torch.randn(m, 2 * f, **bf), torch.randn(m, h, **bf)),
                                 "fc2": (torch.randn(m, h, **bf), torch.randn(m, f, **bf))}.items():
            (qd, sd, ends), (qx, sx, _) = token_major(dout, sizes), token_major(x, sizes)
            out_dtype = torch.bfloat16 if fresh else torch.float32
            main_grad = torch.randn(e, dout.shape[1], x.shape[1], device="cuda").to(out_dtype)
            start = main_grad.clone()
            ref = start.clone()
            cute.scaled_grouped_wgrad(qd, qx, sd, sx, ends, out=ref, accumulate=not fresh,
                                      tiling=FP8_TILINGS["coop256"])
            fns, errs = {}, {}
            for t, tiling in tilings.items():
                main_grad.copy_(start)
                try:
                    cute.scaled_grouped_wgrad(qd, qx, sd, sx, ends, out=main_grad,
                                              accumulate=not fresh, tiling=tiling)
                except Exception as err:  # a tiling the kernel refuses: say so, time the rest
                    print(name, label, t, "refused:", str(err).splitlines()[0][:160], flush=True)
                    continue
                errs[t] = rel_err(main_grad - start, ref - start) if not fresh else \
                    rel_err(main_grad, ref)
                fns[t] = (lambda c, tl: lambda: cute.scaled_grouped_wgrad(
                    qd, qx, sd, sx, ends, out=c, accumulate=not fresh,
                    tiling=tl))(main_grad, tiling)
            del ref
            ms = time_ms(fns, 10)
            gb = ((1 if fresh else 2) * main_grad.numel() * main_grad.element_size()
                  + qd.numel() + qx.numel()) / 1e9
            tflop = 2 * m * dout.shape[1] * x.shape[1] / 1e12
            print(name, "fp8", "fresh" if fresh else "accumulate", label,
                  "  ".join(f"{t} {ms[t]:.3f}ms {gb / ms[t]:.2f}TB/s {tflop / ms[t] * 1e3:.0f}TF "
                            f"err {errs[t]:.1e}" for t in fns), flush=True)
            del main_grad, start
            torch.cuda.empty_cache()


def race() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
    from cute_marks import wgrad_operands
    from test_cute_pingpong_wgrad import _CASES

    for cname, sizes, n, k in _CASES[1:]:
        grad_out, x, offs = wgrad_operands(sizes, n, k)
        start = torch.randn(len(sizes), n, k, device="cuda")
        ref = reference.grouped_wgrad(grad_out.double(), x.double(), offs) + start.double()
        ref = ref.float()
        for tn, cl in ((128, (1, 2)), (192, (2, 1)), (128, (1, 1))):
            for pp in (True, False):
                for dyn in (True, False):
                    bad, first = [], ""
                    for _ in range(6):
                        out = start.clone()
                        cute.grouped_wgrad(grad_out, x, offs, out=out, accumulate=True,
                                           tiling=Tiling(tn, cl, pp, dynamic=dyn))
                        wrong = ((out - ref).abs() > 1e-3 * (1 + ref.abs())).nonzero()
                        bad.append(len(wrong))
                        if len(wrong) and not first:
                            i = tuple(wrong[0].tolist())
                            first = (f"first {i} got {out[i].item():.4f} want "
                                     f"{ref[i].item():.4f} old {start[i].item():.4f}")
                    print(cname, tn, cl, "pp" if pp else "coop", "dyn" if dyn else "static",
                          bad, first, flush=True)


def _matches(t, value, limit=3):
    """Positions (expert, row, col) of ``t`` holding ``value`` within fp32 rounding."""
    hits = ((t - value).abs() <= 2e-6 * (1 + abs(value))).nonzero()
    return [tuple(h.tolist()) for h in hits[:limit]]


def locate(case: str, tn: int, cluster: tuple, dynamic: bool, calls: int = 20) -> None:
    """Where the wrong values' old C came from: per wrong element (expert, row, col), its row
    in the 128-row tile, its 32-column subtile, the value it added in place of its old C and
    where that value sits in the old C (``start``), in this call's output and in the
    reference."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
    from cute_marks import wgrad_operands
    from test_cute_pingpong_wgrad import _CASES

    _, sizes, n, k = next(c for c in _CASES if c[0] == case)
    grad_out, x, offs = wgrad_operands(sizes, n, k)
    start = torch.randn(len(sizes), n, k, device="cuda")
    wgrad = reference.grouped_wgrad(grad_out.double(), x.double(), offs)
    ref = (wgrad + start.double()).float()
    tiling = Tiling(tn, cluster, True, dynamic=dynamic)
    print("locate", case, sizes, n, k, tiling, flush=True)
    for call in range(calls):
        out = start.clone()
        cute.grouped_wgrad(grad_out, x, offs, out=out, accumulate=True, tiling=tiling)
        wrong = ((out - ref).abs() > 1e-3 * (1 + ref.abs())).nonzero()
        print(f"call {call}: {len(wrong)} wrong", flush=True)
        for w in wrong[:16].tolist():
            i = tuple(w)
            added = (out[i].double() - wgrad[i]).item()
            print(f"  {i} tile row {i[1] % 128} col {i[2] % tn} subtile {(i[2] % tn) // 32}"
                  f" added {added:.5f} (old {start[i].item():.5f}) in old C at "
                  f"{_matches(start, added)} in out at {_matches(out, added)} in ref at "
                  f"{_matches(ref, added)}", flush=True)
        if len(wrong):
            rows = sorted({(w[0], w[1] // 128, w[2] // tn) for w in wrong.tolist()})
            print(f"  tiles (expert, m-tile, n-tile): {rows[:12]}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--speed", default="")
    p.add_argument("--fp8-speed", default="")
    p.add_argument("--fresh", action="store_true",
                   help="--fp8-speed: the wgrad written as a new bf16 gradient, more tilings")
    p.add_argument("--race", action="store_true")
    p.add_argument("--locate", default="", help="CASE,TILE_N,CLUSTER_M,CLUSTER_N,dyn|static")
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    if args.speed:
        speed(args.speed)
    if args.fp8_speed:
        fp8_speed(args.fp8_speed, args.fresh)
    if args.race:
        race()
    if args.locate:
        case, tn, cm, cn, mode = args.locate.split(",")
        locate(case, int(tn), (int(cm), int(cn)), mode == "dyn", args.calls)


if __name__ == "__main__":
    main()
