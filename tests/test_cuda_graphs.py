"""GPU tests of te_seq.make_graphed_callables: captured graphs replayed with new inputs and new
device split sizes give the outputs and gradients of eager mode, under every gradient-contract
configuration, and under the interleaved schedules of docs/cuda_graphs.md.

Every test runs the same model twice, graphed and eager (same weights, same inputs), and compares.
Both use the same kernels, so only nondeterministic accumulation order separates them; the
tolerances allow for that and nothing more. The pure schedule rules are tested on CPU in
tests/test_graph_schedule.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

import te_seq
from te_seq import ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU"),
]

# T tokens, E experts, H hidden, F ffn. Small but not tile-aligned (T, F not multiples of 64).
E, H, F, T = 4, 64, 48, 80
DEVICE = "cuda"

# Split sizes to replay with, each summing to T: empty experts, all rows in one expert (first,
# middle, last), unaligned sizes. The capture uses SAMPLE_SPLITS.
SAMPLE_SPLITS = [20, 20, 20, 20]
REPLAY_SPLITS = [
    [5, 0, 70, 5],
    [0, 0, T, 0],
    [T, 0, 0, 0],
    [0, 0, 0, T],
    [1, 33, 0, 46],
]


def _splits(sizes: Sequence[int]) -> torch.Tensor:
    return torch.tensor(sizes, device=DEVICE, dtype=torch.int64)


def _assert_close(actual: torch.Tensor | None, expected: torch.Tensor | None, what: str) -> None:
    assert (actual is None) == (expected is None), f"{what}: {actual is None=} {expected is None=}"
    if actual is None or expected is None:
        return
    scale = max(1.0, expected.detach().abs().max().item())
    tol = 2e-2 if expected.dtype in (torch.bfloat16, torch.float16) else 1e-5
    torch.testing.assert_close(
        actual.detach().float(), expected.detach().float(), rtol=tol, atol=tol * scale, msg=what
    )


@pytest.fixture(params=["auto", "torch", "cute"])
def grouped_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Backends that run the grouped GEMMs with device split sizes and no host sync (the
    reference backend reads offsets on the host, so it cannot be captured)."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(te_seq.backend(request.param))
        except RuntimeError as exc:
            pytest.skip(f"backend {request.param!r} unavailable: {exc}")
        yield request.param


# ------------------------------------------------------------------------------------------------
# models: built twice with the same weights (one graphed, one eager)
# ------------------------------------------------------------------------------------------------

def _grouped_mlp(**linear_kwargs: object) -> te_seq.Sequential:
    return te_seq.Sequential(
        ops.GroupedLinear(E, H, 2 * F, bias=False, device=DEVICE, dtype=torch.bfloat16,
                          **linear_kwargs),
        ops.SwiGLU(),
        ops.GroupedLinear(E, F, H, bias=False, device=DEVICE, dtype=torch.bfloat16,
                          **linear_kwargs),
    )


def _linear_chain(**linear_kwargs: object) -> te_seq.Sequential:
    return te_seq.Sequential(
        ops.BasicLinear(H, F, device=DEVICE, dtype=torch.float32, **linear_kwargs),
        ops.GELU(),
        ops.BasicLinear(F, H, device=DEVICE, dtype=torch.float32, **linear_kwargs),
    )


def _twins(build: Callable[[], te_seq.Sequential]) -> tuple[te_seq.Sequential, te_seq.Sequential]:
    graphed_model, eager_model = build(), build()
    eager_model.load_state_dict(graphed_model.state_dict())
    return graphed_model, eager_model


def _input(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(T, H, device=DEVICE, dtype=dtype)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def _compare_params(graphed: torch.nn.Module, eager: torch.nn.Module, what: str) -> None:
    for (name, pg), pe in zip(graphed.named_parameters(), eager.parameters()):
        _assert_close(pg.grad, pe.grad, f"{what}: {name}.grad")
        if hasattr(pe, "main_grad"):
            _assert_close(pg.main_grad, pe.main_grad, f"{what}: {name}.main_grad")
        if hasattr(pe, "grad_added_to_main_grad"):
            assert pg.grad_added_to_main_grad == pe.grad_added_to_main_grad, f"{what}: {name} flag"


def _plan_names(model: te_seq.Sequential) -> list[str]:
    plan = model.fusion_plan()
    assert plan is not None
    return [step.name for step in plan.forward]


# ------------------------------------------------------------------------------------------------
# grouped MLP with device split sizes
# ------------------------------------------------------------------------------------------------

def test_grouped_mlp_replays_new_split_sizes_like_eager(grouped_backend: str) -> None:
    """Capture GroupedLinear→SwiGLU→GroupedLinear once, then replay with new inputs and new split
    sizes copied into the same device tensor; `.grad` accumulates over iterations (no zero_grad),
    which also checks that autograd never aliases `.grad` to graph memory."""
    torch.manual_seed(0)
    model, eager = _twins(_grouped_mlp)
    splits = _splits(SAMPLE_SPLITS)
    sample_x = _input(torch.bfloat16).requires_grad_(True)
    graphed = te_seq.make_graphed_callables(model, (sample_x, splits, splits))
    assert all(p.grad is None for p in model.parameters()), "warm-up leaked into .grad"
    for i, sizes in enumerate(REPLAY_SPLITS):
        splits.copy_(_splits(sizes))
        x, dy = _input(torch.bfloat16), _input(torch.bfloat16)
        xg, xe = _leaf(x), _leaf(x)
        yg = graphed(xg, splits, splits)
        yg.backward(dy)
        ye = eager(xe, splits, splits)
        ye.backward(dy)
        _assert_close(yg, ye, f"iteration {i} {sizes}: output")
        _assert_close(xg.grad, xe.grad, f"iteration {i} {sizes}: input grad")
        _compare_params(model, eager, f"iteration {i} {sizes}")
    # the split sizes were one tensor at capture, as in eager: the same ops ran (fused or not)
    assert _plan_names(model) == _plan_names(eager)


def test_grouped_mlp_other_split_tensor_is_copied_in(grouped_backend: str) -> None:
    """A different device tensor at replay is copied into the captured static buffer."""
    torch.manual_seed(1)
    model, eager = _twins(_grouped_mlp)
    splits = _splits(SAMPLE_SPLITS)
    graphed = te_seq.make_graphed_callables(model, (_input(torch.bfloat16), splits, splits),
                                            num_warmup_iters=1)
    for sizes in REPLAY_SPLITS[:2]:
        fresh = _splits(sizes)
        x = _input(torch.bfloat16)
        yg = graphed(x, fresh, fresh)
        yg.float().square().sum().backward()
        ye = eager(x, fresh, fresh)
        ye.float().square().sum().backward()
        _assert_close(yg, ye, f"{sizes}: output")
        _compare_params(model, eager, f"{sizes}")
    assert torch.equal(fresh, _splits(REPLAY_SPLITS[1])), "the caller's tensor was written"


@pytest.mark.parametrize("delayed", [False, True], ids=["backward", "delayed"])
def test_fresh_grads_are_lent_without_a_copy(grouped_backend: str, delayed: bool) -> None:
    """`.grad` set to None before every step: each weight's `.grad` after the step is the
    graph's own buffer (the same memory every step, no copy into a new tensor) and holds that
    step's gradient, as eager mode computes it."""
    torch.manual_seed(4)
    model, eager = _twins(lambda: _grouped_mlp(delay_wgrad_compute=delayed))
    splits = _splits(SAMPLE_SPLITS)
    graphed = te_seq.make_graphed_callables(model, (_input(torch.bfloat16), splits, splits),
                                            num_warmup_iters=1)
    first: dict[str, int] = {}
    for i, sizes in enumerate(REPLAY_SPLITS[:3]):
        splits.copy_(_splits(sizes))
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        x, dy = _input(torch.bfloat16), _input(torch.bfloat16)
        graphed(x, splits, splits).backward(dy)
        graphed.backward_dw()
        eager(x, splits, splits).backward(dy)
        eager.backward_dw()
        _compare_params(model, eager, f"iteration {i} {sizes}")
        for name, p in model.named_parameters():
            assert first.setdefault(name, p.grad.data_ptr()) == p.grad.data_ptr(), name


