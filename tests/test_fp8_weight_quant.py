"""The stacked expert weights' two FP8 forms (`fp8_quantize.stacked_weight_rows`): W along K
(the forward operand) and Wᵀ along N (the dgrad's), made after every optimizer step.

On the cute kernels the two forms come from two reads of w (row-wise with each expert's column
maxima, then the cast along N from them) instead of the torch definitions' fp32 passes. Both
must be bitwise `fp8_reference.quantize_stacked` of w and of its transpose. CPU: the layout
wiring with the kernel pair replaced by its torch definitions; GPU: the kernels themselves.
"""

from __future__ import annotations

import pytest
import torch

from te_seq.kernels import fp8_quantize, fp8_wgrad
from te_seq.kernels import fp8_reference as ref
from te_seq.kernels.backend import backend_available

E4M3 = ref.ScaleRule("E4M3")
RULES = [E4M3, ref.ScaleRule("E4M3", power_of_two=True)]


def _weights(g: int, n: int, k: int, device="cpu") -> torch.Tensor:
    w = torch.randn(g, n, k, device=device) * torch.logspace(-2, 2, n, device=device)[:, None]
    w = w.to(torch.bfloat16)
    w[0, 3, 5] = 0.0
    if g > 1:
        w[1].zero_()  # an all-zero expert: scale 1 everywhere
    return w


def _assert_same_as_definition(w: torch.Tensor, rule: ref.ScaleRule, backend: str) -> None:
    along_k, along_n = fp8_quantize.stacked_weight_rows(w, rule, backend)
    want_k = ref.quantize_stacked(w, ref.ROWWISE, rule)
    want_n = ref.quantize_stacked(w.transpose(1, 2), ref.ROWWISE, rule)
    for got, want in ((along_k, want_k), (along_n, want_n)):
        assert got.data.shape == want.data.shape and got.scale_inv.shape == want.scale_inv.shape
        assert _same_bits(got.data, want.data) and _same_bits(got.scale_inv, want.scale_inv)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values bit for bit, a nan in one matching a nan in the other (its sign aside)."""
    a, b = a.contiguous(), b.contiguous()
    same = a.view(torch.uint8) == b.view(torch.uint8) if a.element_size() == 1 else a == b
    return bool((same | (a.float().isnan() & b.float().isnan())).all())


@pytest.fixture
def kernel_pair_as_definitions(monkeypatch):
    """The cute kernel pair replaced by the torch definitions of what it returns."""
    def rows_keeping_group_amax(t, offs, rule, backend_name):
        bounds = torch.cat([offs.new_zeros(1), offs]).tolist()
        amax = torch.stack([t[s:e].abs().amax(0).float() for s, e in zip(bounds, bounds[1:])])
        return ref.quantize(t, ref.ROWWISE, rule), amax

    def token_major_from_amax(t, offs, amax, rule):
        return fp8_wgrad.quantize_token_major(t, offs, rule)

    monkeypatch.setattr(fp8_quantize, "group_amax_reason", lambda t, rule, backend: "")
    monkeypatch.setattr(fp8_quantize, "rows_keeping_group_amax", rows_keeping_group_amax)
    monkeypatch.setattr(fp8_quantize, "token_major_from_amax", token_major_from_amax)


@pytest.mark.parametrize("shape", [(3, 256, 64), (1, 128, 16)])
def test_kernel_path_layout_is_the_definition(kernel_pair_as_definitions, shape):
    _assert_same_as_definition(_weights(*shape), E4M3, "cute")


@pytest.mark.parametrize("shape", [(3, 200, 64), (2, 128, 48)])
@pytest.mark.parametrize("backend", ["torch", "cute"])
def test_other_shapes_and_backends_take_the_definition(shape, backend):
    """N not a multiple of 128, the torch backend, or no GPU here: the torch definitions."""
    _assert_same_as_definition(_weights(*shape), E4M3, backend)


def test_the_reason_names_what_keeps_the_kernel_pair_off():
    """`stacked_weight_reason`: what `stacked_weight_rows` checks before the kernel pair (and
    what `bench_quant.py --weights` says of the pair's halves it cannot time)."""
    no_experts = torch.empty(0, 128, 16, dtype=torch.bfloat16)
    assert fp8_quantize.stacked_weight_reason(no_experts, E4M3, "cute") == "no experts"
    assert "N=200 is no multiple of 128" in fp8_quantize.stacked_weight_reason(
        _weights(2, 200, 16), E4M3, "cute")
    strided = _weights(2, 128, 32)[:, :, ::2]
    assert fp8_quantize.stacked_weight_reason(strided, E4M3, "cute") == "w is not contiguous"
    assert "torch" in fp8_quantize.stacked_weight_reason(_weights(2, 128, 16), E4M3, "torch")
    if not torch.cuda.is_available():  # on the CPU: the device check names the device
        assert "CUDA" in fp8_quantize.stacked_weight_reason(_weights(2, 128, 16), E4M3, "cute")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not backend_available("cute")[0],
                    reason="needs the cute backend (CUDA sm_90 and the CuTe DSL)")
@pytest.mark.parametrize("rule", RULES, ids=["scale", "pow2"])
@pytest.mark.parametrize("shape", [(4, 256, 128), (1, 128, 4096), (8, 384, 2064), (2, 128, 16)])
def test_cute_weight_forms_are_bitwise_the_definition(rule, shape):
    torch.manual_seed(3)
    w = _weights(*shape, device="cuda")
    w[0, 7, 9] = float("inf")  # a non-finite expert column and row: nan scales, as defined
    _assert_same_as_definition(w, rule, "cute")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not backend_available("cute")[0],
                    reason="needs the cute backend (CUDA sm_90 and the CuTe DSL)")
def test_cute_dgrad_reads_the_weight_form_in_place():
    """The dgrad form is a [G, K, N] view of the cast's [K, G·N] buffer (no copy per optimizer
    step); the FP8 GEMM reads it as it reads a contiguous copy, bit for bit."""
    from te_seq.kernels import cute

    torch.manual_seed(4)
    g, n, k, rows = 4, 256, 128, 300
    w = _weights(g, n, k, device="cuda")
    along_n = fp8_quantize.stacked_weight_rows(w, E4M3, "cute")[1]
    assert along_n.data.stride(-1) == 1 and not along_n.data.is_contiguous()
    dy = ref.quantize(torch.randn(rows, n, device="cuda").to(torch.bfloat16), ref.ROWWISE, E4M3)
    offs = torch.tensor([90, 90, 250, 300], device="cuda", dtype=torch.int32)  # one empty expert
    args = (dy.data, dy.scale_inv.reshape(-1), along_n.scale_inv.reshape(g, k), offs)
    in_place = cute.scaled_grouped_mm(args[0], along_n.data, *args[1:])
    copied = cute.scaled_grouped_mm(args[0], along_n.data.contiguous(), *args[1:])
    assert torch.equal(in_place, copied) and in_place.abs().sum() > 0
