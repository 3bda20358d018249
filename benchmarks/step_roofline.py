"""A roofline of one fused grouped-MLP step, kernel by kernel: what the kernels te_seq launches
must move and compute at the least, and the time that takes on a given GPU.

Each kernel reads its operands and weights once and writes its outputs once (its compulsory
bytes: re-reads that L2 serves and padding are not counted) and does its GEMM's FLOPs (the
quantization passes none). At the copy rate and the dense peak it needs at least
max(bytes / bandwidth, FLOPs / peak); kernels run one after another, so the step needs at
least the sum of those. A kernel near both limits at once (intensity near the machine's
balance of FLOPs per byte) cannot reach either while paying the other, so real kernels stay
further from this bound there than where one limit dominates.

Precisions, as the benchmark's te_seq MLP runs them on the cute backend (SwiGLU, no router
probs: their 4-12 bytes a row are below 0.1 %):
- ``bf16``: the GLU FC1 (x, W1 -> h, a), FC2 (a, W2 -> y), the GLU dgrad (dy, W2, h -> dh, a),
  FC1's dgrad (dh, W1 -> dx), the wgrads (dy, a -> dW2; dh, x -> dW1), gradients written
  fresh in bf16;
- ``fp8``: ``Float8RowwiseScaling(fp8_wgrad=False)``: x, a, dy and dh quantized row-wise by a
  pass each (read bf16, write E4M3 and a scale per row), the four GEMMs before the wgrads on
  E4M3 operands with the cached E4M3 weights, the wgrads in bf16 as above;
- ``fp8all``: ``Float8RowwiseScaling()``: also the token-major E4M3 forms for FP8 wgrads: x's
  from its group maxima (one more read), a's (recomputed by the dgrad), dy's and dh's from
  two passes each (maxima, then cast, row-wise forms of dy and dh written by the same pair).

    python benchmarks/step_roofline.py [--shapes A,B,Q,Z] [--bandwidth 4.2] [--bf16-peak 766]
        [--fp8-peak 1336] [--kernels] [--grad-mode fresh|accumulate|megatron]

``--grad-mode`` as the benchmark's: the wgrads write new bf16 gradients (fresh), read and
write bf16 ``.grad`` (accumulate) or the fp32 ``main_grad`` (megatron).

Defaults: one H200 (copy 4.2 TB/s, the dense 8192³ bf16 matmul in bursts 766 TFLOP/s, dense
FP8 1336: benchmarks/README.md). Z has Q's totals (the same rows, widths and experts).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from mlp_case import SHAPES, Shape

PRECISIONS = ("bf16", "fp8", "fp8all")
# how the wgrads meet their gradients, as bench_grouped_mlp.py's --grad-mode: bytes per weight
# element (read, written): new bf16 tensors, bf16 .grad read and written, the fp32 main_grad
GRAD_MODES = {"fresh": (0, 2), "accumulate": (2, 2), "megatron": (4, 4)}
_SCALE = 4  # bytes of one fp32 scale


@dataclass(frozen=True)
class Kernel:
    """One launch's compulsory traffic and work."""

    name: str
    read: float  # bytes
    written: float  # bytes
    flops: float
    fp8: bool = False  # on the FP8 tensor cores

    @property
    def bytes(self) -> float:
        return self.read + self.written


@dataclass(frozen=True)
class Rates:
    """A GPU's copy bandwidth (bytes/s) and dense peaks (FLOP/s)."""

    bandwidth: float = 4.2e12
    bf16: float = 766e12
    fp8: float = 1336e12

    def memory_s(self, k: Kernel) -> float:
        return k.bytes / self.bandwidth

    def compute_s(self, k: Kernel) -> float:
        return k.flops / (self.fp8 if k.fp8 else self.bf16)

    def bound_s(self, k: Kernel) -> float:
        return max(self.memory_s(k), self.compute_s(k))


def step_kernels(shape: Shape, precision: str, grad_mode: str = "fresh") -> list[Kernel]:
    """The step's kernels under ``precision`` (one of `PRECISIONS`), in launch order; the
    wgrads write their gradients in ``grad_mode`` (`GRAD_MODES`)."""
    if precision not in PRECISIONS or grad_mode not in GRAD_MODES:
        raise ValueError(f"step_roofline: precision must be one of {PRECISIONS} and grad_mode "
                         f"one of {tuple(GRAD_MODES)}, got {precision!r}, {grad_mode!r}")
    w2 = shape.E * shape.H * shape.F
    weights = {"FC2 wgrad": w2, "FC1 wgrad": 2 * w2}  # the gradient each wgrad meets
    read, written = GRAD_MODES[grad_mode]
    return [replace(k, read=k.read + read * weights[k.name], written=written * weights[k.name])
            if k.name in weights else k for k in _kernels(shape, precision)]


