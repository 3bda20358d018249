"""Grouped MoE MLP benchmark: FC1 (H -> 2F) -> ScaledSwiGLU -> FC2 (F -> H), forward and
forward+backward, te_seq against the peers a user would otherwise run.

Shape legend: M routed rows (tokens, already permuted by expert), E experts, H hidden, F ffn.
The activation is ScaledSwiGLU by default, a = silu(gate) · up · probs[:, None] with fp32 router
probs (what MoE layers run); `--act swiglu` runs without probs. FLOPs: forward 6·M·H·F, every
forward+backward mode 18·M·H·F (padding rows are waste, never FLOPs; FP8 counts the same).

Variants, all in this process on the same random data, each checked against an fp32 reference
(mlp_case.reference_outputs) before it is timed:
  te_seq:<backend>     te_seq.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear) under
                       te_seq.backend(); `:per-group` with one weight per expert
  te_seq:<backend>:compiled[-ro]   the same Sequential through torch.compile(fullgraph=True),
                       with `--compile default` / `reduce-overhead` (CUDA graphs)
  te_seq:<backend>:fp8[:tm-fwd|:hp-wgrad[:requant]]   under Float8RowwiseScaling (`--fp8`);
                       `:tm-fwd` with te_seq.config.set_fp8_token_major_input(True);
                       `:hp-wgrad` with the recipe's fp8_wgrad=False (wgrads in bf16);
                       `:requant` with cache_weights=False: the weights quantized on every
                       call, as after every optimizer step of a training run
  te_seq:<backend>:fp8-block[:hp-wgrad]   under Float8BlockScaling (`--fp8-block`)
  te_seq:cute:coop     the cute MLP with TE_SEQ_PINGPONG=0 (`--pingpong`): every default tiling
                       cooperative, interleaved with the default (ping-pong where allowed)
  te_seq:cute:NAME     the cute MLP with environment variables set while it runs
                       (`--env-variant NAME:VAR=VALUE,...`), e.g. the tiling settings of
                       te_seq/kernels/cute/launch.py: two tilings compared in one process;
                       `--env-base BASE` (repeatable) applies them to other te_seq variants
                       too, e.g. te_seq:cute:fp8:hp-wgrad -> te_seq:cute:fp8:hp-wgrad:NAME
  te_seq:cute:aa       the base variant timed again with nothing changed (`--aa`): the A/A
                       yardstick of an `--env-variant` comparison (in one process two timed
                       entries of one module measured 0.2-1.7 % apart, 2026-11-29 run "n")
  te_seq:<backend>[:fp8[:hp-wgrad]]:graphed   the same Sequential captured by
                       te_seq.make_graphed_callables (`--graphed`; fresh grads): what a step
                       costs with no Python per op (FP8: weights quantized by their own graphs,
                       replayed only after a weight changes: none in this benchmark)
  kernels:<backend>    the backend's raw functionals (grouped_mm, grouped_wgrad, glu_*), unfused
  grouped_mm[_compiled], loop, torchao_fp8[_compiled]   peers.py
  quack[_tuned]        peer_quack.py
Grad modes (`--grad-mode`, grad_modes.py): fresh (default), accumulate, megatron; the compiled
te_seq variants run in those of COMPILE_MODES (compiled: fresh, accumulate; compiled-ro: fresh).
`vs` = the best bf16 peer's time / the variant's, same shape and mode (mlp_report.py, which also
has the bytes-moved lower bound printed next to each time). Columns: ms (steady state, bursts),
latency (one call from an idle GPU to its end), host (te_seq variants: one call's host time until
it returns, kernels not waited for: the Python cost per call that compiling removes).

  python benchmarks/bench_grouped_mlp.py --shapes A,B,Q,Z --grad-mode fresh,megatron
  python benchmarks/bench_grouped_mlp.py --shapes A,B,Q,Z --compile default,reduce-overhead
  python benchmarks/bench_grouped_mlp.py --dry-run   # tiny shapes, CPU, float32: checks the script
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, for te_seq
from _common import Result, copy_bandwidth_gbs, dense_peak_tflops, write_json, write_png  # noqa: E402
from grad_modes import GRAD_MODES, GradState, mode_label  # noqa: E402
from mlp_case import (  # noqa: E402
    ACTS,
    SHAPES,
    AutogradVariant,
    Case,
    Variant,
    make_case,
    reference_outputs,
)
from mlp_measure import check_variants, free_memory, measure_case, progress, why  # noqa: E402
from mlp_report import annotate, bytes_bound, print_table  # noqa: E402
from peer_quack import QuackPeer  # noqa: E402
from peers import FP8_TOL, GroupedMMPeer, LoopPeer, SharedWeights, TorchaoFP8Peer  # noqa: E402

try:  # without te_seq the te_seq variants are skipped, said why
    import te_seq
    from te_seq import ops

    TE_SEQ_ERROR = ""
except Exception as exc:  # noqa: BLE001 - any import failure just disables those variants
    te_seq, ops = None, None
    TE_SEQ_ERROR = f"te_seq not importable: {type(exc).__name__}: {exc}"

REFERENCE_MAX_MHF = 1 << 28  # the reference backend loops on the host: tiny shapes only
PEER_FAMILIES = ("grouped_mm", "loop", "quack", "torchao_fp8")
# --compile mode -> (variant name suffix, the grad modes it runs in): accumulate_into_main_grad
# (megatron) runs eagerly at a graph break, which fullgraph=True forbids; under CUDA graphs a
# wgrad lives in the graph's memory, overwritten by the next replay before accumulate adds to it.
COMPILE_MODES = {
    "default": ("compiled", ("fresh", "accumulate")),
    "reduce-overhead": ("compiled-ro", ("fresh",)),
}


# --------------------------------------------------------------------------- te_seq variants


class KernelsVariant(Variant):
    """A backend's raw kernels (grouped_mm / grouped_wgrad) with its GLU maths (glu_forward /
    glu_backward: on the GPU backends the reference compiled on CUDA), not fused into the GEMMs.
    It owns no parameters (its wgrads are outputs): run in the fresh grad mode only."""

    def __init__(self, case: Case, backend: str, impl: object, glu: object) -> None:
        self.name = f"kernels:{backend}"
        self.case, self.k, self.glu = case, impl, glu  # impl: a te_seq.kernels.Backend
        self.result: tuple[Tensor, ...] | None = None

    def _fc1(self) -> tuple[Tensor, Tensor]:
        c = self.case
        h = self.k.grouped_mm(c.x, c.w1.transpose(1, 2), c.offs)  # [M, 2F]; H_e = X_e W1_eᵀ
        return h, self.k.glu_forward(h, self.glu, c.probs)  # [M, 2F], a (· probs) [M, F]

    def forward(self) -> Tensor:
        _, act = self._fc1()
        return self.k.grouped_mm(act, self.case.w2.transpose(1, 2), self.case.offs)  # [M, H]

    def forward_backward(self) -> None:
        c, k = self.case, self.k
        self.result = None
        h, act = self._fc1()
        y = k.grouped_mm(act, c.w2.transpose(1, 2), c.offs)  # [M, H]
        da = k.grouped_mm(c.dy, c.w2, c.offs)  # [M, F]; dA_e = dY_e W2_e
        dh, dprobs = k.glu_backward(h, da, self.glu, c.probs)  # [M, 2F], [M] or None
        dw2 = k.grouped_wgrad(c.dy, act, c.offs)  # [E, H, F]; dW2_e = dY_eᵀ A_e
        dx = k.grouped_mm(dh, c.w1, c.offs)  # [M, H]; dX_e = dH_e W1_e
        dw1 = k.grouped_wgrad(dh, c.x, c.offs)  # [E, 2F, H]; dW1_e = dH_eᵀ X_e
        self.result = (y, dx, dw1, dw2) + ((dprobs,) if c.uses_probs else ())

    def outputs(self) -> tuple[Tensor, ...]:
        return self.result


class TeSeqVariant(AutogradVariant):
    """te_seq.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)(x, split_sizes, probs,
    split_sizes) (SwiGLU and no probs with `--act swiglu`); in the megatron grad mode the linears
    run with accumulate_into_main_grad=True."""

    times_host = True

    def __init__(self, case: Case, backend: str, grad_mode: str, per_group: bool = False) -> None:
        super().__init__(case)
        suffix = ":per-group" if per_group else ""
        self.name, self.backend = f"te_seq:{backend}{suffix}", backend
        s, x = case.shape, case.x
        # The default layout is one [E, out, in] weight per linear (single_grouped_weight): with
        # E Parameters (weight0..), autograd accumulates E gradients one by one (host time).
        kw = {
            "device": x.device,
            "dtype": x.dtype,
            "single_grouped_weight": not per_group,
            "accumulate_into_main_grad": grad_mode == "megatron",
        }
        self.fc1 = ops.GroupedLinear(s.E, s.H, 2 * s.F, bias=False, **kw)
        self.fc2 = ops.GroupedLinear(s.E, s.F, s.H, bias=False, **kw)
        act = ops.ScaledSwiGLU() if case.uses_probs else ops.SwiGLU()
        self.mlp = te_seq.Sequential(self.fc1, act, self.fc2)
        _load_weights(self.fc1, case.w1)
        _load_weights(self.fc2, case.w2)
        self.per_group, self.n1 = per_group, len(_group_weights(self.fc1))
        self.weights = GradState(grad_mode, _group_weights(self.fc1) + _group_weights(self.fc2))

    def run(self, x: Tensor, probs: Tensor | None) -> Tensor:
        sizes = self.case.split_sizes
        extra = (sizes, probs, sizes) if probs is not None else (sizes, sizes)
        with te_seq.backend(self.backend):
            return self.mlp(x, *extra)

    def forward_backward(self) -> None:
        with te_seq.backend(self.backend):
            super().forward_backward()

    def stacked_wgrads(self, grads: list[Tensor]) -> tuple[Tensor, Tensor]:
        g1, g2 = grads[: self.n1], grads[self.n1 :]
        return (torch.stack(g1), torch.stack(g2)) if self.per_group else (g1[0], g2[0])

    def plan(self) -> str:
        plan = self.mlp.fusion_plan()
        steps = getattr(plan, "forward", []) or []
        return " ".join(f"{st.name}@{st.backend}" for st in steps)


class _EnvMixin:
    """A te_seq variant's own module, weights and inputs run with environment variables set
    while it runs (`--env-variant`, `--pingpong`; the bases: `--env-base`): the default tilings
    read TE_SEQ_PINGPONG, TE_SEQ_PINGPONG_MAX_K, ... (te_seq/kernels/cute/launch.py), so two
    tilings compare in the same process, interleaved, on the same memory. (Separately built
    copies of one configuration measured up to 9 % apart on Q in one process, 2026-11-25:
    benchmarks/README.md.) Mixed into the base's own class, so an FP8 base keeps its recipe."""

    def __init__(self, base: TeSeqVariant, name: str, env: dict[str, str]) -> None:
        vars(self).update(vars(base))  # shared: the module, its weights, x, probs and dy
        self.name, self.env = f"{base.name}:{name}", env
        self.note = " ".join(f"{k}={v}" for k, v in env.items()) or AA_NOTE

    def run(self, x: Tensor, probs: Tensor | None) -> Tensor:
        with _environment(self.env):
            return super().run(x, probs)

    def forward_backward(self) -> None:
        with _environment(self.env):
            super().forward_backward()


