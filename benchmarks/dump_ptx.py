"""Dump the PTX of te_seq's CuTe DSL kernels, one file per kernel config, compiled on the CPU.

Use it to show that a refactor of ``te_seq/kernels/cute`` left the device code unchanged: dump
before and after, then compare the printed digests (or ``diff -r`` the two directories).

    python benchmarks/dump_ptx.py --out /tmp/ptx_before [--configs mm256,glu_fc1_silu_probs]
    python benchmarks/dump_ptx.py --out /tmp/ptx_after --compare /tmp/ptx_before

No GPU is needed: the script sets ``CUTE_DSL_ARCH=sm_90a`` (read once, at ``import cutlass``, so
run it as its own process), keeps the PTX that the DSL writes (``CUTE_DSL_KEEP=ptx`` into a
temporary ``CUTE_DSL_DUMP_DIR``) and turns te_seq's disk cache off so every config compiles.
Each config is written to ``<out>/<name>.ptx`` and printed with the sha256 of its PTX; with
``--compare DIR`` the exit status is 1 when any file differs from ``DIR/<name>.ptx``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


def _configs() -> dict[str, object]:
    """Named kernel configs: both GEMM problems (tile widths, majors, cluster shapes, wgrad
    outputs) and both GLU epilogues (activations, probs, interleaving, dgrad tile widths)."""
    import torch

    from te_seq.kernels.cute.compile import GemmConfig, GluConfig

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    return {
        "mm256": GemmConfig("m", bf16, bf16, "k", 256, (1, 2)),
        "mm192": GemmConfig("m", bf16, bf16, "k", 192, (1, 2)),
        "mm128_nmajor": GemmConfig("m", bf16, bf16, "n", 128, (1, 2)),
        "mm256_fp16_2x1": GemmConfig("m", fp16, fp16, "k", 256, (2, 1)),
        "mm192_pingpong": GemmConfig("m", bf16, bf16, "k", 192, (1, 2), pingpong=True),
        "wgrad_bf16": GemmConfig("k", bf16, bf16, "n", 256, (1, 2)),
        "wgrad_fp32_acc": GemmConfig("k", bf16, fp32, "n", 256, (1, 2), accumulate=True),
        "wgrad_fp32_acc192": GemmConfig("k", bf16, fp32, "n", 192, (1, 2), accumulate=True),
        "wgrad_pp128": GemmConfig("k", bf16, bf16, "n", 128, (1, 2), pingpong=True),
        "wgrad_fp32_pp192": GemmConfig("k", bf16, fp32, "n", 192, (2, 1), pingpong=True),
        "glu_fc1_silu_probs": GluConfig("fc1", bf16, "k", "silu", None, fp32),
        "glu_fc1_relu_il32": GluConfig("fc1", bf16, "k", "relu", 32, None),
        "glu_dgrad_gelu_il64": GluConfig("dgrad", bf16, "n", "gelu", 64, bf16),
        "glu_dgrad_silu192": GluConfig("dgrad", bf16, "n", "silu", None, fp32, tile_n=192),
        # per-expert biases (bias_epilogue.py)
        "mm256_bias_scaled": GemmConfig("m", bf16, bf16, "k", bias_dtype=fp32, bias_scales=True),
        "glu_fc1_silu_bias": GluConfig("fc1", bf16, "k", "silu", None, fp32, bias_dtype=bf16),
        # routed rows (routed.py): A gathered by index, C scattered by index
        "mm256_gather": GemmConfig("m", bf16, bf16, "k", 256, (1, 1), route="gather"),
        "mm256_scatter": GemmConfig("m", bf16, bf16, "k", 256, (1, 2), route="scatter"),
        "mm256_bias_scatter": GemmConfig("m", bf16, bf16, "k", bias_dtype=bf16, route="scatter"),
        "glu_fc1_silu_gather": GluConfig("fc1", bf16, "k", "silu", None, fp32, (1, 1),
                                         route="gather"),
        # FP8 operands, row-wise dequantization scales in the epilogue (scale_epilogue.py)
        "fp8_rowwise": GemmConfig("m", torch.float8_e4m3fn, bf16, "k", 256, (1, 2), scaled=True),
        "fp8_wgrad_fp32_acc": GemmConfig("k", torch.float8_e4m3fn, fp32, "k", 256, (1, 2),
                                         accumulate=True, scaled=True),
        # FP8 GLU epilogues: the scales applied to the accumulators first (scaled_glu.py)
        "fp8_glu_fc1_silu_probs": GluConfig("fc1", torch.float8_e4m3fn, "k", "silu", None, fp32,
                                            scaled=True),
        "fp8_glu_dgrad_silu_probs": GluConfig("dgrad", torch.float8_e4m3fn, "k", "silu", None,
                                              fp32, scaled=True),
        # FP8 block scales promoted in the main loop (block_scaled.py, block_wgrad.py)
        "fp8_block": GemmConfig("m", torch.float8_e4m3fn, bf16, "k", 128, (1, 2),
                                block_scaled=True),
        "fp8_block_wgrad_fp32_acc": GemmConfig("k", torch.float8_e4m3fn, fp32, "k", 128,
                                               (1, 2), accumulate=True, block_wgrad=True),
    }


def _ptx_of(compiled: object) -> str:
    """The PTX text of a compiled kernel (the DSL gives the path of the file it kept)."""
    ptx = getattr(compiled, "__ptx__", None)
    if not ptx:
        raise RuntimeError("the DSL kept no PTX (is CUTE_DSL_KEEP=ptx honoured?)")
    return Path(ptx).read_text() if os.path.isfile(ptx) else ptx


def _compile(cfg: object) -> object:
    from te_seq.kernels.cute.compile import GemmConfig, compile_gemm, compile_glu

    return (compile_gemm if isinstance(cfg, GemmConfig) else compile_glu)(cfg).fn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for <name>.ptx")
    parser.add_argument("--configs", default="", help="comma-separated names (default: all)")
    parser.add_argument("--compare", type=Path, help="directory of an earlier dump")
    args = parser.parse_args()

    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    os.environ["CUTE_DSL_KEEP"] = "ptx"
    os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix="te_seq_ptx_")
    os.environ["TE_SEQ_DISK_CACHE"] = "0"
    sys.path.insert(0, str(_ROOT))
    if "cutlass" in sys.modules:
        raise RuntimeError("cutlass was imported before CUTE_DSL_ARCH was set")

    configs = _configs()
    names = [n for n in args.configs.split(",") if n] or list(configs)
    unknown = sorted(set(names) - set(configs))
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(configs)}")
    args.out.mkdir(parents=True, exist_ok=True)
    differ = []
    for name in names:
        text = _ptx_of(_compile(configs[name]))
        (args.out / f"{name}.ptx").write_text(text)
        verdict = ""
        if args.compare is not None:
            old = args.compare / f"{name}.ptx"
            same = old.is_file() and old.read_text() == text
            verdict = "  same" if same else "  DIFFERS"
            if not same:
                differ.append(name)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        print(f"{name:22s} {digest} {len(text):8d} chars{verdict}", flush=True)
    if differ:
        print(f"PTX differs from {args.compare} for: {', '.join(differ)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
