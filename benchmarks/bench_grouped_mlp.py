"""Grouped MoE MLP benchmark: FC1 (H -> 2F) -> SwiGLU -> FC2 (F -> H), forward and forward+backward.

Shape legend: M routed rows (tokens, already permuted by expert), E experts, H hidden, F ffn.
FLOPs: forward 6·M·H·F, forward+backward 18·M·H·F (padding rows are waste, never FLOPs).

Variants, all in this process on the same random data, checked against each other before timing:
  te_seq:<backend>  te_seq.Sequential(GroupedLinear, SwiGLU, GroupedLinear) under te_seq.backend()
  te_seq:<backend>:compiled[-ro]  the same Sequential through torch.compile(fullgraph=True) (with
                    --compile default / reduce-overhead); split sizes on the device
  kernels:<backend> the backend's raw functionals (grouped_mm, grouped_wgrad) + torch SwiGLU helpers
  grouped_mm        torch._grouped_mm with a separate SwiGLU, backward by hand, wgrad rows padded
                    to 16-byte group boundaries where the split sizes need it
  loop              a per-expert Python loop of matmuls, backward by autograd

  python benchmarks/bench_grouped_mlp.py --shapes A,B,Q,Z --json out.json --png out.png
  python benchmarks/bench_grouped_mlp.py --dry-run   # tiny shapes, CPU, float32: checks the script
  python benchmarks/bench_grouped_mlp.py --shapes A,B,Q,Z --compile default,reduce-overhead

Columns: ms (steady state, bursts), latency (one call from an idle GPU to its end) and host (one
call's host time until it returns, kernels not waited for: the Python cost per call).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, for te_seq
from _common import (  # noqa: E402
    Result,
    dense_peak_tflops,
    print_table,
    rel_err,
    summarize,
    time_host,
    time_interleaved,
    write_json,
    write_png,
)

try:  # the core is written in parallel: without it the te_seq variants are skipped, said why
    import te_seq
    from te_seq import ops

    TE_SEQ_ERROR = ""
except Exception as exc:  # noqa: BLE001 - any import failure just disables those variants
    te_seq, ops = None, None
    TE_SEQ_ERROR = f"te_seq not importable: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Shape:
    E: int
    H: int
    F: int
    M: int
    skewed: bool = False  # Zipf-like counts, some empty experts, sizes not multiples of 8


SHAPES = {
    "A": Shape(E=8, H=4096, F=14336, M=32768),
    "B": Shape(E=128, H=4096, F=1024, M=65536),
    "Q": Shape(E=128, H=2048, F=768, M=32768),
    "Z": Shape(E=128, H=2048, F=768, M=32768, skewed=True),
    # tiny shapes for --dry-run and GPU smoke runs
    "T": Shape(E=6, H=64, F=40, M=203, skewed=True),
    "U": Shape(E=4, H=32, F=24, M=128),
}
REFERENCE_MAX_MHF = 1 << 28  # the reference backend loops on the host: tiny shapes only
CHECK_TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def zipf_counts(num_experts: int, num_rows: int, seed: int = 0, s: float = 1.1) -> list[int]:
    """Zipf-like split sizes summing to M: ~1/16 of experts (≥ 1) empty, no size a multiple of 8."""
    gen = torch.Generator().manual_seed(seed)
    rank = torch.randperm(num_experts, generator=gen)  # popularity rank of each expert
    weight = (rank + 1.0) ** -s
    weight[rank >= num_experts - max(1, num_experts // 16)] = 0.0  # least popular are empty
    counts = (weight / weight.sum() * num_rows).floor().long().tolist()
    big = max(range(num_experts), key=lambda e: counts[e])
    for e in range(num_experts):
        if e != big and counts[e] > 0 and counts[e] % 8 == 0:
            counts[e] -= 1
    counts[big] += num_rows - sum(counts)
    if counts[big] % 8 == 0:  # move one row to an expert that stays unaligned
        other = next(e for e in range(num_experts) if e != big and counts[e] % 8 not in (0, 7))
        counts[big] -= 1
        counts[other] += 1
    return counts


# --------------------------------------------------------------------------- data


@dataclass
class Case:
    """One shape's random data; weights in te_seq's layout (FC1 [E, 2F, H], FC2 [E, H, F])."""

    name: str
    shape: Shape
    sizes: list[int]  # split sizes on the host
    split_sizes: Tensor  # [E] int64 on the device
    offs: Tensor  # [E] int32 cumulative ends on the device
    x: Tensor  # [M, H]
    w1: Tensor  # [E, 2F, H]
    w2: Tensor  # [E, H, F]
    dy: Tensor  # [M, H]


def make_case(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Case:
    s = SHAPES[name]
    sizes = zipf_counts(s.E, s.M, seed) if s.skewed else _uniform_counts(s.E, s.M)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

    split_sizes = torch.tensor(sizes, dtype=torch.int64, device=device)
    return Case(
        name=name,
        shape=s,
        sizes=sizes,
        split_sizes=split_sizes,
        offs=split_sizes.cumsum(0).to(torch.int32),
        x=randn(s.M, s.H),
        w1=randn(s.E, 2 * s.F, s.H, scale=s.H**-0.5),
        w2=randn(s.E, s.H, s.F, scale=s.F**-0.5),
        dy=randn(s.M, s.H),
    )


def _uniform_counts(num_experts: int, num_rows: int) -> list[int]:
    base, extra = divmod(num_rows, num_experts)
    return [base + (1 if e < extra else 0) for e in range(num_experts)]


# --------------------------------------------------------------------------- variants


class Variant:
    """A way to run the MLP. ``forward`` returns y; ``forward_backward`` leaves its results for
    ``outputs`` (y, dx, dW1 [E, 2F, H], dW2 [E, H, F]), which is not timed."""

    name: str
    note: str = ""

    def forward(self) -> Tensor:
        raise NotImplementedError

    def forward_backward(self) -> None:
        raise NotImplementedError

    def outputs(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        raise NotImplementedError


def _swiglu_plain(h: Tensor) -> Tensor:
    gate, up = h.chunk(2, dim=-1)  # [M, F] each
    return F.silu(gate) * up  # [M, F]


def _swiglu_plain_backward(da: Tensor, h: Tensor) -> Tensor:
    gate, up = h.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    dgate = da * up * sig * (1 + gate * (1 - sig))
    return torch.cat([dgate, da * gate * sig], dim=-1)  # [M, 2F]


class LoopVariant(Variant):
    """Per-expert matmuls over host split sizes, one weight tensor per expert (like weight0..)."""

    name = "loop"

    def __init__(self, case: Case) -> None:
        self.case = case
        self.w1 = [w.clone().requires_grad_() for w in case.w1]  # E × [2F, H]
        self.w2 = [w.clone().requires_grad_() for w in case.w2]  # E × [H, F]
        self.x = case.x.clone().requires_grad_()
        self.y: Tensor | None = None

    def forward(self) -> Tensor:
        parts = []
        for e, x_e in enumerate(self.x.split(self.case.sizes)):
            h_e = x_e @ self.w1[e].t()  # [M_e, 2F]
            parts.append(_swiglu_plain(h_e) @ self.w2[e].t())  # [M_e, H]
        return torch.cat(parts)  # [M, H]

    def forward_backward(self) -> None:
        for p in [self.x, *self.w1, *self.w2]:
            p.grad = None
        self.y = self.forward()
        self.y.backward(self.case.dy)

    def outputs(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        dw1 = torch.stack([w.grad for w in self.w1])
        return self.y, self.x.grad, dw1, torch.stack([w.grad for w in self.w2])


class GroupedMMVariant(Variant):
    """torch._grouped_mm + separate SwiGLU; wgrad rows padded to 16-byte group boundaries."""

    name = "grouped_mm"

    def __init__(self, case: Case) -> None:
        self.case = case
        align = 16 // case.x.element_size()
        padded = [(n + align - 1) // align * align for n in case.sizes]
        self.needs_pad = padded != case.sizes
        starts = torch.tensor([0] + padded[:-1]).cumsum(0).tolist()  # setup only: host sizes
        dest = [starts[e] + i for e, n in enumerate(case.sizes) for i in range(n)]
        self.dest = torch.tensor(dest, dtype=torch.int64, device=case.x.device)  # [M]
        self.padded_rows = sum(padded)
        self.padded_offs = torch.tensor(padded, device=case.x.device).cumsum(0).to(torch.int32)
        waste = 100.0 * (self.padded_rows - case.shape.M) / max(1, case.shape.M)
        self.note = f"wgrad pad waste {waste:.2f}% rows" if self.needs_pad else ""
        self.result: tuple[Tensor, Tensor, Tensor, Tensor] | None = None

    def _pad(self, t: Tensor) -> Tensor:
        """[M, C] -> [P, C], each group starting on a 16-byte boundary, zero rows between."""
        if not self.needs_pad:
            return t
        return t.new_zeros(self.padded_rows, t.shape[1]).index_copy_(0, self.dest, t)

    def _fc1(self) -> tuple[Tensor, Tensor]:
        c = self.case
        h = torch._grouped_mm(c.x, c.w1.transpose(1, 2), offs=c.offs)  # [M, 2F]; H_e = X_e W1_eᵀ
        return h, _swiglu_plain(h)  # [M, 2F], [M, F]

    def forward(self) -> Tensor:
        _, act = self._fc1()
        return torch._grouped_mm(act, self.case.w2.transpose(1, 2), offs=self.case.offs)  # [M, H]

    def forward_backward(self) -> None:
        c, offs = self.case, self.case.offs
        self.result = None
        h, act = self._fc1()
        y = torch._grouped_mm(act, c.w2.transpose(1, 2), offs=offs)  # [M, H]
        da = torch._grouped_mm(c.dy, c.w2, offs=offs)  # [M, F]; dA_e = dY_e W2_e
        dh = _swiglu_plain_backward(da, h)  # [M, 2F]
        dw2 = torch._grouped_mm(self._pad(c.dy).t(), self._pad(act), offs=self.padded_offs)
        dx = torch._grouped_mm(dh, c.w1, offs=offs)  # [M, H]; dX_e = dH_e W1_e
        dw1 = torch._grouped_mm(self._pad(dh).t(), self._pad(c.x), offs=self.padded_offs)
        self.result = (y, dx, dw1, dw2)  # dW1_e = dH_eᵀ X_e [E, 2F, H]; dW2_e = dY_eᵀ A_e

    def outputs(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.result


class KernelsVariant(Variant):
    """A backend's raw GEMM kernels (grouped_mm / grouped_wgrad) with its SwiGLU maths (on the
    GPU backends: the reference, compiled on CUDA), not fused into the GEMMs."""

    def __init__(self, case: Case, backend: str, impl: object, glu: object) -> None:
        self.name = f"kernels:{backend}"
        self.case, self.k = case, impl  # impl: a te_seq.kernels.Backend
        self.swiglu = lambda h: impl.glu_forward(h, glu)
        self.swiglu_bwd = lambda da, h: impl.glu_backward(h, da, glu)[0]
        self.result: tuple[Tensor, Tensor, Tensor, Tensor] | None = None

    def _fc1(self) -> tuple[Tensor, Tensor]:
        c = self.case
        h = self.k.grouped_mm(c.x, c.w1.transpose(1, 2), c.offs)  # [M, 2F]; H_e = X_e W1_eᵀ
        return h, self.swiglu(h)  # [M, 2F], [M, F]

    def forward(self) -> Tensor:
        _, act = self._fc1()
        return self.k.grouped_mm(act, self.case.w2.transpose(1, 2), self.case.offs)  # [M, H]

    def forward_backward(self) -> None:
        c, k = self.case, self.k
        self.result = None
        h, act = self._fc1()
        y = k.grouped_mm(act, c.w2.transpose(1, 2), c.offs)  # [M, H]
        da = k.grouped_mm(c.dy, c.w2, c.offs)  # [M, F]; dA_e = dY_e W2_e
        dh = self.swiglu_bwd(da, h)  # [M, 2F]
        dw2 = k.grouped_wgrad(c.dy, act, c.offs)  # [E, H, F]; dW2_e = dY_eᵀ A_e
        dx = k.grouped_mm(dh, c.w1, c.offs)  # [M, H]; dX_e = dH_e W1_e
        dw1 = k.grouped_wgrad(dh, c.x, c.offs)  # [E, 2F, H]; dW1_e = dH_eᵀ X_e
        self.result = (y, dx, dw1, dw2)

    def outputs(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.result


class TeSeqVariant(Variant):
    """te_seq.Sequential(GroupedLinear, SwiGLU, GroupedLinear)(x, split_sizes, split_sizes)."""

    def __init__(self, case: Case, backend: str, per_group: bool = False) -> None:
        suffix = ":per-group" if per_group else ""
        self.name, self.backend, self.case = f"te_seq:{backend}{suffix}", backend, case
        s, x = case.shape, case.x
        # The default layout is one [E, out, in] weight per linear (single_grouped_weight): with
        # E Parameters (weight0..), autograd accumulates E gradients one by one (host time).
        kw = {"device": x.device, "dtype": x.dtype, "single_grouped_weight": not per_group}
        self.fc1 = ops.GroupedLinear(s.E, s.H, 2 * s.F, bias=False, **kw)
        self.fc2 = ops.GroupedLinear(s.E, s.F, s.H, bias=False, **kw)
        self.mlp = te_seq.Sequential(self.fc1, ops.SwiGLU(), self.fc2)
        _load_weights(self.fc1, case.w1)
        _load_weights(self.fc2, case.w2)
        self.x = x.clone().requires_grad_()
        self.y: Tensor | None = None

    def forward(self) -> Tensor:
        with te_seq.backend(self.backend):
            return self.mlp(self.x, self.case.split_sizes, self.case.split_sizes)

    def forward_backward(self) -> None:
        for p in [self.x, *self.mlp.parameters()]:
            p.grad = None
        self.y = self.forward()
        with te_seq.backend(self.backend):
            self.y.backward(self.case.dy)

    def outputs(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.y, self.x.grad, _stacked_grad(self.fc1), _stacked_grad(self.fc2)

    def plan(self) -> str:
        plan = self.mlp.fusion_plan()
        steps = getattr(plan, "forward", []) or []
        return " ".join(f"{st.name}@{st.backend}" for st in steps)


class CompiledTeSeqVariant(TeSeqVariant):
    """TeSeqVariant through torch.compile(fullgraph=True); `mode` "default" or "reduce-overhead"
    (CUDA graphs: each call marks a new step, outputs are copied out of the graph's memory)."""

    def __init__(self, case: Case, backend: str, mode: str, compiler: str) -> None:
        super().__init__(case, backend)
        self.mode = mode
        self.name += ":compiled" + ("-ro" if mode == "reduce-overhead" else "")
        kwargs = {"mode": mode} if mode != "default" else {"backend": compiler}
        self.compiled = torch.compile(self.mlp, fullgraph=True, **kwargs)

    def forward(self) -> Tensor:
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with te_seq.backend(self.backend):
            return self.compiled(self.x, self.case.split_sizes, self.case.split_sizes)


def _per_group(linear: torch.nn.Module) -> bool:
    return hasattr(linear, "weight0")


def _group_weights(linear: torch.nn.Module) -> list[Tensor]:
    """weight0..weight{E-1} ([out, in] each) or the single grouped weight [E, out, in]."""
    if _per_group(linear):
        return [getattr(linear, f"weight{i}") for i in range(linear.num_groups)]
    return [linear.weight]


@torch.no_grad()
def _load_weights(linear: torch.nn.Module, w: Tensor) -> None:
    """w [E, out, in] into the op's parameters, whichever layout it uses."""
    for param, src in zip(_group_weights(linear), w.unbind(0) if _per_group(linear) else [w]):
        param.copy_(src)


def _stacked_grad(linear: torch.nn.Module) -> Tensor:
    grads = [w.grad for w in _group_weights(linear)]
    return torch.stack(grads) if _per_group(linear) else grads[0]  # [E, out, in]


# --------------------------------------------------------------------------- building variants


def build_variants(
    case: Case,
    backends: list[str],
    peers: list[str],
    compile_modes: tuple[str, ...] = (),
    compiler: str = "inductor",
) -> tuple[list[Variant], list[Result]]:
    """The variants that can run here, and a skipped Result (with the reason) for the others
    (`compile_modes`: torch.compile modes of the compiled te_seq variants, `compiler` the
    torch.compile backend of mode "default")."""
    variants: list[Variant] = []
    skipped: list[Result] = []

    def attempt(name: str, make: Callable[[], Variant]) -> None:
        try:
            variants.append(make())
        except Exception as exc:  # noqa: BLE001 - a variant that cannot be built is reported
            skipped.append(Result(case.name, "both", name, note=_why(exc)))

    for peer in peers:
        if peer == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
            skipped.append(Result(case.name, "both", peer, note="torch has no _grouped_mm"))
        elif peer in ("grouped_mm", "loop"):
            attempt(
                peer, lambda p=peer: (GroupedMMVariant if p == "grouped_mm" else LoopVariant)(case)
            )
    s = case.shape
    for backend in backends:
        if backend == "reference" and s.M * s.H * s.F > REFERENCE_MAX_MHF:
            note = "reference backend skipped for big shapes (host loop)"
            skipped.append(Result(case.name, "both", f"te_seq:{backend}", note=note))
            continue
        if backend == "cute" and case.x.device.type != "cuda":
            note = "the cute kernels need CUDA data (this run is on the CPU)"
            skipped += [
                Result(case.name, "both", f"{kind}:cute", note=note)
                for kind in ("te_seq", "kernels")
            ]
            continue
        reason = _te_seq_unavailable(backend)
        if reason:
            skipped.append(Result(case.name, "both", f"te_seq:{backend}", note=reason))
        else:
            attempt(f"te_seq:{backend}", lambda b=backend: TeSeqVariant(case, b))
            for mode in compile_modes:
                attempt(
                    f"te_seq:{backend}:compiled" + ("-ro" if mode == "reduce-overhead" else ""),
                    lambda b=backend, m=mode: CompiledTeSeqVariant(case, b, m, compiler),
                )
            if backend == "cute":
                attempt("te_seq:cute:per-group", lambda: TeSeqVariant(case, "cute", True))
        attempt(f"kernels:{backend}", lambda b=backend: _kernels_variant(case, b))
    return variants, skipped


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]


