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

``--ptxas`` also assembles each PTX for sm_90a (``ptxas -v``, ``$PTXAS`` or the CUDA toolkit's)
and prints per config the registers per thread and the bytes of register spill stores and loads
(the kernel's maximum over its entry points), e.g. to check that an epilogue fits the 232
registers of a math thread. ptxas reports the launch-time count (168 for 384 threads); the
warpgroups raise theirs with ``setmaxnreg``, so where an ``nvdisasm`` is found (``$NVDISASM``,
PATH) the highest register the SASS names is printed too ("sass R"):

    python benchmarks/dump_ptx.py --out /tmp/ptx --configs glu_dgrad_silu192_pp --ptxas
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


def _configs() -> dict[str, object]:
    """Named kernel configs: both GEMM problems (tile widths, majors, cluster shapes, wgrad
    outputs), both GLU epilogues (activations, probs, interleaving, dgrad tile widths), the
    non-gated activation dgrad and the FP8 quantization kernels (bf16 in, E4M3 out)."""
    import torch

    from te_seq.kernels.cute.compile import ActConfig, GemmConfig, GluConfig
    from te_seq.kernels.cute.compile_quant import QuantConfig

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    return {
        "mm256": GemmConfig("m", bf16, bf16, "k", 256, (1, 2)),
        "mm192": GemmConfig("m", bf16, bf16, "k", 192, (1, 2)),
        "mm128_nmajor": GemmConfig("m", bf16, bf16, "n", 128, (1, 2)),
        "mm256_fp16_2x1": GemmConfig("m", fp16, fp16, "k", 256, (2, 1)),
        "mm192_pingpong": GemmConfig("m", bf16, bf16, "k", 192, (1, 2), pingpong=True),
        # the default ping-pong varlen-M GEMM: 2x1 with split tails (two B atoms)
        "mm192_pp_2x1": GemmConfig("m", bf16, bf16, "k", 192, (2, 1), pingpong=True),
        "mm192_pp_2x1_c64": GemmConfig("m", bf16, bf16, "k", 192, (2, 1), pingpong=True,
                                       epi_cols=64),
        # an expert's last tile with <= 64 rows runs one 64-row atom (mainloop.py)
        "mm128_pp_half": GemmConfig("m", bf16, bf16, "k", 128, (1, 2), pingpong=True,
                                    half_tiles=True),
        "mm192_pp_half": GemmConfig("m", bf16, bf16, "n", 192, (1, 2), pingpong=True,
                                    half_tiles=True),
        "wgrad_bf16": GemmConfig("k", bf16, bf16, "n", 256, (1, 2)),
        "wgrad_fp32_acc": GemmConfig("k", bf16, fp32, "n", 256, (1, 2), accumulate=True),
        "wgrad_fp32_acc192": GemmConfig("k", bf16, fp32, "n", 192, (1, 2), accumulate=True),
        "wgrad_pp128": GemmConfig("k", bf16, bf16, "n", 128, (1, 2), pingpong=True),
        "wgrad_fp32_pp192": GemmConfig("k", bf16, fp32, "n", 192, (2, 1), pingpong=True),
        "wgrad_pp192": GemmConfig("k", bf16, bf16, "n", 192, (2, 1), pingpong=True),
        # dynamic work units (tile_scheduler.py): every cluster shape, both consumer modes
        "wgrad_pp192_dyn": GemmConfig("k", bf16, bf16, "n", 192, (2, 1), pingpong=True,
                                      dynamic=True),
        # Q's default: 64-column epilogue subtiles over short groups (launch.wgrad_epi_cols)
        "wgrad_pp192_dyn_c64": GemmConfig("k", bf16, bf16, "n", 192, (2, 1), pingpong=True,
                                          dynamic=True, epi_cols=64),
        "wgrad_pp128_1x1_dyn": GemmConfig("k", bf16, bf16, "n", 128, (1, 1), pingpong=True,
                                          dynamic=True),
        "wgrad_fp32_acc_dyn": GemmConfig("k", bf16, fp32, "n", 256, (1, 2), accumulate=True,
                                         dynamic=True),
        # the fp32 main_grad accumulate in ping-pong (one set of old-C blocks per warpgroup)
        "wgrad_fp32_acc_pp192_dyn": GemmConfig("k", bf16, fp32, "n", 192, (2, 1),
                                               accumulate=True, pingpong=True, dynamic=True),
        "wgrad_fp32_acc_pp128_dyn": GemmConfig("k", bf16, fp32, "n", 128, (1, 2),
                                               accumulate=True, pingpong=True, dynamic=True),
        # its default (launch.ACCUMULATE_TILING: groups of <= 512 rows)
        "wgrad_fp32_acc_pp128_1x1_dyn": GemmConfig("k", bf16, fp32, "n", 128, (1, 1),
                                                   accumulate=True, pingpong=True, dynamic=True),
        # the non-gated FC2 dgrad (act_epilogue: h loaded by TMA, read by the threads)
        "act_dgrad_relu_probs": ActConfig("dgrad", bf16, "n", "relu", fp32),
        "glu_fc1_silu_probs": GluConfig("fc1", bf16, "k", "silu", None, fp32),
        "glu_fc1_relu_il32": GluConfig("fc1", bf16, "k", "relu", 32, None),
        "glu_dgrad_gelu_il64": GluConfig("dgrad", bf16, "n", "gelu", 64, bf16),
        "glu_dgrad_silu192": GluConfig("dgrad", bf16, "n", "silu", None, fp32, tile_n=192),
        "glu_dgrad_silu192_pf2": GluConfig("dgrad", bf16, "n", "silu", None, fp32, tile_n=192,
                                           h_prefetch=2),
        # ping-pong GLU epilogues (one warpgroup holds the whole 128-row tile)
        "glu_fc1_silu_probs_pp": GluConfig("fc1", bf16, "k", "silu", None, fp32, tile_n=128,
                                           pingpong=True),
        # ... in the default 2x1 cluster (split tails)
        "glu_fc1_silu_probs_pp_2x1": GluConfig("fc1", bf16, "k", "silu", None, fp32, (2, 1),
                                               tile_n=128, pingpong=True),
        # a forward without backward: a only, h not stored
        "glu_fc1_silu_probs_pp_noh": GluConfig("fc1", bf16, "k", "silu", None, fp32, tile_n=128,
                                               pingpong=True, store_h=False),
        # 64-column epilogue subtiles (TE_SEQ_GLU_FC1_EPI_COLS=64), with and without h
        "glu_fc1_silu_probs_pp_2x1_c64": GluConfig("fc1", bf16, "k", "silu", None, fp32, (2, 1),
                                                   tile_n=128, pingpong=True, epi_cols=64),
        "glu_fc1_silu_pp_2x1_noh_c64": GluConfig("fc1", bf16, "k", "silu", None, None, (2, 1),
                                                 tile_n=128, pingpong=True, store_h=False,
                                                 epi_cols=64),
        "glu_dgrad_silu128_pp": GluConfig("dgrad", bf16, "n", "silu", None, fp32, tile_n=128,
                                          pingpong=True),
        "glu_dgrad_silu192_pp": GluConfig("dgrad", bf16, "n", "silu", None, fp32, tile_n=192,
                                          pingpong=True),
        # the default 16-bit GLU dgrad: ping-pong in 2x1 clusters with split tails
        "glu_dgrad_silu_probs_pp_2x1": GluConfig("dgrad", bf16, "n", "silu", None, fp32,
                                                 (2, 1), tile_n=128, pingpong=True),
        # ... loading 2 or 4 of a tile's h subtiles ahead (TE_SEQ_GLU_DGRAD_H_PREFETCH)
        "glu_dgrad_silu_probs_pp_2x1_pf4": GluConfig("dgrad", bf16, "n", "silu", None, fp32,
                                                     (2, 1), tile_n=128, pingpong=True,
                                                     h_prefetch=4),
        # ... with (64 x 32) epilogue subtiles: half the registers per subtile
        "glu_fc1_silu_probs_pp_half": GluConfig("fc1", bf16, "k", "silu", None, fp32,
                                                tile_n=128, pingpong=True, half_tiles=True),
        "glu_fc1_silu_probs_pp64": GluConfig("fc1", bf16, "k", "silu", None, fp32, tile_n=128,
                                             pingpong=True, epi_rows=64),
        "glu_fc1_silu_probs_pp192": GluConfig("fc1", bf16, "k", "silu", None, fp32, tile_n=192,
                                              pingpong=True),
        "glu_fc1_silu_probs_pp192_64": GluConfig("fc1", bf16, "k", "silu", None, fp32,
                                                 tile_n=192, pingpong=True, epi_rows=64),
        "glu_fc1_relu_il32_pp64": GluConfig("fc1", bf16, "k", "relu", 32, None, tile_n=128,
                                            pingpong=True, epi_rows=64),
        "glu_dgrad_silu128_pp64": GluConfig("dgrad", bf16, "n", "silu", None, fp32, tile_n=128,
                                            pingpong=True, epi_rows=64),
        "glu_dgrad_silu192_pp64": GluConfig("dgrad", bf16, "n", "silu", None, fp32, tile_n=192,
                                            pingpong=True, epi_rows=64),
        "glu_dgrad_gelu_il64_pp64": GluConfig("dgrad", bf16, "n", "gelu", 64, bf16, tile_n=192,
                                              pingpong=True, epi_rows=64),
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
        # the scaled accumulate's default over short groups (fp8.SCALED_ACCUMULATE_TILING)
        "fp8_wgrad_fp32_acc_pp128_2x1": GemmConfig("k", torch.float8_e4m3fn, fp32, "k", 128,
                                                   (2, 1), accumulate=True, scaled=True,
                                                   pingpong=True),
        # FP8 GLU epilogues: the scales applied to the accumulators first (scaled_glu.py)
        "fp8_glu_fc1_silu_probs": GluConfig("fc1", torch.float8_e4m3fn, "k", "silu", None, fp32,
                                            scaled=True),
        "fp8_glu_dgrad_silu_probs": GluConfig("dgrad", torch.float8_e4m3fn, "k", "silu", None,
                                              fp32, scaled=True),
        # FP8 row-wise in ping-pong: a scale scratch block per warpgroup (scale_epilogue.py)
        "fp8_rowwise_pp128": GemmConfig("m", torch.float8_e4m3fn, bf16, "k", 128, (1, 2),
                                        scaled=True, pingpong=True),
        "fp8_rowwise_pp192": GemmConfig("m", torch.float8_e4m3fn, bf16, "k", 192, (1, 2),
                                        scaled=True, pingpong=True),
        "fp8_rowwise_pp192_2x1_c64": GemmConfig("m", torch.float8_e4m3fn, bf16, "k", 192,
                                                (2, 1), scaled=True, pingpong=True, epi_cols=64),
        "fp8_glu_fc1_silu_probs_pp": GluConfig("fc1", torch.float8_e4m3fn, "k", "silu", None,
                                               fp32, tile_n=128, scaled=True, pingpong=True),
        "fp8_wgrad_pp192_2x1": GemmConfig("k", torch.float8_e4m3fn, bf16, "k", 192, (2, 1),
                                          scaled=True, pingpong=True),
        "fp8_wgrad_pp192_2x1_c64": GemmConfig("k", torch.float8_e4m3fn, bf16, "k", 192, (2, 1),
                                              scaled=True, pingpong=True, epi_cols=64),
        "fp8_glu_dgrad_silu_probs_pp": GluConfig("dgrad", torch.float8_e4m3fn, "k", "silu",
                                                 None, fp32, tile_n=128, scaled=True,
                                                 pingpong=True),
        # the default FP8 GLU dgrad: 2x1, two h pairs (glu.FP8_PINGPONG_DGRAD_H_PREFETCH)
        "fp8_glu_dgrad_silu_probs_pp_2x1_pf2": GluConfig("dgrad", torch.float8_e4m3fn, "k",
                                                         "silu", None, fp32, (2, 1),
                                                         tile_n=128, scaled=True,
                                                         pingpong=True, h_prefetch=2),
        "fp8_glu_dgrad_silu_probs_pp64": GluConfig("dgrad", torch.float8_e4m3fn, "k", "silu",
                                                   None, fp32, tile_n=128, scaled=True,
                                                   pingpong=True, epi_rows=64),
        "fp8_glu_fc1_silu_probs_pp64": GluConfig("fc1", torch.float8_e4m3fn, "k", "silu", None,
                                                 fp32, tile_n=128, scaled=True, pingpong=True,
                                                 epi_rows=64),
        # FP8 block scales promoted in the main loop (block_scaled.py, block_wgrad.py)
        "fp8_block": GemmConfig("m", torch.float8_e4m3fn, bf16, "k", 128, (1, 2),
                                block_scaled=True),
        "fp8_block_glu_fc1_silu_probs": GluConfig("fc1", torch.float8_e4m3fn, "k", "silu", None,
                                                  fp32, tile_n=128, block_scaled=True),
        "fp8_block_glu_fc1_gelu_il32": GluConfig("fc1", torch.float8_e4m3fn, "k", "gelu", 32,
                                                 None, tile_n=128, block_scaled=True),
        "fp8_block_glu_dgrad_silu_probs": GluConfig("dgrad", torch.float8_e4m3fn, "k", "silu",
                                                    None, fp32, tile_n=128, block_scaled=True),
        "fp8_block_wgrad_fp32_acc": GemmConfig("k", torch.float8_e4m3fn, fp32, "k", 128,
                                               (1, 2), accumulate=True, block_wgrad=True),
        # FP8 quantization kernels (quant_kernels.py, span_kernels.py, block_span_kernels.py)
        "quant_rows": QuantConfig("rows", bf16),
        "quant_rows_regs16": QuantConfig("rows", bf16, lane_vecs=16),  # C <= 4096 in registers
        "quant_span_amax": QuantConfig("span_amax", bf16),
        "quant_span_cast": QuantConfig("span_cast", bf16),
        "quant_span_amax_rows": QuantConfig("span_amax", bf16, rows=True),
        "quant_span_cast_rows": QuantConfig("span_cast", bf16, rows=True),
        "quant_span_block_cast": QuantConfig("span_block_cast", bf16),
        # row_amax_kernels.py: C > 8192 (8 vectors, 1 row in flight), C <= 8192 (4 x 2)
        "quant_rows_group_amax": QuantConfig("rows_group_amax", bf16),
        "quant_rows_group_amax_v4r2": QuantConfig("rows_group_amax", bf16, lane_vecs=4,
                                                  rows_in_flight=2),
        "quant_rows_group_amax_v2r4": QuantConfig("rows_group_amax", bf16, lane_vecs=2,
                                                  rows_in_flight=4),
        # strip_kernels.py: a group's 512 x 64 strip in registers, one read of t
        "quant_strip_cast": QuantConfig("strip_cast", bf16),
    }


def _ptx_of(compiled: object) -> str:
    """The PTX text of a compiled kernel (the DSL gives the path of the file it kept)."""
    ptx = getattr(compiled, "__ptx__", None)
    if not ptx:
        raise RuntimeError("the DSL kept no PTX (is CUTE_DSL_KEEP=ptx honoured?)")
    return Path(ptx).read_text() if os.path.isfile(ptx) else ptx


def _ptxas_binary() -> str:
    """ptxas: ``$PTXAS``, else on PATH, else the newest /usr/local/cuda*/bin/ptxas."""
    found = os.environ.get("PTXAS") or shutil.which("ptxas")
    if found:
        return found
    toolkits = sorted(Path("/usr/local").glob("cuda*/bin/ptxas"))
    if not toolkits:
        raise RuntimeError("ptxas not found: set $PTXAS")
    return str(toolkits[-1])


_USED = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


_SASS_REG = re.compile(r"\bR(\d+)\b")


def _highest_sass_register(cubin: Path) -> int | None:
    """The highest general register R<i> named in the SASS of ``cubin`` (None: no nvdisasm)."""
    tool = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not tool:
        return None
    sass = subprocess.run([tool, str(cubin)], capture_output=True, text=True, check=True).stdout
    return max((int(r) for r in _SASS_REG.findall(sass)), default=0)


def ptxas_usage(ptx_file: Path) -> tuple[int, int, int, int | None]:
    """(registers per thread, spill store bytes, spill load bytes, highest SASS register or
    None) of ``ptx_file`` assembled for sm_90a by ``ptxas -v``: the maximum of each over the
    file's kernels."""
    cubin = ptx_file.with_suffix(".cubin")
    run = subprocess.run(
        [_ptxas_binary(), "-arch=sm_90a", "-v", str(ptx_file), "-o", str(cubin)],
        capture_output=True, text=True,
    )
    log = run.stdout + run.stderr
    if run.returncode:  # e.g. "Unsupported .version": a toolkit older than the DSL's PTX
        raise RuntimeError(f"ptxas failed on {ptx_file} (exit {run.returncode}):\n{log}")
    regs = [int(m) for m in _USED.findall(log)]
    spills = [(int(a), int(b)) for a, b in _SPILLS.findall(log)]
    if not regs or not spills:
        raise RuntimeError(f"no register report from ptxas for {ptx_file}:\n{log}")
    highest = _highest_sass_register(cubin)
    cubin.unlink()
    return max(regs), max(a for a, _ in spills), max(b for _, b in spills), highest


def _compile(cfg: object) -> object:
    from te_seq.kernels.cute.compile import (
        ActConfig,
        GemmConfig,
        compile_act,
        compile_gemm,
        compile_glu,
    )
    from te_seq.kernels.cute.compile_quant import QuantConfig, compile_quant

    if isinstance(cfg, QuantConfig):
        return compile_quant(cfg).fn
    if isinstance(cfg, ActConfig):
        return compile_act(cfg).fn
    return (compile_gemm if isinstance(cfg, GemmConfig) else compile_glu)(cfg).fn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for <name>.ptx")
    parser.add_argument("--configs", default="", help="comma-separated names (default: all)")
    parser.add_argument("--compare", type=Path, help="directory of an earlier dump")
    parser.add_argument("--ptxas", action="store_true",
                        help="print registers and spill bytes per config (ptxas -v, sm_90a)")
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
        if args.ptxas:
            regs, stores, loads, highest = ptxas_usage(args.out / f"{name}.ptx")
            verdict += f"  regs {regs:3d} spill stores {stores:5d} B loads {loads:5d} B"
            verdict += "" if highest is None else f"  sass R{highest}"
        print(f"{name:22s} {digest} {len(text):8d} chars{verdict}", flush=True)
    if differ:
        print(f"PTX differs from {args.compare} for: {', '.join(differ)}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
