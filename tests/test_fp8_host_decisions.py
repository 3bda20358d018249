"""What the FP8 linear path decides once per set of static facts instead of on every call
(core/fp8.py, core/fp8_gemm.py): the operand checks, the grouped GEMMs' route (real FP8 or
emulated forward, native backward, FP8 wgrad) and each recipe's per-role scaling. Each is
reused on a repeated call (counted, not timed), decided afresh for other facts, and a refused
call is refused again, with the same message, every time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from aten_log import counting_calls

from te_seq.core import fp8, fp8_gemm
from te_seq.kernels import fp8_reference as ref
from te_seq.recipe import Float8BlockScaling, Float8CurrentScaling, Float8RowwiseScaling


def test_operand_checks_run_once_per_facts_and_refuse_every_time(monkeypatch):
    checks = counting_calls(monkeypatch, fp8, "_check_operands")
    monkeypatch.setattr(fp8, "_PASSED", {})  # none passed yet
    recipe, op = Float8BlockScaling(), torch.nn.Identity()
    x, w = torch.randn(4, 256), torch.randn(2, 128, 256)
    for _ in range(3):
        fp8.check_operands(op, recipe, x, w, 256, 128)
    assert len(checks) == 1
    fp8.check_operands(op, recipe, x, w.half(), 256, 128)  # W's dtype: new facts
    assert len(checks) == 2
    for _ in range(2):  # 1x128 tiles: in_features 200 is refused, each call checked
        with pytest.raises(ValueError, match="Identity: recipe Float8BlockScaling needs "
                           "in_features and out_features to be multiples of 128"):
            fp8.check_operands(op, recipe, torch.randn(4, 200), torch.randn(2, 128, 200), 200,
                               128)
    for _ in range(2):
        with pytest.raises(ValueError, match="got input dtype torch.int32"):
            fp8.check_operands(op, recipe, x.int(), w, 256, 128)
    assert len(checks) == 6


def _ctx(recipe, backend: str = "torch"):
    return SimpleNamespace(backend=SimpleNamespace(name=backend), recipe=recipe)


def test_grouped_route_is_decided_once_per_facts(monkeypatch):
    fp8_gemm.clear_decisions()
    forward = counting_calls(monkeypatch, fp8_gemm, "forward_reason")
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(2, 32, 64, dtype=torch.bfloat16)
    rowwise = Float8RowwiseScaling()
    routes = [fp8_gemm.grouped_route(_ctx(rowwise), x, w) for _ in range(3)]
    assert routes[0] is routes[2] and len(forward) == 1
    assert routes[0] == fp8_gemm.GroupedRoute(False, False, False)  # CPU: emulated
    fp8_gemm.grouped_route(_ctx(Float8RowwiseScaling(fp8_wgrad=False)), x, w)  # recipe
    fp8_gemm.grouped_route(_ctx(rowwise), x.float(), w)  # dtype
    fp8_gemm.grouped_route(_ctx(rowwise), x, w[:, :16])  # N
    fp8_gemm.grouped_route(_ctx(rowwise, "cute"), x, w)  # backend
    assert len(forward) == 5
    fp8_gemm.clear_decisions()
    fp8_gemm.grouped_route(_ctx(rowwise), x, w)
    assert len(forward) == 6


def test_grouped_route_matches_the_reasons(monkeypatch):
    """Where the forward runs in real FP8, the route's backward and FP8-wgrad answers are
    `backward_reason`'s and `wgrad_reason`'s (the recipe's fp8_wgrad among them)."""
    fp8_gemm.clear_decisions()
    monkeypatch.setattr(fp8_gemm, "forward_reason", lambda *facts: "")
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(2, 32, 64, dtype=torch.bfloat16)
    for recipe in (Float8RowwiseScaling(), Float8RowwiseScaling(fp8_wgrad=False),
                   Float8CurrentScaling()):
        route = fp8_gemm.grouped_route(_ctx(recipe), x, w)
        facts = ("torch", recipe, x.dtype, x.device, [(64, 32)], True)
        native = not fp8_gemm.backward_reason(*facts)
        assert route == (True, native, native and not fp8_gemm.wgrad_reason(recipe))
    fp8_gemm.clear_decisions()


def test_recipe_scalings_are_made_once_per_recipe():
    recipe = Float8RowwiseScaling(fp8_format="HYBRID")
    first = fp8.scaling(recipe, "grad")
    assert fp8.scaling(recipe, "grad") is first  # the same rule object on every call
    assert first.rule == recipe.rule("grad") and first.rule.dtype == torch.float8_e5m2
    assert first.block == recipe.block("grad") and first.rowwise and not first.per_tensor
    other = fp8.scaling(Float8RowwiseScaling(), "grad")  # an equal-looking recipe of E4M3
    assert other.rule.dtype == torch.float8_e4m3fn
    per_tensor = fp8.scaling(Float8CurrentScaling(), "input")
    assert per_tensor.per_tensor and not per_tensor.rowwise
    assert per_tensor.block == ref.QuantBlock(None, None)
