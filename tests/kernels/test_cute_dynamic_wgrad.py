"""Dynamic work units in the varlen-K grouped GEMM (``cute.grouped_wgrad`` with
``Tiling(..., dynamic=True)``, the default of ``wgrad_tiling``): the groups' units are handed
out longest group first as clusters free up (``tile_scheduler.py``), from an order-and-counter
tensor made by one small launch per call (``unit_order``).

Every output tile is still computed by one unit over the same k-tiles in the same order, so the
dynamic result equals the static kernel's of the same tiling bit for bit, and the float64
reference within rounding; an output filled with NaN first shows any tile left unwritten (or a
unit dropped). Compile-only tests run on CPU; GPU tests need sm_90+.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from cute_marks import (
    check_wgrad,
    check_wgrad_graph_replays,
    compile_for_sm90a,
    gpu,
    needs_cute,
    needs_dsl,
    wgrad_operands,
)

from te_seq.kernels import reference
from te_seq.kernels.cute import Tiling
from te_seq.kernels.cute.unit_order import unit_order_reference

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    import torch
    from te_seq.kernels.cute.compile import GemmConfig, compile_gemm
    from te_seq.kernels.cute.unit_order_kernel import compile_unit_order
    bf16, fp32 = torch.bfloat16, torch.float32
    for cfg in [
        GemmConfig("k", bf16, bf16, "n", 192, (2, 1), pingpong=True, dynamic=True),
        GemmConfig("k", bf16, bf16, "n", 128, (1, 1), pingpong=True, dynamic=True),
        GemmConfig("k", bf16, fp32, "n", 256, (1, 2), accumulate=True, dynamic=True),
    ]:
        print(cfg, f"{compile_gemm(cfg).compile_s:.1f}s", flush=True)
    print("unit order", f"{compile_unit_order().compile_s:.1f}s")
    print("ALL COMPILED")
    """
)


@pytest.mark.slow  # DSL compiles in a subprocess
@needs_dsl
def test_compile_dynamic_wgrad_configs_for_sm90a():
    compile_for_sm90a(_COMPILE_SCRIPT, timeout=900)


