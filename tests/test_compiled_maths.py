"""te_seq/kernels/compiled_maths.py: the compiled form of a torch function gives the plain
function's bits, fp32 division included (Triton's default division is approximate; the
compile options ask for IEEE division)."""

import pytest
import torch

from te_seq.kernels import compiled_maths
from te_seq.kernels.fp8_reference import inverse


def _scale_and_reciprocal(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = torch.div(torch.full_like(amax, 448.0), amax)
    return scale, inverse(scale)


def _check_bitwise(device: str) -> None:
    torch.manual_seed(0)
    amax = torch.rand(4096, device=device) * torch.logspace(-20, 20, 4096, device=device)
    compiled = compiled_maths.CompiledMaths(_scale_and_reciprocal)
    got = compiled(amax)
    assert compiled.broken is None, compiled.broken  # it really ran compiled
    for g, w in zip(got, _scale_and_reciprocal(amax), strict=True):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32))
    eager_reciprocal = torch.reciprocal(got[0])  # `inverse` is the eager reciprocal, bitwise
    assert torch.equal(got[1].view(torch.int32), eager_reciprocal.view(torch.int32))


@pytest.mark.slow
def test_compiled_division_is_bitwise_eager_on_cpu():
    _check_bitwise("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_compiled_division_is_bitwise_eager_on_cuda():
    _check_bitwise("cuda")
