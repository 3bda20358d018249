"""Random te_seq chains for the differential fuzz campaign (tests/test_fuzz.py).

A `Chain` is a list of `Link`s drawn by hypothesis: te_seq basic ops (every op of te_seq.ops),
user subclasses that keep or override the maths, plain torch.nn modules, nested Sequentials, and
motifs that the built-in fusions match (grouped MLP, linear+bias+activation, linear+bias+add,
extra output+linear, activation+bias). Each link knows how to build its module, which extra
inputs it takes and its plain-PyTorch reference. `run_te_seq` runs the chain (fused or not) with
every weight under a drawn gradient-contract mode; `run_reference` runs the references in
float64 with autograd. Both return an `Outcome`: outputs and one effective gradient per leaf.

Shape legend: the chain's input is [*lead, W]; `rows` = prod(lead) (zero allowed); G groups.
"""

from __future__ import annotations

import contextlib
import copy
import math
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from op_specs import gelu_tanh, ref_glu, ref_grouped, ref_layer_norm, ref_rms_norm
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
    kind = draw(st.sampled_from(["linear", "grouped", "bias", "activation", "norm", "residual",
                                 "extra_output", "shape", "torch"]))
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
    else:
        link, width = draw_torch_module(draw, state)
        state.shape = state.with_width(width)
    return [link]


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


@st.composite
def chains(draw, *, widths=(2, 3, 4, 6, 8), dtypes=(torch.float64, torch.float32),
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
    surgery = draw(st.sampled_from(["none"] * 4 + list(SURGERIES)))
    alone = len(links) == 1 and not links[0].children and "torch.nn" not in links[0].label
    return Chain(links, draw(st.sampled_from(dtypes)), shape, draw(st.booleans()),
                 draw(st.integers(0, 2**16)), draw(st.sampled_from([1, 1, 2])), device,
                 device_splits, surgery, noncontig=draw(st.booleans()),
                 standalone=alone and draw(st.booleans()),
                 no_grad=draw(st.integers(0, 9)) == 0, pack_hooks=draw(st.integers(0, 4)) == 0)


# --- building and running ---------------------------------------------------------------------


def build_model(chain: Chain) -> tuple[te_seq.Sequential, dict[int, str]]:
    """The Sequential, with random parameters, frozen ones frozen, and main_grad buffers on the
    weights whose link asks for them. Returns it and the mode of each contract weight (by id)."""
    torch.manual_seed(chain.seed)
    modules = [link.build(chain.dtype, chain.device) for link in chain.links]
    model = te_seq.Sequential(*modules)
    gen = torch.Generator().manual_seed(chain.seed + 1)
    modes: dict[int, str] = {}
    for link, module in _pairs(chain.links, modules):
        named = list(module.named_parameters())
        assert len(named) == len(link.frozen), f"{link!r}: {len(named)} parameters"
        for frozen, (name, p) in zip(link.frozen, named):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
            p.requires_grad_(not frozen)
            if _is_contract_weight(module, name):
                modes[id(p)] = link.mode
    if chain.surgery == "tie":
        _tie_linear_weights(model, modes)
    return model, modes


# --- weight surgery between the runs -------------------------------------------------------------


def _rebuilt_by_assign(chain: Chain, model: te_seq.Sequential) -> te_seq.Sequential:
    """A fresh model (other random values) given the model's tensors by load_state_dict(...,
    assign=True)."""
    fresh, _ = build_model(Chain(**{**vars(chain), "seed": chain.seed + 7}))
    fresh.load_state_dict(model.state_dict(), assign=True)
    return fresh


def _tie_linear_weights(model: te_seq.Sequential, modes: dict[int, str]) -> te_seq.Sequential:
    """Every later BasicLinear/Linear weight of a shape seen before (contract mode default or
    delay, so .grad collects both uses) is replaced by the first one (weight tying)."""
    first: dict[tuple, torch.nn.Parameter] = {}
    for module in model.modules():
        if not isinstance(module, (ops.BasicLinear, ops.Linear)):
            continue
        weight = module.weight
        if modes.get(id(weight)) not in ("default", "delay"):
            continue
        key = tuple(weight.shape)
        if key in first:
            module.weight = first[key]
        else:
            first[key] = weight
    return model


SURGERIES = {  # done between the fused and the unfused run, except "tie" (see build_model)
    "deepcopy": lambda chain, model, modes: copy.deepcopy(model),
    "pickle": lambda chain, model, modes: pickle.loads(pickle.dumps(model)),
    "assign": lambda chain, model, modes: _rebuilt_by_assign(chain, model),
    "tie": None,
    "copy_pending": None,  # checked inside the fused run: copy_while_pending
}


def operate(chain: Chain, model: te_seq.Sequential,
            modes: dict[int, str]) -> tuple[te_seq.Sequential, dict[int, str]]:
    """The chain's surgery; the modes follow the parameters by position."""
    if SURGERIES.get(chain.surgery) is None:  # none, tie (before both runs), copy_pending
        return model, modes
    by_position = [modes.get(id(p)) for p in model.parameters()]
    new = SURGERIES[chain.surgery](chain, model, modes)
    new_modes = {id(p): m for p, m in zip(new.parameters(), by_position) if m is not None}
    return new, new_modes


def _pairs(links: Sequence[Link], modules: Sequence[torch.nn.Module]):
    for link, module in zip(links, modules):
        if link.children:
            yield from _pairs(link.children, list(module))
        else:
            yield link, module


def _is_contract_weight(module: torch.nn.Module, name: str) -> bool:
    weighted = (ops.BasicLinear, ops.Linear, ops.GroupedLinear)
    return isinstance(module, weighted) and name.startswith("weight")


def make_inputs(chain: Chain) -> tuple[Tensor, tuple]:
    """Fresh input and extra inputs (same values every call for one chain), aliasing kept."""
    gen = torch.Generator().manual_seed(chain.seed + 2)

    def randn(shape, dtype=None):
        dtype = dtype or chain.dtype
        if chain.noncontig and shape:  # every other column of a buffer twice as wide
            wide = torch.randn((*shape[:-1], 2 * shape[-1]), generator=gen, dtype=torch.float64)
            return wide.to(dtype).to(chain.device)[..., ::2]
        t = torch.randn(shape, generator=gen, dtype=torch.float64)
        return t.to(dtype).to(chain.device)

    x = randn(chain.shape).requires_grad_(chain.x_requires_grad)
    extras: list = []
    shared: dict[int, Tensor] = {}
    for link in walk(chain.links):
        for e in link.extras:
            extras.append(_make_extra(e, x, randn, shared))
    if chain.device_splits:
        on_device = {id(t): t.to(chain.device) for t in extras if not t.is_floating_point()}
        extras = [on_device.get(id(t), t) for t in extras]
    return x, tuple(extras)


def _make_extra(e: Extra, x: Tensor, randn, shared: dict[int, Tensor]):
    if e.kind == "splits":
        if e.share is not None and e.share in shared:
            return shared[e.share]
        sizes = list(e.sizes)
        if e.bad:
            sizes[-1] += 1
        t = torch.tensor(sizes, dtype=e.split_dtype)
        if e.share is not None:
            shared[e.share] = t
        return t
    if e.alias == "input":
        return x
    shape = (e.shape[0] + 1,) if e.bad else e.shape
    t = randn(shape, e.dtype)
    if e.kind == "scales":
        t = t.abs() + 0.25  # router-probability-like
    return t.requires_grad_(e.requires_grad)


@dataclass
class Outcome:
    outputs: list[Tensor]
    grads: dict[str, Tensor | None]  # leaf label -> effective gradient (None: none arrived)
    error: BaseException | None = None
    plan: object = None
    loose: frozenset[str] = frozenset()  # grads read from fp32 main_grad buffers
    problems: list[str] = field(default_factory=list)  # seen while running (copy_pending)


def _grad_outputs(chain: Chain, outs: Sequence[Tensor]) -> list[Tensor]:
    gen = torch.Generator().manual_seed(chain.seed + 3)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]


