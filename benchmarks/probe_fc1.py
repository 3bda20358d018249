"""Where the GLU FC1 forward's time goes: the kernel against itself with parts changed.

The FC1 GLU kernel (x W1ᵀ -> a = act(gate)·up, h not written: a forward without backward)
trailed QuACK's gated FC1 by ~11 % on shape Q while our plain GEMM of the same N was QuACK's
equal (te_seq/kernels/cute/README.md, sections 14 and 15). Changing one part and timing the
difference places the time without hardware counters:

- ``fc1``: the kernel as the forward runs it (SiLU; MUFU exp and reciprocal);
- ``fc1_relu``: the same with ReLU, whose maths is one max (the activation's own cost);
- ``fc1_h``: h written too (the store ring's cost per extra subtile);
- ``fc1_rounded``, ``fc1_h_rounded``: a computed from h rounded to 16 bits
  (``act_from_rounded_h``, the default until 2026-11-29: a conversion to bf16 and back per
  gate and up value), without and with h;
- ``fc1_w192``: 192-wide tiles (96 gate + 96 up columns, where F is a multiple of 96);
- ``fc1_c64``, ``fc1_h_c64``: 64-column epilogue subtiles (``Tiling(epi_cols=64)``, one
  64-column gate, up and a subtile a tile), without and with h;
- ``no_epilogue``: the same kernel with an empty epilogue (a subclass whose ``_store_tile``
  stores nothing; one accumulator value is written under a condition that never holds at
  run time, so the compiler keeps the WGMMAs): the mainloop and the ping-pong hand-offs alone.
  Its output is garbage by design; only its time means something (it varied by 15 % between
  runs, more than the other variants: read it with care);
- ``plain_mm``: our plain grouped GEMM of N = 2F (writes h whole, no GLU epilogue);
- ``quack_gated``, ``quack_gated_h``, ``quack_mm``: QuACK's gated FC1 (without and with its
  pre-activation stored: the latter is its MLP's training forward, to compare with ``fc1_h``)
  and plain GEMM, where quack-kernels is installed (benchmarks/README.md, "Running it").

Each variant is timed as bench_grouped_mlp.py times (`_common.time_interleaved`: shuffled
rounds of bursts). The variants that compute a are checked against ``fc1`` first.

  python benchmarks/probe_fc1.py [--shapes Q,J,B] [--iters 20] [--probs]
  python benchmarks/probe_fc1.py --compile-only   # the variant kernels for sm_90a, no GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch


def variant_kernel(cfg, empty_epilogue: bool = False, rounded_act: bool = False,
                   store_h: bool = False):
    """The `GluGemmKernel` of ``cfg`` (a `GluConfig` of fc1 with SiLU, no h) with parts
    changed: ``empty_epilogue`` (the epilogue stores nothing), ``rounded_act``
    (``act_from_rounded_h``: a from h rounded to 16 bits, not from the fp32 accumulators),
    ``store_h`` (h written too)."""
    import cutlass
    import cutlass.cute as cute

    from te_seq.kernels.cute.glu_epilogue import GluGemmKernel

    class Variant(GluGemmKernel):
        act_from_rounded_h = rounded_act

        if empty_epilogue:
            @cute.jit
            def _store_tile(self, ep, acc, group, m_tile, n_tile, row0, rows, epi_count):
                act_out = ep.epi[2]
                if rows < 0:  # never: keeps the accumulators (and so the WGMMAs) alive
                    act_out[(0, 0)] = acc[0].to(cutlass.BFloat16)
                return 0

    return Variant("fc1", "silu", None, cfg.probs_dtype is not None, cfg.cluster_mn,
                   tile_n=cfg.tile_n, pingpong=cfg.pingpong, epi_rows=cfg.epi_rows,
                   half_tiles=cfg.half_tiles, store_h=store_h)


def compile_variant(cfg, **changes):
    """`variant_kernel` compiled for ``cfg`` (a `GluConfig` of the real launch)."""
    import cutlass.cute as cute

    from te_seq.kernels.cute.compile import _fake_glu_args

    kernel = variant_kernel(cfg, **changes)
    return cute.compile(kernel, *_fake_glu_args(cfg), options="--enable-tvm-ffi")


def compile_check() -> str:
    """Compile the real FC1 (ping-pong, 128 wide, 1x2, no h) and its variants for sm_90a and
    count in each one's PTX the WGMMAs (equal counts: the compiler kept every mainloop) and
    the conversions to bf16 (the real kernel's must be fewer than ``fc1_rounded``'s: it
    converts a only, not gate and up on their way to the activation)."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ["CUTE_DSL_KEEP"] = "ptx"
    os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix="te_seq_probe_ptx_")
    import cutlass.cute as cute
    from dump_ptx import _ptx_of

    from te_seq.kernels.cute.compile import GluConfig, _fake_glu_args
    from te_seq.kernels.cute.glu_epilogue import GluGemmKernel

    cfg = GluConfig("fc1", torch.bfloat16, "k", "silu", None, None, (1, 2), tile_n=128,
                    pingpong=True, store_h=False)
    real = GluGemmKernel("fc1", "silu", None, False, (1, 2), tile_n=128, pingpong=True,
                         store_h=False)
    counts, converts = {}, {}
    variants = (("fc1", real), ("no_epilogue", variant_kernel(cfg, empty_epilogue=True)),
                ("fc1_rounded", variant_kernel(cfg, rounded_act=True)))
    for name, kernel in variants:
        ptx = _ptx_of(cute.compile(kernel, *_fake_glu_args(cfg)))
        counts[name] = ptx.count("wgmma.mma_async")
        converts[name] = ptx.count("cvt.rn.bf16")  # cvt.rn.bf16.f32 and cvt.rn.bf16x2.f32
    if len(set(counts.values())) != 1 or not counts["fc1"]:
        raise RuntimeError(f"WGMMAs in the PTX differ: {counts}")
    if not 0 < converts["fc1"] < converts["fc1_rounded"]:
        raise RuntimeError(f"the FC1 converts gate and up to bf16 again: {converts}")
    return f"compiled; WGMMAs in the PTX: {counts}; conversions to bf16: {converts}"


