"""Mixed precision the PyTorch way: fp32 weights under `torch.autocast`. Every chain of te_seq ops
must train like the same chain of plain torch modules under autocast: the same output dtype,
values and gradients as accurate as torch's own (judged against a float64 run without
autocast), and gradients in the parameters' dtype. Fused and unfused te_seq chains agree.

CPU autocast (bf16) runs everywhere; the `gpu` tests repeat it on CUDA (bf16 and fp16, every
available backend) on the GPU machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from op_specs import randomize_params

import te_seq
from te_seq import ops

# Shape legend: T rows, H hidden, N ffn, G groups (sizes of the two non-empty groups below).
T, H, N, G = 12, 16, 24, 3
SIZES = [5, 0, 7]


@dataclass
class Chain:
    """te_seq modules, the same maths in plain torch (module list, x, extras) -> y, the extras."""

    id: str
    build: Callable[[], list[torch.nn.Module]]
    torch_ref: Callable[[list, torch.Tensor, tuple], torch.Tensor]
    extras: Callable[[str], tuple] = lambda device: ()


def _grouped(fc, x, bias=True):
    """Per-group torch.nn.functional.linear: what autocast does to each expert."""
    parts = x.split(SIZES)
    return torch.cat([F.linear(p, getattr(fc, f"weight{g}"),
                               getattr(fc, f"bias{g}") if bias and fc.has_bias else None)
                      for g, p in enumerate(parts)])


def _glu(h, probs=None):
    gate, up = h.chunk(2, -1)
    a = F.silu(gate) * up
    return a if probs is None else a * probs[:, None]


def _splits(device):
    return torch.tensor(SIZES)


def _probs(device):
    return torch.rand(T, device=device) + 0.5


CHAINS = [
    Chain("basic_linear", lambda: [ops.BasicLinear(H, N)],
          lambda m, x, e: F.linear(x, m[0].weight)),
    Chain("linear", lambda: [ops.Linear(H, N)],
          lambda m, x, e: F.linear(x, m[0].weight, m[0].bias)),
    Chain("linear_gelu_linear", lambda: [ops.Linear(H, N), ops.GELU(), ops.Linear(N, H)],
          lambda m, x, e: F.linear(F.gelu(F.linear(x, m[0].weight, m[0].bias), approximate="tanh"),
                                   m[2].weight, m[2].bias)),
    Chain("layer_norm_linear_swiglu", lambda: [ops.LayerNorm(H), ops.Linear(H, 2 * N),
                                               ops.SwiGLU()],
          lambda m, x, e: _glu(F.linear(F.layer_norm(x, (H,), m[0].weight, m[0].bias),
                                        m[1].weight, m[1].bias))),
    Chain("rms_norm_linear", lambda: [ops.RMSNorm(H), ops.BasicLinear(H, N)],
          lambda m, x, e: F.linear(F.rms_norm(x, (H,), m[0].weight, 1e-5), m[1].weight)),
    Chain("linear_residual", lambda: [ops.Linear(H, H), ops.AddExtraInput()],
          lambda m, x, e: F.linear(x, m[0].weight, m[0].bias) + e[0],
          lambda device: (torch.randn(T, H, device=device),)),
    Chain("residual_branch_linear", lambda: [ops.MakeExtraOutput(), ops.Linear(H, N)],
          lambda m, x, e: (F.linear(x, m[1].weight, m[1].bias), x)),
    Chain("grouped_linear", lambda: [ops.GroupedLinear(G, H, N)],
          lambda m, x, e: _grouped(m[0], x), lambda device: (_splits(device),)),
    Chain("grouped_mlp_scaled_swiglu",
          lambda: [ops.GroupedLinear(G, H, 2 * N), ops.ScaledSwiGLU(), ops.GroupedLinear(G, N, H)],
          lambda m, x, e: _grouped(m[2], _glu(_grouped(m[0], x), e[1])),
          lambda device: (_splits(device), _probs(device), _splits(device))),
    Chain("grouped_mlp_gelu_no_bias",
          lambda: [ops.GroupedLinear(G, H, N, bias=False), ops.GELU(),
                   ops.GroupedLinear(G, N, H, bias=False)],
          lambda m, x, e: _grouped(m[2], F.gelu(_grouped(m[0], x), approximate="tanh")),
          lambda device: (_splits(device), _splits(device))),
    Chain("elementwise", lambda: [ops.Linear(H, H), ops.ConstantScale(0.5), ops.Dropout(0.0),
                                  ops.Identity(), ops.Reshape((-1, H)), ops.ReLU()],
          lambda m, x, e: F.relu(F.linear(x, m[0].weight, m[0].bias) * 0.5)),
]


def _setup(chain: Chain, device: str):
    torch.manual_seed(0)
    modules = [m.to(device) for m in chain.build()]
    seq = te_seq.Sequential(*modules)
    randomize_params(seq)
    x = torch.randn(T, H, device=device)
    return seq, modules, x, chain.extras(device)


def _train_step(run, params, x, extras, autocast):
    """Outputs and gradients (x, floating extras, params) of one step."""
    x = x.detach().clone().requires_grad_(True)
    extras = [e.detach().clone().requires_grad_(True) if e.is_floating_point() else e
              for e in extras]
    for p in params:
        p.grad = None
    with autocast:
        out = run(x, extras)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(11)
    torch.autograd.backward(outs, [torch.randn(o.shape, generator=gen).to(o) for o in outs])
    grads = [x.grad, *[e.grad for e in extras if e.is_floating_point()],
             *[p.grad for p in params]]
    for p in params:
        p.grad = None  # (a later module conversion would convert it in place)
    return [o.detach() for o in outs], grads


def _compare(chain: Chain, device: str, dtype: torch.dtype, fused: bool) -> None:
    seq, modules, x, extras = _setup(chain, device)
    params = list(seq.parameters())
    autocast = torch.autocast(device, dtype=dtype)
    guard = contextlib.nullcontext() if fused else te_seq.fusions_disabled()
    with guard:
        ours, our_grads = _train_step(lambda x, e: seq(x, *e), params, x, extras, autocast)
    theirs, their_grads = _train_step(lambda x, e: chain.torch_ref(modules, x, e), params, x,
                                      extras, autocast)
    seq.double()
    exact, exact_grads = _train_step(
        lambda x, e: chain.torch_ref(modules, x, e), params, x.double(),
        [e.double() if e.is_floating_point() else e for e in extras], contextlib.nullcontext())
    seq.float()
    for a, b, ref in zip(ours, theirs, exact, strict=True):
        assert a.dtype == b.dtype, f"output dtype {a.dtype}, torch gives {b.dtype}"
        _as_accurate_as_torch(a, b, ref, "output")
    for i, (a, b, ref) in enumerate(zip(our_grads, their_grads, exact_grads, strict=True)):
        assert a is not None and b is not None, f"gradient {i} missing"
        assert a.dtype == b.dtype, f"gradient {i}: dtype {a.dtype}, torch gives {b.dtype}"
        _as_accurate_as_torch(a, b, ref, f"gradient {i}")


def _as_accurate_as_torch(ours, theirs, exact, what: str) -> None:
    """Our error against the float64 run is at most twice torch's own under autocast (plus a
    little slack for results torch happens to get almost exact)."""
    ours, theirs, exact = ours.double(), theirs.double(), exact.double()
    scale = exact.abs().max().item() or 1.0
    ours_err = (ours - exact).abs().max().item()
    torch_err = (theirs - exact).abs().max().item()
    assert ours_err <= 2 * torch_err + 4e-3 * scale, (
        f"{what}: te_seq error {ours_err:.3g} vs torch's {torch_err:.3g} (scale {scale:.3g})")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: c.id)
def test_cpu_autocast_trains_like_torch(chain: Chain, fused: bool) -> None:
    _compare(chain, "cpu", torch.bfloat16, fused)


def test_fused_ops_run_under_autocast() -> None:
    """The chains above do fuse under autocast (so the fused ops are what was compared)."""
    expected = {"linear_gelu_linear": "LinearBiasActivation",
                "layer_norm_linear_swiglu": "LinearBiasActivation",
                "linear_residual": "LinearBiasAdd",
                "grouped_mlp_scaled_swiglu": "GroupedMLP", "grouped_mlp_gelu_no_bias": "GroupedMLP"}
    for chain in CHAINS:
        if chain.id not in expected:
            continue
        seq, _, x, extras = _setup(chain, "cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            seq(x.requires_grad_(True), *extras)
        names = [s.name for s in seq.fusion_plan().forward]
        assert expected[chain.id] in names, (chain.id, names)


def test_backward_inside_the_autocast_region() -> None:
    """Some training loops call backward inside `with autocast`: same gradients."""
    chain = next(c for c in CHAINS if c.id == "grouped_mlp_scaled_swiglu")
    seq, _, x, extras = _setup(chain, "cpu")
    grads = []
    for inside in (False, True):
        x_ = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = seq(x_, *extras)
            if inside:
                y.float().sum().backward()
        if not inside:
            y.float().sum().backward()
        grads.append(x_.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_plan_follows_the_autocast_state() -> None:
    """The same Sequential with and without autocast: dtypes follow each call (no stale plan)."""
    seq = te_seq.Sequential(ops.Linear(H, H))
    x = torch.randn(T, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert seq(x).dtype == torch.bfloat16
    assert seq(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.float16):
        assert seq(x).dtype == torch.float16


def test_float64_is_never_cast() -> None:
    """As in torch, autocast leaves float64 alone."""
    seq = te_seq.Sequential(ops.Linear(H, H, dtype=torch.float64))
    x = torch.randn(T, H, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = seq(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, F.linear(x, seq[0].weight, seq[0].bias))


def test_mismatched_dtypes_still_fail_outside_autocast() -> None:
    seq = te_seq.Sequential(ops.Linear(H, H))
    with pytest.raises(ValueError, match="BasicLinear: input dtype torch.bfloat16 does not match"):
        seq(torch.randn(T, H, dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert seq(torch.randn(T, H, dtype=torch.bfloat16)).dtype == torch.bfloat16


class _UserMatmul(ops.BasicOperation):
    """A user op written as plain torch code: it sees torch's autocast like any torch code."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(H, H))

    def op_forward(self, ctx, x):
        ctx.save_for_backward(x, self.w)
        return x @ self.w

    def op_backward(self, ctx, dy):
        x, w = ctx.saved_tensors
        return (dy @ w.t().to(dy.dtype)).to(x.dtype), [(x.t().to(dy.dtype) @ dy).to(w.dtype)]


