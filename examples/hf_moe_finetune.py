"""Fine-tune a tiny random Hugging Face Mixtral with its experts run by te_seq.

`te_seq.integrations.transformers.swap_experts(model)` replaces every sparse-MoE block's routed
experts by te_seq's expert block (ExpertDispatch -> fused grouped MLP -> ExpertCombine); the
router, attention and everything else stay transformers' own modules. The example checks that
the swapped model gives the original's logits, trains both for a few steps on the same random
token batch (next-token loss: the model learns it by heart, so the loss must fall), prints the
time per step of each, and restores the original experts (holding the trained weights) with
`restore_experts`.

    python examples/hf_moe_finetune.py                 # GPU if present (bf16), else CPU
    python examples/hf_moe_finetune.py --steps 5 --device cpu

No download: the model is built from a config. Exit status 1 when the swapped model's logits
are off (float32: norm-relative difference to the original over 1e-4; bf16: farther from the
float32 original than 1.5x the original's own bf16 logits are, since in bf16 a token whose
top-2 experts nearly tie may be routed differently after the first block by any two
implementations), or when its loss did not fall.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from te_seq.integrations.transformers import restore_experts, swap_experts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args(argv)


def build_model(args: argparse.Namespace, dtype: torch.dtype):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=256, hidden_size=args.hidden,
                           intermediate_size=2 * args.hidden,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=args.experts, num_experts_per_tok=2,
                           max_position_embeddings=args.seq)
    torch.manual_seed(0)
    return MixtralForCausalLM(config).to(device=args.device, dtype=dtype)


def train(model, batches, lr: float) -> tuple[list[float], float]:
    """Losses per step and the mean seconds per step (the first step, which compiles and
    plans, excluded)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, times = [], []
    for tokens in batches:
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if tokens.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, sum(times[1:]) / max(len(times) - 1, 1)


def logits_match(args: argparse.Namespace, original, swapped, dtype: torch.dtype) -> bool:
    """The swapped model's logits against the original's (see the module docstring)."""
    tokens = torch.randint(0, 256, (args.batch, args.seq), device=args.device)
    with torch.no_grad():
        want, got = original(input_ids=tokens).logits.float(), swapped(input_ids=tokens).logits
        exact = build_model(args, torch.float32)(input_ids=tokens).logits  # the same weights
    err = ((got.float() - want).norm() / want.norm()).item()
    print(f"logits: norm-relative difference to the original {err:.2e}")
    if dtype == torch.float32:
        return err <= 1e-4
    err_te = ((got.float() - exact).norm() / exact.norm()).item()
    err_hf = ((want - exact).norm() / exact.norm()).item()
    print(f"to the float32 original: te_seq {err_te:.2e}, transformers' own {dtype} {err_hf:.2e}")
    return err_te <= 1.5 * err_hf


def main(argv: list[str] | None = None) -> int:
    try:
        import transformers
    except ImportError:
        print("transformers is not installed (pip install -e '.[hf]'); nothing to run")
        return 0
    args = parse_args(argv)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"device {args.device}, dtype {dtype}")
    original = build_model(args, dtype)
    swapped = copy.deepcopy(original)
    print(f"swapped {swap_experts(swapped)} MoE blocks")
    if not logits_match(args, original, swapped, dtype):
        return 1
    gen = torch.Generator(device="cpu").manual_seed(1)
    batch = torch.randint(0, 256, (args.batch, args.seq), generator=gen).to(args.device)
    batches = [batch] * args.steps
    hf_losses, hf_time = train(original, batches, args.lr)
    te_losses, te_time = train(swapped, batches, args.lr)
    print(f"transformers experts: {hf_time * 1e3:.1f} ms/step, loss {hf_losses[0]:.4f} -> "
          f"{hf_losses[-1]:.4f}")
    print(f"te_seq experts:       {te_time * 1e3:.1f} ms/step, loss {te_losses[0]:.4f} -> "
          f"{te_losses[-1]:.4f}  (speedup {hf_time / te_time:.2f}x)")
    if not args.device.startswith("cuda"):
        print("(off CUDA te_seq runs its reference backend, the oracle, not a fast path)")
    print(f"restored {restore_experts(swapped)} MoE blocks")
    if not te_losses[-1] < te_losses[0]:
        print("loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
