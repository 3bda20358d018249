"""The per-op spec table that drives te_seq's CPU test matrix.

A new op gets the whole matrix (every dtype, shape and gradient mode; gradcheck) by adding one
`OpSpec` here. Each spec carries a pure-PyTorch reference written independently of te_seq (plain
`torch.nn.functional`, per-group loops) so the reference never shares code with what it checks.

Shape legend: T rows (tokens), H = `in_width` (the input's last dim), G groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import te_seq

ALL_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
Params = dict[str, Tensor]
# extras(x_shape, dtype) -> the op's extra inputs (fresh random data; integer split sizes on host)
ExtrasFactory = Callable[[torch.Size, torch.dtype], tuple]


@dataclass(frozen=True)
class OpSpec:
    """One row of the table: how to build the op, feed it, and what it must compute."""

    name: str  # test id
    op_name: str  # class name in te_seq.ops (the case skips while the op does not exist)
    build: Callable[[torch.dtype, str], torch.nn.Module]
    in_width: int
    reference: Callable[..., Tensor | tuple[Tensor, ...]]  # (params, x, *extras) -> out(s)
    extras: ExtrasFactory = lambda shape, dtype: ()
    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES
    train: bool = True  # False: the module runs in eval mode
    extras_need_grad: bool = True  # False: floating extras never require grad (in-place ops)


def missing_op(op_name: str) -> bool:
    return getattr(te_seq.ops, op_name, None) is None


def skip_if_missing(op_name: str) -> None:
    if missing_op(op_name):
        pytest.skip(f"te_seq.ops.{op_name} does not exist yet (not written yet)")


def op(name: str) -> Any:
    """The op class, looked up at build time (ops still being written only skip their cases)."""
    return getattr(te_seq.ops, name)


def exported_subclasses(base: type) -> list[type]:
    """The op classes te_seq.ops exports that derive from `base` (the base itself too, if
    exported), in `__all__` order: e.g. every activation op, from the Activation base."""
    classes = [getattr(te_seq.ops, name) for name in te_seq.ops.__all__]
    return [c for c in classes if isinstance(c, type) and issubclass(c, base)]


def activation_ops() -> list[type]:
    """Every activation op class te_seq.ops exports (they all derive from Activation)."""
    from te_seq.ops.basic.activation import Activation

    return exported_subclasses(Activation)


# --- extra-input factories --------------------------------------------------------------------

def rows_of(shape: torch.Size) -> int:
    return int(torch.Size(shape[:-1]).numel())


def split_with_empty_group(rows: int, num_groups: int, dtype: torch.dtype = torch.int64) -> Tensor:
    """Host split sizes summing to `rows`, always with an empty group when G > 1:
    [a, 0, ..., rows - a] (G=1: [rows])."""
    if num_groups == 1:
        return torch.tensor([rows], dtype=dtype)
    first = rows // 3
    sizes = [first] + [0] * (num_groups - 2) + [rows - first]
    return torch.tensor(sizes, dtype=dtype)


def random_scales(rows: int, dtype: torch.dtype) -> Tensor:
    """Router-probability-like scales, one per row, away from zero."""
    return (torch.rand(rows, dtype=torch.float64) * 1.5 + 0.25).to(dtype)


def splits_factory(num_groups: int, scales: bool = False, split_dtype=torch.int64) -> ExtrasFactory:
    def make(shape: torch.Size, dtype: torch.dtype) -> tuple:
        splits = split_with_empty_group(rows_of(shape), num_groups, split_dtype)
        return (splits, random_scales(rows_of(shape), dtype)) if scales else (splits,)

    return make


def scales_factory(shape: torch.Size, dtype: torch.dtype) -> tuple:
    return (random_scales(rows_of(shape), dtype),)


def like_input_factory(shape: torch.Size, dtype: torch.dtype) -> tuple:
    return (torch.randn(shape, dtype=torch.float64).to(dtype),)


# --- references (plain PyTorch, independent of te_seq) ----------------------------------------

def ref_linear(p: Params, x: Tensor) -> Tensor:
    return F.linear(x, p["weight"], p.get("bias"))


def ref_bias(p: Params, x: Tensor) -> Tensor:
    return x + p["bias"]


def ref_grouped(num_groups: int, single_weight: bool, single_bias: bool, has_bias: bool,
                scale_bias: bool) -> Callable[..., Tensor]:
    """Per-group loop: y_g = x_g W_gᵀ + b_g (· s_t with scale_bias)."""

    def reference(p: Params, x: Tensor, splits: Tensor, scales: Tensor | None = None) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [T, K]
        outs, start = [], 0
        for g, n in enumerate(splits.tolist()):
            w = p["weight"][g] if single_weight else p[f"weight{g}"]
            y = rows[start:start + n] @ w.t()  # [n, N]
            if has_bias:
                b = p["bias"][g] if single_bias else p[f"bias{g}"]
                y = y + (scales.reshape(-1)[start:start + n, None] * b if scale_bias else b)
            outs.append(y)
            start += n
        out = torch.cat(outs) if outs else rows.new_zeros(0, 0)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return reference


def gate_up(x: Tensor, interleave: int | None) -> tuple[Tensor, Tensor]:
    """Gate and up columns by index mask: halves, or alternating blocks of `interleave` columns."""
    cols = torch.arange(x.shape[-1])
    if interleave is None:
        is_gate = cols < x.shape[-1] // 2
    else:
        is_gate = (cols // interleave) % 2 == 0
    return x[..., is_gate], x[..., ~is_gate]


def ref_glu(act: Callable[[Tensor], Tensor], interleave: int | None = None, scaled: bool = False):
    def reference(p: Params, x: Tensor, scales: Tensor | None = None) -> Tensor:
        gate, up = gate_up(x, interleave)
        y = act(gate) * up
        return y * scales.reshape(x.shape[:-1]).unsqueeze(-1) if scaled else y

    return reference


def ref_elementwise(act: Callable[[Tensor], Tensor]):
    return lambda p, x: act(x)


def gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def ref_layer_norm(eps: float, zero_centered: bool):
    def reference(p: Params, x: Tensor) -> Tensor:
        w = p["weight"] + 1 if zero_centered else p["weight"]
        return F.layer_norm(x, (x.shape[-1],), w, p["bias"], eps)

    return reference


def ref_rms_norm(eps: float, zero_centered: bool):
    def reference(p: Params, x: Tensor) -> Tensor:
        w = p["weight"] + 1 if zero_centered else p["weight"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    return reference


# --- the table --------------------------------------------------------------------------------

H, N, G = 8, 6, 3  # input width, output width, groups


def _grouped_specs() -> list[OpSpec]:
    """GroupedLinear in every parameter layout; split sizes always include an empty group."""
    variants = [  # (id, kwargs, num_groups, split dtype)
        ("per_group_bias", dict(bias=True), G, torch.int64),
        ("no_bias", dict(bias=False), G, torch.int64),
        ("single_weight_single_bias",
         dict(bias=True, single_grouped_weight=True, single_grouped_bias=True), G, torch.int64),
        ("single_weight_group_bias", dict(bias=True, single_grouped_weight=True), G, torch.int32),
        ("scale_bias", dict(bias=True, scale_bias=True), G, torch.int64),
        ("scale_bias_single_bias",
         dict(bias=True, scale_bias=True, single_grouped_bias=True), G, torch.int64),
        ("scale_bias_without_bias", dict(bias=False, scale_bias=True), G, torch.int64),
        ("one_group", dict(bias=True), 1, torch.int64),
    ]
    specs = []
    for label, kwargs, groups, split_dtype in variants:
        scaled = kwargs.get("scale_bias", False) and kwargs["bias"]
        specs.append(OpSpec(
            name=f"GroupedLinear-{label}",
            op_name="GroupedLinear",
            build=lambda dtype, device, kw=kwargs, g=groups: op("GroupedLinear")(
                g, H, N, dtype=dtype, device=device, **kw),
            in_width=H,
            reference=ref_grouped(groups, kwargs.get("single_grouped_weight", False),
                                  kwargs.get("single_grouped_bias", False), kwargs["bias"], scaled),
            extras=splits_factory(groups, scales=scaled, split_dtype=split_dtype),
        ))
    return specs


def _activation_specs() -> list[OpSpec]:
    gated = [  # (id, class, activation, interleave, scaled)
        ("SwiGLU", "SwiGLU", F.silu, None, False),
        ("SwiGLU-interleave2", "SwiGLU", F.silu, 2, False),
        ("ScaledSwiGLU", "ScaledSwiGLU", F.silu, None, True),
        ("ScaledSwiGLU-interleave2", "ScaledSwiGLU", F.silu, 2, True),
        ("GEGLU", "GEGLU", gelu_tanh, None, False),
        ("ReGLU", "ReGLU", torch.relu, None, False),
    ]
    specs = [
        OpSpec(label, cls,
               lambda dtype, device, c=cls, s=inter: op(c)(glu_interleave_size=s),
               H, ref_glu(act, inter, scaled), scales_factory if scaled else (lambda s, d: ()))
        for label, cls, act, inter, scaled in gated
    ]
    elementwise = [
        ("GELU", lambda: op("GELU")(), gelu_tanh),
        ("GELU-erf", lambda: op("GELU")(approximate="none"), F.gelu),
        ("ReLU", lambda: op("ReLU")(), torch.relu),
        ("SiLU", lambda: op("SiLU")(), F.silu),
    ]
    specs += [OpSpec(label, label.split("-")[0], lambda dtype, device, b=build: b(), H,
                     ref_elementwise(act)) for label, build, act in elementwise]
    return specs


def _linear_specs() -> list[OpSpec]:
    def build(name: str, *args, **kwargs):
        return lambda dtype, device: op(name)(*args, dtype=dtype, device=device, **kwargs)

    return [
        OpSpec("BasicLinear", "BasicLinear", build("BasicLinear", H, N), H, ref_linear),
        OpSpec("Bias", "Bias", build("Bias", H), H, ref_bias),
        OpSpec("Linear", "Linear", build("Linear", H, N), H, ref_linear),
        OpSpec("Linear-no_bias", "Linear", build("Linear", H, N, bias=False), H, ref_linear),
    ]


def _norm_specs() -> list[OpSpec]:
    specs = []
    for zero_centered in (False, True):
        tag = "-zero_centered_gamma" if zero_centered else ""
        for cls, ref in (("LayerNorm", ref_layer_norm), ("RMSNorm", ref_rms_norm)):
            specs.append(OpSpec(
                f"{cls}{tag}", cls,
                lambda dtype, device, c=cls, z=zero_centered: op(c)(
                    H, eps=1e-5, zero_centered_gamma=z, dtype=dtype, device=device),
                H, ref(1e-5, zero_centered)))
    return specs


class _ReshapeThenNorm(te_seq.Sequential):
    """Reshape [..., 8] -> [-1, 2, 4], then a norm over (2, 4); resets the norm's parameters."""

    def reset_parameters(self) -> None:
        self[1].reset_parameters()


