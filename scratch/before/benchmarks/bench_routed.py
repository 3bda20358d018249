"""The routed-row GEMMs of the fused MoE block against the same GEMMs on copied rows.

Per shape (bench_grouped_gemm.SHAPES; T = M / 2 tokens, each feeding 2 routed rows, as top-2
routing does) it times, interleaved, with CUDA events:

* FC1 + SwiGLU (probs), M rows gathered from x [T, H]: the fused kernel on rows copied first
  (``index_select`` + kernel), the kernel alone on pre-copied rows, and the kernel gathering
  them itself (``gather_rows``);
* the plain FC1 GEMM the same three ways, on pre-copied rows with a 1x1 cluster, and gathering
  on 1x1 clusters (128 or 256 wide) and with rows in order (the default gathers on 2x1 clusters:
  B multicast to two m-tiles);
* FC2 with its rows placed by a permutation: the plain kernel then ``index_copy_``, the plain
  kernel alone, and the kernel scattering them itself (``scatter_rows``).

TFLOP/s count the GEMM's FLOPs only.

    python benchmarks/bench_routed.py [--shapes Q,B,Z] [--iters 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_grouped_gemm import SHAPES, split_sizes, time_ms


def _data(name: str):
    e, h, f, m = SHAPES[name]
    gen = torch.Generator().manual_seed(0)
    offs = torch.tensor(split_sizes(name, e, m, gen)).cumsum(0).to(torch.int32).cuda()
    bf = dict(device="cuda", dtype=torch.bfloat16)
    tokens = m // 2
    idx = (torch.arange(m, device="cuda") % tokens)[torch.randperm(m, device="cuda")]
    perm = torch.randperm(m, device="cuda")
    return dict(
        e=e, h=h, f=f, m=m, offs=offs, idx=idx, perm=perm, probs=torch.rand(m, device="cuda"),
        x=torch.randn(tokens, h, **bf), w1t=(torch.randn(e, 2 * f, h, **bf) * 0.02).transpose(1, 2),
        a=torch.randn(m, f, **bf), w2t=(torch.randn(e, h, f, **bf) * 0.02).transpose(1, 2),
    )


def _cases(d: dict):
    """(label, flops, {variant: fn}) of the three routed steps."""
    from te_seq.kernels import cute

    x, idx, offs, w1t, probs, perm = d["x"], d["idx"], d["offs"], d["w1t"], d["probs"], d["perm"]
    rows = x.index_select(0, idx)
    seq = torch.arange(d["m"], device="cuda") % x.shape[0]  # consecutive rows (twice)
    one = cute.Tiling(cute.tile_n_for(2 * d["f"], 1), (1, 1))
    narrow = cute.Tiling(128, (1, 1))

    def glu(xx, **kw):
        return cute.glu_fc1_forward(xx, w1t, offs, "silu", None, probs, **kw)

    def place(res):
        return torch.empty_like(res).index_copy_(0, perm, res)

    yield "fc1_glu", 2 * d["m"] * d["h"] * 2 * d["f"], {
        "copy+kernel": lambda: glu(x.index_select(0, idx)),
        "kernel(copied rows)": lambda: glu(rows),
        "gather": lambda: glu(x, gather_rows=idx),
    }
    yield "fc1_mm", 2 * d["m"] * d["h"] * 2 * d["f"], {
        "copy+kernel": lambda: cute.grouped_mm(x.index_select(0, idx), w1t, offs),
        "kernel(copied rows)": lambda: cute.grouped_mm(rows, w1t, offs),
        "kernel 1x1(copied rows)": lambda: cute.grouped_mm(rows, w1t, offs, tiling=one),
        "gather": lambda: cute.grouped_mm(x, w1t, offs, gather_rows=idx),
        "gather 1x1": lambda: cute.grouped_mm(x, w1t, offs, gather_rows=idx, tiling=one),
        "gather n128": lambda: cute.grouped_mm(x, w1t, offs, gather_rows=idx, tiling=narrow),
        "gather in order": lambda: cute.grouped_mm(x, w1t, offs, gather_rows=seq),
    }
    yield "fc2_mm", 2 * d["m"] * d["h"] * d["f"], {
        "kernel+index_copy": lambda: place(cute.grouped_mm(d["a"], d["w2t"], offs)),
        "kernel": lambda: cute.grouped_mm(d["a"], d["w2t"], offs),
        "scatter": lambda: cute.grouped_mm(d["a"], d["w2t"], offs, scatter_rows=perm),
    }


def run_shape(name: str, iters: int) -> list[dict]:
    d = _data(name)
    out = []
    for label, flops, fns in _cases(d):
        first = {k: fn() for k, fn in fns.items()}  # compiles; outputs for the check
        ref = next(iter(first.values()))
        same = {k: _equal(v, ref) for k, v in first.items()}
        ms = time_ms(fns, iters)
        row = dict(shape=name, step=label, ms=ms, same_as_first=same,
                   tflops={k: flops / v / 1e9 for k, v in ms.items()})
        out.append(row)
        print(json.dumps(row), flush=True)
        del first, ref
    return out


def _equal(a, b) -> bool:
    """Bit equality of two results (tuples compared element by element)."""
    if isinstance(a, tuple):
        return all(torch.equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="Q,B,Z")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    for name in args.shapes.split(","):
        rows += run_shape(name, args.iters)
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    for r in rows:
        cells = "  ".join(f"{k} {v:.0f}" for k, v in r["tflops"].items())
        print(f"{r['shape']:3} {r['step']:8} TFLOP/s: {cells}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