# ------------------------------------------------------------------------------------------------
# delayed wgrad
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("build", [_linear_chain, _grouped_mlp], ids=["linear", "grouped_mlp"])
def test_delayed_wgrad_replays_backward_dw_like_eager(build: Callable[..., te_seq.Sequential],
                                                      ) -> None:
    torch.manual_seed(2)
    model, eager = _twins(lambda: build(delay_wgrad_compute=True))
    grouped = build is _grouped_mlp
    dtype = torch.bfloat16 if grouped else torch.float32
    splits = _splits(SAMPLE_SPLITS)
    extra = (splits, splits) if grouped else ()
    graphed = te_seq.make_graphed_callables(model, (_input(dtype).requires_grad_(True), *extra))
    assert not model.need_backward_dw() and not graphed.need_backward_dw()
    for i, sizes in enumerate(REPLAY_SPLITS[:3]):
        splits.copy_(_splits(sizes))
        x, dy = _input(dtype), _input(dtype)
        xg, xe = _leaf(x), _leaf(x)
        graphed(xg, *extra).backward(dy)
        eager(xe, *extra).backward(dy)
        _assert_close(xg.grad, xe.grad, f"iteration {i}: input grad")
        _compare_params(model, eager, f"iteration {i}, before backward_dw")
        assert graphed.need_backward_dw() and eager.need_backward_dw()
        graphed.backward_dw()
        eager.backward_dw()
        assert not graphed.need_backward_dw()
        _compare_params(model, eager, f"iteration {i}, after backward_dw")