class TeSeqEnvVariant(_EnvMixin, TeSeqVariant):
    """`_EnvMixin` on the bf16 te_seq variant."""


_ENV_CLASSES: dict[type, type] = {TeSeqVariant: TeSeqEnvVariant}


def env_variant(base: TeSeqVariant, name: str, env: dict[str, str]) -> TeSeqVariant:
    """``base`` (any te_seq variant) as `NAME` with ``env`` set while it runs (`_EnvMixin`)."""
    kind = type(base)
    if kind not in _ENV_CLASSES:
        _ENV_CLASSES[kind] = type(f"Env{kind.__name__}", (_EnvMixin, kind), {})
    return _ENV_CLASSES[kind](base, name, env)


AA_NOTE = "A/A: the base again, nothing set"


def pingpong_flip() -> tuple[str, dict[str, str]]:
    """`--pingpong`: the other ping-pong setting, te_seq:cute:coop (TE_SEQ_PINGPONG=0, every
    default tiling cooperative) where ping-pong is the default, else te_seq:cute:pp."""
    from te_seq.kernels.cute.launch import pingpong_by_default

    return ("coop", {"TE_SEQ_PINGPONG": "0"}) if pingpong_by_default() else (
        "pp", {"TE_SEQ_PINGPONG": "1"})