def _te_seq_unavailable(backend: str) -> str:
    if te_seq is None:
        return TE_SEQ_ERROR
    try:
        with te_seq.backend(backend):
            return ""
    except Exception as exc:  # noqa: BLE001 - RuntimeError says why the backend is unavailable
        return _why(exc)


def _kernels_variant(case: Case, backend: str) -> Variant:
    """Raises (with the reason) when the backend is not registered, not available or lacks a
    grouped GEMM kernel."""
    import importlib

    kernels = importlib.import_module("te_seq.kernels")
    impl = kernels.get_backend(backend)
    ok, reason = impl.available()
    if not ok:
        raise RuntimeError(reason)
    missing = [f for f in ("grouped_mm", "grouped_wgrad") if not impl.implements(f)]
    if missing:
        raise RuntimeError(f"backend {backend!r} has no {', '.join(missing)}")
    return KernelsVariant(case, backend, impl, kernels.GluSpec("silu"))


# --------------------------------------------------------------------------- checking


@dataclass
class Check:
    ok: bool
    max_rel_err: float | None
    note: str = ""
    first_call_s: float | None = None  # cold: includes compiling kernels on first use


def check_variants(variants: list[Variant], dtype: torch.dtype) -> dict[str, Check]:
    """Run every variant once (forward, forward+backward) and compare all outputs with the first
    variant that ran; a variant that fails or disagrees is not timed."""
    tol = CHECK_TOL.get(dtype, 1e-4)
    ref: tuple[Tensor, ...] | None = None
    ref_name = ""
    checks: dict[str, Check] = {}
    for v in variants:
        t0 = time.perf_counter()
        try:
            outs = _run_for_check(v)
        except Exception as exc:  # noqa: BLE001 - reported, not timed
            checks[v.name] = Check(False, None, f"failed: {_why(exc)}")
            _free_memory()
            continue
        first_call_s = time.perf_counter() - t0
        if ref is None:
            ref, ref_name = outs, v.name
            checks[v.name] = Check(True, 0.0, "checking reference", first_call_s)
            continue
        err = max(rel_err(o, r) for o, r in zip(outs, ref))
        ok = err <= tol
        note = "" if ok else f"MISMATCH vs {ref_name}: {err:.2e} > {tol}"
        checks[v.name] = Check(ok, err, note, first_call_s)
        del outs
    return checks