def _prepare_contract(model: torch.nn.Module, modes: dict[int, str], seed: int) -> dict:
    """Reset .grad, set main_grad buffers (random start values) and flags; returns the starts."""
    gen = torch.Generator().manual_seed(seed + 4)
    starts = {}
    for p in model.parameters():
        p.grad = None
        for attr in ("main_grad", "overwrite_main_grad", "grad_added_to_main_grad",
                     "zero_out_wgrad"):
            if hasattr(p, attr):
                delattr(p, attr)
        mode = modes.get(id(p), "default")
        if "main_grad" not in mode:
            continue
        start = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device)
        p.main_grad = start.clone()
        starts[id(p)] = start
        p.overwrite_main_grad = mode == "main_grad_overwrite"
        if "flag" in mode:
            p.grad_added_to_main_grad = False
            if mode.endswith("zero"):
                p.zero_out_wgrad = True
    return starts


def run_te_seq(chain: Chain, model: te_seq.Sequential, modes: dict[int, str],
               fused: bool) -> Outcome:
    """Forward and backward `chain.steps` times (fresh inputs each), backward_dw() after each
    backward; effective gradients per the gradient contract."""
    starts = _prepare_contract(model, modes, chain.seed)
    outputs, leaf_grads, problems = [], {}, []
    try:
        for _ in range(chain.steps):
            x, extras = make_inputs(chain)
            with contextlib.nullcontext() if fused else te_seq.fusions_disabled(), \
                    torch.no_grad() if chain.no_grad else contextlib.nullcontext(), \
                    _copying_hooks() if chain.pack_hooks else contextlib.nullcontext():
                out = (model[0] if chain.standalone else model)(x, *extras)
                outs = list(out) if isinstance(out, tuple) else [out]
                outputs = [o.detach().clone() for o in outs]
                if not chain.no_grad:  # (an output may be the input itself, e.g. Identity's)
                    _backward(chain, outs)
            if fused and chain.surgery == "copy_pending":
                problems += copy_while_pending(model)
            while model.need_backward_dw():
                model.backward_dw()
            _add_leaf_grads(leaf_grads, x, extras)
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError) as error:
        return Outcome([], {}, error, plan_of(chain, model))
    grads = dict(leaf_grads)
    loose = set()
    for index, p in enumerate(model.parameters()):
        mode = modes.get(id(p), "default")
        grads[f"param{index}"] = _effective_grad(p, mode, starts, not chain.no_grad)
        if "main_grad" in mode:
            loose.add(f"param{index}")
    return Outcome(outputs, grads, None, plan_of(chain, model), frozenset(loose), problems)