def parse_env_variant(text: str) -> tuple[str, dict[str, str]]:
    """"NAME:VAR=VALUE[,VAR=VALUE...]" -> (NAME, {VAR: VALUE})."""
    name, sep, body = text.partition(":")
    pairs = [item.partition("=") for item in body.split(",") if item]
    if not sep or not name or not pairs or any(not k or not eq for k, eq, _ in pairs):
        raise ValueError(f"--env-variant wants NAME:VAR=VALUE[,VAR=VALUE...], got {text!r}")
    return name, {k: v for k, _, v in pairs}


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """``env`` set while it runs; the cute tilings re-read at entry and exit."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _refresh_tilings()
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
        _refresh_tilings()


def _refresh_tilings() -> None:
    """``te_seq.kernels.cute.refresh_tiling_settings()`` where the cute package imports."""
    try:
        from te_seq.kernels.cute import refresh_tiling_settings
    except ImportError:
        return
    refresh_tiling_settings()


class TeSeqFP8Variant(TeSeqVariant):
    """TeSeqVariant under te_seq.autocast(recipe=Float8RowwiseScaling()) (`block`:
    Float8BlockScaling()): real FP8 GEMMs where the backend has them, the rest emulated
    (docs/fp8.md says which). Checked with the FP8 tolerance; never a bf16 peer."""

    precision, check_tol = "fp8", FP8_TOL

    def __init__(self, case: Case, backend: str, grad_mode: str,
                 token_major_input: bool = False, block: bool = False,
                 hp_wgrad: bool = False, requant: bool = False) -> None:
        super().__init__(case, backend, grad_mode)
        kind = "fp8-block" if block else "fp8"
        flags = ((":tm-fwd", token_major_input), (":hp-wgrad", hp_wgrad), (":requant", requant))
        self.name = f"te_seq:{backend}:{kind}" + "".join(f for f, on in flags if on)
        self.recipe = (te_seq.recipe.Float8BlockScaling if block
                       else te_seq.recipe.Float8RowwiseScaling)(fp8_wgrad=not hp_wgrad,
                                                                cache_weights=not requant)
        self.token_major_input = token_major_input  # te_seq.config's switch while it runs

    def run(self, x: Tensor, probs: Tensor | None) -> Tensor:
        with te_seq.autocast(recipe=self.recipe), self._token_major():
            return super().run(x, probs)

    def forward_backward(self) -> None:
        with te_seq.backend(self.backend), te_seq.autocast(recipe=self.recipe), \
                self._token_major():
            AutogradVariant.forward_backward(self)

    @contextlib.contextmanager
    def _token_major(self):
        te_seq.config.set_fp8_token_major_input(self.token_major_input)
        try:
            yield
        finally:
            te_seq.config.set_fp8_token_major_input(False)


class GraphedTeSeqVariant(TeSeqVariant):
    """TeSeqVariant captured by te_seq.make_graphed_callables (a forward and a backward CUDA
    graph, replayed per call: no Python per op), bf16 or under Float8RowwiseScaling (`fp8`).
    Fresh grad mode only; its outputs live in the graphs' memory until the next replay."""

    def __init__(self, case: Case, backend: str, fp8: bool = False, hp_wgrad: bool = False,
                 ) -> None:
        super().__init__(case, backend, "fresh")
        self.name = graphed_name(backend, fp8, hp_wgrad)
        self.recipe = (te_seq.recipe.Float8RowwiseScaling(fp8_wgrad=not hp_wgrad) if fp8
                       else None)
        if fp8:
            self.precision, self.check_tol = "fp8", FP8_TOL
        x = self.x.detach().clone().requires_grad_()
        probs = None if self.probs is None else self.probs.detach().clone().requires_grad_()
        with self._contexts():
            self.graphed = te_seq.make_graphed_callables(self.mlp, (x, *self._extra(probs)))

    def _extra(self, probs: Tensor | None) -> tuple:
        sizes = self.case.split_sizes
        return (sizes, probs, sizes) if probs is not None else (sizes, sizes)

    def _contexts(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(te_seq.backend(self.backend))
        stack.enter_context(te_seq.autocast(enabled=self.recipe is not None, recipe=self.recipe))
        return stack

    def run(self, x: Tensor, probs: Tensor | None) -> Tensor:
        with self._contexts():
            return self.graphed(x, *self._extra(probs))

    def forward_backward(self) -> None:
        with self._contexts():
            AutogradVariant.forward_backward(self)


class CompiledTeSeqVariant(TeSeqVariant):
    """TeSeqVariant through torch.compile(fullgraph=True): mode "default" with the `compiler`
    backend (--compile-backend), "reduce-overhead" inductor with CUDA graphs, where every call
    starts a new step (cudagraph_mark_step_begin) and its outputs stay valid only until the next
    call (the check copies y). Grad modes: COMPILE_MODES (fresh always)."""

    def __init__(self, case: Case, backend: str, grad_mode: str, mode: str, compiler: str) -> None:
        suffix, grad_modes = COMPILE_MODES[mode]
        if grad_mode not in grad_modes:
            raise ValueError(f"--compile {mode} runs in grad modes {grad_modes}, not {grad_mode!r}")
        super().__init__(case, backend, grad_mode)
        self.name, self.mode = f"{self.name}:{suffix}", mode
        kwargs = {"backend": compiler} if mode == "default" else {"mode": mode}
        self.compiled = torch.compile(_own_code(_call, self.name), fullgraph=True, **kwargs)

    def run(self, x: Tensor, probs: Tensor | None) -> Tensor:
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        sizes = self.case.split_sizes
        extra = (sizes, probs, sizes) if probs is not None else (sizes, sizes)
        with te_seq.backend(self.backend):
            return self.compiled(self.mlp, x, *extra)


def _call(mlp: torch.nn.Module, *args: object) -> Tensor:
    return mlp(*args)


def _own_code(fn: Callable, tag: str) -> Callable:
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs per code object, with
    a recompile limit per code object and every cached graph's guards checked in turn on each
    call: compiling the shared Sequential.forward of every variant would pile all of their
    graphs (3 per variant: the no_grad forward again once the training plan was added) onto one
    code object, past the limit, and add the others' guard checks to each call's host time."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}".replace(":", "_").replace("-", "_"))
    return types.FunctionType(code, fn.__globals__, code.co_name)


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


