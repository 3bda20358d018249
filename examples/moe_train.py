"""Train a small mixture-of-experts block with te_seq on synthetic data.

The whole expert block is one te_seq Sequential: ExpertDispatch -> GroupedLinear ->
ScaledSwiGLU -> GroupedLinear -> ExpertCombine. The dispatch sorts the token rows by expert and
publishes the split sizes, the per-row router probabilities and the routing map on channels
that the grouped linears, the scaled SwiGLU and the combine read, so the block is called as
`block(x, topk_indices, topk_probs)` and the fuser runs it as the fused MoeBlock.
Only the router (a linear, softmax, top-k) is plain PyTorch. The student learns to imitate a
random teacher MoE of the same shape (a regression target), so its loss must fall.

    python examples/moe_train.py                      # a few hundred steps, GPU if present
    python examples/moe_train.py --steps 50 --device cpu --dtype float32
    python examples/moe_train.py --fp8 block --hidden 128   # FP8 vs the same run without
    python examples/moe_train.py --fp8 rowwise --fp8-hp-wgrad   # weight gradients in bf16
    torchrun --nproc-per-node 2 examples/moe_train.py --ep 2 --device cpu --steps 40
    torchrun --nproc-per-node 2 examples/moe_train.py --ep 2 --fp8 rowwise   # on 2 GPUs

With --ep n (under torchrun, n processes) the experts are expert-parallel: rank r holds
experts r·E/n .. (r+1)·E/n - 1 and ExpertDispatch / ExpertCombine exchange the rows over the
group (gloo on CPU, nccl on CUDA, one GPU per rank); each rank draws its own tokens, the
router is replicated (its gradient averaged over the ranks) and rank 0 prints.

With --fp8 {block,rowwise,tensor} the student trains twice from the same seed, without FP8 and
under te_seq.autocast(recipe=...) (Float8BlockScaling, Float8RowwiseScaling,
Float8CurrentScaling), and the FP8 run's final loss must be within --fp8-margin (default 10%,
relative) of the other's: E4M3 keeps 3 mantissa bits (relative rounding up to 2**-4 per
operand), errors that average out over a GEMM's sums; measured on CPU (float32, hidden 128,
40 and 300 steps, 2026-11-24) the gap is under 0.1% for all three recipes. 10% leaves room for
other seeds, sizes and bf16 baselines; a broken recipe (wrong scales, operands in the wrong
layout) fails the separate check that the FP8 loss falls.

Shape legend: T tokens, K experts per token (top-k), E experts,
H hidden, F ffn width (FC1 maps H -> 2F, SwiGLU halves it).
Exit status 1 when the loss did not fall, or when the te_seq block disagrees with a plain
per-token, per-expert PyTorch loop at step 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import Tensor

import te_seq
from te_seq import ops, recipe
from te_seq.distributed import all_gather_rows

RECIPES = {"block": recipe.Float8BlockScaling, "rowwise": recipe.Float8RowwiseScaling,
           "tensor": recipe.Float8CurrentScaling}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "float64": torch.float64}


class MoE(torch.nn.Module):
    """y = Σ_{e in top-k(x)} p_e(x) · FC2_e(SwiGLU(FC1_e(x))), routed by a linear router."""

    def __init__(self, experts: int, hidden: int, ffn: int, topk: int, *, device, dtype,
                 ep_group=None) -> None:
        super().__init__()
        self.experts, self.topk, self.ep_group = experts, topk, ep_group
        local = experts // (1 if ep_group is None else ep_group.size())  # this rank's experts
        self.router = torch.nn.Linear(hidden, experts, bias=False, device=device, dtype=dtype)
        self.block = te_seq.Sequential(
            ops.ExpertDispatch(experts, ep_group=ep_group),
            ops.GroupedLinear(local, hidden, 2 * ffn, bias=False, device=device, dtype=dtype),
            ops.ScaledSwiGLU(),
            ops.GroupedLinear(local, ffn, hidden, bias=False, device=device, dtype=dtype),
            ops.ExpertCombine(ep_group=ep_group),
        )

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Top-k softmax routing: expert indices [T, K] and renormalised probabilities [T, K]."""
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [T, E]
        top_p, top_e = probs.topk(self.topk, dim=-1)  # [T, K], [T, K]
        return top_e, (top_p / top_p.sum(-1, keepdim=True)).to(x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x, *self.route(x))  # [T, H]

    def forward_loop(self, x: Tensor) -> Tensor:
        """The same maths, one token and one chosen expert at a time (the reference)."""
        top_e, top_p = self.route(x)
        w1, w2 = (expert_weights(self.block[i], self.ep_group) for i in (1, 3))
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(self.topk):
                e = int(top_e[t, j])
                gate, up = (x[t] @ w1[e].T).chunk(2)  # [F] each
                h = torch.nn.functional.silu(gate) * up
                out[t] += top_p[t, j] * (h @ w2[e].T)
        return out


