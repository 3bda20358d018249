"""Parameter initialisation and GroupedLinear's weight block.

- `reset_parameters()` on every op with parameters gives the values construction gives, which
  are recorded here from plain `torch.nn.init` (the initialisation te_seq has always used:
  Kaiming-uniform like torch.nn.Linear, zero biases, ones or zeros for norm weights);
- meta-device construction, `to_empty`, `reset_parameters()` gives a working op (every spec of
  op_specs with parameters, forward and backward against its reference);
- GroupedLinear's per-group weights and biases stay views of one block through module
  conversions, `reset_parameters` and `load_state_dict`, so a forward never stacks (copies) them.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from op_specs import SPECS, Case, OpSpec, leaves_of, reference_run, skip_if_missing

import te_seq
from te_seq import ops

D = torch.float64
G, K, N = 3, 5, 4  # groups, in_features, out_features


def _has_params(spec: OpSpec) -> bool:
    try:
        return any(True for _ in spec.build(torch.float32, "cpu").parameters())
    except AttributeError:  # the op does not exist yet
        return False


PARAM_SPECS = [s for s in SPECS if _has_params(s)]


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


# --- reset_parameters --------------------------------------------------------------------------

def _kaiming(shape: tuple[int, ...]) -> torch.Tensor:
    w = torch.empty(shape)
    torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    return w


def test_linear_weights_initialise_like_torch_linear() -> None:
    torch.manual_seed(3)
    expected = torch.nn.Linear(K, N).weight.detach()  # its weight draws first, like ours
    torch.manual_seed(3)
    assert torch.equal(ops.BasicLinear(K, N).weight.detach(), expected)
    torch.manual_seed(3)
    linear = ops.Linear(K, N)
    assert torch.equal(linear.weight.detach(), expected)
    assert torch.equal(linear.bias.detach(), torch.zeros(N))


@pytest.mark.parametrize("single", [False, True])
def test_grouped_linear_initialises_each_group_in_order(single: bool) -> None:
    skip_if_missing("GroupedLinear")
    torch.manual_seed(5)
    expected = [_kaiming((N, K)) for _ in range(G)]
    torch.manual_seed(5)
    op = ops.GroupedLinear(G, K, N, single_grouped_weight=single, single_grouped_bias=single)
    assert torch.equal(op.stacked_weight().detach(), torch.stack(expected))
    assert torch.equal(op.stacked_bias().detach(), torch.zeros(G, N))


@pytest.mark.parametrize("zero_centered", [False, True])
def test_norm_weights_initialise_to_unit_gamma(zero_centered: bool) -> None:
    gamma = torch.zeros(K) if zero_centered else torch.ones(K)
    layer = ops.LayerNorm(K, zero_centered_gamma=zero_centered)
    assert torch.equal(layer.weight.detach(), gamma)
    assert torch.equal(layer.bias.detach(), torch.zeros(K))
    assert torch.equal(ops.RMSNorm(K, zero_centered_gamma=zero_centered).weight.detach(), gamma)


@pytest.mark.parametrize("spec", PARAM_SPECS, ids=lambda s: s.name)
def test_reset_parameters_repeats_construction(spec: OpSpec) -> None:
    torch.manual_seed(11)
    fresh = _state(spec.build(torch.float32, "cpu"))
    module = spec.build(torch.float32, "cpu")
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(7.0)
    torch.manual_seed(11)
    module.reset_parameters()
    _assert_same_state(_state(module), fresh)


@pytest.mark.parametrize("spec", PARAM_SPECS, ids=lambda s: s.name)
def test_meta_init_then_to_empty_and_reset_gives_a_working_op(spec: OpSpec) -> None:
    torch.manual_seed(13)
    fresh = _state(spec.build(D, "cpu"))
    module = spec.build(D, "meta")
    assert all(p.is_meta for p in module.parameters())
    module.to_empty(device="cpu")
    torch.manual_seed(13)
    module.reset_parameters()
    _assert_same_state(_state(module), fresh)

    x = torch.randn(6, spec.in_width, dtype=D, requires_grad=True)
    seq = te_seq.Sequential(module)
    case = Case(spec, module, seq, x, spec.extras(x.shape, D), dict(module.named_parameters()))
    out = seq(x, *case.extras)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_out, ref_grads = reference_run(case, D, [grad_out])
    torch.testing.assert_close(out, ref_out[0])
    for leaf, ref in zip(leaves_of(case), ref_grads):
        if leaf.requires_grad:
            torch.testing.assert_close(leaf.grad, ref)


def test_linear_shares_its_parameters_with_its_basic_ops_after_meta_init() -> None:
    linear = ops.Linear(K, N, device="meta").to_empty(device="cpu")
    basic_linear, bias = linear.basic_ops()
    assert basic_linear.weight is linear.weight and bias.bias is linear.bias


# --- GroupedLinear's weight block --------------------------------------------------------------

@pytest.fixture
def stack_calls(monkeypatch) -> list[int]:
    """Counts torch.stack calls (how a forward would copy per-group parameters)."""
    calls: list[int] = []
    stack = torch.stack

    def counting(tensors, *args, **kwargs):
        calls.append(len(tensors))
        return stack(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "stack", counting)
    return calls


def _grouped(**kwargs) -> ops.GroupedLinear:
    skip_if_missing("GroupedLinear")
    op = ops.GroupedLinear(G, K, N, **kwargs)
    with torch.no_grad():  # distinct values per group (biases start at zero)
        for p in op.parameters():
            p.copy_(torch.randn(p.shape))
    return op


def _assert_block_intact(op: ops.GroupedLinear) -> None:
    """stacked_weight()/stacked_bias() are the blocks every Parameter views, in order."""
    for stacked, named in ((op.stacked_weight(), op.named_weights()),
                           (op.stacked_bias(), op.named_biases())):
        if stacked is None:  # bias=False
            continue
        assert stacked.shape[0] == G
        for g, (name, param) in enumerate(named):
            assert param.data_ptr() == stacked[g].data_ptr(), name
            assert param.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()


def _forward_backward(op: ops.GroupedLinear, dtype: torch.dtype):
    torch.manual_seed(17)
    x = torch.randn(7, K, dtype=D).to(dtype).requires_grad_()
    y = op(x, torch.tensor([3, 0, 4]))
    y.backward(torch.randn(y.shape, dtype=D).to(dtype))
    grads = [p.grad.clone() for p in op.parameters()]
    for p in op.parameters():
        p.grad = None
    return y.detach(), x.grad, grads


def _to_float64(op):
    return op.to(torch.float64)


def _double(op):
    return op.double()


def _half_then_back(op):  # float32 values survive the round trip only where fp16 holds them
    return op.half().float()


CONVERSIONS = {"to_float64": _to_float64, "double": _double, "half_float": _half_then_back}


@pytest.fixture(params=["set_data", "swap_tensors", "overwrite"])
def conversion_mode(request):
    """The three ways torch.nn.Module._apply can hand converted tensors to Parameters."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(request.param == "swap_tensors")
    torch.__future__.set_overwrite_module_params_on_conversion(request.param == "overwrite")
    yield request.param
    torch.__future__.set_swap_module_params_on_conversion(swap)
    torch.__future__.set_overwrite_module_params_on_conversion(overwrite)