# --------------------------------------------------------------------------- building variants


class _Builder:
    """Builds the variants of one case and grad mode; a variant that cannot be built becomes a
    skipped Result with the reason (a missing package, no CUDA, unsupported sizes)."""

    def __init__(self, case: Case, grad_mode: str) -> None:
        self.case, self.grad_mode = case, grad_mode
        self.fp8 = False  # also te_seq:<backend>:fp8 (--fp8)
        self.fp8_block = False  # also te_seq:<backend>:fp8-block (--fp8-block)
        self.env_variants: list[tuple[str, dict]] = []  # --pingpong, --env-variant
        self.env_bases: list[str] = ["te_seq:cute"]  # the variants they apply to (--env-base)
        self.variants: list[Variant] = []
        self.skipped: list[Result] = []

    def attempt(self, name: str, make: Callable[[], Variant]) -> None:
        try:
            self.variants.append(make())
        except Exception as exc:  # noqa: BLE001 - a variant that cannot be built is reported
            self.skip(name, why(exc))

    def skip(self, name: str, note: str, mode: str = "both") -> None:
        self.skipped.append(Result(self.case.name, mode, name, note=note))


def build_variants(
    case: Case, args: argparse.Namespace, grad_mode: str
) -> tuple[list[Variant], list[Result]]:
    """The variants that can run here, and a skipped Result (with the reason) for the others."""
    b = _Builder(case, grad_mode)
    b.fp8, b.fp8_block = args.fp8, args.fp8_block
    b.env_variants = ([pingpong_flip()] if args.pingpong else []) + [
        parse_env_variant(text) for text in args.env_variant] + ([("aa", {})] if args.aa else [])
    b.env_bases = args.env_base or ["te_seq:cute"]
    _build_te_seq(b, args.backends)
    _build_env_variants(b)
    _build_graphed_te_seq(b, args)
    _build_compiled_te_seq(b, args)
    _build_peers(b, args)
    return b.variants, b.skipped


