"""Expert and tensor parallelism on n ranks: te_seq's blocks against the same blocks in PyTorch.

Run under torchrun, one process per GPU (NCCL), or per CPU process for a dry run (gloo):

  torchrun --nproc-per-node 2 benchmarks/bench_expert_parallel.py --shapes Q,B --json out.json
  torchrun --nproc-per-node 2 benchmarks/bench_expert_parallel.py --device cpu --dry-run

Shape legend: n ranks, E global experts (L = E / n on each rank), H hidden, F ffn width, k top-k,
T tokens per rank, N = T·k routed rows each rank sends, R the rows this rank's experts receive.

``--parts moe``: the expert-parallel MoE block, forward + backward. Each rank draws its own T =
M / k tokens (mlp_case.SHAPES: M, E, H, F; uniform-ish top-k of softmax(random logits)), so at
uniform routing R ≈ M and each GPU runs the single-GPU shape's work (L experts of twice the
rows). Variants, all on the same tokens, routing and weights:

- ``te_seq``: Sequential(ExpertDispatch(E, ep_group), GroupedLinear(L, H, 2F), ScaledSwiGLU,
  GroupedLinear(L, F, H), ExpertCombine) on the fastest backend (exact mode: one host sync);
- ``te_seq:capacity``: the same with ``capacity=C``, C = ceil(factor · N / n) rows per rank pair
  (no host sync; rows past C dropped, free slots padded: it multiplies n·C rows per rank,
  its TFLOP/s count the R real ones as the others' do);
- ``torch``: what a user writes with torch.distributed and ``torch._grouped_mm``: argsort of the
  rows by expert, ``all_to_all_single`` of the counts (one ``.tolist()``) and of the rows and
  probs (``torch.distributed.nn.functional``, autograd), a stable sort by local expert, the
  grouped-MM SwiGLU MLP with probs (autograd), the inverse exchange, ``index_add`` per token;
- ``torch:compiled`` (CUDA only): the same with its expert MLP ``torch.compile``d (fullgraph;
  the exchange stays eager: its sizes come from the host).

``--parts tp``: the sequence-parallel linears' forward with te_seq's overlap on and off
(``te_seq.config.set_tensor_parallel_overlap``): a column-parallel BasicLinear (all-gather of
[T, H] then [n·T, H] x [H, F/n]) and a row-parallel one ([n·T, F/n] x [F/n, H], reduce-scatter
to [T, H]), and the Megatron MLP (column, GELU, row) forward + backward.

Timing: the variants interleaved in one seeded order on every rank (their collectives must
match), a barrier before each burst of ``--burst`` calls, CUDA events around it; a burst's time
is the slowest rank's (all-reduce MAX), a variant's the median over ``--iters`` bursts. MoE
TFLOP/s per GPU = 18 · R · H · F / time with R this rank's received rows (the slowest rank's
time, the mean R); tokens/s = n · T per step / time.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, for te_seq
from _common import Result, rel_err, summarize, time_once, write_json  # noqa: E402
from mlp_case import SHAPES  # noqa: E402
from peers import grouped_mm_mlp  # noqa: E402

import te_seq  # noqa: E402
from te_seq import ops  # noqa: E402

DRY_SHAPES = ("T", "U")
BF16_TOL = 3e-2  # relative, te_seq against the PyTorch block on the same bf16 data
# torch 2.13 deprecates the autograd all-to-all of torch.distributed.nn.functional for a private
# module's; the public one is what users write, and torch 2.11 (the GPU host's) has no warning
warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated",
                        category=FutureWarning)


# --------------------------------------------------------------------------- the MoE block


@dataclass
class MoeCase:
    """One shape on this rank: its tokens x [T, H], routing, dOut [T, H], the blocks' weights."""

    name: str
    x: Tensor
    indices: Tensor  # [T, k] global experts
    probs: Tensor  # [T, k]
    dout: Tensor
    w1: Tensor  # [L, 2F, H] this rank's experts (te_seq's layout)
    w2: Tensor  # [L, H, F]
    experts: int  # E
    hidden: int
    ffn: int