def _kernels(shape: Shape, precision: str) -> list[Kernel]:
    """`step_kernels` with fresh bf16 gradients."""
    m, h, f, e = shape.M, shape.H, shape.F, shape.E
    x, a, w1, w2 = m * h, m * f, e * 2 * f * h, e * h * f  # elements (h and dh: 2a)
    gemm1, gemm2 = 2 * m * 2 * f * h, 2 * m * h * f  # FC1-sized and FC2-sized GEMMs
    if precision == "bf16":
        return [
            Kernel("FC1 (GLU)", 2 * (x + w1), 2 * (2 * a + a), gemm1),
            Kernel("FC2", 2 * (a + w2), 2 * x, gemm2),
            Kernel("GLU dgrad", 2 * (x + w2 + 2 * a), 2 * (2 * a + a), gemm2),
            Kernel("FC1 dgrad", 2 * (2 * a + w1), 2 * x, gemm1),
            *_bf16_wgrads(x, a, w1, w2, gemm1, gemm2),
        ]
    rows = _SCALE * m  # one fp32 scale per row of a row-wise operand
    kernels = [
        _quant("quant x", x, m, token_major=precision == "fp8all"),
        Kernel("FC1 (GLU)", x + rows + w1, 2 * (2 * a + a), gemm1, fp8=True),
        _quant("quant a", a, m),
        Kernel("FC2", a + rows + w2, 2 * x, gemm2, fp8=True),
        _quant("quant dy", x, m, token_major=precision == "fp8all"),
        Kernel("GLU dgrad", x + rows + w2 + 2 * 2 * a, 2 * (2 * a + a), gemm2, fp8=True),
        _quant("quant dh", 2 * a, m, token_major=precision == "fp8all"),
        Kernel("FC1 dgrad", 2 * a + rows + w1, 2 * x, gemm1, fp8=True),
    ]
    if precision == "fp8":
        return kernels + _bf16_wgrads(x, a, w1, w2, gemm1, gemm2)
    return kernels + [
        # the recomputed a, quantized along the tokens only (two passes: maxima, cast)
        Kernel("token-major a", 2 * 2 * a, a, 0),
        Kernel("FC2 wgrad", x + a, 2 * w2, gemm2, fp8=True),
        Kernel("FC1 wgrad", 2 * a + x, 2 * w1, gemm1, fp8=True),
    ]


def _bf16_wgrads(x: int, a: int, w1: int, w2: int, gemm1: int, gemm2: int) -> list[Kernel]:
    return [Kernel("FC2 wgrad", 2 * (x + a), 2 * w2, gemm2),
            Kernel("FC1 wgrad", 2 * (2 * a + x), 2 * w1, gemm1)]


def _quant(name: str, elements: int, rows: int, token_major: bool = False) -> Kernel:
    """A row-wise quantization pass of a bf16 [rows, C] matrix: read, write E4M3 and a scale per
    row. ``token_major``: its token-major E4M3 form too, which takes one more read (x's: cast
    from the group maxima its row-wise pass kept; dy's and dh's: the maxima pass of a pair
    whose cast writes both forms)."""
    read, written = 2 * elements, elements + _SCALE * rows
    if token_major:
        read, written = read + 2 * elements, written + elements
    return Kernel(name + (" (+ token-major)" if token_major else ""), read, written, 0)


def step_bound_s(kernels: list[Kernel], rates: Rates) -> float:
    """The step's least time: its kernels' bounds, one after another."""
    return sum(rates.bound_s(k) for k in kernels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="A,B,Q")
    p.add_argument("--bandwidth", type=float, default=4.2, help="copy rate, TB/s")
    p.add_argument("--bf16-peak", type=float, default=766.0, help="TFLOP/s")
    p.add_argument("--fp8-peak", type=float, default=1336.0, help="TFLOP/s")
    p.add_argument("--kernels", action="store_true", help="each kernel's figures too")
    p.add_argument("--grad-mode", default="fresh", choices=sorted(GRAD_MODES))
    args = p.parse_args()
    rates = Rates(args.bandwidth * 1e12, args.bf16_peak * 1e12, args.fp8_peak * 1e12)
    print(f"copy {args.bandwidth} TB/s, bf16 {args.bf16_peak:.0f} and FP8 {args.fp8_peak:.0f} "
          f"TFLOP/s, gradients {args.grad_mode}; per step: GB, GFLOP, ms at the copy rate / "
          f"the peak, bound ms")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        bounds = {}
        for precision in PRECISIONS:
            kernels = step_kernels(shape, precision, args.grad_mode)
            bounds[precision] = step_bound_s(kernels, rates)
            nbytes, flops = sum(k.bytes for k in kernels), sum(k.flops for k in kernels)
            print(f"{name} {precision:7s} {nbytes / 1e9:7.2f} GB {flops / 1e9:8.0f} GFLOP "
                  f"{sum(rates.memory_s(k) for k in kernels) * 1e3:7.3f} / "
                  f"{sum(rates.compute_s(k) for k in kernels) * 1e3:7.3f} ms, bound "
                  f"{bounds[precision] * 1e3:7.3f} ms")
            for k in kernels if args.kernels else ():
                print(f"    {k.name:26s} {k.bytes / 1e9:6.3f} GB {k.flops / 1e9:7.1f} GFLOP "
                      f"{rates.memory_s(k) * 1e3:6.3f} / {rates.compute_s(k) * 1e3:6.3f} ms")
        print(f"{name} bound bf16 / FP8: {bounds['bf16'] / bounds['fp8']:.2f}x "
              f"(fp8_wgrad=False), {bounds['bf16'] / bounds['fp8all']:.2f}x (all FP8)")


if __name__ == "__main__":
    main()