def _build_te_seq(b: _Builder, backends: list[str]) -> None:
    case, s = b.case, b.case.shape
    for backend in backends:
        if backend == "reference" and s.M * s.H * s.F > REFERENCE_MAX_MHF:
            b.skip(f"te_seq:{backend}", "reference backend skipped for big shapes (host loop)")
            continue
        if backend == "cute" and case.x.device.type != "cuda":
            for kind in ("te_seq", "kernels"):
                b.skip(f"{kind}:cute", "the cute kernels need CUDA data (this run is on the CPU)")
            continue
        reason = _te_seq_unavailable(backend)
        if reason:
            b.skip(f"te_seq:{backend}", reason)
        else:
            b.attempt(f"te_seq:{backend}", lambda k=backend: TeSeqVariant(case, k, b.grad_mode))
            if backend == "cute":
                name = "te_seq:cute:per-group"
                b.attempt(name, lambda: TeSeqVariant(case, "cute", b.grad_mode, per_group=True))
            if b.fp8:
                b.attempt(f"te_seq:{backend}:fp8",
                          lambda k=backend: TeSeqFP8Variant(case, k, b.grad_mode))
                b.attempt(f"te_seq:{backend}:fp8:tm-fwd",
                          lambda k=backend: TeSeqFP8Variant(case, k, b.grad_mode, True))
                b.attempt(f"te_seq:{backend}:fp8:hp-wgrad",
                          lambda k=backend: TeSeqFP8Variant(case, k, b.grad_mode, hp_wgrad=True))
                b.attempt(f"te_seq:{backend}:fp8:hp-wgrad:requant",
                          lambda k=backend: TeSeqFP8Variant(case, k, b.grad_mode, hp_wgrad=True,
                                                            requant=True))
            if b.fp8_block:
                b.attempt(f"te_seq:{backend}:fp8-block",
                          lambda k=backend: TeSeqFP8Variant(case, k, b.grad_mode, block=True))
                b.attempt(f"te_seq:{backend}:fp8-block:hp-wgrad",
                          lambda k=backend: TeSeqFP8Variant(case, k, b.grad_mode, block=True,
                                                            hp_wgrad=True))
        if b.grad_mode == "fresh":  # raw kernels own no parameters: no grad modes
            b.attempt(f"kernels:{backend}", lambda k=backend: _kernels_variant(case, k))