def make_moe_case(name: str, k: int, group, device, dtype) -> MoeCase:
    s = SHAPES[name]
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if s.E % n:
        raise ValueError(f"shape {name}: {s.E} experts do not split over {n} ranks")
    tokens, local = max(1, s.M // k), s.E // n
    gen = torch.Generator(device=device).manual_seed(1000 + rank)  # each rank its own tokens
    logits = torch.randn(tokens, s.E, device=device, generator=gen)
    probs, indices = torch.softmax(logits, -1).topk(k, dim=-1)
    wgen = torch.Generator(device=device).manual_seed(rank)  # each rank its own experts

    def weight(*shape: int, fan_in: int) -> Tensor:
        w = torch.randn(*shape, device=device, generator=wgen) / math.sqrt(fan_in)
        return w.to(dtype)

    x = torch.randn(tokens, s.H, device=device, generator=gen).to(dtype)
    dout = torch.randn(tokens, s.H, device=device, generator=gen).to(dtype)
    return MoeCase(name, x, indices, probs.to(dtype), dout,
                   weight(local, 2 * s.F, s.H, fan_in=s.H), weight(local, s.H, s.F, fan_in=s.F),
                   s.E, s.H, s.F)


def te_seq_block(case: MoeCase, group, capacity: int | None) -> te_seq.Sequential:
    local = case.w1.shape[0]
    kw = {"bias": False, "device": case.x.device, "dtype": case.x.dtype,
          "single_grouped_weight": True}
    block = te_seq.Sequential(
        ops.ExpertDispatch(case.experts, ep_group=group, capacity=capacity),
        ops.GroupedLinear(local, case.hidden, 2 * case.ffn, **kw),
        ops.ScaledSwiGLU(),
        ops.GroupedLinear(local, case.ffn, case.hidden, **kw),
        ops.ExpertCombine(ep_group=group),
    )
    with torch.no_grad():
        block[1].weight.copy_(case.w1)
        block[3].weight.copy_(case.w2)
    return block


class TorchBlock(torch.nn.Module):
    """The expert-parallel SwiGLU MoE block in plain PyTorch (see the module): one host sync."""

    def __init__(self, case: MoeCase, group, compiled: bool = False) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(case.w1.clone())
        self.w2 = torch.nn.Parameter(case.w2.clone())
        self.group, self.experts = group, case.experts
        # the expert MLP between the exchanges, eager or torch.compile'd (the exchange's host
        # sizes and autograd all-to-alls stay eager, as a user would compile it)
        self.mlp = torch.compile(grouped_mm_mlp, fullgraph=True) if compiled else grouped_mm_mlp

    def forward(self, x: Tensor, indices: Tensor, probs: Tensor) -> Tensor:
        n, local = dist.get_world_size(self.group), self.w1.shape[0]
        k = indices.shape[1]
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)  # rows by global expert = by destination rank
        token = order // k
        counts = torch.bincount(flat, minlength=self.experts)  # [E]: n blocks of L
        recv_counts = torch.empty_like(counts)  # [n, L] flat: from source s for local expert l
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send, recv = counts.view(n, local).sum(1), recv_counts.view(n, local).sum(1)
        send_sizes, recv_sizes = torch.stack([send, recv]).tolist()  # the host sync
        rows = self._exchange(x[token], recv_sizes, send_sizes)
        row_probs = self._exchange(probs.reshape(-1)[order], recv_sizes, send_sizes)
        expert = torch.repeat_interleave(
            torch.arange(local, device=x.device).repeat(n), recv_counts,
            output_size=sum(recv_sizes))  # local expert of each received row
        perm = torch.argsort(expert, stable=True)
        offs = recv_counts.view(n, local).sum(0).cumsum(0).to(torch.int32)
        y = self.mlp(rows[perm], self.w1, self.w2, row_probs[perm], offs)
        back = self._exchange(y[torch.argsort(perm)], send_sizes, recv_sizes)
        return x.new_zeros(x.shape).index_add(0, token, back)

    def _exchange(self, t: Tensor, out_sizes: list[int], in_sizes: list[int]) -> Tensor:
        out = t.new_empty((sum(out_sizes), *t.shape[1:]))
        return dist_fn.all_to_all_single(out, t, out_sizes, in_sizes, group=self.group)


def _step(block, case: MoeCase, x: Tensor) -> tuple[Tensor, ...]:
    y = block(x, case.indices, case.probs)
    return (y.detach(), *torch.autograd.grad(y, [x, *block.parameters()], case.dout))


def capacity_rows(case: MoeCase, factor: float, n: int) -> int:
    return math.ceil(factor * case.indices.numel() / n)


def received_rows(case: MoeCase, group) -> int:
    """R: the rows this rank's experts receive (exact mode)."""
    counts = torch.bincount(case.indices.reshape(-1), minlength=case.experts)
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    return int(recv.sum())