# ------------------------------------------------------------------------------------------------
# the gradient contract: main_grad, overwrite_main_grad, grad_added_to_main_grad, zero_out_wgrad
# ------------------------------------------------------------------------------------------------

def _add_main_grads(model: torch.nn.Module, flag: bool, overwrite: bool) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    for p in model.parameters():
        p.main_grad = torch.randn(p.shape, device=DEVICE, dtype=torch.float32, generator=gen)
        if flag:
            p.grad_added_to_main_grad = False
            p.zero_out_wgrad = True  # the dummy handed to autograd is zeros: comparable
        if overwrite:
            p.overwrite_main_grad = True


@pytest.mark.parametrize("delayed", [False, True], ids=["now", "delayed"])
@pytest.mark.parametrize("flag", [False, True], ids=["no_flag", "flag"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
@pytest.mark.parametrize("build", [_linear_chain, _grouped_mlp], ids=["linear", "grouped_mlp"])
def test_main_grad_contract_matches_eager(
    build: Callable[..., te_seq.Sequential], delayed: bool, flag: bool, overwrite: bool
) -> None:
    torch.manual_seed(4)
    kwargs = {"accumulate_into_main_grad": True, "delay_wgrad_compute": delayed}
    model, eager = _twins(lambda: build(**kwargs))
    _add_main_grads(model, flag, overwrite)
    _add_main_grads(eager, flag, overwrite)
    grouped = build is _grouped_mlp
    dtype = torch.bfloat16 if grouped else torch.float32
    splits = _splits(SAMPLE_SPLITS)
    extra = (splits, splits) if grouped else ()
    graphed = te_seq.make_graphed_callables(model, (_input(dtype), *extra))
    _compare_params(model, eager, "after capture (warm-up must leave main_grad untouched)")
    for i, sizes in enumerate(REPLAY_SPLITS[:3]):
        splits.copy_(_splits(sizes))
        for m in (model, eager):  # what a DDP wrapper does at the start of an iteration
            for p in m.parameters():
                if flag:
                    p.grad_added_to_main_grad = False
        x, dy = _input(dtype), _input(dtype)
        graphed(x, *extra).backward(dy)
        eager(x, *extra).backward(dy)
        _compare_params(model, eager, f"iteration {i}, after backward")
        graphed.backward_dw()  # a no-op for a chunk that does not delay wgrad, as in eager
        eager.backward_dw()
        _compare_params(model, eager, f"iteration {i}, after backward_dw")


# ------------------------------------------------------------------------------------------------
# the interleaved schedule of the issue
# ------------------------------------------------------------------------------------------------

INTERLEAVED = [1, 1, 2, -2, -2.5, 2, -2, -1, -1.5, -2.5, -1, -1.5]


def _run_schedule(
    chunks: Sequence[Callable[..., torch.Tensor]],
    order: Sequence[float],
    inputs: Sequence[Sequence[tuple[torch.Tensor, ...]]],
    grads: Sequence[Sequence[torch.Tensor]],
) -> list[list[torch.Tensor]]:
    """Drive graphed or eager chunks through `order`; returns each (chunk, microbatch) output."""
    outputs: list[list[torch.Tensor]] = [[] for _ in chunks]
    live: list[list[torch.Tensor]] = [[] for _ in chunks]
    backwards = [0] * len(chunks)
    for entry in order:
        if entry > 0:
            k = int(entry) - 1
            y = chunks[k](*inputs[k][len(live[k])])
            live[k].append(y)
            outputs[k].append(y.detach().clone())
        elif entry == int(entry):
            k = int(-entry) - 1
            live[k][backwards[k]].backward(grads[k][backwards[k]])
            backwards[k] += 1
        else:
            chunks[int(-entry - 0.5) - 1].backward_dw()  # type: ignore[attr-defined]
    return outputs


def _microbatch_inputs(split_sets: Sequence[torch.Tensor]) -> tuple[list, list, list, list]:
    """Per chunk and microbatch: (inputs, output grads). Chunk 1: linear chain, fp32; chunk 2:
    grouped MLP, bf16, each microbatch with its own device split sizes."""
    x1 = [(_leaf(_input(torch.float32)),) for _ in range(2)]
    x2 = [(_leaf(_input(torch.bfloat16)), s, s) for s in split_sets]
    dy1 = [_input(torch.float32) for _ in range(2)]
    dy2 = [_input(torch.bfloat16) for _ in range(2)]
    return x1, x2, dy1, dy2


def _eager_copy(inputs: list) -> list:
    return [tuple(_leaf(t) if t.is_floating_point() else t for t in args) for args in inputs]


def test_interleaved_schedule_gives_eager_gradients(grouped_backend: str) -> None:
    torch.manual_seed(5)
    linear, linear_eager = _twins(lambda: _linear_chain(delay_wgrad_compute=True))
    mlp, mlp_eager = _twins(lambda: _grouped_mlp(delay_wgrad_compute=True))
    sample_splits = _splits(SAMPLE_SPLITS)
    graphed = te_seq.make_graphed_callables(
        [linear, mlp],
        [(_leaf(_input(torch.float32)),),
         (_leaf(_input(torch.bfloat16)), sample_splits, sample_splits)],
        order=INTERLEAVED,
    )
    for it, split_sets in enumerate([REPLAY_SPLITS[:2], REPLAY_SPLITS[2:4]]):
        splits = [_splits(sizes) for sizes in split_sets]
        x1, x2, dy1, dy2 = _microbatch_inputs(splits)
        x1e, x2e = _eager_copy(x1), _eager_copy(x2)
        out_g = _run_schedule(graphed, INTERLEAVED, [x1, x2], [dy1, dy2])
        out_e = _run_schedule([linear_eager, mlp_eager], INTERLEAVED, [x1e, x2e], [dy1, dy2])
        for k, (og, oe) in enumerate(zip(out_g, out_e)):
            for m, (a, b) in enumerate(zip(og, oe)):
                _assert_close(a, b, f"iteration {it}: output of chunk {k + 1} microbatch {m}")
        for k, (xs, xes) in enumerate([(x1, x1e), (x2, x2e)]):
            for m, (a, b) in enumerate(zip(xs, xes)):
                _assert_close(a[0].grad, b[0].grad, f"iteration {it}: dx chunk {k + 1} mb {m}")
        _compare_params(linear, linear_eager, f"iteration {it}: chunk 1")
        _compare_params(mlp, mlp_eager, f"iteration {it}: chunk 2")


# ------------------------------------------------------------------------------------------------
# a plain module around a te_seq Sequential, returning a tuple
# ------------------------------------------------------------------------------------------------

class _TwoOutputs(torch.nn.Module):
    """Not a te_seq Sequential itself: its wgrad comes from the inner one's backward_dw()."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _linear_chain(delay_wgrad_compute=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.inner(x)
        return y, torch.tanh(y)


def test_plain_module_with_tuple_output_and_inner_delayed_wgrad() -> None:
    torch.manual_seed(7)
    model, eager = _TwoOutputs(), _TwoOutputs()
    eager.load_state_dict(model.state_dict())
    graphed = te_seq.make_graphed_callables(model, (_input(torch.float32).requires_grad_(True),))
    for i in range(2):
        x, d0, d1 = _input(torch.float32), _input(torch.float32), _input(torch.float32)
        xg, xe = _leaf(x), _leaf(x)
        outs_g, outs_e = graphed(xg), eager(xe)
        assert isinstance(outs_g, tuple) and len(outs_g) == 2
        torch.autograd.backward(outs_g, (d0, d1))
        torch.autograd.backward(outs_e, (d0, d1))
        graphed.backward_dw()
        eager.inner.backward_dw()
        for a, b in zip(outs_g, outs_e):
            _assert_close(a, b, f"iteration {i}: output")
        _assert_close(xg.grad, xe.grad, f"iteration {i}: input grad")
        _compare_params(model, eager, f"iteration {i}")


# ------------------------------------------------------------------------------------------------
# misuse after capture
# ------------------------------------------------------------------------------------------------

def test_out_of_order_replay_and_bad_inputs_are_errors() -> None:
    torch.manual_seed(6)
    model = _linear_chain(delay_wgrad_compute=True)
    graphed = te_seq.make_graphed_callables(model, (_input(torch.float32),), num_warmup_iters=1)
    with pytest.raises(RuntimeError, match=r"expects order\[0\] = forward of chunk 1"):
        graphed.backward_dw()
    with pytest.raises(ValueError, match=r"argument 0 is torch.float32 \(3, 64\), captured as"):
        graphed(torch.randn(3, H, device=DEVICE))
    y = graphed(_input(torch.float32))
    with pytest.raises(RuntimeError, match=r"expects order\[1\] = backward of chunk 1"):
        graphed(_input(torch.float32))
    y.sum().backward()
    graphed.backward_dw()
    graphed(_input(torch.float32)).sum().backward()  # next iteration starts over
    graphed.backward_dw()


def test_sample_args_on_host_are_rejected() -> None:
    model = _grouped_mlp()
    host_splits = torch.tensor(SAMPLE_SPLITS)
    with pytest.raises(ValueError, match=r"argument 1 is on cpu"):
        te_seq.make_graphed_callables(model, (_input(torch.bfloat16), host_splits, host_splits))