def _build_env_variants(b: _Builder) -> None:
    """BASE:NAME for every `--env-variant` NAME and `--env-base` BASE built in this run (a
    BASE not built is reported as skipped, said why)."""
    if not b.env_variants:
        return
    built = {v.name: v for v in b.variants}
    for base_name in b.env_bases:
        base = built.get(base_name)
        for name, env in b.env_variants:
            if base is None:
                b.skip(f"{base_name}:{name}", f"--env-base {base_name} is not a variant of "
                       f"this run (built: {', '.join(built)})")
            else:
                b.attempt(f"{base_name}:{name}", lambda n=name, e=env: env_variant(base, n, e))


def graphed_name(backend: str, fp8: bool, hp_wgrad: bool) -> str:
    return f"te_seq:{backend}{':fp8' if fp8 else ''}{':hp-wgrad' if hp_wgrad else ''}:graphed"


def _build_graphed_te_seq(b: _Builder, args: argparse.Namespace) -> None:
    """te_seq:<backend>[:fp8[:hp-wgrad]]:graphed (--graphed) for the backends whose eager
    variant was built, in the fresh grad mode (skipped, said why, elsewhere)."""
    built = {v.name for v in b.variants}
    recipes = ((False, False), (True, False), (True, True)) if b.fp8 else ((False, False),)
    for backend in args.backends if args.graphed else ():
        for fp8, hp_wgrad in recipes:
            name = graphed_name(backend, fp8, hp_wgrad)
            if f"te_seq:{backend}" not in built:
                continue
            if b.case.x.device.type != "cuda":
                b.skip(name, "CUDA graphs need CUDA data (this run is on the CPU)")
            elif b.grad_mode != "fresh":
                b.skip(name, "--graphed runs in the fresh grad mode only", mode_label(b.grad_mode))
            else:
                b.attempt(name, lambda k=backend, f=fp8, h=hp_wgrad:
                          GraphedTeSeqVariant(b.case, k, f, h))


def _build_compiled_te_seq(b: _Builder, args: argparse.Namespace) -> None:
    """te_seq:<backend>:compiled[-ro] per --compile mode, for the backends whose eager variant
    was built, in the grad modes that mode runs in (COMPILE_MODES; skipped, said why, in others)."""
    built = {v.name for v in b.variants}
    for backend in args.backends:
        if f"te_seq:{backend}" not in built:
            continue
        for mode in args.compile:
            suffix, grad_modes = COMPILE_MODES[mode]
            name = f"te_seq:{backend}:{suffix}"
            if b.grad_mode not in grad_modes:
                note = f"--compile {mode} runs in grad modes {', '.join(grad_modes)} only"
                b.skip(name, note, mode_label(b.grad_mode))
                continue
            compiler = args.compile_backend
            b.attempt(
                name,
                lambda k=backend, m=mode: CompiledTeSeqVariant(b.case, k, b.grad_mode, m, compiler),
            )


def _build_peers(b: _Builder, args: argparse.Namespace) -> None:
    case, mode = b.case, b.grad_mode
    shared = SharedWeights(case, mode)  # grouped_mm and torchao peers share one set of weights
    compiled = args.compile_backend
    for family in args.peers:
        if family == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
            for name in ("grouped_mm", "grouped_mm_compiled"):
                b.skip(name, f"torch {torch.__version__} has no _grouped_mm")
        elif family == "grouped_mm":
            b.attempt("grouped_mm", lambda: GroupedMMPeer(case, shared, None))
            b.attempt("grouped_mm_compiled", lambda: GroupedMMPeer(case, shared, compiled))
        elif family == "loop":
            b.attempt("loop", lambda: LoopPeer(case, mode))
        elif family == "quack":
            b.attempt("quack", lambda: QuackPeer(case, mode))
            if args.quack_tuned:
                b.attempt("quack_tuned", lambda: QuackPeer(case, mode, tuned=True))
        elif family == "torchao_fp8":
            b.attempt("torchao_fp8", lambda: TorchaoFP8Peer(case, shared, None))
            b.attempt("torchao_fp8_compiled", lambda: TorchaoFP8Peer(case, shared, compiled))


def _te_seq_unavailable(backend: str) -> str:
    if te_seq is None:
        return TE_SEQ_ERROR
    try:
        with te_seq.backend(backend):
            return ""
    except Exception as exc:  # noqa: BLE001 - RuntimeError says why the backend is unavailable
        return why(exc)


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