def run_moe(case: MoeCase, group, args, device) -> list[Result]:
    n = dist.get_world_size(group)
    cap = capacity_rows(case, args.capacity_factor, n)
    blocks = {"torch": TorchBlock(case, group)}
    if device.type == "cuda":  # torch.compile of _grouped_mm takes bf16 (not the CPU's fp32)
        blocks["torch:compiled"] = TorchBlock(case, group, compiled=True)
    blocks |= {"te_seq": te_seq_block(case, group, None),
               f"te_seq:capacity{args.capacity_factor:g}": te_seq_block(case, group, cap)}
    x = case.x.detach().clone().requires_grad_()
    checks = {name: _step(block, case, x) for name, block in blocks.items()}
    fns = {name: (lambda b=block: _step(b, case, x)) for name, block in blocks.items()}
    runs = time_ranks(fns, args, device, group)
    if args.profile:
        profile_ranks(fns, args, device, group, f"shape {case.name}")
    rows = received_rows(case, group)
    mean_rows = all_reduce_float(rows, group, dist.ReduceOp.SUM) / n
    out = []
    for name in blocks:
        err = max(rel_err(a.float(), b.float()) for a, b in zip(checks[name], checks["torch"]))
        r = Result(case.name, "fwd+bwd", name, status="ok", is_peer=name.startswith("torch"))
        summarize(r, runs[name], 18 * mean_rows * case.hidden * case.ffn, 0.0)
        r.max_rel_err = max_over_ranks(err, group)
        if name != "torch" and r.max_rel_err > BF16_TOL and case.x.dtype == torch.bfloat16:
            r.status = "failed"
        r.note = (f"tokens/s {n * case.x.shape[0] / (r.ms * 1e-3):.3g}; R {mean_rows:.0f} "
                  f"mean rows/rank" + (f"; C {cap}" if "capacity" in name else "") +
                  f"; plan {_plan(blocks[name])}")
        out.append(r)
    return out


def _plan(block) -> str:
    if not isinstance(block, te_seq.Sequential):
        return "-"
    return " ".join(f"{s.name}@{s.backend}" for s in block.fusion_plan().forward)


# --------------------------------------------------------------------------- tensor parallel


