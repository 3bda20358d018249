"""The grouped-MLP benchmark's figures: FLOPs, the bytes-moved lower bound, the ratio against the
best peer of the run, and the table.

Bytes-moved lower bound of one call (compulsory HBM traffic; benchmarks/README.md has the
derivation). b = bytes per element of x and the weights (2 for bf16), p = 4 with fp32 router
probs (0 with `--act swiglu`), W = 3·E·F·H weight elements (W1 [E, 2F, H] and W2 [E, H, F]):
    fwd      b·(2·M·H + W) + p·M                      read x, W1, W2, probs; write y
    bwd      b·(3·M·H + W) + 2·p·M + G                read dy, x, W1, W2, probs; write dx, dprobs
    G        fresh b·W (write the wgrads), accumulate 2·b·W (read and write .grad),
             megatron 2·4·W (read and write the fp32 main_grad)
    fwd+bwd  fwd + bwd (the backward cannot start before the forward has returned y)
Intermediates (h, a, dh) count nothing: any real implementation moves more than this.
"""

from __future__ import annotations

from collections.abc import Sequence

from _common import Result
from mlp_case import Shape

WGRAD_BYTES = {"fresh": lambda b: b, "accumulate": lambda b: 2 * b, "megatron": lambda b: 8}


def flops(shape: Shape, mode: str) -> float:
    """fwd 6·M·H·F, every forward+backward mode 18·M·H·F (padding rows are never FLOPs)."""
    return (6 if mode == "fwd" else 18) * shape.M * shape.H * shape.F


def grad_mode_of(mode: str) -> str:
    """The grad mode of a result's mode ("fwd+bwd" -> fresh, "fwd+bwd:megatron" -> megatron)."""
    return mode.split(":", 1)[1] if ":" in mode else "fresh"


def bytes_bound(shape: Shape, mode: str, elem_bytes: int, uses_probs: bool) -> float:
    """The bytes-moved lower bound of one call (module docstring)."""
    M, H, W = shape.M, shape.H, 3 * shape.E * shape.F * shape.H
    b, p = elem_bytes, (4 if uses_probs else 0)
    fwd = b * (2 * M * H + W) + p * M
    if mode == "fwd":
        return fwd
    wgrad = WGRAD_BYTES[grad_mode_of(mode)](b) * W
    return fwd + b * (3 * M * H + W) + 2 * p * M + wgrad


def annotate(results: Sequence[Result], bound_bytes: dict, bandwidth_gbs: float) -> None:
    """Fill each timed result's bytes bound, its share of the time, and `vs` = the best bf16
    peer's time (same shape and mode) / its time. ``bound_bytes[(shape, mode)]`` -> bytes."""
    best: dict[tuple[str, str], Result] = {}
    for r in results:
        if r.ms and r.is_peer and r.precision == "bf16":
            key = (r.shape, r.mode)
            if key not in best or r.ms < best[key].ms:
                best[key] = r
    for r in results:
        nbytes = bound_bytes.get((r.shape, r.mode))
        if nbytes is not None:
            r.bytes_bound_gb = nbytes / 1e9
            r.bound_ms = nbytes / (bandwidth_gbs * 1e6) if bandwidth_gbs > 0 else None
        peer = best.get((r.shape, r.mode))
        if peer is not None:
            r.best_peer = peer.variant
            r.vs_best_peer = peer.ms / r.ms if r.ms else None
        if r.ms and r.bound_ms:
            r.pct_bound = 100.0 * r.bound_ms / r.ms


def _cell(value: float | None, fmt: str, width: int) -> str:
    return format(value, fmt) if value is not None else "-".rjust(width)


def print_table(results: Sequence[Result], peak_tflops: float, bandwidth_gbs: float) -> None:
    """One line per result, then the best peer of each (shape, mode)."""
    print(
        f"\ndense peak (measured): {peak_tflops:.1f} TFLOP/s; copy bandwidth (measured): "
        f"{bandwidth_gbs:.0f} GB/s"
    )
    print(
        f"{'shape':5} {'mode':18} {'variant':22} {'ms':>9} {'TFLOP/s':>8} {'%peak':>6} "
        f"{'vs':>5} {'GB':>7} {'%bw':>5} {'latency':>9} {'host':>8}  note"
    )
    for r in results:
        print(
            f"{r.shape:5} {r.mode:18} {r.variant:22} {_cell(r.ms, '9.3f', 9)} "
            f"{_cell(r.tflops, '8.1f', 8)} {_cell(r.pct_peak, '6.1f', 6)} "
            f"{_cell(r.vs_best_peer, '5.2f', 5)} {_cell(r.bytes_bound_gb, '7.2f', 7)} "
            f"{_cell(r.pct_bound, '5.1f', 5)} {_cell(r.latency_ms, '9.3f', 9)} "
            f"{_cell(r.host_ms, '8.3f', 8)}  {r.note}"
        )
    best = {(r.shape, r.mode): r.best_peer for r in results if r.best_peer}
    print(
        "\nvs = the best bf16 peer's time / the variant's (same shape, mode); GB = bytes-moved "
        "lower bound; %bw = its time at the copy bandwidth / the measured time; latency = one "
        "call from an idle GPU to its end; host = one call until it returns (te_seq variants)"
    )
    for (shape, mode), peer in best.items():
        print(f"best peer {shape} {mode}: {peer}")