@pytest.mark.parametrize("convert", CONVERSIONS.values(), ids=CONVERSIONS.keys())
def test_conversions_keep_the_block(convert, conversion_mode, stack_calls) -> None:
    op = _grouped()
    with torch.no_grad():  # values an fp16 round trip keeps exactly
        for p in op.parameters():
            p.copy_(p.half().float())
    before = _state(op)
    y0, dx0, grads0 = _forward_backward(op, torch.float32)
    grads0 = [g.half().float() for g in grads0]  # so the fp16 round trip keeps them too
    for p, g in zip(op.parameters(), grads0):
        p.grad = g.clone()
    stack_calls.clear()

    convert(op)
    dtype = op.weight0.dtype
    _assert_block_intact(op)
    assert stack_calls == []  # the conversion itself converted each block once, no stacking
    _assert_same_state(_state(op), {k: v.to(dtype) for k, v in before.items()})
    for p, g in zip(op.parameters(), grads0):  # existing .grad converted, not lost
        torch.testing.assert_close(p.grad, g.to(dtype), rtol=0, atol=0)
        p.grad = None
    y1, dx1, grads1 = _forward_backward(op, dtype)
    assert stack_calls == []  # and the forward read the blocks
    for a, b in zip([y1, dx1, *grads1], [y0, dx0, *grads0]):
        torch.testing.assert_close(a.float(), b, rtol=2e-3, atol=2e-3)  # grads0: fp16-rounded


