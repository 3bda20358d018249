"""How a Fuser runs while `torch.compile` traces it (docs/design.md, "torch.compile").

Dynamo traces the fuser's Python: the plan key (so every fact the plan depends on becomes a
guard), the contexts, the autograd bridge and the ops, whose GEMM kernels are opaque custom ops
(`te_seq.kernels.traced`). Two pieces run as real Python at trace time instead:

- `ensure_plan`: builds (or finds) the plan for a key. Dynamo calls it with the key's constants
  and treats its result, an index into the Fuser's plan list, as a constant; the traced code then
  reads the plan from that list. Fusion builds see stand-ins for the extra inputs (meta tensors
  with the real dtypes, ranks and sameness), never data.
- `run_eagerly`: a run that cannot be traced runs at a graph break, exactly as in eager mode:
  runs with ops from outside te_seq (user ops, te_seq subclasses) unless their class sets
  `compile_traceable = True`; `Reshape` and in-place `AddExtraInput` (dynamo's autograd.Function
  can neither return a view of its input nor write into one); runs under user-registered
  fusions; and runs whose gradient contract has effects outside autograd (main_grad, delayed
  wgrad: the Python that routes them must run when backward runs, not when it is traced).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from te_seq.core import fp8
from te_seq.core.amp import AutocastState
from te_seq.core.operation import FusibleOperation
from te_seq.fusion.registry import list_fusions

# Dynamo traces te_seq's fuser from torch 2.11 on (tested: 2.11 and 2.13). Older torch runs a
# whole te_seq Sequential eagerly at a graph break (`run_sequential_eagerly`): results are exactly
# eager's, `fullgraph=True` is refused by dynamo.
TRACEABLE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 11)
UNTRACEABLE_REASON = (
    f"te_seq is traced by torch.compile from torch 2.11 on; torch {torch.__version__} runs each "
    "te_seq Sequential eagerly at a graph break"
)


@torch.compiler.disable
def run_sequential_eagerly(
    module: Any, input_: Tensor, *extra_inputs: Any, op_kwargs: Any = None
) -> Any:
    """A Sequential's eager forward, at a graph break (torch older than 2.11, or a call with
    op_kwargs: caller-provided buffers are written in place, which is left to eager mode)."""
    if op_kwargs:
        return module(input_, *extra_inputs, op_kwargs=op_kwargs)
    return module(input_, *extra_inputs)


# `fuser` arguments are run/fuser.py's Fuser (not imported: fuser.py imports this module).
Fuser = Any

KEY_DTYPE, KEY_DEVICE, KEY_WITH_BACKWARD, KEY_INPUT_GRAD, KEY_EXTRA = 4, 5, 6, 7, 10
KEY_AUTOCAST = 12


def op_traceable(op: FusibleOperation) -> bool:
    """Whether dynamo may trace `op`: its `compile_traceable` attribute where it has one (te_seq
    ops that return a view of their input or write into it say False), else whether its class
    is te_seq's own; and no gradient-contract effects outside autograd."""
    own = getattr(op, "compile_traceable", None)
    if own is None:
        own = type(op).__module__.startswith("te_seq.")
    policy = getattr(op, "grad_policy", None)
    side_effects = policy is not None and (
        policy.accumulate_into_main_grad or policy.delay_wgrad_compute
    )
    return own and not side_effects


def untraceable_reason(fuser: Fuser, steps: Sequence[FusibleOperation]) -> str:
    """Why this run must run eagerly under torch.compile ("" if it can be traced)."""
    user = [p.name for p in list_fusions() if p.enabled and not p.builtin]
    if user:
        return f"user-registered fusions are enabled ({', '.join(user)})"
    if fp8.active_recipe() is not None:  # host reads of group offsets, the weight cache
        return f"FP8 recipe {fp8.active_recipe()} (FP8 runs eagerly under torch.compile)"
    for op in (*fuser.ops, *steps):
        if not op_traceable(op):
            return f"{type(op).__name__} is not traceable (see te_seq.run.compiled)"
    return ""


def _stand_ins(fuser: Fuser, signature: tuple) -> list[tuple]:
    """Meta tensors in place of the extra inputs (dtype, rank, requires_grad and sameness from
    the plan key's signature), split per basic op."""
    made: dict[int, Any] = {}
    flat = []
    for label, *facts in signature:
        if label not in made:
            made[label] = _stand_in(facts)
        flat.append(made[label])
    out, start = [], 0
    for op in fuser.ops:
        out.append(tuple(flat[start : start + op.num_extra_inputs]))
        start += op.num_extra_inputs
    return out


def _stand_in(facts: list) -> Any:
    if len(facts) != 4:  # not a tensor: (type,)
        return object()
    dtype, _device, requires_grad, dim = facts
    t = torch.empty((0,) * dim, dtype=dtype, device="meta")
    return t.requires_grad_() if requires_grad else t


# Objects that traced code hands to the functions below by a token: dynamo passes
# only constants to `assume_constant_result` functions, and torch 2.11 does not take a module
# or a plain object as one (measured on the GPU host, 2026-11-24: "UnspecializedNNModuleVariable
# (Sequential) is not a constant"). A token is a str attribute of its object, weakly mapped back:
# a str, not an int, since dynamo may turn an int attribute that differs between objects of the
# same code into a symbolic int (then "SymNodeVariable() is not a constant").
_OBJECTS: dict[str, weakref.ref] = {}
_TOKENS = itertools.count()


def token_for(obj: object) -> str:
    """A new token naming `obj` (its owner stores it; a copy must ask for its own)."""
    token = f"te_seq-{next(_TOKENS)}"
    _OBJECTS[token] = weakref.ref(obj, lambda _, t=token: _OBJECTS.pop(t, None))
    return token


def _object(token: str) -> Any:
    obj = _OBJECTS[token]()
    if obj is None:
        raise RuntimeError(f"te_seq: the object of compile token {token} was freed")
    return obj


@torch._dynamo.assume_constant_result
def ensure_plan(token: str, key: tuple) -> int:
    """The index in the Fuser's `compiled_plans` of the plan for `key`, built now if new (real
    Python at trace time; dynamo treats the index as a constant). `token`: the Fuser's."""
    fuser = _object(token)
    for index, (known, _) in enumerate(fuser.compiled_plans):
        if known == key:
            return index
    input_ = torch.empty(0, dtype=key[KEY_DTYPE], device="meta")
    extra = _stand_ins(fuser, key[KEY_EXTRA])
    autocast = None if key[KEY_AUTOCAST] is None else AutocastState(*key[KEY_AUTOCAST])
    plan = fuser.build_plan(
        input_, key[KEY_DEVICE], extra, key[KEY_WITH_BACKWARD], autocast
    ).traced()
    steps = [seg.op for seg in plan.forward + plan.backward]
    plan.eager_reason = untraceable_reason(fuser, steps)
    fuser.compiled_plans.append((key, plan))
    return len(fuser.compiled_plans) - 1


@torch._dynamo.assume_constant_result
def prepare(token: str) -> int:
    """The Sequential's `prepare_runs()` as real Python at trace time (its Fusers must be real
    objects, not ones dynamo builds symbolically); the result, 0, is a constant."""
    _object(token).prepare_runs()
    return 0


@torch.compiler.disable
def run_eagerly(
    fuser: Fuser, input_: Tensor, extra: list[tuple], call_inputs: object = None
) -> tuple[Tensor, list[tuple]]:
    """The eager run, at a graph break."""
    return fuser.run_eager(input_, extra, call_inputs)