def run_tp(args, device, dtype, group) -> list[Result]:
    """The sequence-parallel linears' forward and the Megatron MLP's step, overlap on / off."""
    n = dist.get_world_size(group)
    tokens, hidden, ffn = (64, 32, 64) if args.dry_run else (args.tp_tokens, 4096, 14336)
    kw = {"device": device, "dtype": dtype, "tensor_parallel_group": group,
          "sequence_parallel": True}
    column = ops.BasicLinear(hidden, ffn, tensor_parallel_mode="column", **kw)
    row = ops.BasicLinear(ffn, hidden, tensor_parallel_mode="row", **kw)
    mlp = te_seq.Sequential(ops.BasicLinear(hidden, ffn, tensor_parallel_mode="column", **kw),
                            ops.GELU(),
                            ops.BasicLinear(ffn, hidden, tensor_parallel_mode="row", **kw))
    gen = torch.Generator(device=device).manual_seed(2000 + dist.get_rank(group))
    x_col = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
    x_row = torch.randn(n * tokens, ffn // n, device=device, generator=gen).to(dtype)
    x_mlp = x_col.clone().requires_grad_()
    dy = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
    cases = {
        "column fwd": (lambda: column(x_col), 2 * n * tokens * hidden * ffn // n),
        "row fwd": (lambda: row(x_row), 2 * n * tokens * hidden * ffn // n),
        "mlp fwd+bwd": (lambda: torch.autograd.grad(mlp(x_mlp), [x_mlp, *mlp.parameters()], dy),
                        6 * 2 * n * tokens * hidden * ffn // n),
    }
    fns, checks = {}, {}
    for name, (fn, _) in cases.items():
        for overlap in (True, False):
            variant = f"{name}:overlap" if overlap else f"{name}:plain"
            fns[variant] = _with_overlap(fn, overlap)
            checks[variant] = fns[variant]()
    runs = time_ranks(fns, args, device, group)
    out = []
    for name, (_, flops) in cases.items():
        for overlap in (True, False):
            variant = f"{name}:overlap" if overlap else f"{name}:plain"
            a, b = checks[variant], checks[f"{name}:plain"]
            err = max(rel_err(u.float(), v.float()) for u, v in
                      zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)))
            mode, label = name.rsplit(" ", 1)
            r = Result(f"tp {mode}", label, "overlap" if overlap else "plain", status="ok")
            summarize(r, runs[variant], flops, 0.0)
            r.max_rel_err = max_over_ranks(err, group)
            r.note = f"T {tokens}/rank, H {hidden}, F {ffn} (F/n {ffn // n} per rank)"
            out.append(r)
    return out


def _with_overlap(fn: Callable[[], object], overlap: bool) -> Callable[[], object]:
    def run():
        te_seq.config.set_tensor_parallel_overlap(overlap)
        try:
            return fn()
        finally:
            te_seq.config.set_tensor_parallel_overlap(True)

    return run


# --------------------------------------------------------------------------- timing on n ranks


def all_reduce_float(value: float, group, op) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64,
                     device="cuda" if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())


def max_over_ranks(value: float, group) -> float:
    return all_reduce_float(value, group, dist.ReduceOp.MAX)


def time_ranks(fns: dict[str, Callable[[], object]], args, device, group) -> dict[str, list]:
    """ms per call per variant: warm-up calls, then ``args.iters`` rounds, each variant one
    burst per round in a seeded order (the same on every rank), the slowest rank's time."""
    for fn in fns.values():
        for _ in range(args.warmup):
            fn()
    rng, runs = random.Random(0), {name: [] for name in fns}
    for _ in range(args.iters):
        for name in rng.sample(list(fns), len(fns)):
            dist.barrier(group=group)
            runs[name].append(max_over_ranks(time_once(fns[name], device, args.burst), group))
    return runs


def profile_ranks(fns: dict[str, Callable[[], object]], args, device, group, title: str) -> None:
    """Rank 0's device time per step by kernel (torch.profiler, ``args.profile`` steps of each
    variant, every rank running them), the top ``args.profile_top`` rows, printed."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sort_key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    for name, fn in fns.items():
        dist.barrier(group=group)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.profile):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        if dist.get_rank(group) == 0:
            table = prof.key_averages().table(sort_by=sort_key, row_limit=args.profile_top,
                                              max_name_column_width=60)
            print(f"--- profile, {title}, {name}: {args.profile} steps\n{table}", flush=True)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="moe,tp", help="moe, tp or both")
    p.add_argument("--shapes", default="Q,B", help=f"MoE shapes, of {sorted(SHAPES)}")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--tp-tokens", type=int, default=8192, help="sequence-parallel rows per rank")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--burst", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--json", default=None, help="written by rank 0")
    p.add_argument("--profile", type=int, default=0,
                   help="also profile this many steps of each variant (rank 0's kernels)")
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes, few iterations")
    args = p.parse_args(argv)
    if args.dry_run:
        args.shapes, args.iters, args.warmup, args.burst = ",".join(DRY_SHAPES), 2, 1, 1
        args.topk = min(args.topk, 2)
    return args


def _init(device_type: str) -> torch.device:
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group(backend, device_id=torch.device("cuda", local))
        return torch.device("cuda", local)
    dist.init_process_group(backend)
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = _init(torch.device(args.device).type)
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    group, rank = dist.group.WORLD, dist.get_rank()
    results: list[Result] = []
    try:
        parts = args.parts.split(",")
        if "moe" in parts:
            for name in args.shapes.split(","):
                case = make_moe_case(name, args.topk, group, device, dtype)
                results += _report(run_moe(case, group, args, device), rank)
        if "tp" in parts:
            results += _report(run_tp(args, device, dtype, group), rank)
        if args.json and rank == 0:
            meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu", "ranks": dist.get_world_size(), "backend": dist.get_backend(),
                    "dtype": str(dtype), "topk": args.topk, "torch": torch.__version__,
                    "te_seq": te_seq.__version__, "nccl": _nccl_version(device)}
            write_json(args.json, meta, results)
        dist.barrier()  # no rank tears its group down while another still uses it
    finally:
        dist.destroy_process_group()
    return 1 if any(r.status == "failed" for r in results) else 0


def _report(results: list[Result], rank: int) -> list[Result]:
    if rank == 0:
        for r in results:
            p20_p80 = f"[{r.ms_p20:.3f}, {r.ms_p80:.3f}]"
            print(f"{r.shape:>10} {r.mode:<8} {r.variant:<20} {r.ms:9.3f} ms {p20_p80:<20} "
                  f"{r.tflops:8.1f} TFLOP/s/GPU  rel_err {r.max_rel_err:.1e}  {r.status}  "
                  f"{r.note}", flush=True)
    return results


def _nccl_version(device) -> str:
    if device.type != "cuda":
        return "-"
    return ".".join(map(str, torch.cuda.nccl.version()))


def _exit_after_teardown(code: int) -> None:
    """Leave without the interpreter's own teardown: the process group is destroyed and the
    results are written, but gloo's worker threads can still hold work objects whose release
    during interpreter finalization aborts the process ("terminate called without an active
    exception", SIGABRT: seen now and then on 2-rank CPU runs, which failed the dry-run test)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_after_teardown(main())
