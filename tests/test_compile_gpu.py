"""torch.compile of the grouped MLP on CUDA, for each GPU backend (torch, cute): fullgraph with
split sizes on the device, no recompile for new split sizes, CUDA graphs (mode="reduce-overhead")
replaying with new split sizes, and the gradient contract. Compiled runs are compared with eager
runs on the same backend (bf16: relative error of the whole tensor, as test_gpu_grouped.py).

Run on the GPU host: bash tests/run_gpu_tests.sh (one process per file).
"""

from __future__ import annotations

import pytest
import torch
from compile_helpers import CountingBackend, fresh_dynamo  # noqa: F401 (autouse)
from torch._dynamo.utils import counters

import te_seq
from te_seq import ops
from te_seq.run import compiled as te_seq_compiled

needs_tracing = pytest.mark.skipif(
    not te_seq_compiled.TRACEABLE, reason=te_seq_compiled.UNTRACEABLE_REASON
)

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

GPU_BACKENDS = [b for b in ("torch", "cute") if te_seq.kernels.backend_available(b)[0]]
# E experts, H hidden, F ffn, T rows: multiples the cute kernels take (H % 8, F % 128)
E, H, F, T = 8, 256, 256, 1000
BF16 = torch.bfloat16
TOL = 2e-2  # relative error (norm of the difference over the norm) for bf16


def make_mlp(**kwargs) -> te_seq.Sequential:
    mlp = te_seq.Sequential(
        ops.GroupedLinear(E, H, 2 * F, bias=False, single_grouped_weight=True, device="cuda",
                          dtype=BF16, **kwargs),
        ops.ScaledSwiGLU(),
        ops.GroupedLinear(E, F, H, bias=False, device="cuda", dtype=BF16, **kwargs),
    )
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.05)
    return mlp


def device_splits(seed: int) -> torch.Tensor:
    """Split sizes on the GPU summing to T, with an empty group and sizes off the tiles."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(0, T + 1, (E - 1,), generator=gen)).values
    sizes = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([T])]))
    sizes[seed % E] += sizes[(seed + 1) % E]
    sizes[(seed + 1) % E] = 0
    return sizes.cuda()


def inputs(seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", dtype=BF16, generator=gen).requires_grad_()
    probs = (torch.rand(T, device="cuda", generator=gen) + 0.5).requires_grad_()
    dy = torch.randn(T, H, device="cuda", dtype=BF16, generator=gen)
    return x, device_splits(seed), probs, dy


def step(fn, mlp, seed: int) -> list[torch.Tensor]:
    """Output, dx, dprobs and every parameter gradient of one forward + backward (cloned)."""
    x, splits, probs, dy = inputs(seed)
    y = fn(x, splits, probs, splits)
    y.backward(dy)
    out = [y.detach().clone(), x.grad.clone(), probs.grad.clone()]
    out += [p.grad.clone() for p in mlp.parameters()]
    for p in mlp.parameters():
        p.grad = None
    return out


def assert_close(actual: list, expected: list, what: str) -> None:
    for i, (a, b) in enumerate(zip(actual, expected)):
        err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
        assert err < TOL, f"{what}: tensor {i} relative error {err:.3g}"


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@needs_tracing
def test_fullgraph_matches_eager_without_recompiles(backend):
    mlp = make_mlp()
    counter = CountingBackend("inductor")
    compiled = torch.compile(mlp, backend=counter, fullgraph=True)
    with te_seq.backend(backend):
        for seed in range(3):  # new split sizes each call
            assert_close(step(compiled, mlp, seed), step(mlp, mlp, seed), f"seed {seed}")
    plan = mlp.fusion_plan()
    assert [s.name for s in plan.forward] == ["GroupedMLP"]
    assert plan.forward[0].backend == backend
    assert counter.graphs == 1, f"{counter.graphs} compiles for 3 split sizes"
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@needs_tracing
def test_reduce_overhead_replays_new_split_sizes(backend):
    """CUDA graphs (cudagraph trees): after warm-up and capture, each replay gets new device
    split sizes and must give what eager gives for them."""
    mlp = make_mlp()
    compiled = torch.compile(mlp, mode="reduce-overhead", fullgraph=True)
    with te_seq.backend(backend):
        expected = {seed: step(mlp, mlp, seed) for seed in range(6)}
        # eager runs on the torch backend compile their elementwise pass (counted graphs too)
        counters["stats"].clear()
        for seed in range(6):  # seeds 0-2 warm up and record, 3-5 replay
            torch.compiler.cudagraph_mark_step_begin()
            assert_close(step(compiled, mlp, seed), expected[seed], f"seed {seed}")
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_main_grad_accumulate_compiled_equals_eager(backend):
    """The gradient contract under compile (main_grad runs eagerly at a graph break)."""
    mlp = make_mlp(accumulate_into_main_grad=True)

    def grads(fn) -> list[torch.Tensor]:
        for p in mlp.parameters():
            p.main_grad = torch.zeros(p.shape, device="cuda", dtype=torch.float32)
            p.grad_added_to_main_grad = False
        x, splits, probs, dy = inputs(0)
        fn(x, splits, probs, splits).backward(dy)
        assert all(p.grad_added_to_main_grad for p in mlp.parameters())
        return [p.main_grad.clone() for p in mlp.parameters()] + [x.grad]

    with te_seq.backend(backend):
        assert_close(grads(torch.compile(mlp)), grads(mlp), "main_grad")


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_host_split_sizes_compile(backend):
    """Host split sizes with CUDA data compile too (the graph copies them to the device)."""
    mlp = make_mlp()
    compiled = torch.compile(mlp)
    with te_seq.backend(backend):
        x, splits, probs, _ = inputs(1)
        host = splits.cpu()
        y = compiled(x, host, probs, host)
        assert_close([y], [mlp(x, host, probs, host)], "output")


@pytest.mark.skipif("cute" not in GPU_BACKENDS, reason="needs the cute backend (sm_90 + DSL)")
@needs_tracing
def test_fullgraph_non_gated_epilogue_matches_eager():
    """A row-scaled non-gated activation (ScaledSReLU) in the cute epilogues, traced through the
    te_seq::act_fc1_forward / act_fc2_dgrad custom ops: compiled equals eager, one graph."""
    mlp = te_seq.Sequential(
        ops.GroupedLinear(E, H, F, bias=False, single_grouped_weight=True, device="cuda",
                          dtype=BF16),
        ops.ScaledSReLU(),
        ops.GroupedLinear(E, F, H, bias=False, device="cuda", dtype=BF16),
    )
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.05)
    counter = CountingBackend("inductor")
    compiled = torch.compile(mlp, backend=counter, fullgraph=True)
    with te_seq.backend("cute"):
        for seed in range(2):
            assert_close(step(compiled, mlp, seed), step(mlp, mlp, seed), f"seed {seed}")
    (fwd,) = mlp.fusion_plan().forward
    assert "activation fused into the FC1 and FC2-dgrad epilogues" in fwd.backend_reason
    assert counter.graphs == 1, f"{counter.graphs} compiles for 2 split sizes"
