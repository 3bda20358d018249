"""Running the fuzz campaign's chains (tests/fuzz_chains.py draws them; tests/test_fuzz.py).

`build_model` builds a chain's Sequential with random parameters, frozen ones and the contract
attributes; `run_te_seq` runs it (fused or not) for the chain's microbatches, `run_reference` runs
the links' plain-PyTorch references in float64; both return an `Outcome` (outputs and one
effective gradient per leaf, wherever the gradient contract put it), and `compare` lists their
differences at the dtype's tolerance. `operate` does the chain's weight surgery.
"""

from __future__ import annotations

import contextlib
import copy
import math
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from fuzz_chains import Chain, Extra, Link, params_of, walk
from torch import Tensor

import te_seq
from te_seq import ops

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


def _reassigned(model: te_seq.Sequential) -> te_seq.Sequential:
    """Every parameter of every module replaced by a new Parameter with the same values (and
    requires_grad), by attribute assignment: `module.weight = Parameter(...)`."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                fresh = torch.nn.Parameter(param.detach().clone(), param.requires_grad)
                setattr(module, name, fresh)
    return model


SURGERIES = {  # done between the fused and the unfused run, except "tie" (see build_model)
    "deepcopy": lambda chain, model, modes: copy.deepcopy(model),
    "pickle": lambda chain, model, modes: pickle.loads(pickle.dumps(model)),
    "assign": lambda chain, model, modes: _rebuilt_by_assign(chain, model),
    "reassign": lambda chain, model, modes: _reassigned(model),
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
            extras.append(_make_extra(e, x, randn, shared, chain))
    if chain.device_splits:
        on_device = {id(t): t.to(chain.device) for t in extras if not t.is_floating_point()}
        extras = [on_device.get(id(t), t) for t in extras]
    return x, tuple(extras)


def _make_extra(e: Extra, x: Tensor, randn, shared: dict[int, Tensor], chain: Chain):
    if e.kind == "spec":  # the table's factory draws from the global RNG: seeded, isolated
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(e.seed)
            value = e.factory(torch.Size(e.shape), chain.dtype)[e.index]
        if not value.is_floating_point():
            return value
        return value.to(chain.device).requires_grad_(e.requires_grad)
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
        for op in model.basic_ops():  # the run is abandoned: drop what it queued
            if hasattr(op, "grad_policy"):
                op.grad_policy.clear()
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