# --------------------------------------------------------------------------- main


def run_shape(name: str, args: argparse.Namespace, peak: float) -> tuple[list[Result], dict]:
    torch._dynamo.reset()  # compiled peers compile per shape, never past dynamo's recompile limit
    case = make_case(name, args.device, args.dtype, act=args.act, seed=args.seed)
    s = case.shape
    info = {**s.__dict__, "sizes": case.sizes, "empty_experts": case.sizes.count(0)}
    print(
        f"[{name}] E={s.E} H={s.H} F={s.F} M={s.M} skewed={s.skewed} jittered={s.jittered} "
        f"act={case.act} empty={info['empty_experts']} max={max(case.sizes)}",
        flush=True,
    )
    ref = tuple(t.to(case.x.dtype) for t in reference_outputs(case))
    results: list[Result] = []
    for i, grad_mode in enumerate(args.grad_modes):
        modes = [mode_label(grad_mode) if m == "fwd+bwd" else m for m in args.modes]
        modes = [m for m in modes if m != "fwd" or i == 0]  # the forward has no grad mode
        variants, skipped = build_variants(case, args, grad_mode)
        seen = {(r.variant, r.note) for r in results if r.status == "skipped"}
        skipped = [r for r in skipped if (r.variant, r.note) not in seen]  # once per shape
        for r in skipped:
            progress(r)
        checks = check_variants(variants, ref, args.dtype)
        results += skipped + measure_case(case, variants, checks, args, modes, peak)
        del variants
        free_memory()
    del case, ref
    free_memory()
    return results, info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=None, help="comma list of " + ",".join(SHAPES))
    p.add_argument("--backends", default="torch,cute", help="te_seq backends: torch,cute,reference")
    p.add_argument(
        "--peers",
        default="all",
        help=f"peer families: {','.join(PEER_FAMILIES)} or all (default); grouped_mm and "
        "torchao_fp8 run eager and compiled; one that cannot run here is skipped, said why",
    )
    p.add_argument("--quack-tuned", action="store_true", help="also quack with its autotuner")
    p.add_argument("--act", default="scaled_swiglu", choices=ACTS, help="swiglu: no router probs")
    p.add_argument("--fp8", action="store_true",
                   help="also te_seq:<backend>:fp8 (the MLP under Float8RowwiseScaling), "
                        ":fp8:tm-fwd (the same, x quantized along the tokens in forward) and "
                        ":fp8:hp-wgrad (the wgrads in bf16: fp8_wgrad=False), with :requant "
                        "(weights quantized every call, as in training)")
    p.add_argument("--fp8-block", action="store_true",
                   help="also te_seq:<backend>:fp8-block, the MLP under Float8BlockScaling, "
                        "and :fp8-block:hp-wgrad (its wgrads in bf16)")
    p.add_argument(
        "--grad-mode",
        default="fresh",
        help=f"comma list of {','.join(GRAD_MODES)} (weight gradients: grad_modes.py)",
    )
    p.add_argument("--pingpong", action="store_true",
                   help="also te_seq:cute:coop, the MLP with TE_SEQ_PINGPONG=0 (same process)")
    p.add_argument("--env-variant", action="append", default=[],
                   help="also te_seq:cute:NAME with these variables set while it runs, "
                   "NAME:VAR=VALUE[,VAR=VALUE...] (repeatable; same process)")
    p.add_argument("--aa", action="store_true",
                   help="also BASE:aa for every --env-base: the base timed again with nothing "
                   "set, the noise yardstick of the --env-variant comparisons")
    p.add_argument("--env-base", action="append", default=[],
                   help="a te_seq variant the --env-variant and --pingpong variants apply to "
                   "(repeatable; default te_seq:cute), e.g. te_seq:cute:fp8:hp-wgrad")
    p.add_argument("--graphed", action="store_true",
                   help="also te_seq:<backend>[:fp8]:graphed, captured by "
                   "te_seq.make_graphed_callables (host time out of the picture)")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument(
        "--compile",
        default="",
        help="also te_seq through torch.compile(fullgraph=True), per mode: comma list of "
        f"{','.join(COMPILE_MODES)} (variants te_seq:<backend>:compiled, :compiled-ro)",
    )
    p.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend of the compiled peers and of --compile default (default "
        "inductor; aot_eager in a dry run: no C++ toolchain needed, the same tracing and autograd)",
    )
    p.add_argument("--iters", type=int, default=20, help="timed runs per variant (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--burst",
        type=int,
        default=10,
        help="back-to-back calls per timed run (steady state); the JSON also holds each "
        "variant's single-call latency (from an idle GPU) when > 1",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="benchmarks/results/grouped_mlp.json")
    p.add_argument("--png", default="benchmarks/results/grouped_mlp.png")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU in float32")
    args = p.parse_args(argv)
    _resolve_args(p, args)
    return args