def _grad_state(model: torch.nn.Module) -> list[Tensor | None]:
    state = []
    for p in model.parameters():
        state.append(None if p.grad is None else p.grad.clone())
        main = getattr(p, "main_grad", None)
        state.append(None if main is None else main.clone())
    return state


def copy_while_pending(model: te_seq.Sequential) -> list[str]:
    """Between backward and backward_dw(): a deepcopy has no pending wgrad and its
    backward_dw() writes nothing of the original's; pickling refuses while one is pending."""
    pending = model.need_backward_dw()
    before = _grad_state(model)
    twin = copy.deepcopy(model)
    problems = []
    if twin.need_backward_dw():
        problems.append("copy_pending: the deepcopy inherited pending wgrads")
    twin.backward_dw()
    after = _grad_state(model)
    if any((a is None) != (b is None)  # (a dummy .grad may hold NaN bits: equal_nan)
           or (a is not None and not torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
           for a, b in zip(before, after)):
        problems.append("copy_pending: the copy's backward_dw() wrote into the original")
    try:
        pickle.dumps(model)
        refused = False
    except RuntimeError as error:
        refused = "run backward_dw() first" in str(error)
    if refused != pending:
        problems.append(f"copy_pending: pickling with pending={pending} refused={refused}")
    return problems


def _copying_hooks():
    """Saved tensors are copied when saved and handed back as copies (like save_on_cpu)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)


def plan_of(chain: Chain, model: te_seq.Sequential):
    """The plan of the last call (a standalone op's own one-op Sequential's)."""
    if chain.standalone:
        inner = model[0].__dict__.get("_standalone")
        return None if inner is None else inner.fusion_plan()
    return model.fusion_plan()


def _backward(chain: Chain, outs: Sequence[Tensor]) -> None:
    pairs = [(o, g.to(o.dtype).to(o.device)) for o, g in zip(outs, _grad_outputs(chain, outs))
             if o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _add_leaf_grads(acc: dict, x: Tensor, extras: tuple) -> None:
    leaves = {"x": x}
    seen = {id(x)}
    for i, e in enumerate(extras):
        if isinstance(e, Tensor) and e.is_floating_point() and id(e) not in seen:
            leaves[f"extra{i}"] = e
            seen.add(id(e))
    for name, t in leaves.items():
        if t.grad is not None:
            acc[name] = t.grad.clone() if acc.get(name) is None else acc[name] + t.grad
        else:
            acc.setdefault(name, None)


def _effective_grad(p: torch.nn.Parameter, mode: str, starts: dict,
                    backward_ran: bool) -> Tensor | None:
    """The weight gradient that arrived, wherever the contract put it (main_grad: what was
    added to its start value, or its value under overwrite_main_grad; a frozen weight's buffer
    must stay at its start, so its change is compared against no gradient)."""
    if "main_grad" not in mode:
        return p.grad
    if mode == "main_grad_overwrite" and p.requires_grad and backward_ran:
        return p.main_grad.double()
    return p.main_grad.double() - starts[id(p)].double()


def contract_violations(chain: Chain, model: torch.nn.Module, modes: dict[int, str]) -> list[str]:
    """What autograd left in .grad and in the flag, against the gradient contract's table."""
    problems = []
    if chain.no_grad:
        return problems
    for index, p in enumerate(model.parameters()):
        mode = modes.get(id(p), "default")
        if "main_grad" not in mode or not p.requires_grad:
            continue
        if "flag" in mode:
            if p.grad_added_to_main_grad is not True:
                problems.append(f"param{index} ({mode}): grad_added_to_main_grad not set")
            if mode.endswith("zero") and p.grad is not None and p.grad.abs().sum() != 0:
                problems.append(f"param{index} ({mode}): the dummy grad is not zero")
        elif p.grad is not None:
            problems.append(f"param{index} ({mode}): .grad written besides main_grad")
    return problems


# --- the reference ------------------------------------------------------------------------------


def run_reference(chain: Chain, model: te_seq.Sequential, modes: dict[int, str]) -> Outcome:
    """Plain PyTorch in float64 on the same values: one forward/backward; grads times steps
    (overwrite_main_grad weights: once)."""
    x, extras = make_inputs(chain)
    ref_of: dict[int, Tensor] = {}

    def leaf(t):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            return t
        if id(t) not in ref_of:
            ref_of[id(t)] = t.detach().double().requires_grad_(t.requires_grad)
        return ref_of[id(t)]

    xr = leaf(x)
    extras_r = tuple(leaf(e) for e in extras)
    clones = {id(p): leaf(p) for p in model.parameters()}
    with torch.no_grad() if chain.no_grad else contextlib.nullcontext():
        y, extra_outs = run_links(chain.links, list(model), clones, xr, iter(extras_r))
    outs = [y, *extra_outs]
    if not chain.no_grad:
        _backward(chain, outs)
    grads = {}
    seen = {id(xr)}
    grads["x"] = _times(xr.grad, chain.steps)
    for i, e in enumerate(extras_r):
        if isinstance(e, Tensor) and e.is_floating_point() and id(e) not in seen:
            grads[f"extra{i}"] = _times(e.grad, chain.steps)
            seen.add(id(e))
    for index, p in enumerate(model.parameters()):
        steps = 1 if modes.get(id(p)) == "main_grad_overwrite" else chain.steps
        grads[f"param{index}"] = _times(clones[id(p)].grad, steps)
    return Outcome([o.detach() for o in outs], grads)


def _times(grad: Tensor | None, steps: int) -> Tensor | None:
    return None if grad is None else grad * steps


def run_links(links: Sequence[Link], modules: Sequence[torch.nn.Module], clones, x: Tensor,
              extras: Iterator) -> tuple[Tensor, list[Tensor]]:
    extra_outs: list[Tensor] = []
    for link, module in zip(links, modules):
        if link.children:
            x, inner = run_links(link.children, list(module), clones, x, extras)
            extra_outs.extend(inner)
            continue
        mine = tuple(next(extras) for _ in link.extras)
        x, outs = link.reference(module, params_of(module, clones), x, mine)
        extra_outs.extend(outs)
    return x, extra_outs


# --- comparison ---------------------------------------------------------------------------------

TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 6e-2}