def expert_weights(linear: ops.GroupedLinear, ep_group) -> Tensor:
    """All E experts' weights [E, out, in]: the local ones, all-gathered over the ep group."""
    local = torch.stack([getattr(linear, f"weight{e}").detach() for e in range(linear.num_groups)])
    return local if ep_group is None else all_gather_rows(local, ep_group)


def init_expert_parallel(args: argparse.Namespace):
    """--ep n under torchrun: the process group (gloo on CPU, nccl on CUDA: one GPU per rank)
    and this rank's device; ranks other than 0 print nothing. (None, device) without --ep."""
    if args.ep == 1:
        return None, torch.device(args.device)
    import torch.distributed as dist

    if "RANK" not in os.environ:
        sys.exit(f"--ep {args.ep} needs torchrun: torchrun --nproc-per-node {args.ep} "
                 f"examples/moe_train.py --ep {args.ep} ...")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if dist.is_initialized():  # --fp8 trains a second time in the same processes
        return dist.group.WORLD, device
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != args.ep:
        sys.exit(f"--ep {args.ep} but torchrun started {dist.get_world_size()} processes")
    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - one quiet stream for the run
    print(f"expert parallel: {args.ep} ranks ({dist.get_backend()}), "
          f"{args.experts // args.ep} of {args.experts} experts per rank")
    return dist.group.WORLD, device


def replicate_router(model: MoE, group) -> None:
    """The router is replicated (data parallel over the ep ranks): rank 0's copy everywhere."""
    if group is not None:
        for p in model.router.parameters():
            torch.distributed.broadcast(p.data, src=0, group=group)


def average_over_ranks(loss: Tensor, model: MoE, group) -> Tensor:
    """After backward of loss / n: the router's gradient summed over the ranks (each saw its
    own tokens; the experts' gradients already gather every rank's tokens through the
    exchange); returns the mean loss over the ranks (detached)."""
    loss = loss.detach().clone()
    if group is not None:
        for p in model.router.parameters():
            torch.distributed.all_reduce(p.grad, group=group)
        torch.distributed.all_reduce(loss, group=group)
    return loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: bfloat16 on CUDA, float32 elsewhere")
    p.add_argument("--backend", default="auto", choices=te_seq.kernels.backend_names())
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256, help="tokens per batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp8", choices=sorted(RECIPES), default=None,
                   help="also train under this FP8 recipe and compare with the run without")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks (run under torchrun with this many processes)")
    p.add_argument("--fp8-hp-wgrad", action="store_true",
                   help="with --fp8: the recipe's fp8_wgrad=False (weight gradients in the "
                        "compute dtype, forward and dgrad GEMMs in FP8)")
    p.add_argument("--fp8-margin", type=float, default=0.1,
                   help="largest relative gap between the FP8 and the plain final loss")
    # At these sizes one CPU thread is as fast as two (0.75 s per 50 steps either way, 2-core
    # CPU VM, 2026-11-22) and does not collapse when the cores are shared: 9 s vs 107 s for
    # 300 steps with another job running on the same 2 cores.
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (CPU only)")
    args = p.parse_args(argv)
    if args.fp8 == "block" and (args.hidden % 128 or args.ffn % 128):
        p.error(f"--fp8 block needs --hidden and --ffn multiples of 128 (128x128 weight blocks), "
                f"got {args.hidden} and {args.ffn}")
    if args.ep < 1 or args.experts % args.ep:
        p.error(f"--experts {args.experts} must be divisible by --ep {args.ep} (>= 1)")
    if args.fp8_hp_wgrad and not args.fp8:
        p.error("--fp8-hp-wgrad needs --fp8 {block,rowwise,tensor}")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    return args


