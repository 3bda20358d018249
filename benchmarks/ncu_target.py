"""A lean process for Nsight Compute to profile: the benchmark's grouped MLP, a few steps, nothing
else (no torch.profiler, whose CUPTI use would clash with ncu's, no timing loops).

It builds the MLP of benchmarks/profile_kernels.py (te_seq's, or QuACK's with ``--peer
quack``) on a benchmark shape and runs ``--steps`` forward+backward steps, or forwards under
torch.no_grad() with ``--forward``. Pick the launch with ncu's filters: a kernel name regex
and ``--launch-skip`` past the warm-up steps (each step launches each kernel once or twice:
`profile_kernels.py --order` lists them), e.g. the FC1 GLU kernel of the fourth forward:

  ncu --clock-control none --launch-skip 3 --launch-count 1 -k regex:GluGemm --set full \
      --import-source no -f -o /tmp/fc1 python benchmarks/ncu_target.py --shape Q --forward
  ncu ... -k regex:linear_act ... python benchmarks/ncu_target.py --shape Q --forward \
      --peer quack

then `ncu_stalls.py` on its source page. ``--fp8``: te_seq's MLP under the row-wise recipe
(bf16 wgrads; its GLU kernels are ``ScaledGluGemmKernel``). ``--device cpu`` runs the torch
backend on a tiny shape (a check of this script, nothing to profile).
"""

from __future__ import annotations

import argparse

import torch
from mlp_case import ACTS, make_case
from profile_host import build
from profile_kernels import forward_fn, step_fn

import te_seq


def make_step(shape: str, act: str, forward: bool, peer: str, device: str, fp8: bool = False):
    """One step (no arguments) of the chosen MLP on ``shape``'s case; ``fp8``: te_seq's under
    the row-wise recipe with bf16 wgrads (`profile_kernels.py --fp8 ROWWISE --hp-wgrad`)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    case = make_case(shape, torch.device(device), dtype, act=act)
    if peer == "quack":
        from peer_quack import QuackPeer

        mlp = QuackPeer(case, "fresh")
        return forward_fn(mlp.forward, None) if forward else mlp.forward_backward
    backend = "cute" if device == "cuda" else "torch"
    mlp, run = build(case, backend)
    recipe = te_seq.recipe.Float8RowwiseScaling(fp8_wgrad=False) if fp8 else None
    return forward_fn(run, recipe) if forward else step_fn(mlp, run, recipe)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="Q")
    p.add_argument("--act", default="swiglu", choices=ACTS, help="swiglu: no router probs")
    p.add_argument("--forward", action="store_true", help="forwards under torch.no_grad()")
    p.add_argument("--peer", default="", choices=["", "quack"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--fp8", action="store_true", help="te_seq's MLP under the row-wise recipe, "
                   "bf16 wgrads")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    step = make_step(args.shape if args.device == "cuda" else "U", args.act, args.forward,
                     args.peer, args.device, args.fp8)
    for _ in range(args.steps):
        step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    print(f"ran {args.steps} {'forward' if args.forward else 'fwd+bwd'} steps")


if __name__ == "__main__":
    main()