def compare(a: Outcome, b: Outcome, dtype: torch.dtype, what: str,
            same_dtypes: bool = False) -> list[str]:
    """Differences between two outcomes (outputs, then every gradient), scaled to magnitude.
    fp32 main_grad buffers are judged at float32 tolerance whatever the model's dtype.
    `same_dtypes`: the outputs must also have the same dtypes (two te_seq runs)."""
    problems = []
    if len(a.outputs) != len(b.outputs):
        return [f"{what}: {len(a.outputs)} outputs vs {len(b.outputs)}"]
    for i, (u, v) in enumerate(zip(a.outputs, b.outputs)):
        if same_dtypes and u.dtype != v.dtype:
            problems.append(f"{what}: output {i} is {u.dtype} vs {v.dtype}")
        problems += _differ(u, v, TOLERANCE[dtype], f"{what}: output {i}")
    for name in sorted(set(a.grads) | set(b.grads)):
        loose = name in a.loose | b.loose
        tol = max(TOLERANCE[dtype], TOLERANCE[torch.float32]) if loose else TOLERANCE[dtype]
        problems += _differ(a.grads.get(name), b.grads.get(name), tol, f"{what}: grad {name}")
    return problems


def _differ(u: Tensor | None, v: Tensor | None, tol: float, what: str) -> list[str]:
    if u is None and v is None:
        return []
    if u is None or v is None:
        present = u if u is not None else v
        if present.abs().max().item() if present.numel() else 0.0:
            side = "first" if u is None else "second"
            return [f"{what}: missing on the {side} side (other side max |g| = "
                    f"{present.abs().max().item():.3g})"]
        return []
    if u.shape != v.shape:
        return [f"{what}: shape {tuple(u.shape)} vs {tuple(v.shape)}"]
    if u.numel() == 0:
        return []
    tol = max(tol, TOLERANCE.get(u.dtype, tol), TOLERANCE.get(v.dtype, tol))  # e.g. fp32 extras
    u, v = u.double().cpu(), v.double().cpu()
    scale = max(1.0, v.abs().max().item(), u.abs().max().item())
    err = (u - v).abs().max().item()
    if not math.isfinite(err) or err > tol * scale:
        return [f"{what}: max error {err:.3g} > {tol:.1g} x {scale:.3g}"]
    return []
