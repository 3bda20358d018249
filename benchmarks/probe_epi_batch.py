"""Probe: what the epilogue costs the wgrads written fresh (bf16 out, the MLP's fresh-grads
step): the 16-bit ``cute.grouped_wgrad`` and the FP8 row-wise ``cute.scaled_grouped_wgrad``,
default tilings.

``--epi-batch N``: epilogue subtiles staged per pair of barriers (``GroupedGemmKernel.
epi_batch``); every value must give the same bits (only the synchronisation changes).
``--cut PART``: time the kernels with part of the epilogue removed (wrong results, timing
only): ``scale`` (the FP8 dequantization multiply), ``tma`` (the TMA stores: subtiles
still staged in smem and fenced), ``all`` (nothing staged or stored: the main loop's own
rate), ``select`` (the liveness select of the FP8 scales), ``turn`` (ping-pong's two
epilogues no longer wait for each other: they race on the shared store ring and its
barrier).

Both are read at trace time, so each value runs in its own process with its own compile
cache directory (``TE_SEQ_CACHE_DIR``). Each line prints ms, TFLOP/s and a checksum of the
output's bits.

  TE_SEQ_CACHE_DIR=/tmp/eb3 python benchmarks/probe_epi_batch.py --epi-batch 3 --shapes B,Q
  TE_SEQ_CACHE_DIR=/tmp/cut_tma python benchmarks/probe_epi_batch.py --cut tma --shapes B
"""

from __future__ import annotations

import argparse
import hashlib

import cutlass.pipeline as pipeline
import torch
from bench_fp8_gemm import token_major
from bench_grouped_gemm import SHAPES, split_sizes, time_ms

from te_seq.kernels import cute
from te_seq.kernels.cute.grouped_gemm import GroupedGemmKernel
from te_seq.kernels.cute.mainloop import MainloopMixin
from te_seq.kernels.cute.scale_epilogue import ScaleScratchMixin
from te_seq.kernels.cute.store_epilogue import StoreEpilogueMixin


def _cut(part: str) -> None:
    """Remove ``part`` of the epilogue from every kernel traced after this (timing only)."""
    if part == "scale":
        ScaleScratchMixin._scaled_at = lambda self, st, i, value: value
    elif part == "tma":
        StoreEpilogueMixin._ring_flush = lambda self, warp, stores: self._sync_for_tma()
    elif part == "all":
        StoreEpilogueMixin._store_group = lambda self, *args, **kwargs: None
    elif part == "select":
        ScaleScratchMixin._scaled_at = _scaled_unselected
    elif part == "turn":
        MainloopMixin._turn_barriers = _mma_turns_only(MainloopMixin._turn_barriers)
    elif part != "none":
        raise ValueError(f"--cut: none, scale, select, tma, all or turn, got {part!r}")


def _scaled_unselected(self, st, i, value):
    """``_scaled_at`` without the select of the tile's liveness (right on live tiles)."""
    r, c = st.coords[i]
    return value * (st.scratch[r] * st.scratch[self.tile_mnk[0] + c])


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


def probe(shapes: str, iters: int, label: str) -> None:
    for name in shapes.split(","):
        e, m, sizes, grads = _operands(name)
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32).cuda()
        for gemm, (dout, x) in grads.items():
            (qd, sd, ends), (qx, sx, _) = token_major(dout, sizes), token_major(x, sizes)
            outs = {k: torch.empty(e, dout.shape[1], x.shape[1], device="cuda",
                                   dtype=torch.bfloat16) for k in ("bf16", "fp8")}
            fns = {"bf16": lambda: cute.grouped_wgrad(dout, x, offs, out=outs["bf16"]),
                   "fp8": lambda: cute.scaled_grouped_wgrad(qd, qx, sd, sx, ends,
                                                            out=outs["fp8"])}
            for fn in fns.values():
                fn()
            ms = time_ms(fns, iters)
            tflop = 2 * m * dout.shape[1] * x.shape[1] / 1e12
            print(label, name, gemm, "  ".join(
                f"{k} {ms[k]:.4f}ms {tflop / ms[k] * 1e3:.0f}TF bits {_bits(o)}"
                for k, o in outs.items()), flush=True)
            outs.clear()
            torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epi-batch", default="1", help="an int, or 'none' (the ring less one)")
    p.add_argument("--cut", default="none",
                   help="none, scale, select, tma, all or turn (timing only)")
    p.add_argument("--shapes", default="B,Q")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    GroupedGemmKernel.epi_batch = None if args.epi_batch == "none" else int(args.epi_batch)
    _cut(args.cut)
    probe(args.shapes, args.iters, f"epi_batch={args.epi_batch} cut={args.cut}")


if __name__ == "__main__":
    main()
