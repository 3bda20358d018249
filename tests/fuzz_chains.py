"""Random te_seq chains for the differential fuzz campaign (tests/test_fuzz.py).

A `Chain` is a list of `Link`s drawn by hypothesis: te_seq basic ops (hand-drawn ones with
varied sizes and options, and every row of the op spec table, so every op of te_seq.ops), user
subclasses that keep or override the maths, plain torch.nn modules, nested Sequentials, and the
windows the built-in fusions match (grouped MLP, linear+bias+activation, linear+bias+add, extra
output+linear, bias+activation). Each link knows how to build its module, which extra inputs it
takes, the gradient-contract mode of its weights, which parameters are frozen, and its
plain-PyTorch reference. tests/fuzz_runner.py builds and runs chains.

Shape legend: the chain's input is [*lead, W]; `rows` = prod(lead) (zero allowed); G groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from op_specs import (
    SPECS,
    as_tuple,
    gelu_tanh,
    missing_op,
    ref_glu,
    ref_grouped,
    ref_layer_norm,
    ref_rms_norm,
)
from torch import Tensor

import te_seq
from te_seq import ops

Params = dict[str, Tensor]
# reference(module, params by name, x, extra inputs) -> (y, extra outputs)
Reference = Callable[[torch.nn.Module, Params, Tensor, tuple], tuple[Tensor, tuple]]

# --- user subclasses ---------------------------------------------------------------------------
# Non-overriding subclasses must fuse exactly like their parents; overriding ones must keep
# their own maths (the fused result must equal theirs, never the parent's).


class UserReLU(ops.ReLU):
    pass


class UserSwiGLU(ops.SwiGLU):
    pass


class UserBasicLinear(ops.BasicLinear):
    pass


class UserGroupedLinear(ops.GroupedLinear):
    pass


class UserBias(ops.Bias):
    pass


class UserAddExtraInput(ops.AddExtraInput):
    pass


class UserMakeExtraOutput(ops.MakeExtraOutput):
    pass


class LeakyReLU(ops.ReLU):
    """Overrides the maths: y = x for x > 0, else 0.1 x."""

    def op_forward(self, ctx, input_):
        ctx.save_for_backward(input_)
        return F.leaky_relu(input_, 0.1)

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        return torch.where(x > 0, grad_output, 0.1 * grad_output), []


class DoubledSwiGLU(ops.SwiGLU):
    """Overrides the maths: y = 2 · silu(gate) · up."""

    def op_forward(self, ctx, input_):
        return 2 * super().op_forward(ctx, input_)

    def op_backward(self, ctx, grad_output):
        return super().op_backward(ctx, 2 * grad_output)


class DoubledGroupedLinear(ops.GroupedLinear):
    """Overrides the maths: y_g = 2 (x_g W_gᵀ + b_g)."""

    def fuser_forward(self, basic_op_ctxs, input_, **kwargs):
        y, extra = super().fuser_forward(basic_op_ctxs, input_, **kwargs)
        return 2 * y, extra

    def fuser_backward(self, basic_op_ctxs, grad_output, **kwargs):
        return super().fuser_backward(basic_op_ctxs, 2 * grad_output, **kwargs)


class DoubledResidual(ops.MakeExtraOutput):
    """Overrides the maths: the extra output is 2x (so dx = dy + 2 d residual)."""

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        return input_, [(2 * input_.detach(),)]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        (grad_extra,) = basic_op_grad_extra_outputs[0]
        dx = grad_output if grad_extra is None else grad_output + 2 * grad_extra
        return dx, [[]], [()]


class HalfBias(ops.Bias):
    """Overrides the maths: y = x + b / 2."""

    def op_forward(self, ctx, input_):
        return input_ + self.bias / 2

    def op_backward(self, ctx, grad_output):
        dbias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) / 2
        return grad_output, [dbias if ctx.weight_requires_grad else None]


class TwiceExtraAdd(ops.AddExtraInput):
    """Overrides the maths: y = x + 2 · extra."""

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        (extra,) = basic_op_extra_inputs[0]
        self.save(basic_op_ctxs[0], input_, extra)
        return input_ + 2 * extra, [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        dx, pgrads, (eg,) = super().fuser_backward(
            basic_op_ctxs, grad_output, basic_op_grad_extra_outputs=basic_op_grad_extra_outputs)
        return dx, pgrads, [tuple(None if g is None else 2 * g for g in eg)]


MATHS_METHODS = ("op_forward", "op_backward", "fuser_forward", "fuser_backward")


def overrides_maths(cls: type) -> bool:
    """Whether a class between `cls` and its nearest te_seq class defines maths of its own."""
    for klass in cls.__mro__:
        if klass.__module__.startswith("te_seq."):
            return False
        if any(m in vars(klass) for m in MATHS_METHODS):
            return True
    return False


# --- extra inputs and links ---------------------------------------------------------------------


@dataclass(frozen=True)
class Extra:
    """How to make one extra input. kind: "splits" (host integer sizes), "scales" [rows], or
    "residual" (`shape`; alias="input": the chain's input itself). `share`: extras with the same
    key are one tensor object (split sizes given to both linears of a grouped MLP). `bad`: an
    invalid value (split sizes that do not sum to the rows; one scale too many)."""

    kind: str
    shape: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    requires_grad: bool = False
    alias: str | None = None
    share: int | None = None
    bad: bool = False
    split_dtype: torch.dtype = torch.int64
    dtype: torch.dtype | None = None  # a floating extra's dtype when not the chain's (mixed)
    factory: Callable | None = None  # kind "spec": the OpSpec's extras factory, its `index`th
    index: int = 0
    seed: int = 0


@dataclass
class Link:
    """One element of a chain: how to build it, its extra inputs, its reference."""

    label: str
    build: Callable[[torch.dtype, str], torch.nn.Module]
    reference: Reference
    extras: tuple[Extra, ...] = ()
    mode: str = "default"  # gradient-contract mode of its weights (ops with weights only)
    frozen: tuple[bool, ...] = ()  # per parameter, in named_parameters() order
    children: tuple[Link, ...] = ()  # a nested te_seq.Sequential
    extra_outputs: int = 0

    def __repr__(self) -> str:
        inner = f"[{', '.join(map(repr, self.children))}]" if self.children else ""
        frozen = f" frozen={self.frozen}" if any(self.frozen) else ""
        mode = f" mode={self.mode}" if self.mode != "default" else ""
        extras = f" extras={list(self.extras)}" if self.extras else ""
        return f"{self.label}{inner}{mode}{frozen}{extras}"


@dataclass
class Chain:
    links: list[Link]
    dtype: torch.dtype
    shape: tuple[int, ...]
    x_requires_grad: bool
    seed: int
    steps: int  # forward+backward passes per run (microbatches): accumulation is checked
    device: str = "cpu"
    device_splits: bool = False  # split sizes on the device (else on the host)
    surgery: str = "none"  # done to the model between the fused and the unfused run (SURGERIES)
    noncontig: bool = False  # the input (and residuals) are strided views, not contiguous
    standalone: bool = False  # a one-op chain called as `op(x, *extras)`, not through Sequential
    no_grad: bool = False  # forward under torch.no_grad(): outputs only
    pack_hooks: bool = False  # saved-tensor hooks that copy on pack (as CPU offloading does)

    @property
    def bad(self) -> bool:
        return any(e.bad for link in walk(self.links) for e in link.extras)

    @property
    def strict(self) -> bool:
        """No mixed dtypes: the chain must run. With them te_seq may refuse a promoted input
        that no longer matches a later op's parameters (a clear error on both sides)."""
        return not any(e.dtype is not None for link in walk(self.links) for e in link.extras)


def walk(links: Sequence[Link]) -> Iterator[Link]:
    for link in links:
        yield link
        yield from walk(link.children)


# What is done to the model besides running it (fuzz_runner.operate): copies and pickles between
# the fused and the unfused run, tying before both, a copy while a delayed wgrad is pending.
SURGERY_NAMES = ("deepcopy", "pickle", "assign", "reassign", "tie", "copy_pending")

# --- gradient-contract modes --------------------------------------------------------------------
# Which attributes the weights carry and what the op is built with (docs/gradient_contract.md).
MODES = ("default", "delay", "main_grad", "main_grad_overwrite", "main_grad_flag",
         "main_grad_flag_zero", "delay_main_grad", "delay_main_grad_flag")


def contract_kwargs(mode: str) -> dict:
    return {"accumulate_into_main_grad": "main_grad" in mode,
            "delay_wgrad_compute": mode.startswith("delay")}


def params_of(module: torch.nn.Module, clones: dict[int, Tensor]) -> Params:
    return {name: clones[id(p)] for name, p in module.named_parameters()}


# --- references ---------------------------------------------------------------------------------


def _unary(fn: Callable[[Params, Tensor], Tensor]) -> Reference:
    return lambda module, p, x, extras: (fn(p, x), ())


def _torch_module_reference(module, p, x, extras):
    return torch.func.functional_call(module, p, (x,)), ()


def _add_reference(scale: float) -> Reference:
    return lambda module, p, x, extras: (x + scale * extras[0], ())


def _extra_output_reference(module, p, x, extras):
    return x, (x,)


def _grouped_reference(module, p, x, extras):
    op = module
    scaled = op.scale_bias and op.has_bias
    ref = ref_grouped(op.num_groups, op.single_grouped_weight, op.single_grouped_bias,
                      op.has_bias, scaled)
    y = ref(p, x, *extras)
    return (2 * y if isinstance(op, DoubledGroupedLinear) else y), ()


# --- drawing links ------------------------------------------------------------------------------


@dataclass
class State:
    """The shape flowing through the chain while it is drawn."""

    shape: tuple[int, ...]
    widths: tuple[int, ...]
    input_shape: tuple[int, ...]
    bad_ok: bool = True  # may draw invalid extra inputs (host-checked: CPU only)
    extra_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
    splits_keys: list[int] = field(default_factory=list)

    @property
    def width(self) -> int:
        return self.shape[-1]

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    def with_width(self, width: int) -> tuple[int, ...]:
        return (*self.shape[:-1], width)


def _frozen(draw, count: int) -> tuple[bool, ...]:
    """Each parameter frozen with probability ~1/5 (frozen weights take other code paths)."""
    return tuple(draw(st.lists(st.integers(0, 4), min_size=count, max_size=count).map(
        lambda xs: [x == 0 for x in xs])))


def _mode(draw) -> str:
    return draw(st.sampled_from(MODES))


def _splits(draw, state: State, groups: int, share: int | None = None) -> Extra:
    """Random sizes summing to the rows, empty groups likely."""
    cuts = sorted(draw(st.lists(st.integers(0, state.rows), min_size=groups - 1,
                                max_size=groups - 1)))
    sizes = tuple(b - a for a, b in zip([0, *cuts], [*cuts, state.rows]))
    bad = state.bad_ok and draw(st.integers(0, 29)) == 0
    split_dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    return Extra("splits", sizes=sizes, share=share, bad=bad, split_dtype=split_dtype)


def _other_dtype(draw, state: State) -> torch.dtype | None:
    """Mostly the chain's dtype (None); one time in six another float dtype (router scales in
    fp32 beside bf16 activations, a float64 residual)."""
    if draw(st.integers(0, 5)):
        return None
    return draw(st.sampled_from(state.extra_dtypes))


def _scales(draw, state: State) -> Extra:
    bad = state.bad_ok and draw(st.integers(0, 29)) == 0
    return Extra("scales", shape=(state.rows,), requires_grad=draw(st.booleans()), bad=bad,
                 dtype=_other_dtype(draw, state))


def draw_grouped(draw, state: State, out: int, groups: int, splits: Extra,
                 kind: str | None = None) -> Link:
    kind = kind or draw(st.sampled_from(["plain", "plain", "user", "doubled"]))
    cls = {"plain": ops.GroupedLinear, "user": UserGroupedLinear,
           "doubled": DoubledGroupedLinear}[kind]
    bias = draw(st.booleans())
    single_w = draw(st.booleans())
    single_b = bias and draw(st.booleans())
    scale_bias = draw(st.booleans())
    mode = _mode(draw)
    k = state.width
    nparams = (1 if single_w else groups) + ((1 if single_b else groups) if bias else 0)
    extras = (splits,) + ((_scales(draw, state),) if scale_bias and bias else ())

    def build(dtype, device):
        return cls(groups, k, out, bias, dtype=dtype, device=device,
                   single_grouped_weight=single_w, single_grouped_bias=single_b,
                   scale_bias=scale_bias, **contract_kwargs(mode))

    label = f"{cls.__name__}({groups},{k},{out},bias={bias},single_w={single_w}," \
            f"single_b={single_b},scale_bias={scale_bias})"
    return Link(label, build, _grouped_reference, extras, mode, _frozen(draw, nparams))


def draw_linear(draw, state: State, out: int, with_bias: bool | None = None) -> Link:
    """BasicLinear (optionally a user subclass) or the composite Linear (weight [+ bias])."""
    kind = draw(st.sampled_from(["basic", "user_basic", "linear"]))
    mode = _mode(draw)
    k = state.width
    if kind == "linear":
        bias = draw(st.booleans()) if with_bias is None else with_bias

        def build(dtype, device):
            return ops.Linear(k, out, bias, dtype=dtype, device=device, **contract_kwargs(mode))

        ref = _unary(lambda p, x: F.linear(x, p["weight"], p.get("bias")))
        return Link(f"Linear({k},{out},bias={bias})", build, ref, (), mode,
                    _frozen(draw, 2 if bias else 1))
    cls = ops.BasicLinear if kind == "basic" else UserBasicLinear

    def build(dtype, device):
        return cls(k, out, dtype=dtype, device=device, **contract_kwargs(mode))

    return Link(f"{cls.__name__}({k},{out})", build,
                _unary(lambda p, x: F.linear(x, p["weight"])), (), mode, _frozen(draw, 1))


def draw_bias(draw, state: State) -> Link:
    cls = draw(st.sampled_from([ops.Bias, ops.Bias, UserBias, HalfBias]))
    size = state.width
    scale = 0.5 if cls is HalfBias else 1.0
    return Link(f"{cls.__name__}({size})",
                lambda dtype, device: cls(size, dtype=dtype, device=device),
                _unary(lambda p, x: x + scale * p["bias"]), (), "default", _frozen(draw, 1))


def _activation_choices(width: int) -> list[tuple]:
    """(label, factory, reference maker, gated, interleave, takes scales) that fit `width`."""
    choices = [
        ("ReLU", ops.ReLU, lambda: lambda p, x: torch.relu(x), False, None, False),
        ("UserReLU", UserReLU, lambda: lambda p, x: torch.relu(x), False, None, False),
        ("LeakyReLU", LeakyReLU, lambda: lambda p, x: F.leaky_relu(x, 0.1), False, None, False),
        ("GELU", ops.GELU, lambda: lambda p, x: gelu_tanh(x), False, None, False),
        ("GELU-erf", lambda: ops.GELU(approximate="none"), lambda: lambda p, x: F.gelu(x),
         False, None, False),
        ("SiLU", ops.SiLU, lambda: lambda p, x: F.silu(x), False, None, False),
    ]
    gated = [  # (label, class, act, scaled)
        ("SwiGLU", ops.SwiGLU, F.silu, False, 1), ("UserSwiGLU", UserSwiGLU, F.silu, False, 1),
        ("DoubledSwiGLU", DoubledSwiGLU, F.silu, False, 2),
        ("GEGLU", ops.GEGLU, gelu_tanh, False, 1), ("ReGLU", ops.ReGLU, torch.relu, False, 1),
        ("ScaledSwiGLU", ops.ScaledSwiGLU, F.silu, True, 1),
    ]
    for label, cls, act, scaled, factor in gated:
        for inter in (None, 1, 2):
            if width % (2 * (inter or 1)):
                continue
            choices.append((f"{label}(interleave={inter})",
                            lambda c=cls, i=inter: c(glu_interleave_size=i),
                            lambda a=act, i=inter, s=scaled, f=factor: _scaled(
                                ref_glu(a, i, s), f),
                            True, inter, scaled))
    return choices


def _scaled(ref, factor: float):
    if factor == 1:
        return lambda p, x, *extras: ref(p, x, *extras)
    return lambda p, x, *extras: factor * ref(p, x, *extras)


def draw_activation(draw, state: State, gated: bool | None = None) -> tuple[Link, int]:
    """An activation op that fits the width; returns it and the output width."""
    choices = [c for c in _activation_choices(state.width) if gated is None or c[3] == gated]
    label, factory, make_ref, is_gated, _, scaled = draw(st.sampled_from(choices))
    ref = make_ref()
    extras = (_scales(draw, state),) if scaled else ()

    def reference(module, p, x, ex):
        return ref(p, x, *ex), ()

    out = state.width // 2 if is_gated else state.width
    return Link(label, lambda dtype, device: factory(), reference, extras), out


def draw_norm(draw, state: State) -> Link:
    cls = draw(st.sampled_from(["LayerNorm", "RMSNorm"]))
    zero = draw(st.booleans())
    size = state.width
    ref = (ref_layer_norm if cls == "LayerNorm" else ref_rms_norm)(1e-5, zero)
    count = 2 if cls == "LayerNorm" else 1
    return Link(f"{cls}({size},zero_centered_gamma={zero})",
                lambda dtype, device: getattr(ops, cls)(size, zero_centered_gamma=zero,
                                                        dtype=dtype, device=device),
                _unary(ref), (), "default", _frozen(draw, count))


def draw_residual(draw, state: State, cls: type | None = None) -> Link:
    """AddExtraInput (maybe in place, maybe a user subclass) with a residual of the current
    shape or broadcast [W]; sometimes the chain's input itself (aliasing)."""
    cls = cls or draw(st.sampled_from([ops.AddExtraInput, ops.AddExtraInput, UserAddExtraInput,
                                       TwiceExtraAdd]))
    in_place = draw(st.booleans())
    # The chain's input itself whenever the shapes allow it half the time: in-place aliasing.
    can_alias = state.shape == state.input_shape
    form = draw(st.sampled_from(["full", "broadcast", "input", "input"] if can_alias
                                else ["full", "full", "broadcast"]))
    shape = (state.width,) if form == "broadcast" else state.shape
    extra = Extra("residual", shape=shape, requires_grad=draw(st.booleans()),
                  alias="input" if form == "input" else None,
                  dtype=None if form == "input" else _other_dtype(draw, state))
    scale = 2.0 if cls is TwiceExtraAdd else 1.0
    return Link(f"{cls.__name__}(in_place={in_place})",
                lambda dtype, device: cls(in_place=in_place), _add_reference(scale), (extra,))


def draw_shape_op(draw, state: State) -> tuple[Link, tuple[int, ...]]:
    kind = draw(st.sampled_from(["Identity", "ConstantScale", "Dropout", "Reshape-flat",
                                 "Reshape-split"]))
    if kind == "Identity":
        return Link("Identity", lambda d, dev: ops.Identity(), _unary(lambda p, x: x)), state.shape
    if kind == "ConstantScale":
        s = draw(st.sampled_from([-0.5, 2.0, 0.0]))
        return Link(f"ConstantScale({s})", lambda d, dev: ops.ConstantScale(s),
                    _unary(lambda p, x: s * x)), state.shape
    if kind == "Dropout":  # p = 0: the identity (a random mask has no reference)
        return Link("Dropout(0.0)", lambda d, dev: ops.Dropout(0.0),
                    _unary(lambda p, x: x)), state.shape
    width = state.width  # bound now: `state` changes as the chain is drawn
    if kind == "Reshape-split" and width % 2 == 0:
        return Link("Reshape(-1,2,W/2)", lambda d, dev: ops.Reshape((-1, 2, width // 2)),
                    _unary(lambda p, x: x.reshape(-1, 2, width // 2))), (state.rows, 2, width // 2)
    return Link("Reshape(-1,W)", lambda d, dev: ops.Reshape((-1, width)),
                _unary(lambda p, x: x.reshape(-1, width))), (state.rows, width)


def draw_torch_module(draw, state: State) -> tuple[Link, int]:
    kind = draw(st.sampled_from(["Tanh", "Linear", "Identity"]))
    if kind == "Linear":
        out = draw(st.sampled_from(state.widths))
        k = state.width
        return Link(f"torch.nn.Linear({k},{out})",
                    lambda dtype, device: torch.nn.Linear(k, out, dtype=dtype, device=device),
                    _torch_module_reference, (), "default", _frozen(draw, 2)), out
    module = {"Tanh": torch.nn.Tanh, "Identity": torch.nn.Identity}[kind]
    return Link(f"torch.nn.{kind}", lambda dtype, device: module(),
                _torch_module_reference), state.width


# --- motifs (windows the built-in fusions match) ---------------------------------------------


def motif_grouped_mlp(draw, state: State) -> list[Link]:
    groups = draw(st.integers(1, 6))
    share = len(state.splits_keys)
    state.splits_keys.append(share)
    first = _splits(draw, state, groups, share)
    how = draw(st.sampled_from(["same", "same", "equal", "other"]))
    gated = draw(st.booleans())
    ffn = draw(st.sampled_from(state.widths))
    fc1 = draw_grouped(draw, state, 2 * ffn if gated else ffn, groups, first)
    state.shape = state.with_width(2 * ffn if gated else ffn)
    act, width = draw_activation(draw, state, gated=gated)
    state.shape = state.with_width(width)
    if how == "same":
        second = first
    elif how == "equal":
        second = Extra("splits", sizes=first.sizes, split_dtype=first.split_dtype)
    else:
        second = _splits(draw, state, groups)
    out = draw(st.sampled_from(state.widths))
    fc2 = draw_grouped(draw, state, out, groups, second)
    state.shape = state.with_width(out)
    return [fc1, act, fc2]


def motif_linear_activation(draw, state: State) -> list[Link]:
    out = draw(st.sampled_from([w for w in state.widths if w % 2 == 0]))
    links = [draw_linear(draw, state, out, with_bias=True)]
    state.shape = state.with_width(out)
    if draw(st.booleans()) and links[0].label.startswith(("BasicLinear", "UserBasicLinear")):
        links.append(draw_bias(draw, state))
    act, width = draw_activation(draw, state)
    state.shape = state.with_width(width)
    return [*links, act]


def motif_linear_add(draw, state: State) -> list[Link]:
    # Often the input's own width, so the residual may be the chain's input (aliasing).
    out = state.width if draw(st.booleans()) else draw(st.sampled_from(state.widths))
    links = [draw_linear(draw, state, out, with_bias=True)]
    state.shape = state.with_width(out)
    if links[0].label.startswith(("BasicLinear", "UserBasicLinear")):
        links.append(draw_bias(draw, state))
    links.append(draw_residual(draw, state))
    return links


def _doubled_residual_reference(module, p, x, extras):
    return x, (2 * x,)


def motif_extra_output_linear(draw, state: State) -> list[Link]:
    cls = draw(st.sampled_from([ops.MakeExtraOutput, ops.MakeExtraOutput, UserMakeExtraOutput,
                                DoubledResidual]))
    in_place = draw(st.booleans())
    ref = _doubled_residual_reference if cls is DoubledResidual else _extra_output_reference
    make = Link(f"{cls.__name__}(in_place={in_place})",
                lambda d, dev: cls(in_place=in_place), ref, extra_outputs=1)
    out = draw(st.sampled_from(state.widths))
    linear = draw_linear(draw, state, out)
    state.shape = state.with_width(out)
    return [make, linear]


def motif_bias_activation(draw, state: State) -> list[Link]:
    bias = draw_bias(draw, state)
    act, width = draw_activation(draw, state)
    state.shape = state.with_width(width)
    return [bias, act]


def draw_single(draw, state: State) -> list[Link]:
    kinds = ["linear", "grouped", "bias", "activation", "norm", "residual", "extra_output",
             "shape", "torch"]
    if _fitting_specs(state):  # often: the table reaches every op, the rest only the above
        kinds += ["spec"] * 4
    kind = draw(st.sampled_from(kinds))
    if kind == "linear":
        out = draw(st.sampled_from(state.widths))
        link = draw_linear(draw, state, out)
        state.shape = state.with_width(out)
    elif kind == "grouped":
        groups = draw(st.integers(1, 6))
        out = draw(st.sampled_from(state.widths))
        link = draw_grouped(draw, state, out, groups, _splits(draw, state, groups))
        state.shape = state.with_width(out)
    elif kind == "bias":
        link = draw_bias(draw, state)
    elif kind == "activation":
        link, width = draw_activation(draw, state)
        state.shape = state.with_width(width)
    elif kind == "norm":
        link = draw_norm(draw, state)
    elif kind == "residual":
        link = draw_residual(draw, state)
    elif kind == "extra_output":
        cls = draw(st.sampled_from([ops.MakeExtraOutput, UserMakeExtraOutput]))
        link = Link(cls.__name__, lambda d, dev: cls(), _extra_output_reference, extra_outputs=1)
    elif kind == "shape":
        link, state.shape = draw_shape_op(draw, state)
    elif kind == "spec":
        link = draw_spec_op(draw, state)
    else:
        link, width = draw_torch_module(draw, state)
        state.shape = state.with_width(width)
    return [link]


def _fitting_specs(state: State) -> list:
    """Rows of the op spec table (tests/op_specs.py) that take the current width, in training
    mode: through them a new op joins the fuzz with its OpSpec alone."""
    return [s for s in SPECS if s.in_width == state.width and s.train and not missing_op(s.op_name)]


def draw_spec_op(draw, state: State) -> Link:
    """Any op of the spec table, built and referenced as the table says; its output shape (and
    extra outputs) come from running its reference once on zeros."""
    spec = draw(st.sampled_from(_fitting_specs(state)))
    probe = spec.build(torch.float64, "cpu")
    shape = torch.Size(state.shape)
    probe_extras = spec.extras(shape, torch.float64)
    probe_params = dict(probe.named_parameters())
    outs = as_tuple(spec.reference(probe_params, torch.zeros(shape, dtype=torch.float64),
                                   *probe_extras))
    seed = draw(st.integers(0, 2**16))
    extras = tuple(
        Extra("spec", shape=state.shape, factory=spec.extras, index=i, seed=seed,
              requires_grad=spec.extras_need_grad and t.is_floating_point() and draw(st.booleans()))
        for i, t in enumerate(probe_extras))
    state.shape = tuple(outs[0].shape)

    def reference(module, p, x, ex):
        result = as_tuple(spec.reference(p, x, *ex))
        return result[0], tuple(result[1:])

    return Link(f"spec:{spec.name}", spec.build, reference, extras, "default",
                _frozen(draw, len(probe_params)), extra_outputs=len(outs) - 1)


MOTIFS = {
    "single": draw_single, "grouped_mlp": motif_grouped_mlp,
    "linear_activation": motif_linear_activation, "linear_add": motif_linear_add,
    "extra_output_linear": motif_extra_output_linear, "bias_activation": motif_bias_activation,
}


def _nested_reference(module, p, x, extras):
    raise AssertionError("nested links are run link by link")  # see run_links


def draw_links(draw, state: State, budget: int, depth: int = 0) -> list[Link]:
    links: list[Link] = []
    while budget > 0:
        name = draw(st.sampled_from([*MOTIFS, "single", "nested"] if depth < 2 else [*MOTIFS]))
        if name == "nested":
            children = draw_links(draw, state, draw(st.integers(1, 2)), depth + 1)
            links.append(Link("Sequential", _nested_builder(children), _nested_reference,
                              children=tuple(children)))
            budget -= 1
            continue
        new = MOTIFS[name](draw, state)
        links.extend(new)
        budget -= 1
    return links


def _nested_builder(children: Sequence[Link]):
    def build(dtype, device):
        return te_seq.Sequential(*[c.build(dtype, device) for c in children])

    return build


DEFAULT_WIDTHS = (2, 3, 4, 6, 8)  # 8: the spec table's input width (op_specs.H)


@st.composite
def chains(draw, *, widths=DEFAULT_WIDTHS, dtypes=(torch.float64, torch.float32),
           max_motifs: int = 3, device: str = "cpu") -> Chain:
    """A random chain of 1..max_motifs motifs over an input [*lead, W] (rows may be zero).
    On CUDA no invalid extra inputs are drawn (device split sizes fail a device assert) and
    split sizes live on the host or the device."""
    lead = draw(st.sampled_from([(0,), (1,), (3,), (5,), (2, 3), (0, 2), (7,)]))
    shape = (*lead, draw(st.sampled_from(widths)))
    state = State(shape, tuple(widths), shape, bad_ok=device == "cpu",
                  extra_dtypes=tuple(d for d in (torch.float32, torch.float64) if d in dtypes)
                  or (torch.float32,))
    links = draw_links(draw, state, draw(st.integers(1, max_motifs)))
    device_splits = device != "cpu" and draw(st.booleans())
    surgery = draw(st.sampled_from(["none"] * 4 + list(SURGERY_NAMES)))
    alone = len(links) == 1 and not links[0].children and "torch.nn" not in links[0].label
    return Chain(links, draw(st.sampled_from(dtypes)), shape, draw(st.booleans()),
                 draw(st.integers(0, 2**16)), draw(st.sampled_from([1, 1, 2])), device,
                 device_splits, surgery, noncontig=draw(st.booleans()),
                 standalone=alone and draw(st.booleans()),
                 no_grad=draw(st.integers(0, 9)) == 0, pack_hooks=draw(st.integers(0, 4)) == 0)