def _split(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _resolve_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.shapes = _split(args.shapes or ("T,U" if args.dry_run else "A,B,Q,Z"))
    args.peers = list(PEER_FAMILIES) if args.peers == "all" else _split(args.peers)
    args.backends, args.modes = _split(args.backends), _split(args.modes)
    args.grad_modes, args.compile = _split(args.grad_mode), _split(args.compile)
    unknown = (
        [s for s in args.shapes if s not in SHAPES]
        + [m for m in args.modes if m not in ("fwd", "fwd+bwd")]
        + [f for f in args.peers if f not in PEER_FAMILIES]
        + [g for g in args.grad_modes if g not in GRAD_MODES]
        + [c for c in args.compile if c not in COMPILE_MODES]
    )
    if unknown:
        p.error(f"unknown shapes/modes/peers/grad modes/compile modes: {unknown}")
    cuda = torch.cuda.is_available() and not args.dry_run
    args.device = torch.device("cuda" if cuda else "cpu")
    args.dtype = torch.bfloat16 if cuda else torch.float32
    args.compile_backend = args.compile_backend or ("inductor" if cuda else "aot_eager")
    if args.dry_run:
        args.iters, args.warmup = min(args.iters, 3), min(args.warmup, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = args.device.type == "cuda"
    if cuda and args.iters < 20:
        print(f"warning: --iters {args.iters} < 20; the protocol asks for a median of >= 20 runs")
    if not cuda and not args.dry_run:
        print("no CUDA GPU: running the tiny CPU shapes only makes sense with --dry-run")
    peak = dense_peak_tflops(args.device, args.dtype, 8192 if cuda else 256, max(20, args.iters))
    copy_bytes = (1 << 31) if cuda else (1 << 24)
    bandwidth = copy_bandwidth_gbs(args.device, copy_bytes, max(20, args.iters))
    print(
        f"device {_device_name(args.device)}, {args.dtype}, dense peak {peak:.1f} TFLOP/s, "
        f"copy bandwidth {bandwidth:.0f} GB/s"
    )
    if TE_SEQ_ERROR:
        print(f"te_seq variants skipped: {TE_SEQ_ERROR}")
    results, shapes = [], {}
    for name in args.shapes:
        rows, shapes[name] = run_shape(name, args, peak)
        results += rows
    annotate(results, _bounds(args, results), bandwidth)
    print_table(results, peak, bandwidth)
    meta = _meta(args, peak, bandwidth, shapes)
    write_json(args.json, meta, results)
    write_png(args.png, [r for r in results if r.tflops], peak, f"grouped MLP, {meta['device']}")
    failed = [f"{r.shape}/{r.mode}/{r.variant}" for r in results if r.status == "failed"]
    if failed:
        print(f"FAILED (error or mismatch, not timed): {', '.join(failed)}")
    return 1 if failed else 0


def _bounds(args: argparse.Namespace, results: list[Result]) -> dict[tuple[str, str], float]:
    """The bytes-moved lower bound of every (shape, mode) measured."""
    elem = torch.empty(0, dtype=args.dtype).element_size()
    probs = args.act == "scaled_swiglu"
    keys = {(r.shape, r.mode) for r in results if r.mode != "both"}
    return {(s, m): bytes_bound(SHAPES[s], m, elem, probs) for s, m in keys}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for dist in ("nvidia-cutlass-dsl", "quack-kernels", "torchao", "triton"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = None
    return found


def _meta(args: argparse.Namespace, peak: float, bandwidth: float, shapes: dict) -> dict:
    return {
        "device": _device_name(args.device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "versions": _versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": str(args.dtype),
        "act": args.act,
        "grad_modes": args.grad_modes,
        "peers": args.peers,
        "compile_backend": args.compile_backend,
        "compile": args.compile,
        "iters": args.iters,
        "warmup": args.warmup,
        "burst": args.burst,
        "dense_peak_tflops": peak,
        "copy_bandwidth_gbs": bandwidth,
        "flops": "fwd 6*M*H*F, fwd+bwd 18*M*H*F (every grad mode, FP8 too); padding not counted",
        "bytes_bound": "benchmarks/mlp_report.py docstring (compulsory HBM traffic of one call)",
        "vs": "the best bf16 peer's time / the variant's, same shape and mode",
        "te_seq_error": TE_SEQ_ERROR,
        "argv": sys.argv,
        "shapes": shapes,
    }


if __name__ == "__main__":
    sys.exit(main())
