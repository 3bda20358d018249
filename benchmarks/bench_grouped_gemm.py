"""te_seq's CuTe DSL grouped GEMM vs torch._grouped_mm on the grouped-MLP GEMMs
of shapes A/B/Q/Z (benchmarks/README.md).

For each shape (A, B, Q, Z) and GEMM (FC1/FC2 forward, FC1 dgrad, FC1 wgrad) it checks the CuTe
result against torch._grouped_mm on random data (output poisoned with NaN first), then times both
with CUDA events (warm-up, median of --iters, the two interleaved) and prints TFLOP/s and the ratio.
FLOPs count real rows only. torch's wgrad (2D x 2D) needs group sizes that are multiples of 8: for
shape Z it runs on zero-padded groups, whose padding is not counted.

    python benchmarks/bench_grouped_gemm.py [--shapes A,B,Q,Z] [--iters 20] [--json out.json]
        [--tilings default,256:2x1]   # CuTe variants: tile_n:cluster_mxcluster_n, the first
                                      # is the ratio column's; "default": te_seq's own choice
        [--tilings 256:1x2,192:1x2p]  # a "p" suffix: ping-pong warpgroups
        [--tilings 192:2x1p,192:2x1pd]  # "d": dynamic work units (the wgrads only)
        [--quack]                     # also QuACK's varlen GEMMs on the same operands
        [--exact-splits]              # m / e rows per expert (A, B, Q), as the MLP benchmark
    python benchmarks/bench_grouped_gemm.py --glu [--shapes Q,B,A] [--iters 20] [--json out.json]
        [--quack]                     # also FC1 in other W1 layouts and QuACK's gated FC1

``--glu`` times the fused grouped-MLP GLU steps instead (SwiGLU with router probs): FC1 forward
(h and a = silu(gate)·up·probs) and FC2 dgrad (dh, re-emitted a, d(probs)), each as
torch._grouped_mm + the reference elementwise maths (eager, fp32 upcast), cute grouped_mm + the
same, cute grouped_mm + the same maths compiled by torch.compile (te_seq's unfused GPU path), and
the fused cute kernel, cooperative and ping-pong (1x2 and 2x1 clusters). FLOPs are the GEMM's
only.

``--glu-pp`` (implies ``--glu``) adds the fused kernels in ping-pong with (64 x 32) epilogue
subtiles (``Tiling(..., pingpong=True, epi_rows=64)``: keys ``fused_pp1x2_e64``, ...) and the
dgrad at both ping-pong widths, 128 and 192 (``fused_pp1x2_w128_e64``, ...), outputs checked
against torch like every other variant.

``--glu-tilings 128:2x1p,...`` (implies ``--glu``) adds both fused steps at those tilings.
``--glu --quack`` adds FC1 without h with W1 interleaved in 64-row blocks, QuACK's gated FC1
without its pre-activation (probs applied after it) and QuACK's plain GEMM of N = 2F
(`fc1_layout_variants`); their a (or h) is checked like every other variant's.

``--main-grad`` times FC1's and FC2's wgrads accumulated into an fp32 ``main_grad`` (Megatron
mode), checked against float64, and prints the TB/s of their compulsory traffic (main_grad read
and written, the operands read): how close the accumulate is to the copy bandwidth.

``--fp8`` times the forward GEMMs (FC1, FC2) on E4M3 operands with row-wise scales: cute
``scaled_grouped_mm``, ``torch._scaled_grouped_mm`` and cute bf16 ``grouped_mm`` in one run
(``bench_fp8_gemm.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import mlp_case
import torch
from _common import time_interleaved
from torch import Tensor

SHAPES = {  # E experts, H hidden, F ffn, M routed rows
    "A": (8, 4096, 14336, 32768),
    "B": (128, 4096, 1024, 65536),
    "Q": (128, 2048, 768, 32768),
    "Z": (128, 2048, 768, 32768),
}


def split_sizes(name: str, e: int, m: int, gen: torch.Generator) -> list[int]:
    """Uniform-ish random counts, or (Z) Zipf-like counts with empty experts, not multiples of 8;
    with ``EXACT_SPLITS`` (``--exact-splits``) A, B and Q take the grouped-MLP benchmark's
    split (mlp_case.py: m / e rows per expert)."""
    if EXACT_SPLITS and name != "Z":
        return mlp_case.split_counts(mlp_case.SHAPES[name])
    if name != "Z":
        w = torch.rand(e, generator=gen) * 0.2 + 0.9
    else:
        w = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** 1.1
        w[torch.randperm(e, generator=gen)[: e // 10]] = 0.0
        w = w[torch.randperm(e, generator=gen)]
    sizes = (w / w.sum() * m).floor().long()
    sizes[int(torch.argmax(w))] += m - int(sizes.sum())
    return sizes.tolist()


BURST = 10  # back-to-back calls per timed run: the host's launch path overlaps the kernels
EXACT_SPLITS = False  # --exact-splits: m / e rows per expert (A, B, Q), as in the MLP benchmark


def time_ms(fns: dict, iters: int, burst: int | None = None) -> dict[str, float]:
    """Median ms per call of each fn: 3 untimed calls each, then ``iters`` rounds of one run
    per fn in a new order every round (`_common.time_interleaved`); each run times ``burst``
    back-to-back calls (default ``BURST``) so that a call's host time hides behind the previous
    kernels, as in a training step. A fixed order measured the same configuration 2 % (Q) to
    7-9 % (B) apart depending on its place (one H200, 2026-11-29: `fused` against its twin
    `fused_pp1x2` in `measured/h200_2026-11-29g_glu_fc1_no_h_*.txt`)."""
    runs = time_interleaved(fns, iters, 3, torch.device("cuda"), burst or BURST)
    return {k: statistics.median(v) for k, v in runs.items()}


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    if torch.isnan(x).any():
        return float("nan")
    return ((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item()


def padded(t: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows regrouped with each group zero-padded to a multiple of 8 (torch's 2D x 2D needs it)."""
    chunks, ends, start, total = [], [], 0, 0
    for s in sizes:
        ps = -(-s // 8) * 8
        chunk = t.new_zeros(ps, t.shape[1])
        chunk[:s] = t[start : start + s]
        chunks.append(chunk)
        start, total = start + s, total + ps
        ends.append(total)
    return torch.cat(chunks), torch.tensor(ends, dtype=torch.int32, device=t.device)


def quack_gemms(qk, x: Tensor, w1: Tensor, w2: Tensor, act: Tensor, dh: Tensor,
                offs: Tensor) -> dict:
    """QuACK's varlen GEMMs (``qk``: quack.gemm_interface, default sm90 config) for the four
    GEMMs of ``gemm_cases``, by label: what its MLP runs (peer_quack.py), on the same operands.
    Each returns a new output (QuACK allocates it)."""
    cu = torch.cat([offs.new_zeros(1), offs])

    def mm(a: Tensor, b: Tensor):
        return lambda: qk.gemm(a, b, cu_seqlens_m=cu, tuned=False)

    return {
        "fc1_fwd": mm(x, w1.transpose(1, 2)),  # [M, 2F] = x W1_eᵀ
        "fc2_fwd": mm(act, w2.transpose(1, 2)),  # [M, H] = a W2_eᵀ
        "fc1_dgrad": mm(dh, w1),  # [M, H] = dH W1_e
        "fc1_wgrad": lambda: qk.gemm(dh.t(), x, cu_seqlens_k=cu, tuned=False),  # [E, 2F, H]
    }


def gemm_cases(name: str, e: int, h: int, f: int, m: int, gen: torch.Generator, qk=None):
    """(label, flops, cute fn, torch fn, cute's output, quack fn or None) for FC1 fwd, FC2
    fwd, FC1 dgrad, FC1 wgrad and FC2 wgrad (``qk``: QuACK's gemm_interface, or None)."""
    from te_seq.kernels import cute

    sizes = split_sizes(name, e, m, gen)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32).cuda()
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, h, **bf)
    w1 = torch.randn(e, 2 * f, h, **bf) * 0.02  # FC1 weight [E, 2F, H]
    w2 = torch.randn(e, h, f, **bf) * 0.02  # FC2 weight [E, H, F]
    act = torch.randn(m, f, **bf)
    dh = torch.randn(m, 2 * f, **bf)
    y1 = torch.empty(m, 2 * f, **bf)
    y2 = torch.empty(m, h, **bf)
    dx = torch.empty(m, h, **bf)
    dw = torch.empty(e, 2 * f, h, **bf)
    tg = torch._grouped_mm
    theirs = {} if qk is None else quack_gemms(qk, x, w1, w2, act, dh, offs)
    if all(s % 8 == 0 for s in sizes):
        dh_p, x_p, offs_p = dh, x, offs
    else:
        dh_p, offs_p = padded(dh, sizes)
        x_p, _ = padded(x, sizes)
    yield (
        "fc1_fwd",
        2 * m * h * 2 * f,
        lambda t: cute.grouped_mm(x, w1.transpose(1, 2), offs, out=y1, tiling=t),
        lambda: tg(x, w1.transpose(1, 2), offs=offs),
        y1,
        theirs.get("fc1_fwd"),
    )
    yield (
        "fc2_fwd",
        2 * m * f * h,
        lambda t: cute.grouped_mm(act, w2.transpose(1, 2), offs, out=y2, tiling=t),
        lambda: tg(act, w2.transpose(1, 2), offs=offs),
        y2,
        theirs.get("fc2_fwd"),
    )
    yield (
        "fc1_dgrad",
        2 * m * 2 * f * h,
        lambda t: cute.grouped_mm(dh, w1, offs, out=dx, tiling=t),
        lambda: tg(dh, w1, offs=offs),
        dx,
        theirs.get("fc1_dgrad"),
    )
    yield (
        "fc1_wgrad",
        2 * m * 2 * f * h,
        lambda t: cute.grouped_wgrad(dh, x, offs, out=dw, tiling=t),
        lambda: tg(dh_p.t(), x_p, offs=offs_p),
        dw,
        theirs.get("fc1_wgrad"),
    )
    dy = torch.randn(m, h, **bf)
    dw2 = torch.empty(e, h, f, **bf)
    dy_p, act_p = (dy, act) if dh_p is dh else (padded(dy, sizes)[0], padded(act, sizes)[0])
    yield (  # split sizes of one expert holding most rows leave a static schedule unbalanced
        "fc2_wgrad",
        2 * m * h * f,
        lambda t: cute.grouped_wgrad(dy, act, offs, out=dw2, tiling=t),
        lambda: tg(dy_p.t(), act_p, offs=offs_p),
        dw2,
        theirs.get("fc2_wgrad"),
    )