def _run_for_check(v: Variant) -> tuple[Tensor, ...]:
    """(y of forward, y, dx, dW1, dW2 of forward+backward), detached copies."""
    with torch.no_grad():
        y_fwd = v.forward().detach().clone()  # a copy: CUDA-graph outputs are reused
    v.forward_backward()
    outs = (y_fwd, *(t.detach() for t in v.outputs()))
    if y_fwd.is_cuda:
        torch.cuda.synchronize()
    return outs


def _free_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- timing


def _flops(shape: Shape, mode: str) -> float:
    return (6 if mode == "fwd" else 18) * shape.M * shape.H * shape.F


def _mode_fn(v: Variant, mode: str) -> Callable[[], object]:
    if mode == "fwd":

        def fwd() -> object:
            with torch.no_grad():
                return v.forward()

        return fwd
    return v.forward_backward


def measure_case(
    case: Case,
    variants: list[Variant],
    checks: dict[str, Check],
    args: argparse.Namespace,
    peak: float,
) -> list[Result]:
    results = []
    ready = [v for v in variants if checks[v.name].ok]
    for mode in args.modes:
        fns = {v.name: _mode_fn(v, mode) for v in ready}
        runs = _time_all(case.name, mode, fns, args, args.burst)
        latency = _time_all(case.name, mode, fns, args, 1) if args.burst > 1 else runs
        for v in variants:
            chk = checks[v.name]
            r = Result(case.name, mode, v.name, "failed", max_rel_err=chk.max_rel_err)
            r.first_call_s = chk.first_call_s
            r.note = "; ".join(n for n in (chk.note, v.note, _plan_note(v)) if n)
            if isinstance(runs.get(v.name), list) and runs[v.name]:
                summarize(r, runs[v.name], _flops(case.shape, mode), peak)
                r.status = "ok"
                if isinstance(latency.get(v.name), list) and latency[v.name]:
                    r.latency_runs = [round(t, 5) for t in latency[v.name]]
                    r.latency_ms = sorted(latency[v.name])[len(latency[v.name]) // 2]
                r.host_ms = time_host(fns[v.name], args.iters, args.device)
            elif v.name in runs:
                r.note = f"timing failed: {runs[v.name]}"
            results.append(r)
            _progress(r)
    return results


def _time_all(
    shape: str,
    mode: str,
    fns: dict[str, Callable[[], object]],
    args: argparse.Namespace,
    burst: int,
) -> dict:
    """Interleaved runs of every variant, or (if that fails) of each alone to find the culprit."""
    try:
        return time_interleaved(fns, args.iters, args.warmup, args.device, burst)
    except Exception as exc:  # noqa: BLE001
        print(f"[{shape}] {mode}: interleaved timing failed ({_why(exc)}); timing alone")
        return _time_each(fns, args, burst)


def _time_each(fns: dict[str, Callable[[], object]], args: argparse.Namespace, burst: int) -> dict:
    out: dict[str, object] = {}
    for name, fn in fns.items():
        try:
            out[name] = time_interleaved({name: fn}, args.iters, args.warmup, args.device, burst)[
                name
            ]
        except Exception as exc:  # noqa: BLE001
            out[name] = _why(exc)
            _free_memory()
    return out


def _plan_note(v: Variant) -> str:
    if not isinstance(v, TeSeqVariant):
        return ""
    try:
        return f"plan: {v.plan()}"
    except Exception as exc:  # noqa: BLE001 - the plan is informative only
        return f"plan unavailable ({_why(exc)})"


def _progress(r: Result) -> None:
    if r.ms is None:
        print(f"[{r.shape}] {r.mode:8} {r.variant:18} not timed  {r.note}", flush=True)
        return
    print(
        f"[{r.shape}] {r.mode:8} {r.variant:18} {r.ms:9.3f} ms {r.tflops:8.1f} TFLOP/s "
        f"{r.pct_peak or 0:5.1f}% of peak  err {r.max_rel_err:.1e}  {r.note}",
        flush=True,
    )


# --------------------------------------------------------------------------- main


def run_shape(name: str, args: argparse.Namespace, peak: float) -> tuple[list[Result], dict]:
    case = make_case(name, args.device, args.dtype, seed=args.seed)
    s = case.shape
    nonzero = [n for n in case.sizes if n]
    info = {**s.__dict__, "sizes": case.sizes, "empty_experts": s.E - len(nonzero)}
    print(
        f"[{name}] E={s.E} H={s.H} F={s.F} M={s.M} skewed={s.skewed} "
        f"empty={info['empty_experts']} max={max(case.sizes)}",
        flush=True,
    )
    variants, skipped = build_variants(
        case, args.backends, args.peers, args.compile, args.compile_backend
    )
    for r in skipped:
        _progress(r)
    checks = check_variants(variants, args.dtype)
    results = measure_case(case, variants, checks, args, peak)
    del variants, case
    _free_memory()
    return skipped + results, info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=None, help="comma list of " + ",".join(SHAPES))
    p.add_argument("--backends", default="torch,cute", help="te_seq backends: torch,cute,reference")
    p.add_argument("--peers", default="grouped_mm,loop", help="baselines: grouped_mm,loop")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--iters", type=int, default=20, help="timed runs per variant (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--burst",
        type=int,
        default=10,
        help="back-to-back calls per timed run (steady state); the JSON also holds each "
        "variant's single-call latency (from an idle GPU) when > 1",
    )
    p.add_argument(
        "--compile",
        default="",
        help="also time te_seq through torch.compile(fullgraph=True), per mode: "
        "default,reduce-overhead",
    )
    p.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of --compile default (aot_eager: fast CPU dry runs)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="benchmarks/results/grouped_mlp.json")
    p.add_argument("--png", default="benchmarks/results/grouped_mlp.png")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU in float32")
    args = p.parse_args(argv)
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    args.shapes = split(args.shapes or ("T,U" if args.dry_run else "A,B,Q,Z"))
    args.backends, args.peers, args.modes = (
        split(args.backends),
        split(args.peers),
        split(args.modes),
    )
    args.compile = tuple(split(args.compile))
    unknown = (
        [s for s in args.shapes if s not in SHAPES]
        + [m for m in args.modes if m not in ("fwd", "fwd+bwd")]
        + [c for c in args.compile if c not in ("default", "reduce-overhead")]
    )
    if unknown:
        p.error(f"unknown shapes/modes/compile modes: {unknown}")
    cuda = torch.cuda.is_available() and not args.dry_run
    args.device = torch.device("cuda" if cuda else "cpu")
    args.dtype = torch.bfloat16 if cuda else torch.float32
    if args.dry_run:
        args.iters, args.warmup = min(args.iters, 3), min(args.warmup, 1)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = args.device.type == "cuda"
    if cuda and args.iters < 20:
        print(f"warning: --iters {args.iters} < 20; the protocol asks for a median of >= 20 runs")
    if not cuda and not args.dry_run:
        print("no CUDA GPU: running the tiny CPU shapes only makes sense with --dry-run")
    peak = dense_peak_tflops(args.device, args.dtype, 8192 if cuda else 256, max(20, args.iters))
    print(f"device {_device_name(args.device)}, {args.dtype}, dense peak {peak:.1f} TFLOP/s")
    if TE_SEQ_ERROR:
        print(f"te_seq variants skipped: {TE_SEQ_ERROR}")
    results, shapes = [], {}
    for name in args.shapes:
        rows, shapes[name] = run_shape(name, args, peak)
        results += rows
    print_table(results, peak, baseline="grouped_mm")
    meta = _meta(args, peak, shapes)
    write_json(args.json, meta, results)
    write_png(args.png, [r for r in results if r.tflops], peak, f"grouped MLP, {meta['device']}")
    failed = [f"{r.shape}/{r.mode}/{r.variant}" for r in results if r.status == "failed"]
    if failed:
        print(f"FAILED (error or mismatch, not timed): {', '.join(failed)}")
    return 1 if failed else 0


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _meta(args: argparse.Namespace, peak: float, shapes: dict) -> dict[str, object]:
    return {
        "device": _device_name(args.device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": str(args.dtype),
        "iters": args.iters,
        "warmup": args.warmup,
        "burst": args.burst,
        "dense_peak_tflops": peak,
        "flops": "fwd 6*M*H*F, fwd+bwd 18*M*H*F; padding rows are not counted",
        "te_seq_error": TE_SEQ_ERROR,
        "argv": sys.argv,
        "shapes": shapes,
    }


if __name__ == "__main__":
    sys.exit(main())