def test_user_ops_keep_torch_autocast() -> None:
    seq = te_seq.Sequential(ops.Linear(H, H), _UserMatmul())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = seq(torch.randn(T, H))
    assert y.dtype == torch.bfloat16  # autocast cast the user's matmul


def test_main_grad_under_autocast() -> None:
    """fp32 main_grad with fp32 weights under autocast: the wgrad lands in main_grad."""
    lin = ops.BasicLinear(H, N, accumulate_into_main_grad=True)
    lin.weight.main_grad = torch.zeros(N, H)
    x = torch.randn(T, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = te_seq.Sequential(lin)(x)
    y.float().sum().backward()
    expected = torch.ones(T, N).t() @ x
    torch.testing.assert_close(lin.weight.main_grad, expected, rtol=2e-2, atol=5e-2)


# --- CUDA (the GPU machine) ----------------------------------------------------------------------

def _cuda_cases():
    """Every chain on "auto"; the grouped chains (the only ones with backend kernels) on each
    backend."""
    for chain in CHAINS:
        backends = ("auto", "reference", "torch", "cute") if "grouped" in chain.id else ("auto",)
        for backend in backends:
            yield pytest.param(chain, backend, id=f"{chain.id}-{backend}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("chain,backend", list(_cuda_cases()))
def test_cuda_autocast_trains_like_torch(chain: Chain, fused: bool, dtype, backend: str) -> None:
    if backend != "auto" and not te_seq.kernels.backend_available(backend)[0]:
        pytest.skip(f"{backend} backend unavailable")
    with te_seq.backend(backend):
        _compare(chain, "cuda", dtype, fused)


def test_autocast_bookkeeping_traces_without_graph_breaks() -> None:
    """The fuser's autocast bookkeeping (reading the state, `running`, `step_scope`) must not
    break `torch.compile(fullgraph=True)` (a ContextVar would)."""
    from te_seq.core import amp

    def step(x):
        state = amp.AutocastState.current(x.device)
        with amp.running(state), amp.step_scope(state, True):
            return x @ x.t(), amp.running_state() is state

    compiled = torch.compile(step, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, seen = compiled(torch.randn(3, 3))
    assert y.dtype == torch.float32 and seen  # autocast off inside, the state visible to checks
    assert amp.running_state() is None


def test_compiled_sequential_under_autocast_matches_eager() -> None:
    chain = next(c for c in CHAINS if c.id == "linear_gelu_linear")
    seq, _, x, _ = _setup(chain, "cpu")
    compiled = torch.compile(seq)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_eager = compiled(x), seq(x)
    assert y.dtype == y_eager.dtype == torch.bfloat16
    # inductor may keep intermediates in fp32 where eager rounds them: bf16 rounding apart
    scale = y_eager.abs().max().item()
    torch.testing.assert_close(y, y_eager, rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("single", [False, True], ids=["per_group", "single_weight"])
def test_delayed_wgrad_under_autocast_lands_in_the_weights_dtype(single: bool) -> None:
    fc = ops.GroupedLinear(G, H, N, bias=False, delay_wgrad_compute=True,
                           single_grouped_weight=single)
    x = torch.randn(T, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = te_seq.Sequential(fc)(x, torch.tensor(SIZES))
    y.float().sum().backward()
    assert all(p.grad is None for p in fc.parameters())
    fc.backward_dw()
    grads = [p.grad for p in fc.parameters()]
    assert all(g.dtype == torch.float32 for g in grads)
    stacked = grads[0] if single else torch.stack(grads)
    expected = torch.stack([torch.ones(n, N).t() @ p for n, p in zip(SIZES, x.split(SIZES))])
    torch.testing.assert_close(stacked, expected, rtol=2e-2, atol=5e-2)