def _quack_or_none():
    """quack.gemm_interface (compile-cache keyer wrapped: peer_quack.py), or None with the
    reason printed."""
    from peer_quack import _quack

    try:
        return _quack()
    except Exception as exc:  # noqa: BLE001 - any import failure: run without it
        print(f"no quack column: {type(exc).__name__}: {exc}"[:240])
        return None


def parse_tilings(spec: str) -> dict:
    """``"default,256:1x2,128:2x1p"`` -> {label: Tiling, or None for te_seq's default}."""
    from te_seq.kernels.cute import Tiling

    out = {}
    for item in spec.split(","):
        if item == "default":  # what a user gets: the kernel picks (launch.py's rules)
            out[item] = None
            continue
        tn, cl = item.split(":")
        dynamic = cl.endswith("d")
        cl = cl.removesuffix("d")
        pingpong = cl.endswith("p")
        cm, cn = cl.removesuffix("p").split("x")
        out[item] = Tiling(int(tn), (int(cm), int(cn)), pingpong, dynamic=dynamic)
    return out


def run_shape(name: str, iters: int, tilings: dict, qk=None) -> list[dict]:
    e, h, f, m = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for label, flops, ours, theirs, out, quack in gemm_cases(name, e, h, f, m, gen, qk):
        ref = theirs()
        fns, errs, first = {"torch": theirs}, {}, {}
        if quack is not None:
            errs["quack"], fns["quack"] = rel_err(quack(), ref), quack
        # dynamic units are for the wgrads (varlen K) only
        here = {k: t for k, t in tilings.items()
                if t is None or not t.dynamic or label.endswith("wgrad")}
        for key, tiling in here.items():
            out.fill_(float("nan"))
            t0 = time.perf_counter()
            ours(tiling)
            torch.cuda.synchronize()
            first[key] = round(time.perf_counter() - t0, 2)
            errs[key] = rel_err(out, ref)
            fns[key] = (lambda t: lambda: ours(t))(tiling)
        ms = time_ms(fns, iters)
        best = min(here, key=lambda k: ms[k])
        row = dict(
            shape=name,
            gemm=label,
            rel_err=errs,
            first_call_s=first,
            ms=ms,
            tflops={k: flops / v / 1e9 for k, v in ms.items()},
            best=best,
            ratio=ms["torch"] / ms[next(iter(here))],
            best_ratio=ms["torch"] / ms[best],
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main_grad_rows(name: str, iters: int) -> list[dict]:
    """FC1's and FC2's wgrads accumulated into an fp32 ``main_grad`` (Megatron mode), default
    tilings: checked against a float64 reference, then ms and TB/s of their compulsory traffic
    (main_grad read and written, both operands read once)."""
    from te_seq.kernels import cute, reference

    e, h, f, m = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    offs = torch.tensor(split_sizes(name, e, m, gen)).cumsum(0).to(torch.int32).cuda()
    bf = dict(device="cuda", dtype=torch.bfloat16)
    cases = {  # label: (dOut [M, N], X [M, K]) -> main_grad [E, N, K]
        "fc1_wgrad_main_grad": (torch.randn(m, 2 * f, **bf), torch.randn(m, h, **bf)),
        "fc2_wgrad_main_grad": (torch.randn(m, h, **bf), torch.randn(m, f, **bf)),
    }
    rows = []
    for label, (dout, x) in cases.items():
        main_grad = torch.randn(e, dout.shape[1], x.shape[1], device="cuda")
        ref = reference.grouped_wgrad(dout.double(), x.double(), offs) + main_grad.double()
        cute.grouped_wgrad(dout, x, offs, out=main_grad, accumulate=True)
        err = rel_err(main_grad, ref)
        del ref
        fn = (lambda c: lambda: cute.grouped_wgrad(dout, x, offs, out=c, accumulate=True))(
            main_grad)
        ms = time_ms({"cute": fn}, iters)["cute"]
        gb = (2 * main_grad.numel() * 4 + (dout.numel() + x.numel()) * 2) / 1e9
        rows.append(dict(shape=name, gemm=label, rel_err=err, ms=ms, gb=gb, tb_per_s=gb / ms))
        print(f"{name:5} {label:20} rel err {err:.1e}  {ms:.3f} ms  {gb:.2f} GB  "
              f"{gb / ms:.2f} TB/s", flush=True)
        del main_grad
        torch.cuda.empty_cache()
    return rows


def launch_overhead_us(calls: int = 2000) -> dict[str, float]:
    """Host time per call on a tiny problem (the GPU keeps up, so this is the launch path)."""
    from te_seq.kernels import cute

    a = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([64, 128, 192, 256], dtype=torch.int32, device="cuda")
    out = torch.empty(256, 128, device="cuda", dtype=torch.bfloat16)
    res = {}
    for key, fn in {
        "cute": lambda: cute.grouped_mm(a, b, offs, out=out),
        "torch": lambda: torch._grouped_mm(a, b, offs=offs),
    }.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        res[key] = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
    return res


def fc1_layout_variants(qk, x: Tensor, w1t: Tensor, offs: Tensor, probs: Tensor) -> dict:
    """FC1 forward without h next to QuACK's (``qk``: quack.gemm_interface), with the same
    weights in each kernel's layout: ours with W1 interleaved in 64-row blocks (a plain TMA
    box, against the default [gate | up] halves: ``fused_no_h``), QuACK's gated FC1 (W1 rows
    interleaved one by one, its default sm90 config, no pre-activation stored; probs applied
    after it, as its MLP does: peer_quack.py), the same storing its pre-activation (as its
    MLP's training forward does) and QuACK's plain GEMM of the same N = 2F."""
    from peer_quack import interleave_gate_up

    from te_seq.kernels import cute

    w1 = w1t.transpose(1, 2)  # [E, 2F, H]
    e, f2, h = w1.shape
    w1_il64 = w1.view(e, 2, f2 // 128, 64, h).transpose(1, 2).reshape(e, f2, h)
    w1_quack = interleave_gate_up(w1).transpose(1, 2)
    cu = torch.cat([offs.new_zeros(1), offs])

    def quack_gated():
        _, a = qk.gemm_gated(x, w1_quack, activation="swiglu", cu_seqlens_m=cu,
                             store_preact=False)
        return None, (a if probs is None else a.mul_(probs[:, None]))

    def quack_gated_h():  # the pre-activation stored too, as its MLP's training forward does
        pre, a = qk.gemm_gated(x, w1_quack, activation="swiglu", cu_seqlens_m=cu,
                               store_preact=True)
        return pre, (a if probs is None else a.mul_(probs[:, None]))

    return {
        "fused_no_h_il64": lambda: cute.glu_fc1_forward(
            x, w1_il64.transpose(1, 2), offs, "silu", 64, probs, store_h=False),
        "quack_gated_no_h": quack_gated,
        "quack_gated_h": quack_gated_h,
        "quack_mm": lambda: (qk.gemm(x, w1t, cu_seqlens_m=cu), None),  # h only
    }


def glu_cases(name: str, e: int, h: int, f: int, m: int, gen: torch.Generator,
              pp64: bool = False, extra: dict | None = None, qk=None):
    """(label, flops, {variant: fn}, check) for the FC1 forward and FC2 dgrad GLU steps
    (``qk``: also `fc1_layout_variants`)."""
    from te_seq.kernels import GluSpec, cute, get_backend, reference

    sizes = split_sizes(name, e, m, gen)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32).cuda()
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, h, **bf)
    w1t = (torch.randn(e, 2 * f, h, **bf) * 0.02).transpose(1, 2)
    w2 = torch.randn(e, h, f, **bf) * 0.02
    probs = torch.rand(m, device="cuda")
    dy = torch.randn(m, h, **bf)
    hpre = torch.randn(m, 2 * f, **bf)
    tg = torch._grouped_mm

    # eager reference maths, or the same compiled by torch.compile into one pass (te_seq's
    # unfused GPU path: the cute backend's elementwise kernels)
    glu = GluSpec("silu")
    eager = (reference.REFERENCE.glu_forward, reference.REFERENCE.glu_backward)
    compiled = (get_backend("cute").glu_forward, get_backend("cute").glu_backward)

    def fc1(mm, ew=eager):
        hh = mm(x, w1t)
        return hh, ew[0](hh, glu, probs)

    def dgrad(mm, ew=eager):
        da = mm(dy, w2)
        dh, dp = ew[1](hpre, da, glu, probs)
        return dh, ew[0](hpre, glu, probs), dp

    def cmm(a, b):
        return cute.grouped_mm(a, b, offs)

    # ping-pong tilings of the fused kernels (fc1: 64 gate + 64 up columns per tile)
    pp = {c: cute.Tiling(128, c, pingpong=True) for c in ((1, 2), (2, 1))}
    pp_dgrad = {c: cute.Tiling(cute.pingpong_tile_n(f, c[1]), c, pingpong=True) for c in pp}
    fc1_pp = {f"fused_pp{c[0]}x{c[1]}": t for c, t in pp.items()}
    dgrad_pp = {f"fused_pp{c[0]}x{c[1]}": t for c, t in pp_dgrad.items()}
    if pp64:  # (64 x 32) epilogue subtiles; the dgrad at both ping-pong widths
        fc1_pp |= {f"{k}_e64": dataclasses.replace(t, epi_rows=64) for k, t in fc1_pp.items()}
        dgrad_pp |= {
            f"fused_pp{c[0]}x{c[1]}_w{w}_e64": cute.Tiling(w, c, pingpong=True, epi_rows=64)
            for c in pp for w in (128, 192)
        }
    for key, t in (extra or {}).items():  # --glu-tilings: both steps at these tilings
        fc1_pp[f"fused_{key}"] = dgrad_pp[f"fused_{key}"] = t

    yield (
        "fc1_glu_fwd",
        2 * m * h * 2 * f,
        {
            "torch+ew": lambda: fc1(lambda a, b: tg(a, b, offs=offs)),
            "cute+ew": lambda: fc1(cmm),
            "cute+compiled_ew": lambda: fc1(cmm, compiled),
            "fused": lambda: cute.glu_fc1_forward(x, w1t, offs, "silu", None, probs),
            # a forward without backward: a only, h not written (inference, no_grad)
            "fused_no_h": lambda: cute.glu_fc1_forward(x, w1t, offs, "silu", None, probs,
                                                       store_h=False),
            **{
                key: (lambda t: lambda: cute.glu_fc1_forward(
                    x, w1t, offs, "silu", None, probs, tiling=t))(t)
                for key, t in fc1_pp.items()
            },
            **({} if qk is None else fc1_layout_variants(qk, x, w1t, offs, probs)),
        },
    )
    yield (
        "fc2_glu_dgrad",
        2 * m * h * f,
        {
            "torch+ew": lambda: dgrad(lambda a, b: tg(a, b, offs=offs)),
            "cute+ew": lambda: dgrad(cmm),
            "cute+compiled_ew": lambda: dgrad(cmm, compiled),
            "fused": lambda: cute.glu_fc2_dgrad(
                dy, w2, offs, hpre, "silu", None, probs, h_prefetch=1),
            "fused_h2": lambda: cute.glu_fc2_dgrad(
                dy, w2, offs, hpre, "silu", None, probs, h_prefetch=2),
            **{
                key: (lambda t: lambda: cute.glu_fc2_dgrad(
                    dy, w2, offs, hpre, "silu", None, probs, tiling=t))(t)
                for key, t in dgrad_pp.items()
            },
        },
    )


