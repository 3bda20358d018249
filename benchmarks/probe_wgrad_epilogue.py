"""Probe: what the epilogue costs the wgrads written fresh (bf16 out, the MLP's fresh-grads
step): the 16-bit ``cute.grouped_wgrad`` and the FP8 row-wise ``cute.scaled_grouped_wgrad``,
default tilings.

``--epi-batch N``: epilogue subtiles staged per pair of barriers (``GroupedGemmKernel.
epi_batch``); every value must give the same bits (only the synchronisation changes).
``--cut PART``: time the kernels with part of the epilogue removed (wrong results, timing
only): ``scale`` (the FP8 dequantization multiply), ``tma`` (the TMA stores: subtiles
still staged in smem and fenced), ``fence`` (the proxy fence before each TMA store),
``stage`` (the copies into the store ring, and with them the conversion and the FP8
scaling that nothing reads then: fences, barriers and TMA stores of stale smem stay),
``const`` (a constant staged and stored in place of the values: the copies, fences,
barriers and TMA stores stay, the conversion and the FP8 scaling go),
``all`` (nothing staged or stored: the main loop's own rate), ``direct`` (not a cut: each
thread writes its converted values straight from the registers, 32-bit global stores of
adjacent column pairs within C's bounds; no smem ring, proxy fence, barrier per subtile or
TMA store; the same bits; run "12-01a": 1.7-2.6x the cycles, section 31), ``turn``
(ping-pong's two epilogues no longer wait for each other: they race on the shared store
ring and its barrier; it hung once on B's FC2). Run "y" (kernel README, section 28) also
timed the FP8 scales without their per-value select, since the kernel's own form.

``--store-ring N``: slots of the epilogue's smem store ring (``epi_store_stages``; default:
4, the 16-bit wgrad trading one for a fifth A/B stage). A 128 x 192 tile's A/B stages are
40 KiB in both precisions: a 2-slot ring leaves room for 5 of them where the FP8 wgrad (its
scale scratch) fits 4 beside 3 or 4 slots.

``--epi-cols N``: columns of an epilogue subtile (``Tiling.epi_cols``, set through
``TE_SEQ_WGRAD_EPI_COLS``; unset: the default rule, ``launch.wgrad_epi_cols``, 64 on Q and
32 on B since run "za"): 64 halves the TMA stores, proxy fences and barrier pairs per tile
(a 128 x 192 tile: 3 instead of 6), in a 2-slot ring of the bytes of the 4 x 32 one (the FP8
wgrad keeps its 4 A/B stages). Same bits expected. Compare ``cols=32`` with ``cols=64``:
``none`` is the default rule (its PTX check: the 32-column configs).

All four are read at trace time, so each value runs in its own process with its own compile
cache directory (``TE_SEQ_CACHE_DIR``); ``--variants`` starts those processes itself, in a
rotated order each round, and ends with each wgrad's min-max ms per variant. Each result
line prints ms, TFLOP/s and a checksum of the output's bits.

``--seconds S``: each kernel instead runs back to back for S seconds while ``nvidia-smi``
samples the SM clock and what holds it down; the result lines add the median MHz, the
cycles (ms x GHz), the (lagging, averaged) board power and the slowdown reasons, and the
variants' table the cycles' min-max. At the 700 W cap a variant that draws less power runs
at a higher clock: ms alone then mix the kernel's cycles with its clock (kernel README,
section 29: B's 16-bit wgrads take the same cycles with and without their epilogue).

  python benchmarks/probe_wgrad_epilogue.py --variants none,cut=tma,cut=fence,cut=stage,cut=all \
      --rounds 2 --shapes B,Q
  python benchmarks/probe_wgrad_epilogue.py --variants none,ring=2,batch=3 --shapes B
  TE_SEQ_CACHE_DIR=/tmp/cut_tma python benchmarks/probe_wgrad_epilogue.py --cut tma --shapes B
  python benchmarks/probe_wgrad_epilogue.py --compile-only \
      --variants cut=all,cut=stage,cut=tma,cut=fence,cut=scale,ring=2   # no GPU
  python benchmarks/probe_wgrad_epilogue.py --variants none,cut=stage,cut=all --rounds 1 \
      --shapes B --seconds 1
  python benchmarks/probe_wgrad_epilogue.py --variants cols=32,cols=64 --rounds 2 \
      --shapes B,Q --seconds 1
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import torch
from bench_fp8_gemm import token_major
from bench_grouped_gemm import SHAPES, split_sizes, time_ms
from cutlass import const_expr
from probe_clocks import reasons_between, run_for, samples_between, smi_samples, window_medians

from te_seq.kernels import cute as te_cute
from te_seq.kernels.cute.grouped_gemm import GroupedGemmKernel
from te_seq.kernels.cute.mainloop import MainloopMixin
from te_seq.kernels.cute.scale_epilogue import ScaledGemmKernel, ScaleScratchMixin
from te_seq.kernels.cute.store_epilogue import StoreEpilogueMixin


def _cut(part: str) -> None:
    """Remove ``part`` of the epilogue from every kernel traced after this (timing only)."""
    cuts = {
        "scale": (ScaleScratchMixin, "_scaled_at", lambda self, st, i, value: value),
        "tma": (StoreEpilogueMixin, "_ring_flush",
                lambda self, warp, stores: self._sync_for_tma()),
        "fence": (StoreEpilogueMixin, "_sync_for_tma",
                  lambda self: self.epi_barrier.arrive_and_wait()),
        "stage": (StoreEpilogueMixin, "_store_group", _store_group_unstaged),
        "const": (StoreEpilogueMixin, "_store_group", _store_group_constant),
        "all": (StoreEpilogueMixin, "_store_group", lambda self, *args, **kwargs: None),
        "turn": (MainloopMixin, "_turn_barriers", _mma_turns_only(MainloopMixin._turn_barriers)),
        "direct": (StoreEpilogueMixin, "_epilogue", _epilogue_direct),
    }
    if part == "none":
        return
    if part == "direct":  # the epilogue needs C itself and the tile's coordinates
        StoreEpilogueMixin._before_mainloop = _before_mainloop_noting_tile
        for cls in (GroupedGemmKernel, ScaledGemmKernel):
            cls._make_epi = _epi_with_c(cls._make_epi)
    if part not in cuts:
        raise ValueError(f"--cut: none or one of {', '.join(cuts)}, got {part!r}")
    cls, name, replacement = cuts[part]
    setattr(cls, name, replacement)


@cute.jit
def _store_group_unstaged(self, tiled_r2s, tRS_sC, warp, items: list, count, scatter=None):
    """``StoreEpilogueMixin._store_group`` without copying the subtiles into the ring (so
    without their conversion, which nothing reads then): the reserves, fences, barriers and
    TMA stores of whatever the ring holds stay."""
    batch = self._batch(len(items))
    for b in cutlass.range_constexpr(len(items) // batch):
        self._ring_reserve(warp, batch)
        stores = []
        for i in cutlass.range_constexpr(batch):
            _, tma, s_part, g_part, coord = items[b * batch + i]
            stores.append((tma, s_part, g_part, (count + b * batch + i) % self.epi_stage, coord))
        self._ring_flush(warp, stores)


_STORE_GROUP = StoreEpilogueMixin._store_group  # the kernels' own, before any cut


@cute.jit
def _store_group_constant(self, tiled_r2s, tRS_sC, warp, items: list, count, scatter=None):
    """``StoreEpilogueMixin._store_group`` staging a constant in place of each subtile's
    values (so without their conversion, which nothing reads then): the copies into the ring,
    the fences, barriers and TMA stores stay, of data that never changes."""
    for item in items:
        item[0].fill(1.0)
    _STORE_GROUP(self, tiled_r2s, tRS_sC, warp, items, count, scatter)


_BEFORE_MAINLOOP = StoreEpilogueMixin._before_mainloop


def _epi_with_c(make_epi):
    """A ``_make_epi`` that appends C (the gmem tensor, not its TMA view) to the epilogue
    state, for ``_epilogue_direct``."""
    def make(self, c, epi_inputs):
        return (*make_epi(self, c, epi_inputs), c)
    return make


@cute.jit
def _before_mainloop_noting_tile(self, ep, group, m_tile, n_tile, row0, epi_count):
    """``StoreEpilogueMixin._before_mainloop`` noting the tile's coordinates (trace time, read
    by ``_epilogue_direct`` in the same loop iteration)."""
    self._direct_tile = (group, m_tile, n_tile)
    _BEFORE_MAINLOOP(self, ep, group, m_tile, n_tile, row0, epi_count)


@cute.jit
def _epilogue_direct(self, ep, gC, epi_count, old, bias_tile=None, scatter=None,
                     scale_tile=None):
    """A fresh varlen-K tile stored from the registers: per (tm x epi_cols) subtile the
    values (times the FP8 scales) are converted and each thread writes its pairs of adjacent
    columns with 32-bit global stores, within C's bounds; no smem ring, proxy fence, barrier
    per subtile or TMA store. One barrier at the end: the next tile's scale copies must not
    overwrite the scratch before every thread has read it. Same bits as the ring."""
    tm, tn, _ = self.tile_mnk
    group, m_tile, n_tile = self._direct_tile
    c = ep.epi[-1]  # (M, N, E): varlen K
    rows_left = cute.size(c, mode=[0]) - m_tile * tm
    cols_left = cute.size(c, mode=[1]) - n_tile * tn
    gC = cute.local_tile(c[None, None, group], (tm, tn), (m_tile, n_tile))
    c_tile = cute.make_identity_tensor((tm, tn))
    coords = ep.tiled_r2s.retile(ep.tiled_mma.get_slice(ep.mma_tidx).partition_C(c_tile))
    g32 = cute.recast_tensor(gC, cutlass.Int32)
    out32 = cute.recast_tensor(ep.rD_out, cutlass.Int32)
    size_rD = cute.size(ep.rD)
    num_epi = tn // self.epi_cols
    for e in cutlass.range_constexpr(num_epi):
        for v in cutlass.range_constexpr(size_rD):
            ep.rD[v] = ep.tRS_acc[self._acc_index(ep, e, v)]
        if const_expr(scale_tile is not None):
            for v in cutlass.range_constexpr(size_rD):
                ep.rD[v] = self._scaled_at(scale_tile, self._acc_index(ep, e, v), ep.rD[v])
        ep.rD_out.store(ep.rD.load().to(self.c_dtype))
        for p in cutlass.range_constexpr(size_rD // 2):
            r, c = coords[self._acc_index(ep, e, 2 * p)]
            if r < rows_left and c < cols_left:
                g32[r, c // 2] = out32[p]
    self.epi_barrier.arrive_and_wait()
    return num_epi


def _mma_turns_only(turn_barriers):
    """Ping-pong turn barriers whose epilogue turns (ids 4, 5) wait for the warpgroup's own
    threads only: the two warpgroups' epilogues overlap each other on the shared store ring
    (a race: timing only)."""
    def turns(self, first_id, wg):
        if first_id == 4:
            own = pipeline.NamedBarrier(barrier_id=first_id + wg, num_threads=128)
            return own, own
        return turn_barriers(self, first_id, wg)
    return turns


def _bits(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:10]


def _operands(name: str):
    e, h, f, m = SHAPES[name]
    sizes = split_sizes(name, e, m, torch.Generator().manual_seed(0))
    gen = torch.Generator(device="cuda").manual_seed(1)
    bf = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    grads = {"fc1": (torch.randn(m, 2 * f, **bf), torch.randn(m, h, **bf)),
             "fc2": (torch.randn(m, h, **bf), torch.randn(m, f, **bf))}
    return e, m, sizes, grads


def probe(shapes: str, iters: int, label: str, seconds: float = 0.0) -> None:
    """One result line per wgrad of each shape: ms (``time_ms``'s median over ``iters``), and
    with ``seconds`` > 0 instead each kernel run back to back for that long while
    ``nvidia-smi`` samples the clock: ms, median MHz, cycles (ms x GHz, comparable across
    variants that draw different power) and W."""
    rows = []
    with contextlib.ExitStack() as stack:
        lines = stack.enter_context(smi_samples(20, reasons=True)) if seconds else []
        for name in shapes.split(","):
            for gemm, cells in _probe_shape(name, iters, seconds):
                rows.append((name, gemm, cells))
                if not seconds:
                    print(_result_line(label, name, gemm, cells, lines), flush=True)
    if seconds:
        for name, gemm, cells in rows:
            print(_result_line(label, name, gemm, cells, lines), flush=True)


def _probe_shape(name: str, iters: int, seconds: float):
    """Per wgrad of ``name`` (gemm, {precision: (ms, TFLOP/s, bits, window)}): the window is
    the (start, end) of its back-to-back run when ``seconds`` > 0."""
    e, m, sizes, grads = _operands(name)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32).cuda()
    for gemm, (dout, x) in grads.items():
        (qd, sd, ends), (qx, sx, _) = token_major(dout, sizes), token_major(x, sizes)
        outs = {k: torch.empty(e, dout.shape[1], x.shape[1], device="cuda",
                               dtype=torch.bfloat16) for k in ("bf16", "fp8")}
        fns = {"bf16": lambda: te_cute.grouped_wgrad(dout, x, offs, out=outs["bf16"]),
               "fp8": lambda: te_cute.scaled_grouped_wgrad(qd, qx, sd, sx, ends,
                                                        out=outs["fp8"])}
        for fn in fns.values():
            fn()
        windows = {}
        if seconds:
            for k, fn in fns.items():
                time.sleep(0.3)  # each run starts from an idle GPU's clock
                start, end, ms = run_for(fn, seconds, 10)
                windows[k] = (start + 0.2, end, ms)
            ms = {k: w[2] for k, w in windows.items()}
        else:
            ms = time_ms(fns, iters)
        tflop = 2 * m * dout.shape[1] * x.shape[1] / 1e12
        yield gemm, {k: (ms[k], tflop / ms[k] * 1e3, _bits(o), windows.get(k))
                     for k, o in outs.items()}
        outs.clear()
        torch.cuda.empty_cache()


def _result_line(label: str, shape: str, gemm: str, cells: dict, lines: list[str]) -> str:
    """'LABEL SHAPE GEMM bf16 1.23ms 600TF [1490MHz 1.833Mcyc 690W slowdown=...] bits ...
    fp8 ...': the clock, cycles, power and what held the clock down (``reasons_between``)
    where the cell has a sampled window."""
    words = [label, shape, gemm]
    for k, (ms, tflops, bits, window) in cells.items():
        words += [k, f"{ms:.4f}ms", f"{tflops:.0f}TF"]
        got = samples_between(lines, window[0], window[1]) if window else []
        if got:
            mhz, watts, _ = window_medians(got)
            words += [f"{mhz:.0f}MHz", f"{ms * mhz / 1e3:.4f}Mcyc", f"{watts:.0f}W"]
            why = reasons_between(lines, window[0], window[1])
            words += [f"slowdown={why}"] if why else []
        words += ["bits", bits + " "]
    return " ".join(words).rstrip()


# --variants: each is 'none' or settings joined by '+' ('cut=tma+ring=2'), run in its own process
VARIANT_FLAGS = {"cut": "--cut", "ring": "--store-ring", "batch": "--epi-batch",
                 "cols": "--epi-cols"}


def _child_args(variant: str) -> list[str]:
    """Command-line flags of one variant: 'cut=tma+ring=2' -> --cut tma --store-ring 2."""
    args = []
    for part in variant.split("+"):
        key, sep, value = part.partition("=")
        if part == "none":
            continue
        if not sep or key not in VARIANT_FLAGS:
            raise ValueError(f"--variants: 'none' or {'/'.join(VARIANT_FLAGS)}=VALUE joined "
                             f"by '+', got {part!r} in {variant!r}")
        args += [VARIANT_FLAGS[key], value]
    return args


def _collect(line: str, times: dict) -> None:
    """Add the ms, and the cycles where sampled, of a result line ('LABEL SHAPE GEMM bf16
    1.23ms 600TF [1490MHz 1.833Mcyc 690W] bits ... fp8 ...') to ``times[(shape, gemm,
    precision, label, unit)]``, unit 'ms' or 'Mcyc'."""
    words = line.split()
    precision = None
    for i, word in enumerate(words[3:], start=3):
        if word in ("bf16", "fp8") and i + 1 < len(words) and words[i + 1].endswith("ms"):
            precision = word
        for unit in ("ms", "Mcyc"):
            if precision and word.endswith(unit) and word[: -len(unit)].replace(".", "").isdigit():
                times[(words[1], words[2], precision, words[0], unit)].append(
                    float(word[: -len(unit)]))


def run_variants(variants: list[str], rounds: int, child: list[str], timeout: float) -> None:
    """Each variant in its own process (and compile cache), in a rotated order each round;
    then the min-max ms of every wgrad per variant. A variant that hangs is stopped after
    ``timeout`` seconds and reported."""
    for v in variants:
        _child_args(v)  # refuse a bad spec before any GPU time is spent
    times: dict = defaultdict(list)
    cache = Path(tempfile.gettempdir()) / "te_seq_probe_epi"
    for r in range(rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            env = dict(os.environ, TE_SEQ_CACHE_DIR=str(cache / v))
            cmd = [sys.executable, __file__, "--label", v, *child, *_child_args(v)]
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                      timeout=timeout)
                out = proc.stdout
                if proc.returncode:
                    tail = proc.stderr.strip().splitlines()[-3:]
                    out += f"\n{v}: exit {proc.returncode}: " + " | ".join(tail)
            except subprocess.TimeoutExpired as err:
                out = err.stdout.decode() if isinstance(err.stdout, bytes) else err.stdout or ""
                out += f"\n{v}: stopped after {timeout:.0f} s"
            for line in out.splitlines():
                print(line, flush=True)
                _collect(line, times)
    for unit in ("ms", "Mcyc"):
        keys = sorted({k[:3] for k in times if k[4] == unit})
        if keys:
            print(f"{unit}, min-max over rounds:")
        for shape, gemm, precision in keys:
            cells = [f"{v} {min(got):.3f}-{max(got):.3f}" for v in variants
                     if (got := times.get((shape, gemm, precision, v, unit)))]
            print(f"{shape} {gemm} {precision}: " + "  ".join(cells), flush=True)


# --compile-only: PTX counts per variant, and what each cut must change against "none"
PTX_COUNTS = {"wgmma": "wgmma.mma_async", "stmatrix": "stmatrix", "fence": "fence.proxy.async",
              "tma_store": ".global.shared::cta", "mbarrier_init": "mbarrier.init",
              "selp": "selp", "fmul": "mul.f32", "cvt": "cvt.rn.bf16x2.f32",
              "st_global": "st.global"}
COMPILE_CONFIGS = ("fp8_wgrad_pp192_2x1", "wgrad_pp192_dyn")  # dump_ptx.py's names
# per cut: counts that must drop to zero / fall below / equal "none"'s, FP8 config
CUT_CHECKS = {"all": {"zero": ("stmatrix", "tma_store")},
              "stage": {"zero": ("stmatrix",), "same": ("tma_store", "fence")},
              "tma": {"zero": ("tma_store",), "same": ("stmatrix",)},
              "fence": {"zero": ("fence",), "same": ("stmatrix", "tma_store")},
              "const": {"same": ("stmatrix", "tma_store", "fence"), "below": ("cvt",)},
              "scale": {"below": ("fmul",)},
              "direct": {"zero": ("stmatrix", "tma_store", "fence"), "above": ("st_global",)}}


def _ptx_counts(config: str, epi_cols: int | None = None) -> dict[str, int]:
    """Compile dump_ptx.py's ``config`` (``epi_cols`` columns per epilogue subtile where
    given) for sm_90a (the settings and cuts already applied) and count what ``PTX_COUNTS``
    names in its PTX."""
    from dataclasses import replace

    from dump_ptx import _compile, _configs, _ptx_of

    cfg = _configs()[config]
    ptx = _ptx_of(_compile(replace(cfg, epi_cols=epi_cols) if epi_cols else cfg))
    return {k: ptx.count(pattern) for k, pattern in PTX_COUNTS.items()}


def check_variants(counts: dict) -> list[str]:
    """Problems with ``counts`` ({variant: {config: {name: n}}}): every variant keeps "none"'s
    WGMMAs (the main loop is still there to time), each cut removes what it says
    (``CUT_CHECKS``, FP8 config) and ``ring=2`` gives the FP8 wgrad a fifth A/B stage (two
    more mbarriers)."""
    base, problems = counts["none"], []
    fp8 = COMPILE_CONFIGS[0]
    for v, per_config in counts.items():
        for config, c in per_config.items():
            if c["wgmma"] != base[config]["wgmma"] or not c["wgmma"]:
                problems.append(f"{v} {config}: {c['wgmma']} WGMMAs, none has "
                                f"{base[config]['wgmma']}")
        settings = dict(part.partition("=")[::2] for part in v.split("+") if part != "none")
        c, b = per_config[fp8], base[fp8]
        rules = CUT_CHECKS.get(settings.get("cut"), {})
        problems += [f"{v}: {k} {c[k]}, not 0" for k in rules.get("zero", ()) if c[k]]
        problems += [f"{v}: {k} {c[k]} against none's {b[k]}" for k in rules.get("same", ())
                     if c[k] != b[k]]
        problems += [f"{v}: {k} {c[k]}, not below none's {b[k]}"
                     for k in rules.get("below", ()) if c[k] >= b[k]]
        problems += [f"{v}: {k} {c[k]}, not above none's {b[k]}"
                     for k in rules.get("above", ()) if c[k] <= b[k]]
        cols = int(settings.get("cols", 32))
        if cols != 32 and c["tma_store"] * cols != b["tma_store"] * 32:
            problems.append(f"{v}: {c['tma_store']} TMA stores, none has {b['tma_store']} "
                            f"of 32 columns")
        if (settings.get("ring") == "2" and cols == 32
                and c["mbarrier_init"] != b["mbarrier_init"] + 2):
            problems.append(f"{v}: {c['mbarrier_init']} mbarriers, none has "
                            f"{b['mbarrier_init']} (a fifth A/B stage adds 2)")
    return problems


def compile_variants(variants: list[str], timeout: float) -> None:
    """Each variant compiled for sm_90a in its own process (no GPU), its PTX counted; raises
    if ``check_variants`` finds a problem."""
    if "none" not in variants:
        variants = ["none", *variants]
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", TE_SEQ_DISK_CACHE="0",
               CUTE_DSL_DUMP_DIR=tempfile.mkdtemp(prefix="te_seq_probe_ptx_"))
    counts = {}
    for v in variants:
        cmd = [sys.executable, __file__, "--compile-only", "--label", v, *_child_args(v)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode:
            raise RuntimeError(f"{v}: exit {proc.returncode}: {proc.stderr[-2000:]}")
        counts[v] = json.loads(proc.stdout.strip().splitlines()[-1])
        for config, c in counts[v].items():
            print(v, config, " ".join(f"{k} {n}" for k, n in c.items()), flush=True)
    problems = check_variants(counts)
    if problems:
        raise RuntimeError("; ".join(problems))
    print("every variant keeps the main loop; each cut removes what it says")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epi-batch", default="1", help="an int, or 'none' (the ring less one)")
    p.add_argument("--cut", default="none",
                   help="none, scale, tma, fence, stage, const, all, direct or turn")
    p.add_argument("--store-ring", type=int, default=None, help="store ring slots")
    p.add_argument("--epi-cols", type=int, default=None,
                   help="columns of an epilogue subtile (one ring slot, one TMA store) of the "
                        "fresh wgrads: 32 or 64 (default: the default tilings' rule)")
    p.add_argument("--variants", default="",
                   help="comma-separated variants, each in its own process: 'none' or "
                        "cut=PART / ring=N / batch=N / cols=N joined by '+'")
    p.add_argument("--rounds", type=int, default=2, help="--variants: rounds")
    p.add_argument("--timeout", type=float, default=300, help="--variants: s per process")
    p.add_argument("--label", default=None, help="the first word of each result line")
    p.add_argument("--compile-only", action="store_true",
                   help="with --variants: compile each for sm_90a (no GPU) and check its PTX")
    p.add_argument("--shapes", default="B,Q")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seconds", type=float, default=0.0,
                   help="run each kernel back to back this long while nvidia-smi samples the "
                        "clock: adds MHz, cycles (ms x GHz) and W to each result")
    args = p.parse_args()
    if args.compile_only and args.variants:
        compile_variants(args.variants.split(","), args.timeout)
        return
    if args.variants:
        run_variants(args.variants.split(","), args.rounds,
                     ["--shapes", args.shapes, "--iters", str(args.iters), "--seconds",
                      str(args.seconds)], args.timeout)
        return
    GroupedGemmKernel.epi_batch = None if args.epi_batch == "none" else int(args.epi_batch)
    GroupedGemmKernel.epi_store_stages = args.store_ring
    if args.epi_cols:
        os.environ["TE_SEQ_WGRAD_EPI_COLS"] = str(args.epi_cols)
        te_cute.refresh_tiling_settings()
    _cut(args.cut)
    if args.compile_only:  # a child of compile_variants: the settings applied, count the PTX
        print(json.dumps({c: _ptx_counts(c, args.epi_cols) for c in COMPILE_CONFIGS}))
        return
    probe(args.shapes, args.iters, args.label or
          f"batch={args.epi_batch}+cut={args.cut}+ring={args.store_ring}", args.seconds)


if __name__ == "__main__":
    main()