class Progress:
    """tqdm when it is installed, else one line rewritten with '\\r'."""

    def __init__(self, total: int) -> None:
        self.total, self.start = total, time.perf_counter()
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, desc="train", file=sys.stdout)

    def update(self, step: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}")
        elif step % max(1, self.total // 50) == 0 or step == self.total:
            rate = step / max(time.perf_counter() - self.start, 1e-9)
            line = f"\rstep {step}/{self.total}  loss {loss:.4f}  {rate:.0f} it/s"
            print(line, end="", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            print()


def check_against_loop(model: MoE, x: Tensor) -> None:
    """The te_seq block (fused) must equal a per-token PyTorch loop; tolerance tied to dtype."""
    with torch.no_grad():
        got, want = model(x), model.forward_loop(x)
    tol = {torch.float64: 1e-10, torch.float32: 1e-4}.get(x.dtype, 3e-2)
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    print(f"te_seq vs per-expert loop: max abs diff {err:.2e} (output max {scale:.2e})")
    if err > tol * max(scale, 1.0):
        sys.exit(f"te_seq output differs from the per-expert loop by {err:.3e}")


def train(
    args: argparse.Namespace, fp8: recipe.Recipe | None = None
) -> tuple[list[float], te_seq.FusionPlan | None]:
    """Train the student (under the FP8 recipe `fp8` if given); the losses and the MLP's plan."""
    group, device = init_expert_parallel(args)  # the group is made on the first call
    ep_rank = 0 if group is None else group.rank()
    dtype = DTYPES[args.dtype]
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed + ep_rank)  # each rank: its own experts and tokens
    dims = (args.experts, args.hidden, args.ffn, args.topk)
    teacher = MoE(*dims, device=device, dtype=dtype, ep_group=group).requires_grad_(False)
    student = MoE(*dims, device=device, dtype=dtype, ep_group=group)
    for model in (teacher, student):
        replicate_router(model, group)
    probe = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
    if fp8 is None:  # the loop is unquantized maths
        check_against_loop(student, probe)
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
    losses, plan, bar = [], None, Progress(args.steps)
    for step in range(1, args.steps + 1):
        x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)  # [T, H]
        with torch.no_grad():
            target = teacher(x)
        with te_seq.autocast(enabled=fp8 is not None, recipe=fp8):
            loss = torch.nn.functional.mse_loss(student(x).float(), target.float())
        opt.zero_grad(set_to_none=True)
        (loss / args.ep).backward()  # the mean over the ranks' tokens
        loss = average_over_ranks(loss / args.ep, student, group)
        opt.step()
        if plan is None:
            plan = student.block.fusion_plan()
        losses.append(loss.item())
        bar.update(step, losses[-1])
    bar.close()
    return losses, plan


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"te_seq {te_seq.__version__}, torch {torch.__version__}, device {args.device}, "
          f"dtype {args.dtype}, backend requested {args.backend!r}")
    with te_seq.backend(args.backend):
        losses, plan = train(args)
    print(plan)
    fused = next(s for s in plan.forward if s.name in ("MoeBlock", "GroupedMLP"))
    print(f"backend chosen by the plan: {fused.backend}")
    first, last = _summary("", losses)
    if not last < 0.9 * first:
        print("loss did not fall", file=sys.stderr)
        return 1
    print("loss fell")
    return 0 if args.fp8 is None else _compare_fp8(args, last)


def _summary(label: str, losses: list[float]) -> tuple[float, float]:
    window = max(1, min(10, len(losses) // 4))
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    print(f"{label}first loss {losses[0]:.6f}, last loss {losses[-1]:.6f} "
          f"(mean of first/last {window}: {first:.6f} -> {last:.6f})")
    return first, last


def _compare_fp8(args: argparse.Namespace, plain_last: float) -> int:
    """Train again under the FP8 recipe; its final loss must be within the margin."""
    fp8 = RECIPES[args.fp8](fp8_wgrad=not args.fp8_hp_wgrad)
    with te_seq.backend(args.backend):
        losses, plan = train(args, fp8)
    print(plan)
    first, last = _summary(f"fp8 {fp8}: ", losses)
    if not last < 0.9 * first:
        print("fp8 loss did not fall", file=sys.stderr)
        return 1
    gap = abs(last - plain_last) / plain_last
    print(f"fp8 {fp8} final loss {last:.6f} vs {plain_last:.6f} without FP8: gap {gap:.2%} "
          f"(margin {args.fp8_margin:.0%})")
    if not gap <= args.fp8_margin:
        print("fp8 loss outside the margin", file=sys.stderr)
        return 1
    print("fp8 loss within the margin")
    return 0


if __name__ == "__main__":
    status = main()
    if torch.distributed.is_initialized():  # --ep
        torch.distributed.destroy_process_group()
    sys.exit(status)
