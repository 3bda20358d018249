"""Activation memory of the grouped MLP's forward: bf16 against FP8 recipes.

Runs the Sequential of profile_host.py (GroupedLinear -> ScaledSwiGLU -> GroupedLinear, split
sizes on the device) and measures what a forward keeps alive for its backward: the CUDA memory
allocated after the forward returns (its output and saved tensors) minus before, with the FP8
weight cache already warm (weights are not activations). Prints MiB per variant and the ratio
to bf16; the target is FP8 <= bf16. Variants "+tm_fwd" run with
`te_seq.config.set_fp8_token_major_input(True)` (x kept quantized along the tokens from the
forward: the faster, larger choice).

  python benchmarks/fp8_memory.py --shapes Q,A --backend cute
"""

from __future__ import annotations

import argparse
import gc

import torch
from mlp_case import make_case
from profile_host import build

import te_seq

RECIPES = {"bf16": None, "fp8_rowwise": te_seq.recipe.Float8RowwiseScaling,
           "fp8_tensor": te_seq.recipe.Float8CurrentScaling,
           "fp8_block": te_seq.recipe.Float8BlockScaling}


def kept_bytes(forward, recipe, token_major_input: bool = False) -> int:
    """Bytes a forward keeps allocated until its backward (its output included);
    `token_major_input`: `te_seq.config.set_fp8_token_major_input` during the forward."""
    te_seq.config.set_fp8_token_major_input(token_major_input)
    try:
        return _kept_bytes(forward, recipe)
    finally:
        te_seq.config.set_fp8_token_major_input(False)


def _kept_bytes(forward, recipe) -> int:
    with te_seq.autocast(enabled=recipe is not None, recipe=recipe):
        forward()  # warm: plans, compiled kernels, the FP8 weight cache
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = forward()
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - before
    del y
    return kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="Q")
    p.add_argument("--backend", default="cute")
    args = p.parse_args()
    for shape in args.shapes.split(","):
        case = make_case(shape, torch.device("cuda"), torch.bfloat16)
        mlp, forward = build(case, args.backend)
        sizes = {name: kept_bytes(forward, r and r()) for name, r in RECIPES.items()}
        sizes.update({f"{name}+tm_fwd": kept_bytes(forward, r(), True)
                      for name, r in RECIPES.items() if r is not None})
        base = sizes["bf16"]
        for name, kept in sizes.items():
            print(f"{shape} {args.backend} {name:12s} {kept / 2**20:10.1f} MiB  "
                  f"{kept / base:5.2f}x bf16")
        del mlp, forward, case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