def run_glu_shape(name: str, iters: int, pp64: bool = False,
                  extra: dict | None = None, qk=None) -> list[dict]:
    e, h, f, m = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for label, flops, fns in glu_cases(name, e, h, f, m, gen, pp64, extra, qk):
        ref = fns["torch+ew"]()
        first, errs = {}, {}
        for key, fn in fns.items():
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            first[key] = round(time.perf_counter() - t0, 2)
            errs[key] = [rel_err(o, r) for o, r in zip(out, ref) if o is not None]
        ms = time_ms(fns, iters)
        row = dict(
            shape=name,
            step=label,
            rel_err_vs_torch=errs,
            first_call_s=first,
            ms=ms,
            tflops={k: flops / v / 1e9 for k, v in ms.items()},
            fused_vs_torch=ms["torch+ew"] / ms["fused"],
            fused_vs_cute=ms["cute+ew"] / ms["fused"],
            fused_vs_cute_compiled=ms["cute+compiled_ew"] / ms["fused"],
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
        del ref
        torch.cuda.empty_cache()
    return rows


def main_glu(args) -> None:
    rows = []
    qk = _quack_or_none() if args.quack else None
    for name in args.shapes.split(","):
        rows += run_glu_shape(name, args.iters, args.glu_pp,
                              parse_tilings(args.glu_tilings) if args.glu_tilings else None, qk)
    print(
        f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  {time.strftime('%Y-%m-%d')}"
    )
    print(
        f"{'shape':5} {'step':14} {'torch+ew':>9} {'cute+ew':>8} {'cute+cew':>8} {'fused':>6}"
        f" {'pp1x2':>6} {'pp2x1':>6} {'h2':>5}  vs torch  vs cute  vs cute+cew"
    )
    for r in rows:
        t = r["tflops"]
        print(
            f"{r['shape']:5} {r['step']:14} {t['torch+ew']:9.0f} {t['cute+ew']:8.0f} "
            f"{t['cute+compiled_ew']:8.0f} {t['fused']:6.0f} {t['fused_pp1x2']:6.0f} "
            f"{t['fused_pp2x1']:6.0f} {t.get('fused_h2', float('nan')):5.0f}  "
            f"{r['fused_vs_torch']:8.2f}  "
            f"{r['fused_vs_cute']:7.2f}  {r['fused_vs_cute_compiled']:10.2f}"
        )
    print(
        "(TFLOP/s of the GEMM incl. the elementwise time; ratio = their time / fused time; "
        "cew = reference maths compiled by torch.compile; h2: dgrad with two h subtiles loaded "
        "ahead)"
    )
    layout = ("fused_no_h", "fused_no_h_il64", "quack_gated_no_h", "quack_gated_h", "quack_mm")
    for r in rows if args.glu_pp or args.glu_tilings or qk else []:  # the extra variants
        more = {k: v for k, v in r["tflops"].items()
                if k.endswith("_e64") or k.removeprefix("fused_") in (args.glu_tilings or "")
                or (qk is not None and k in layout)}
        print(f"{r['shape']:5} {r['step']:14} "
              + "  ".join(f"{k} {v:.0f}" for k, v in more.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows}, fh, indent=1)


def main_fp8(args) -> None:
    from bench_fp8_gemm import print_table, run_fp8_shape

    rows = []
    for name in args.shapes.split(","):
        e, h, f, m = SHAPES[name]
        sizes = split_sizes(name, e, m, torch.Generator().manual_seed(0))
        rows += run_fp8_shape(name, SHAPES[name], sizes, args.iters, time_ms, rel_err)
        torch.cuda.empty_cache()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows}, fh, indent=1)