def _multi_dim_norm_specs() -> list[OpSpec]:
    """Norms over the last two dims (normalized_shape (2, 4)) after a Reshape of [..., 8]."""
    def build(cls: str, zero_centered: bool):
        return lambda dtype, device: _ReshapeThenNorm(
            op("Reshape")((-1, 2, H // 2)),
            op(cls)((2, H // 2), eps=1e-5, zero_centered_gamma=zero_centered, dtype=dtype,
                    device=device))

    def layer_norm(p: Params, x: Tensor) -> Tensor:
        return F.layer_norm(x.reshape(-1, 2, H // 2), (2, H // 2), p["1.weight"], p["1.bias"],
                            1e-5)

    def rms_norm(p: Params, x: Tensor) -> Tensor:
        return F.rms_norm(x.reshape(-1, 2, H // 2), (2, H // 2), p["1.weight"] + 1, 1e-5)

    return [
        OpSpec("LayerNorm-shape2x4", "LayerNorm", build("LayerNorm", False), H, layer_norm),
        OpSpec("RMSNorm-shape2x4-zero_centered_gamma", "RMSNorm", build("RMSNorm", True), H,
               rms_norm),
    ]


def _shape_specs() -> list[OpSpec]:
    def plain(name: str, *args, **kwargs):
        return lambda dtype, device: op(name)(*args, **kwargs)

    return [
        OpSpec("Identity", "Identity", plain("Identity"), H, lambda p, x: x),
        # Outside te_seq.autocast, Quantize passes its input through (FP8: tests/test_fp8.py).
        OpSpec("Quantize", "Quantize", plain("Quantize"), H, lambda p, x: x),
        OpSpec("Reshape", "Reshape", plain("Reshape", (-1, 2, H // 2)), H,
               lambda p, x: x.reshape(-1, 2, H // 2)),
        OpSpec("ConstantScale", "ConstantScale", plain("ConstantScale", -0.75), H,
               lambda p, x: -0.75 * x),
        OpSpec("Dropout-p0", "Dropout", plain("Dropout", 0.0), H, lambda p, x: x),
        OpSpec("Dropout-eval", "Dropout", plain("Dropout", 0.5), H, lambda p, x: x, train=False),
        OpSpec("AddExtraInput", "AddExtraInput", plain("AddExtraInput"), H,
               lambda p, x, extra: x + extra, like_input_factory),
        # in_place writes the sum into `extra`, so `extra` must not be an autograd leaf here.
        OpSpec("AddExtraInput-in_place", "AddExtraInput", plain("AddExtraInput", in_place=True), H,
               lambda p, x, extra: x + extra, like_input_factory, extras_need_grad=False),
        OpSpec("MakeExtraOutput", "MakeExtraOutput", plain("MakeExtraOutput"), H,
               lambda p, x: (x, x)),
        OpSpec("MakeExtraOutput-in_place", "MakeExtraOutput",
               plain("MakeExtraOutput", in_place=True), H, lambda p, x: (x, x)),
    ]


def qgelu_ref(x: Tensor) -> Tensor:
    return x * torch.sigmoid(1.702 * x)


def srelu_ref(x: Tensor) -> Tensor:
    return F.relu(x).square()


def ref_torch_glu(interleave: int | None = None):
    """TE's GLU gates with the first half, torch's F.glu with the second: swap the halves."""
    def reference(p: Params, x: Tensor) -> Tensor:
        gate, up = gate_up(x, interleave)
        return F.glu(torch.cat([up, gate], -1), dim=-1)

    return reference


def ref_clamped_swiglu(limit: float, alpha: float, offset: float, interleave: int | None,
                       scaled: bool = False):
    """GPT-OSS's SwiGLU written out: gate clamped above, up clamped to ±limit, (up + offset)."""
    def reference(p: Params, x: Tensor, scales: Tensor | None = None) -> Tensor:
        gate, up = gate_up(x, interleave)
        gate = gate.clamp(max=limit)
        y = gate * torch.sigmoid(alpha * gate) * (up.clamp(min=-limit, max=limit) + offset)
        return y * scales.reshape(x.shape[:-1]).unsqueeze(-1) if scaled else y

    return reference


def ref_situglu(beta1: float, beta2: float, interleave: int | None, scaled: bool = False):
    def reference(p: Params, x: Tensor, scales: Tensor | None = None) -> Tensor:
        gate, up = gate_up(x, interleave)
        y = beta1 * torch.tanh(gate / beta1) * torch.sigmoid(gate) * beta2 * torch.tanh(up / beta2)
        return y * scales.reshape(x.shape[:-1]).unsqueeze(-1) if scaled else y

    return reference


def _te_activation_specs() -> list[OpSpec]:
    """TransformerEngine's other activations. Clamps and caps are small so random data hits them."""
    def make(cls: str, *args, **kwargs):
        return lambda dtype, device: op(cls)(*args, **kwargs)

    no_extras, scaled = (lambda s, d: ()), scales_factory
    clamp = dict(limit=0.8, alpha=1.3, glu_linear_offset=0.5)
    caps = dict(beta1=1.5, beta2=2.0)
    rows = [  # (id, class, builder, reference, extras)
        ("GLU", "GLU", make("GLU"), ref_torch_glu(), no_extras),
        ("GLU-interleave2", "GLU", make("GLU", glu_interleave_size=2), ref_torch_glu(2),
         no_extras),
        ("QGELU", "QGELU", make("QGELU"), ref_elementwise(qgelu_ref), no_extras),
        ("QGEGLU", "QGEGLU", make("QGEGLU"), ref_glu(qgelu_ref), no_extras),
        ("SReLU", "SReLU", make("SReLU"), ref_elementwise(srelu_ref), no_extras),
        ("SReGLU", "SReGLU", make("SReGLU"), ref_glu(srelu_ref), no_extras),
        ("ScaledSReLU", "ScaledSReLU", make("ScaledSReLU"),
         lambda p, x, s: srelu_ref(x) * s.reshape(x.shape[:-1]).unsqueeze(-1), scaled),
        ("ClampedSwiGLU", "ClampedSwiGLU", make("ClampedSwiGLU", **clamp),
         ref_clamped_swiglu(0.8, 1.3, 0.5, None), no_extras),
        ("ClampedSwiGLU-gpt_oss_interleave1", "ClampedSwiGLU",
         make("ClampedSwiGLU", limit=0.8, glu_interleave_size=1),
         ref_clamped_swiglu(0.8, 1.702, 1.0, 1), no_extras),
        ("ScaledClampedQGeGLU-interleave2", "ScaledClampedQGeGLU",
         make("ScaledClampedQGeGLU", 2, **clamp), ref_clamped_swiglu(0.8, 1.3, 0.5, 2, True),
         scaled),
        ("SiTUGLU", "SiTUGLU", make("SiTUGLU", **caps), ref_situglu(1.5, 2.0, None), no_extras),
        ("ScaledSiTUGLU", "ScaledSiTUGLU", make("ScaledSiTUGLU", **caps),
         ref_situglu(1.5, 2.0, None, True), scaled),
    ]
    return [OpSpec(label, cls, build, H, ref, extras) for label, cls, build, ref, extras in rows]


def ref_l2_normalization(eps: float):
    """TE's L2 norm: x / sqrt(Σ x² + eps) (eps inside the root, unlike F.normalize)."""
    return lambda p, x: x / torch.sqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True) ** 2
                                       + eps)


def _l2_specs() -> list[OpSpec]:
    return [
        OpSpec("L2Normalization", "L2Normalization",
               lambda dtype, device: op("L2Normalization")(), H, ref_l2_normalization(1e-6)),
        OpSpec("L2Normalization-eps0.5", "L2Normalization",
               lambda dtype, device: op("L2Normalization")(eps=0.5), H, ref_l2_normalization(0.5)),
    ]


# --- routing (MoE dispatch / combine): references by explicit per-slot loops ------------------

E_ROUTE = 4  # experts of the dispatch specs


def topk_factory(k: int, one_expert: bool = False) -> ExtrasFactory:
    """Top-k expert indices [..., k] (expert 1 never chosen: an empty group; or all tokens to
    expert 2) and router probabilities [..., k] in (0.25, 1.75)."""
    def make(shape: torch.Size, dtype: torch.dtype) -> tuple:
        lead = tuple(shape[:-1])
        if one_expert:
            indices = torch.full((*lead, k), 2, dtype=torch.int64)
        else:
            choices = torch.tensor([0, 2, 3])
            indices = choices[torch.randint(0, 3, (*lead, k))]
        probs = (torch.rand(*lead, k, dtype=torch.float64) * 1.5 + 0.25).to(dtype)
        return indices, probs

    return make


def ref_dispatch(p: Params, x: Tensor, indices: Tensor, probs: Tensor):
    """Rows by expert, then token, then choice: a Python loop over experts and slots."""
    rows, row_probs = [], []
    flat_x, flat_i, flat_p = x.reshape(-1, x.shape[-1]), indices.reshape(-1, indices.shape[-1]), \
        probs.reshape(-1, probs.shape[-1])
    for e in range(E_ROUTE):
        for t in range(flat_i.shape[0]):
            for j in range(flat_i.shape[1]):
                if int(flat_i[t, j]) == e:
                    rows.append(flat_x[t])
                    row_probs.append(flat_p[t, j])
    if not rows:  # slices of the inputs, so autograd still reaches them
        return flat_x[:0], flat_p.reshape(-1)[:0]
    return torch.stack(rows), torch.stack(row_probs)


def routing_factory(shape: torch.Size, dtype: torch.dtype) -> tuple:
    """A routing map for rows_of(shape) rows: a random permutation as [T, 2] (even row counts)
    or [T, 1]."""
    rows = rows_of(shape)
    k = 2 if rows % 2 == 0 and rows else 1
    return (torch.randperm(rows).reshape(-1, k),)


def ref_combine(p: Params, x: Tensor, routing: Tensor) -> Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = [sum(rows[int(r)] for r in routing[t]) for t in range(routing.shape[0])]
    return torch.stack(out) if out else rows[:0]


def ref_row_scale(p: Params, x: Tensor, scales: Tensor) -> Tensor:
    return x * scales.reshape(*x.shape[:-1], 1)


def _standalone_dispatch(k: int):
    """ExpertDispatch as a plain op: its integer outputs on channels nobody reads (so the
    caller gets rows and probs: the matrix compares floating outputs)."""
    def build(dtype, device):
        dispatch = op("ExpertDispatch")(E_ROUTE)
        dispatch.set_extra_output_channel("split_sizes", "spec.split_sizes")
        dispatch.set_extra_output_channel("routing", "spec.routing")
        return dispatch.set_extra_output_channel("probs", None)

    return build


def _routing_specs() -> list[OpSpec]:
    return [
        OpSpec("ExpertDispatch-k1", "ExpertDispatch", _standalone_dispatch(1), H, ref_dispatch,
               topk_factory(1)),
        OpSpec("ExpertDispatch-k2", "ExpertDispatch", _standalone_dispatch(2), H, ref_dispatch,
               topk_factory(2)),
        OpSpec("ExpertDispatch-one_expert", "ExpertDispatch", _standalone_dispatch(3), H,
               ref_dispatch, topk_factory(3, one_expert=True)),
        OpSpec("ExpertCombine", "ExpertCombine", lambda dtype, device: op("ExpertCombine")(), H,
               ref_combine, routing_factory),
        OpSpec("RowScale", "RowScale", lambda dtype, device: op("RowScale")(), H, ref_row_scale,
               scales_factory),
    ]


SPECS: list[OpSpec] = (
    _linear_specs() + _grouped_specs() + _activation_specs() + _norm_specs() + _shape_specs()
    + _te_activation_specs() + _l2_specs() + _multi_dim_norm_specs()
    + _routing_specs()
)

# Every basic op in te_seq.ops must have at least one spec (a new op without one fails here).
API_BASIC_OPS = (
    "BasicLinear", "Bias", "Linear", "GroupedLinear", "SwiGLU", "ScaledSwiGLU", "GELU", "ReLU",
    "SiLU", "GEGLU", "ReGLU", "LayerNorm", "RMSNorm", "Identity", "Reshape", "ConstantScale",
    "Dropout", "AddExtraInput", "MakeExtraOutput",
    "GLU", "QGELU", "QGEGLU", "SReLU", "SReGLU", "ScaledSReLU", "ClampedSwiGLU",
    "ScaledClampedQGeGLU", "SiTUGLU", "ScaledSiTUGLU", "L2Normalization",
    "ExpertDispatch", "ExpertCombine", "RowScale",
    "Quantize",
)


# --- running a spec ---------------------------------------------------------------------------

@dataclass
class Case:
    """One built instance of a spec: the Sequential, its input, extras and parameters."""

    spec: OpSpec
    module: torch.nn.Module
    seq: te_seq.Sequential
    x: Tensor
    extras: tuple
    params: dict[str, torch.nn.Parameter] = field(default_factory=dict)


def randomize_params(module: torch.nn.Module) -> None:
    """Random (never zero) parameters: biases and norm weights initialise to 0/1 otherwise."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.randn(p.shape, dtype=torch.float64) * 0.5).to(p.dtype))


def build_case(spec: OpSpec, dtype: torch.dtype, x: Tensor) -> Case:
    skip_if_missing(spec.op_name)
    module = spec.build(dtype, "cpu")
    randomize_params(module)
    seq = te_seq.Sequential(module)
    seq.train(spec.train)
    extras = spec.extras(x.shape, dtype)
    return Case(spec, module, seq, x, extras, dict(module.named_parameters()))


def as_tuple(out: Tensor | Sequence[Tensor]) -> tuple[Tensor, ...]:
    return (out,) if isinstance(out, Tensor) else tuple(out)


def floating(t: object) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point()


def reference_run(case: Case, dtype: torch.dtype, grads_out: Sequence[Tensor] | None):
    """The spec's reference on copies cast to `dtype`: (outputs, grads of x, extras, params)."""
    params = {n: p.detach().to(dtype).requires_grad_(p.requires_grad)
              for n, p in case.params.items()}
    x = case.x.detach().to(dtype).requires_grad_(case.x.requires_grad)
    extras = tuple(e.detach().to(dtype).requires_grad_(e.requires_grad) if floating(e) else e
                   for e in case.extras)
    outs = as_tuple(case.spec.reference(params, x, *extras))
    leaves = [t for t in (x, *[e for e in extras if floating(e)], *params.values())]
    wanted = [t for t in leaves if t.requires_grad]
    if grads_out is None or not wanted:
        return outs, None
    grads = torch.autograd.grad(outs, wanted, [g.to(dtype) for g in grads_out],
                                allow_unused=True)
    by_leaf = iter(grads)
    return outs, [next(by_leaf) if t.requires_grad else None for t in leaves]


def leaves_of(case: Case) -> list[Tensor]:
    """x, the floating extra inputs, then the parameters (the order `reference_run` uses)."""
    return [case.x, *[e for e in case.extras if floating(e)], *case.params.values()]


# --- dtype-aware comparison -------------------------------------------------------------------

EXACT_TOL = {torch.float64: 1e-12, torch.float32: 2e-5}
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def assert_close_to(actual: Tensor, ref64: Tensor, dtype: torch.dtype,
                    torch_lowp: Tensor | None, what: str) -> None:
    """float64/float32: tight rtol/atol. bf16/fp16: the error vs the float64 reference may be at
    most twice PyTorch's own error (the same reference run in that dtype) plus two ulps of the
    result's magnitude (te_seq rounds once, PyTorch sometimes more often, sometimes less)."""
    assert actual.shape == ref64.shape, f"{what}: shape {actual.shape} != {ref64.shape}"
    if actual.numel() == 0:
        return
    if dtype in EXACT_TOL:
        tol = EXACT_TOL[dtype]
        torch.testing.assert_close(actual.double(), ref64, rtol=tol, atol=tol,
                                   msg=lambda m: f"{what}: {m}")
        return
    err = (actual.double() - ref64).abs().max().item()
    torch_err = (torch_lowp.double() - ref64).abs().max().item() if torch_lowp is not None else 0.0
    bound = 2 * torch_err + 2 * EPS[dtype] * max(ref64.abs().max().item(), 1e-3)
    assert err <= bound, (
        f"{what}: max error {err:.3g} > bound {bound:.3g} (torch {dtype}: {torch_err:.3g})")
