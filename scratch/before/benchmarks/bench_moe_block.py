"""The fused MoE block against its unfused chain: time and activation memory.

One te_seq.Sequential(ExpertDispatch, GroupedLinear, ScaledSwiGLU, GroupedLinear, ExpertCombine)
run twice on the same data and weights: "fused" (the "moe_block" fusion: FC1 gathers its rows from
the tokens, FC2 scatters its rows into slot order, no [N, H] permuted copy where the backend does
this in its GEMMs) and "unfused" (te_seq.fusions_disabled("moe_block"): dispatch, GroupedMLP,
combine, each permuted copy materialized).

Shape legend: T tokens, k top-k, N = T·k routed rows, E experts, H hidden, F ffn. Shapes are
bench_grouped_mlp.py's (mlp_case.SHAPES) with N = M rows, so T = M / k tokens; routing is top-k
of softmax(random router logits). FLOPs: forward 6·N·H·F, forward+backward 18·N·H·F.
Memory (CUDA only): `act_mb` = torch.cuda.memory_allocated() after the forward minus before
(inputs and weights excluded; the output and everything saved for backward kept), `peak_mb` =
the peak over one forward+backward above the memory before it.

  python benchmarks/bench_moe_block.py --shapes A,B,Q --backends cute,torch --json out.json
  python benchmarks/bench_moe_block.py --device cpu --dry-run     # tiny shapes: checks the script
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, for te_seq
from _common import Result, rel_err, summarize, time_interleaved, write_json  # noqa: E402
from mlp_case import SHAPES  # noqa: E402

import te_seq  # noqa: E402
from te_seq import ops  # noqa: E402

DRY_SHAPES = ("T", "U")
VARIANTS = ("unfused", "fused")


@dataclass
class MoeCase:
    """One shape's data: tokens x [T, H], top-k routing, dOut [T, H], and the block."""

    name: str
    x: Tensor
    indices: Tensor  # [T, k] int64
    probs: Tensor  # [T, k]
    dout: Tensor
    block: te_seq.Sequential
    rows: int  # N = T·k
    hidden: int
    ffn: int


def make_case(name: str, k: int, device: torch.device, dtype: torch.dtype) -> MoeCase:
    s = SHAPES[name]
    tokens = max(1, s.M // k)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(tokens, s.E, device=device, generator=gen)
    probs, indices = torch.softmax(logits, -1).topk(k, dim=-1)
    block = te_seq.Sequential(
        ops.ExpertDispatch(s.E),
        ops.GroupedLinear(s.E, s.H, 2 * s.F, bias=False, device=device, dtype=dtype,
                          single_grouped_weight=True),
        ops.ScaledSwiGLU(),
        ops.GroupedLinear(s.E, s.F, s.H, bias=False, device=device, dtype=dtype,
                          single_grouped_weight=True),
        ops.ExpertCombine(),
    )
    x = torch.randn(tokens, s.H, device=device, dtype=dtype, generator=gen)
    dout = torch.randn(tokens, s.H, device=device, dtype=dtype, generator=gen)
    return MoeCase(name, x, indices, probs.to(dtype), dout, block, tokens * k, s.H, s.F)


def _scope(variant: str):
    if variant == "unfused":
        return te_seq.fusions_disabled("moe_block")
    return contextlib.nullcontext()


def _fwd(case: MoeCase, variant: str, backend: str) -> Tensor:
    with _scope(variant), te_seq.backend(backend), torch.no_grad():
        return case.block(case.x, case.indices, case.probs)


def _fwd_bwd(case: MoeCase, variant: str, backend: str, x: Tensor) -> tuple[Tensor, ...]:
    with _scope(variant), te_seq.backend(backend):
        y = case.block(x, case.indices, case.probs)
        leaves = [x, *case.block.parameters()]
        return (y.detach(), *torch.autograd.grad(y, leaves, case.dout))


def _memory(case: MoeCase, variant: str, backend: str, x: Tensor) -> tuple[float, float]:
    """(MB allocated after forward, MB peak over forward+backward), both above the start."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with _scope(variant), te_seq.backend(backend):
        y = case.block(x, case.indices, case.probs)
        after_fwd = torch.cuda.memory_allocated() - start
        torch.autograd.grad(y, [x, *case.block.parameters()], case.dout)
    del y
    peak = torch.cuda.max_memory_allocated() - start
    return after_fwd / 2**20, peak / 2**20


def _plan(case: MoeCase) -> str:
    return "; ".join(f"{s.name}@{s.backend}" for s in case.block.fusion_plan().forward)


def run_case(case: MoeCase, backend: str, args: argparse.Namespace,
             device: torch.device) -> list[Result]:
    x = case.x.detach().clone().requires_grad_()
    fns, results, checks = {}, {}, {}
    for variant in VARIANTS:
        checks[variant] = _fwd_bwd(case, variant, backend, x)
        fns[(variant, "fwd")] = lambda v=variant: _fwd(case, v, backend)
        fns[(variant, "fwd+bwd")] = lambda v=variant: _fwd_bwd(case, v, backend, x)
        results[variant] = _plan(case)
    err = max(rel_err(a.float(), b.float()) for a, b in zip(checks["fused"], checks["unfused"]))
    flops = {"fwd": 6 * case.rows * case.hidden * case.ffn,
             "fwd+bwd": 18 * case.rows * case.hidden * case.ffn}
    out = []
    for mode in ("fwd", "fwd+bwd"):
        pair = {v: fns[(v, mode)] for v in VARIANTS}
        runs = time_interleaved(pair, args.iters, args.warmup, device, burst=args.burst)
        for variant in VARIANTS:
            r = Result(case.name, mode, f"{variant}:{backend}", status="ok", note=results[variant])
            summarize(r, runs[variant], flops[mode], 0.0)
            r.max_rel_err = err
            if device.type == "cuda" and mode == "fwd+bwd":
                act, peak = _memory(case, variant, backend, x)
                r.note += f"; act_mb={act:.1f} peak_mb={peak:.1f}"
            out.append(r)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="A,B,Q", help=f"of {sorted(SHAPES)}")
    p.add_argument("--backends", default="cute,torch")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--burst", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes, few iterations, the backends available here")
    args = p.parse_args(argv)
    if args.dry_run:
        args.shapes, args.iters, args.warmup, args.burst = ",".join(DRY_SHAPES), 2, 1, 1
    return args


def _backends(args: argparse.Namespace, device: torch.device) -> list[str]:
    names = []
    for name in args.backends.split(","):
        ok, why = te_seq.kernels.backend.backend_available(name)
        if ok and (device.type == "cuda" or name == "reference"):
            names.append(name)
        else:
            print(f"skipping backend {name}: {why or 'needs CUDA data'}")
    if not names:  # a CPU dry run: the reference backend runs every kernel
        names = ["reference"]
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    results: list[Result] = []
    for backend in _backends(args, device):
        for name in args.shapes.split(","):
            case = make_case(name, args.topk, device, dtype)
            for r in run_case(case, backend, args, device):
                print(f"{r.shape:>2} {r.mode:<8} {r.variant:<18} {r.ms:9.3f} ms "
                      f"{r.tflops:8.2f} TFLOP/s  rel_err {r.max_rel_err:.1e}  {r.note}")
                results.append(r)
            del case
    if args.json:
        meta = {"device": str(device), "dtype": str(dtype), "topk": args.topk,
                "torch": torch.__version__, "te_seq": te_seq.__version__}
        write_json(args.json, meta, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