def _ends(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def test_unit_order_is_longest_first_ties_by_index_then_a_zero_counter():
    order = unit_order_reference(_ends([3, 0, 7, 3, 7, 1, 0]))
    assert order.dtype == torch.int32
    assert order.tolist() == [2, 4, 0, 3, 5, 1, 6, 0]
    assert unit_order_reference(_ends([5])).tolist() == [0, 0]


def test_dynamic_units_are_refused_outside_grouped_wgrad():
    from te_seq.kernels import cute
    from te_seq.kernels.cute.compile import GemmConfig, compile_gemm
    from te_seq.kernels.cute.glu import _glu_tiling
    from te_seq.kernels.cute.launch import check_tiling

    dynamic = Tiling(192, (2, 1), True, dynamic=True)
    with pytest.raises(ValueError, match="cute grouped_mm: dynamic work units run in "
                                         "grouped_wgrad only"):
        cute.grouped_mm(torch.zeros(4, 16, dtype=torch.bfloat16),
                        torch.zeros(1, 16, 16, dtype=torch.bfloat16),
                        torch.tensor([4], dtype=torch.int32), tiling=dynamic)
    with pytest.raises(ValueError, match="cute GLU fc1: dynamic"):
        _glu_tiling("fc1", 256, False, dynamic)
    with pytest.raises(ValueError, match="scaled_grouped_wgrad: dynamic"):
        check_tiling(dynamic, "cute scaled_grouped_wgrad", wide_ok=True)
    assert check_tiling(None, "x") is None
    assert check_tiling(dynamic, "cute grouped_wgrad", dynamic_ok=True) is dynamic
    with pytest.raises(ValueError, match="plain 16-bit varlen-K"):
        compile_gemm(GemmConfig("m", torch.bfloat16, torch.bfloat16, dynamic=True))


def test_wgrad_default_tiling_takes_dynamic_units_unless_set_static(tiling_env):
    from te_seq.kernels.cute import launch, wgrad_tiling

    assert launch.WGRAD_SCHEDULE == "dynamic"
    assert wgrad_tiling(2048, False, 256) == Tiling(192, (2, 1), True, dynamic=True, epi_cols=64)
    assert wgrad_tiling(2048, True) == Tiling(128, (1, 1), True, dynamic=True)  # accumulate too
    assert wgrad_tiling(2048, True, 4096) == Tiling(256, (1, 2), dynamic=True)
    tiling_env("TE_SEQ_WGRAD_SCHEDULE", "static")
    assert wgrad_tiling(2048, False, 256) == Tiling(192, (2, 1), True, epi_cols=64)
    tiling_env("TE_SEQ_WGRAD_SCHEDULE", "longest")
    with pytest.raises(ValueError, match="TE_SEQ_WGRAD_SCHEDULE must be one of"):
        wgrad_tiling(2048, False, 256)


# (name, tokens per expert, N, K): one expert; Zipf-like skew with empty experts (one expert
# holds most rows: the case the dynamic schedule is for); unaligned counts and widths; long
# spans with more units than clusters several times over.
def _zipf(groups: int, rows: int) -> list[int]:
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randperm(groups, generator=gen) + 1.0) ** -1.1
    weight[torch.randperm(groups, generator=gen)[: groups // 16]] = 0
    return (weight / weight.sum() * rows).floor().long().tolist()


_CASES = [
    ("one_expert", [300], 256, 512),
    ("zipf_128_experts", _zipf(128, 20000), 384, 256),
    ("empty_and_unaligned", [0, 77, 0, 1, 300, 5, 0], 136, 200),
    ("long_spans", [1100, 0, 2000, 77, 4100, 640], 768, 1536),
]
# (tile_n, cluster, ping-pong): both consumer modes, each cluster shape (1x1: the records are
# written with plain stores; 2x1 and 1x2: by st.async into both CTAs)
_TILINGS = [(192, (2, 1), True), (128, (1, 2), True), (128, (1, 1), True), (256, (1, 2), False)]


def _wgrad(grad_out, x, offs, tiling, dynamic, out_dtype, accumulate=False, start=None):
    from te_seq.kernels import cute

    e, n, k = offs.shape[0], grad_out.shape[1], x.shape[1]
    out = torch.full((e, n, k), float("nan"), device="cuda", dtype=out_dtype)
    if start is not None:
        out.copy_(start)
    t = Tiling(tiling[0], tiling[1], tiling[2], dynamic=dynamic)
    cute.grouped_wgrad(grad_out, x, offs, out=out, accumulate=accumulate, tiling=t)
    return out


@gpu
@needs_cute
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tiling", _TILINGS, ids=str)
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_dynamic_wgrad_equals_static_and_reference(case, tiling, out_dtype):
    _, sizes, n, k = case
    grad_out, x, offs = wgrad_operands(sizes, n, k)
    out = _wgrad(grad_out, x, offs, tiling, True, out_dtype)
    static = _wgrad(grad_out, x, offs, tiling, False, out_dtype)
    check_wgrad(out, static, grad_out, x, offs, sizes)


@gpu
@needs_cute
@pytest.mark.parametrize("tiling", [(256, (1, 2), False), (128, (1, 1), True)], ids=str)
@pytest.mark.parametrize("case", _CASES[1:3], ids=[c[0] for c in _CASES[1:3]])
def test_dynamic_wgrad_accumulates_into_main_grad_as_static_does(case, tiling):
    _, sizes, n, k = case
    grad_out, x, offs = wgrad_operands(sizes, n, k)
    start = torch.randn(len(sizes), n, k, device="cuda", dtype=torch.float32)
    out = _wgrad(grad_out, x, offs, tiling, True, torch.float32, True, start)
    static = _wgrad(grad_out, x, offs, tiling, False, torch.float32, True, start)
    check_wgrad(out, static, grad_out, x, offs, sizes, start)


@gpu
@needs_cute
@pytest.mark.parametrize("groups", [1, 7, 128, 300, 1000])
def test_unit_order_kernel_equals_its_definition(groups):
    from te_seq.kernels.cute.unit_order import SLOTS, _launch

    gen = torch.Generator().manual_seed(groups)
    sizes = torch.randint(0, 40, (groups,), generator=gen)  # many ties, some empty
    sizes[torch.randint(0, groups, (1,), generator=gen)] = 5000
    offs = sizes.cumsum(0).to(torch.int32).cuda()
    rows = _launch(offs)  # every row the same
    assert rows.tolist() == [unit_order_reference(offs.cpu()).tolist()] * SLOTS


@gpu
@needs_cute
def test_wgrads_sharing_offs_each_take_a_fresh_counter():
    """More wgrads on one offs than a launch has rows (SLOTS): each row's counter serves one
    kernel, the next launch's rows serve the rest; every result is right."""
    from te_seq.kernels.cute.unit_order import SLOTS

    _, sizes, n, k = _CASES[1]
    grad_out, x, offs = wgrad_operands(sizes, n, k)
    ref = reference.grouped_wgrad(grad_out.double(), x.double(), offs)
    for _ in range(SLOTS + 2):
        out = _wgrad(grad_out, x, offs, (192, (2, 1), True), True, torch.bfloat16)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


@gpu
@needs_cute
def test_dynamic_wgrad_cuda_graph_replays_with_new_split_sizes():
    # the eager call before the capture cached rows on offs; the capture launched its own,
    # which each replay remakes (order and counter): a cached row would replay a spent counter
    check_wgrad_graph_replays(Tiling(192, (2, 1), pingpong=True, dynamic=True), ([750] * 4,))