def main() -> None:
    global BURST, EXACT_SPLITS
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="A,B,Q,Z")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--burst", type=int, default=BURST, help="back-to-back calls per timed run")
    p.add_argument("--exact-splits", action="store_true",
                   help="m / e rows per expert on A, B, Q (the MLP benchmark's splits; kernel "
                   "README section 21: Q's FC1 dgrad trails QuACK's only on those)")
    p.add_argument("--json", default=None)
    p.add_argument("--tilings", default="default,256:1x2,256:2x1")
    p.add_argument("--quack", action="store_true",
                   help="also QuACK's varlen GEMMs (default config) on the same operands")
    p.add_argument("--glu", action="store_true", help="time the fused GLU steps instead")
    p.add_argument("--glu-pp", action="store_true",
                   help="--glu plus ping-pong with 64-row epilogue subtiles (both dgrad widths)")
    p.add_argument("--glu-tilings", default="",
                   help="--glu plus the fused steps at these tilings (as --tilings), e.g. 256:2x2")
    p.add_argument("--fp8", action="store_true", help="time the FP8 forward GEMMs instead")
    p.add_argument("--main-grad", action="store_true",
                   help="time the wgrads accumulated into fp32 main_grad instead (TB/s)")
    args = p.parse_args()
    BURST, EXACT_SPLITS = args.burst, args.exact_splits
    if args.fp8:
        main_fp8(args)
        return
    if args.main_grad:
        rows = [r for name in args.shapes.split(",") for r in main_grad_rows(name, args.iters)]
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"rows": rows}, fh, indent=1)
        return
    if args.glu or args.glu_pp or args.glu_tilings:
        main_glu(args)
        return
    tilings = parse_tilings(args.tilings)
    qk = _quack_or_none() if args.quack else None
    launch = launch_overhead_us()
    print("host us per call (tiny problem):", {k: round(v, 1) for k, v in launch.items()})
    rows = []
    for name in args.shapes.split(","):
        rows += run_shape(name, args.iters, tilings, qk)
        torch.cuda.empty_cache()
    print(
        f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  {time.strftime('%Y-%m-%d')}"
    )
    keys = list(tilings) + (["quack"] if qk is not None else [])
    print(
        f"{'shape':5} {'gemm':10} {'max err':>8} {'torch':>6} "
        + " ".join(f"{k:>9}" for k in keys)
        + "  ratio(default)  best"
    )
    for r in rows:
        cols = " ".join(f"{r['tflops'].get(k, float('nan')):9.0f}" for k in keys)
        print(
            f"{r['shape']:5} {r['gemm']:10} {max(r['rel_err'].values()):8.1e} "
            f"{r['tflops']['torch']:6.0f} {cols}  {r['ratio']:6.2f}  "
            f"{r['best']} {r['best_ratio']:.2f}"
        )
    print("(TFLOP/s; ratio = torch time / cute time)")
    print("host us per call (tiny problem):", {k: round(v, 1) for k, v in launch.items()})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"launch_us": launch, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
