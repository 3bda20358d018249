"""The FP8 weight graphs of te_seq.make_graphed_callables (te_seq/core/fp8.py), on the CPU with a
stand-in graph: which calls read the graph's operands, when it is replayed, and the errors. The
real capture and replay run in tests/test_fp8_cuda_graphs.py (GPU)."""

from __future__ import annotations

import pytest
import torch

from te_seq.core import fp8
from te_seq.recipe import Float8RowwiseScaling

G, N, K = 2, 8, 16


class _StandInGraph:
    """Counts its replays (a real one re-quantizes the Parameter into the operands in place)."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def _op_with_weight_graph() -> tuple[torch.nn.Module, Float8RowwiseScaling, fp8._WeightGraph]:
    op = torch.nn.Module()
    op.weight = torch.nn.Parameter(torch.randn(G, N, K))
    recipe = Float8RowwiseScaling()
    fp8.cached_weights(op, recipe, op.weight, [op.weight])  # an eager call fills the cache
    key, weights = op.__dict__["_fp8_weight_cache"]
    wg = fp8._WeightGraph(key[:4], [op.weight], _StandInGraph(), weights)
    op.__dict__["_fp8_weight_graph"] = wg
    return op, recipe, wg


def test_calls_read_the_graph_operands_and_replay_only_after_a_change() -> None:
    op, recipe, wg = _op_with_weight_graph()
    w = op.weight
    assert fp8.cached_weights(op, recipe, w, [w]) is wg.weights and wg.graph.replays == 0
    with torch.no_grad():
        w.mul_(2.0)  # an optimizer step: the version counter moves
    fp8.cached_weights(op, recipe, w, [w])
    fp8.cached_weights(op, recipe, w, [w])
    assert wg.graph.replays == 1
    fp8.refresh_weight_graphs(op)
    assert wg.graph.replays == 1
    fp8.clear_weight_cache(op)  # what a write through .data needs: replayed on the next use
    assert "_fp8_weight_graph" in op.__dict__
    fp8.refresh_weight_graphs(op)
    assert wg.graph.replays == 2
    w.grad = torch.randn_like(w)
    torch.optim.AdamW([w], fused=True).step()  # no version counter moves: the step hook sees it
    fp8.refresh_weight_graphs(op)
    assert wg.graph.replays == 3


def test_another_recipe_does_not_read_the_graph_operands() -> None:
    op, _, wg = _op_with_weight_graph()
    other = Float8RowwiseScaling(fp8_format="HYBRID")
    assert fp8.cached_weights(op, other, op.weight, [op.weight]) is not wg.weights


def test_a_weight_replaced_by_new_memory_is_an_error() -> None:
    op, recipe, _ = _op_with_weight_graph()
    with torch.no_grad():
        op.weight.data = torch.randn(G, N, K)
    with pytest.raises(RuntimeError, match=r"weight \(2, 8, 16\) of a graphed module was "
                                           r"replaced by new memory"):
        fp8.cached_weights(op, recipe, op.weight, [op.weight])


def test_used_properties_are_the_forms_calls_made() -> None:
    w = torch.randn(G, N, K)
    weights = fp8._weight_operands(Float8RowwiseScaling(), w, "torch")
    assert fp8._used_properties(weights) == []
    weights.fp8  # noqa: B018 (made on first use)
    weights.dgrad_fp8  # noqa: B018
    assert sorted(fp8._used_properties(weights)) == ["dgrad_fp8", "fp8"]


def test_the_graph_quantizes_the_parameter_or_the_experts_stacked_without_a_cast() -> None:
    one = torch.nn.Parameter(torch.randn(G, N, K))
    experts = [torch.nn.Parameter(torch.randn(N, K)) for _ in range(G)]
    key = (None, "cute", torch.float32, (G, N, K))
    assert fp8._graph_weight_input(key, [one])() is not None
    assert torch.equal(fp8._graph_weight_input(key, experts)(), torch.stack(experts))
    cast = (None, "cute", torch.bfloat16, (G, N, K))  # the calls quantized a cast: not hoisted
    assert fp8._graph_weight_input(cast, [one]) is None
    assert fp8._graph_weight_input(key, experts[:1]) is None


def test_a_second_capture_gets_the_weight_graphs_of_the_first() -> None:
    """Graphs captured again over the same ops read the earlier weight graphs' operands, so
    their forward replays must refresh those too: they are returned, nothing new is captured."""
    op, _, wg = _op_with_weight_graph()
    module = torch.nn.Sequential(op)

    def no_new_pool():
        raise AssertionError("captured a second weight graph")

    assert fp8.capture_weight_graphs(module, no_new_pool) == [wg]


def test_the_cache_does_not_keep_a_replaced_parameter_alive() -> None:
    """What a weight graph would quantize is remembered by weak reference: a Parameter replaced
    after an FP8 call (weight surgery) is freed, not kept by the op's cache."""
    import gc
    import weakref

    op = torch.nn.Module()
    op.weight = torch.nn.Parameter(torch.randn(G, N, K))
    with torch.no_grad():  # as inside an op's forward (an autograd Function's)
        fp8.cached_weights(op, Float8RowwiseScaling(), op.weight, [op.weight])
    old = weakref.ref(op.weight)
    op.weight = torch.nn.Parameter(torch.randn(G, N, K))
    gc.collect()
    assert old() is None
