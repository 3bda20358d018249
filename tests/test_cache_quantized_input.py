"""TransformerEngine's `cache_quantized_input` keyword on every activation op: False is accepted
(TE's signatures work unchanged), True is refused with a clear error rather than ignored."""

from __future__ import annotations

import pytest
import torch

from te_seq import ops
from te_seq.ops.basic.activation import Activation

ACTIVATION_OPS = sorted(
    name for name in ops.__all__
    if isinstance(getattr(ops, name), type) and issubclass(getattr(ops, name), Activation)
    and getattr(ops, name) is not Activation and not name.endswith("Activation")
)


def test_every_activation_is_listed():
    assert {"SwiGLU", "ScaledSwiGLU", "GELU", "ClampedSwiGLU", "ScaledSReLU"} <= set(ACTIVATION_OPS)


@pytest.mark.parametrize("name", ACTIVATION_OPS)
def test_false_is_accepted_and_computes_as_without(name):
    op = getattr(ops, name)(cache_quantized_input=False)
    assert op.cache_quantized_input is False
    plain = getattr(ops, name)()
    x = torch.randn(6, 8, dtype=torch.float64)
    extra = (torch.rand(6, dtype=torch.float64),) if op.num_extra_inputs else ()
    assert torch.equal(op(x, *extra), plain(x, *extra))


@pytest.mark.parametrize("name", ACTIVATION_OPS)
def test_true_is_refused_naming_the_op(name):
    with pytest.raises(ValueError, match=f"{name}: cache_quantized_input=True is not supported"):
        getattr(ops, name)(cache_quantized_input=True)


def test_not_a_bool_is_a_type_error():
    with pytest.raises(TypeError, match="SwiGLU: cache_quantized_input must be a bool"):
        ops.SwiGLU(cache_quantized_input=1)