def variants(x, w1t, offs, probs, qk=None) -> dict:
    """{name: fn} of the module docstring on these operands."""
    from te_seq.kernels import cute
    from te_seq.kernels.cute import glu, launch

    rows, f = x.shape[0], w1t.shape[2] // 2
    plan = glu._plan("fc1", x, w1t, rows, probs, "silu", None, (), None, None, False, None,
                     None, False, False)
    cfg = _config_of(x, w1t, probs)
    w192 = cute.Tiling(192, (1, 2), pingpong=True)
    c64 = cute.Tiling(128, cfg.cluster_mn, pingpong=True, epi_cols=64)
    a_out = torch.empty(rows, f, dtype=x.dtype, device=x.device)
    h_out = torch.empty(rows, 2 * f, dtype=x.dtype, device=x.device)

    def launcher(**changes):
        compiled = compile_variant(cfg, **changes)

        c = h_out if changes.get("store_h") else a_out

        def run():
            compiled(launch._row_major(x), launch.b_view(w1t, plan.b_copy), c, offs,
                     plan.clusters, *glu.epilogue_args(x, a_out, probs, None, None, None),
                     launch.no_route(x.device))
            return None, a_out
        return run

    fns = {
        "fc1": lambda: cute.glu_fc1_forward(x, w1t, offs, "silu", None, probs, store_h=False),
        "fc1_relu": lambda: cute.glu_fc1_forward(x, w1t, offs, "relu", None, probs,
                                                 store_h=False),
        "fc1_h": lambda: cute.glu_fc1_forward(x, w1t, offs, "silu", None, probs),
        "no_epilogue": launcher(empty_epilogue=True),
        "fc1_rounded": launcher(rounded_act=True),
        "fc1_h_rounded": launcher(rounded_act=True, store_h=True),
        "plain_mm": lambda: (cute.grouped_mm(x, w1t, offs), None),
        "fc1_c64": lambda: cute.glu_fc1_forward(x, w1t, offs, "silu", None, probs, tiling=c64,
                                                store_h=False),
        "fc1_h_c64": lambda: cute.glu_fc1_forward(x, w1t, offs, "silu", None, probs,
                                                  tiling=c64),
    }
    if f % 96 == 0:  # whole 192-wide tiles of 96 gate + 96 up columns (not B: F = 1024)
        fns["fc1_w192"] = lambda: cute.glu_fc1_forward(x, w1t, offs, "silu", None, probs,
                                                       tiling=w192, store_h=False)
    if qk is not None:
        from bench_grouped_gemm import fc1_layout_variants

        theirs = fc1_layout_variants(qk, x, w1t, offs, probs)
        fns["quack_gated"], fns["quack_mm"] = theirs["quack_gated_no_h"], theirs["quack_mm"]
        fns["quack_gated_h"] = theirs["quack_gated_h"]
    return fns


def _config_of(x, w1t, probs):
    """The `GluConfig` the default FC1 launch compiles for these operands: its plan made with
    the compile entry watched (`glu._plan` looks ``compile_glu`` up at each call)."""
    from te_seq.kernels.cute import compile as compile_module
    from te_seq.kernels.cute import glu

    seen, original = [], compile_module.compile_glu

    def watch(cfg):
        seen.append(cfg)
        return original(cfg)

    compile_module.compile_glu = watch
    try:
        glu._plan("fc1", x, w1t, x.shape[0], probs, "silu", None, (), None, None, False, None,
                  None, False, False)
    finally:
        compile_module.compile_glu = original
    return seen[0]


def run_shape(name: str, iters: int, with_probs: bool, qk) -> None:
    from _common import time_interleaved
    from mlp_case import make_case

    case = make_case(name, torch.device("cuda"), torch.bfloat16,
                     act="scaled_swiglu" if with_probs else "swiglu")
    x, w1t, offs = case.x, case.w1.transpose(1, 2), case.offs
    probs = case.probs
    fns = variants(x, w1t, offs, probs, qk)
    want = fns["fc1"]()[1]
    for key in ("fc1_h", "fc1_w192", "fc1_rounded", "fc1_h_rounded", "quack_gated",
                "quack_gated_h", "fc1_c64", "fc1_h_c64"):
        if key in fns:
            got = fns[key]()[1].float()
            err = ((got - want.float()).norm() / want.float().norm()).item()
            print(f"[{name}] {key} vs fc1: rel err {err:.1e}")
    runs = time_interleaved(fns, iters, 3, torch.device("cuda"), 10)
    flops = 2 * x.shape[0] * x.shape[1] * w1t.shape[2]
    base = statistics.median(runs["fc1"])
    for key, times in runs.items():
        ms = statistics.median(times)
        print(f"[{name}] {key:12s} {ms:.4f} ms {flops / ms / 1e9:6.0f} TFLOP/s  "
              f"{ms / base:5.2f}x fc1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="Q,J,B")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--probs", action="store_true", help="with router probs (ScaledSwiGLU)")
    p.add_argument("--compile-only", action="store_true",
                   help="compile the no-epilogue kernel for sm_90a (no GPU needed)")
    args = p.parse_args()
    if args.compile_only:
        print(compile_check())
        return
    from bench_grouped_gemm import _quack_or_none

    qk = _quack_or_none()
    for name in args.shapes.split(","):
        run_shape(name, args.iters, args.probs, qk)


if __name__ == "__main__":
    main()