def test_to_empty_then_reset_keeps_the_block(conversion_mode, stack_calls) -> None:
    torch.manual_seed(19)
    expected = _state(ops.GroupedLinear(G, K, N))
    op = _grouped()
    op.to_empty(device="cpu")
    torch.manual_seed(19)
    op.reset_parameters()
    _assert_block_intact(op)
    _assert_same_state(_state(op), expected)
    _forward_backward(op, torch.float32)
    assert stack_calls == []


def test_meta_init_keeps_the_block(conversion_mode, stack_calls) -> None:
    skip_if_missing("GroupedLinear")
    op = ops.GroupedLinear(G, K, N, device="meta")
    op.to_empty(device="cpu")
    op.reset_parameters()
    _assert_block_intact(op)
    _forward_backward(op, torch.float32)
    assert stack_calls == []


def test_load_state_dict_copies_into_the_block(stack_calls) -> None:
    op, source = _grouped(), _grouped()
    blocks = (op.stacked_weight(), op.stacked_bias())
    op.load_state_dict(source.state_dict())
    assert op.stacked_weight() is blocks[0] and op.stacked_bias() is blocks[1]
    _assert_same_state(_state(op), _state(source))
    assert stack_calls == []


def test_load_state_dict_assign_of_a_saved_checkpoint_finds_its_block(stack_calls) -> None:
    """A te_seq checkpoint stores the block's storage once; loading it back with assign=True
    gives Parameters that lie back to back, which the op takes as its block (no copy)."""
    source = _grouped()
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    op = ops.GroupedLinear(G, K, N, device="meta")
    op.load_state_dict(loaded, assign=True)
    _assert_block_intact(op)
    assert op.stacked_weight().data_ptr() == loaded["weight0"].data_ptr()
    _assert_same_state(_state(op), _state(source))
    _forward_backward(op, torch.float32)
    assert stack_calls == []


def test_replaced_storage_falls_back_to_stacking_until_a_conversion(stack_calls) -> None:
    op = _grouped(bias=False)
    y0, _, _ = _forward_backward(op, torch.float32)
    own = op.weight1.detach().clone()
    op.weight1.data = own  # out of band: this weight no longer views the block
    y1, _, _ = _forward_backward(op, torch.float32)
    assert stack_calls  # still correct, but stacked
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    assert op.weight1.data_ptr() == own.data_ptr()

    op.to(torch.float32)  # moves nothing: the deliberate alias stays
    assert op.weight1.data_ptr() == own.data_ptr()
    op.to(torch.float64)  # moves everything: re-homed into one fresh block
    stack_calls.clear()
    _assert_block_intact(op)
    y2, _, _ = _forward_backward(op, torch.float64)
    assert stack_calls == []
    torch.testing.assert_close(y2.float(), y0)


@pytest.mark.gpu
def test_cuda_keeps_the_block(stack_calls) -> None:
    op = _grouped().cuda()
    assert op.weight0.is_cuda
    _assert_block_intact(op)
    assert stack_calls == []


def test_single_grouped_weight_has_no_block_to_keep(stack_calls) -> None:
    op = _grouped(single_grouped_weight=True, single_grouped_bias=True).double()
    assert op.stacked_weight() is op.weight and op.stacked_bias() is op.bias
    _forward_backward(op, D)
    assert stack_calls == []


def test_grouped_mlp_after_meta_init_reads_the_blocks(stack_calls) -> None:
    skip_if_missing("GroupedLinear")
    seq = te_seq.Sequential(
        ops.GroupedLinear(G, K, 2 * N, device="meta"), ops.SwiGLU(),
        ops.GroupedLinear(G, N, K, device="meta"))
    seq.to_empty(device="cpu")
    for op in seq.basic_ops():
        if isinstance(op, ops.GroupedLinear):
            op.reset_parameters()
    splits = torch.tensor([2, 0, 3])
    x = torch.randn(5, K, requires_grad=True)
    seq(x, splits, splits).sum().backward()
    assert {s.name for s in seq.fusion_plan().fused_steps} == {"GroupedMLP"}
    assert stack_calls == []
