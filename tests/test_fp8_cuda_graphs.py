"""GPU: FP8 recipes under te_seq.make_graphed_callables. A replay after an in-place weight
update (an optimizer step) uses the new weights, as eager does: with cached weights
(`cache_weights=True`, the default) each op's quantization runs in a weight graph of its own
(te_seq/core/fp8.py `capture_weight_graphs`), replayed before a forward replay only when a
weight changed; without, the forward graph quantizes the weights on every replay. (Before
both, the warm-up filled the cache and the graph replayed stale FP8 weights silently.)

The cute backend runs the FP8 grouped MLP without host syncs (the torch backend reads the
offsets on the host for its wgrad), so it is the one captured here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import te_seq
from te_seq import ops, recipe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU"),
]

E, H, F, T = 4, 128, 128, 200


def _mlp(**kw: object) -> te_seq.Sequential:
    kw = {"bias": False, "device": "cuda", "dtype": torch.bfloat16, **kw}
    return te_seq.Sequential(ops.GroupedLinear(E, H, 2 * F, **kw), ops.SwiGLU(),
                             ops.GroupedLinear(E, F, H, **kw))


def _step(model, x: torch.Tensor, splits: torch.Tensor) -> torch.Tensor:
    """One forward and backward; a copy of the output (a graph's is overwritten on replay)."""
    y = model(x, splits, splits)
    y.backward(torch.ones_like(y))
    return y.detach().clone()


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2 * scale,
                               msg=what)


@pytest.fixture
def cute_backend() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(te_seq.backend("cute"))
        except RuntimeError as exc:
            pytest.skip(f"cute backend unavailable: {exc}")
        yield


@pytest.mark.parametrize("fp8_recipe", [recipe.Float8RowwiseScaling(),
                                        recipe.Float8RowwiseScaling(cache_weights=False),
                                        recipe.Float8CurrentScaling(fp8_format="E4M3")],
                         ids=["rowwise", "rowwise-uncached", "current"])
def test_graph_replay_sees_weight_updates_under_fp8(fp8_recipe, cute_backend) -> None:
    torch.manual_seed(0)
    graphed_model, eager = _mlp(), _mlp()
    eager.load_state_dict(graphed_model.state_dict())
    splits = torch.tensor([60, 0, 90, 50], device="cuda")
    with te_seq.autocast(recipe=fp8_recipe):
        sample = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        graphed = te_seq.make_graphed_callables(graphed_model, (sample, splits, splits))
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        before = _step(graphed, x, splits)  # replays run in captured order: fwd, then bwd
        _close(before, _step(eager, x, splits), "before the update")
        with torch.no_grad():  # an optimizer step: the same in-place update on both twins
            for pg, pe in zip(graphed_model.parameters(), eager.parameters()):
                delta = torch.randn_like(pg) * pg.float().std().item()
                pg.add_(delta)
                pe.add_(delta)
        after = _step(graphed, x, splits)
        _close(after, _step(eager, x, splits), "after the update")
    change = (after.float() - before.float()).norm() / before.float().norm()
    assert change > 0.3, f"the update barely moved the output ({change:.3f}): test too weak"


class _CountedReplays:
    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph, self.replays = graph, 0

    def replay(self) -> None:
        self.replays += 1
        self.graph.replay()


@pytest.mark.parametrize("single", [True, False], ids=["single-weight", "per-expert"])
def test_weights_are_quantized_by_their_own_graphs_only_when_they_change(
    single: bool, cute_backend
) -> None:
    """Each GroupedLinear gets one weight graph; replays of the MLP with unchanged weights do
    not replay it, an optimizer step (in-place) replays it once, and `clear_weight_cache`
    (what a write through `.data`, which no version counter sees, needs) replays it too. The
    outputs follow eager mode throughout."""
    from te_seq.core import fp8

    torch.manual_seed(1)
    graphed_model, eager = _mlp(single_grouped_weight=single), _mlp(single_grouped_weight=single)
    eager.load_state_dict(graphed_model.state_dict())
    splits = torch.tensor([60, 0, 90, 50], device="cuda")
    with te_seq.autocast(recipe=recipe.Float8RowwiseScaling()):
        sample = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        graphed = te_seq.make_graphed_callables(graphed_model, (sample, splits, splits))
        linears = [m for m in graphed_model.modules() if isinstance(m, ops.GroupedLinear)]
        weight_graphs = [m.__dict__.get("_fp8_weight_graph") for m in linears]
        assert len(linears) == 2 and all(weight_graphs), "no weight graph per GroupedLinear"
        for wg in weight_graphs:
            wg.graph = _CountedReplays(wg.graph)

        def check(what: str, replays: int) -> None:
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            _close(_step(graphed, x, splits), _step(eager, x, splits), what)
            assert [wg.graph.replays for wg in weight_graphs] == [replays] * 2, what

        grads = [torch.randn_like(p) for p in graphed_model.parameters()]
        check("unchanged weights", 0)
        check("unchanged weights, again", 0)
        with torch.no_grad():
            for pg, pe in zip(graphed_model.parameters(), eager.parameters()):
                delta = torch.randn_like(pg) * pg.float().std().item()
                pg.add_(delta)
                pe.add_(delta)
        check("after an optimizer step", 1)
        check("no step since", 1)
        for model in (graphed_model, eager):  # fused: no version counter moves (the hook sees it)
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True).step()
        check("after a fused AdamW step", 2)
        with torch.no_grad():
            for pg, pe in zip(graphed_model.parameters(), eager.parameters()):
                pg.data.mul_(0.5)
                pe.mul_(0.5)
        for m in linears:
            fp8.clear_weight_cache(m)
        check("after a write through .data and clear_weight_cache", 3)
