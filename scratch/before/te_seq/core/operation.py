"""Operation base classes: what every te_seq op (basic or fused) implements.

A *basic op* (`BasicOperation`) defines one piece of maths and may own parameters. A *fused op*
(`FusedOperation`) owns nothing: it runs the maths of a window of adjacent basic ops faster.
The fuser (run/fuser.py) gives every basic op its own `OperationContext` (core/context.py), also
inside a fused op, so forward-only and backward-only fusions can mix with unfused partners.

Layering: core/ imports nothing above it (fusion/, run/, ops/) at module level. The one
deliberate upward import is function-level, in `BasicOperation.forward`: the standalone call
`op(x)` runs the op through a one-op `te_seq.run.sequential.Sequential`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from te_seq.core import channels
from te_seq.core.context import OperationContext
from te_seq.kernels.backend import Backend, BackendChoice, KernelNeed, choose_backend

__all__ = [
    "BasicOperation",
    "CompositeOperation",
    "FusedOperation",
    "FusibleOperation",
    "OperationContext",
    "ParamGrads",
    "is_te_seq_class",
    "no_value_checks",
    "op_state_version",
]

ParamGrads = Sequence[Tensor | None]


# Bumped whenever an attribute of any basic op is set or deleted (its settings, `training`, a
# Parameter replaced, even its class): the fuser's steady-state fast path (run/fast_path.py)
# reuses what it validated only while this is unchanged.
_state_version = [0]


def op_state_version() -> int:
    """The count of attribute writes to basic ops so far (see `_state_version`)."""
    return _state_version[0]


def is_te_seq_class(cls: type) -> bool:
    """Whether `cls` is one of te_seq's own classes (not a user's, nor a user's subclass)."""
    return cls.__module__ == "te_seq" or cls.__module__.startswith("te_seq.")


class FusibleOperation(torch.nn.Module):
    """Anything the fuser can run: a basic op or a fused op."""

    @property
    def is_fused_op(self) -> bool:
        raise NotImplementedError

    def kernel_needs(self) -> list[KernelNeed]:
        """The backend kernels this op calls, with their static facts (K/N sizes, activation...);
        empty for an op whose maths is plain PyTorch (it runs on the reference backend)."""
        return []

    def plan_backend(
        self, requested: str, dtype: torch.dtype, device: torch.device
    ) -> BackendChoice:
        """The backend this op runs on under the `requested` one ("auto" or a name) for `dtype`
        data on `device`, and why: one that supports every kernel in `kernel_needs()`."""
        return choose_backend(requested, dtype, device, self.kernel_needs())

    def plan_note(self, backend: Backend, dtype: torch.dtype, device: torch.device) -> str:
        """A line for `fusion_plan()` on how this op runs (e.g. which kernels fuse); "" if none."""
        return ""

    def fuser_forward(
        self,
        basic_op_ctxs: list[OperationContext],
        input_: Tensor,
        *,
        basic_op_extra_inputs: list[tuple[Tensor, ...]],
        basic_op_kwargs: list[dict[str, Any]],
    ) -> tuple[Tensor, Sequence[Sequence[Tensor]]]:
        """Forward over this op's basic ops. Returns (output, extra outputs per basic op)."""
        raise NotImplementedError(f"{type(self).__name__} has no forward implementation")

    def fuser_backward(
        self,
        basic_op_ctxs: list[OperationContext],
        grad_output: Tensor,
        *,
        basic_op_grad_extra_outputs: list[tuple[Tensor | None, ...]],
    ) -> tuple[Tensor | None, Sequence[ParamGrads], Sequence[Sequence[Tensor | None]]]:
        """Backward over this op's basic ops, in forward order of the returned lists.

        Returns (grad of input, parameter grads per basic op, extra-input grads per basic op).
        """
        raise NotImplementedError(f"{type(self).__name__} has no backward implementation")


def no_value_checks(op: BasicOperation, input_: Tensor, extra_inputs: tuple) -> None:
    """`value_checks` of an op whose checks read only the call's signature: nothing to do."""


_SPLIT_CHECKS: dict[type, bool] = {}


def _splits_checks(cls: type) -> bool:
    """Whether `cls`'s `value_checks` comes from the class that defines its `pre_forward_checks`
    or a subclass of it (so it knows which of those checks read values)."""
    known = _SPLIT_CHECKS.get(cls)
    if known is None:
        mro = cls.__mro__
        checks_owner = next(c for c in mro if "pre_forward_checks" in c.__dict__)
        values_owner = next(c for c in mro if "value_checks" in c.__dict__)
        known = _SPLIT_CHECKS[cls] = issubclass(values_owner, checks_owner)
    return known


class BasicOperation(FusibleOperation):
    """One piece of maths with an optional set of parameters.

    Subclasses implement `op_forward`/`op_backward`; ops with extra inputs or outputs override
    `fuser_forward`/`fuser_backward` instead.

    `fusion_safe`: fusions implement the maths of the class their pattern names, so a subclass
    that overrides any of those four methods is not fused by them (the plan says why), unless
    it sets `fusion_safe = True` in its own class body, declaring that its overrides keep the
    parent's maths (e.g. they only log or count). A subclass of it that overrides the maths
    again must declare it again.
    """

    num_extra_inputs: int = 0
    num_extra_outputs: int = 0
    fusion_safe: bool = False
    # Keyword arguments a call may give this op's forward (`Sequential.forward(...,
    # op_kwargs={index: {...}})`, run/op_kwargs.py), e.g. caller-provided buffers ("out").
    op_kwarg_names: tuple[str, ...] = ()

    @property
    def is_fused_op(self) -> bool:
        return False

    def op_forward(self, ctx: OperationContext, input_: Tensor, **kwargs: Any) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement op_forward")

    def op_backward(
        self, ctx: OperationContext, grad_output: Tensor
    ) -> tuple[Tensor | None, ParamGrads]:
        raise NotImplementedError(f"{type(self).__name__} must implement op_backward")

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs):
        output = self.op_forward(basic_op_ctxs[0], input_, **basic_op_kwargs[0])
        return output, [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        grad_input, param_grads = self.op_backward(basic_op_ctxs[0], grad_output)
        return grad_input, [param_grads], [()]

    # --- hooks the fuser and the gradient contract use -------------------------------------
    def forward(
        self, input_: Tensor, *extra_inputs: Any, **kwargs: Any
    ) -> Tensor | tuple[Tensor, ...]:
        """Run this op alone (outside a Sequential): `op(x, *extra_inputs, **kwargs)`, same
        results and gradient contract as inside a `te_seq.Sequential(op)`; `kwargs` are this
        op's `op_kwarg_names` (e.g. `out=` buffers)."""
        op_kwargs = {0: kwargs} if kwargs else None
        return run_standalone(self, input_, *extra_inputs, op_kwargs=op_kwargs)

    def fuser_parameters(self) -> list[torch.nn.Parameter]:
        """This op's parameters in `parameters()` order, read straight from the module's own
        table: a basic op has no submodules, and `parameters()` walks and de-duplicates a
        module tree (measured: most of the fuser's host time for 128 experts' weights)."""
        return [p for p in self._parameters.values() if p is not None]

    def __setattr__(self, name: str, value: Any) -> None:
        _state_version[0] += 1
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        _state_version[0] += 1
        super().__delattr__(name)

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple[Tensor, ...]) -> None:
        """Validate the call's input before anything runs; raise ValueError naming the op."""

    def value_checks(self, input_: Tensor, extra_inputs: tuple[Tensor, ...]) -> None:
        """The part of `pre_forward_checks` that reads more than the call's signature (shapes,
        dtypes, devices, requires_grad, the op's attributes), e.g. host tensors' values: run on
        every call, also where the fuser's fast path skips the rest (a call whose signature
        passed the checks before). Default: all of `pre_forward_checks`."""
        self.pre_forward_checks(input_, extra_inputs)

    def forward_checks(self, input_: Tensor, extra_inputs: tuple, signature_checked: bool) -> None:
        """`pre_forward_checks`, or only `value_checks` where this call's signature passed them
        before and the class that defines `value_checks` also defines the checks it splits (a
        subclass that overrides `pre_forward_checks` alone is checked in full every call)."""
        if signature_checked and _splits_checks(type(self)):
            self.value_checks(input_, extra_inputs)
        else:
            self.pre_forward_checks(input_, extra_inputs)

    def checks_read_only_signature(self) -> bool:
        """Whether all of this op's input checks read only the call's signature (so a call
        whose signature passed them before needs none: see `forward_checks`)."""
        return _splits_checks(type(self)) and type(self).value_checks is no_value_checks

    def pre_backward_checks(self, ctx: OperationContext) -> None:
        """Validate, before any backward step of the call runs, what this op's backward will
        write (e.g. main_grad buffers); raise naming the op. Called only if its backward runs."""

    def plan_facts(self) -> tuple:
        """Settings besides parameters that the plan depends on (part of the plan cache key),
        e.g. an activation's name and column layout."""
        return ()

    def need_backward_dw(self) -> bool:
        return False

    def backward_dw(self) -> None:
        """Run the oldest pending delayed wgrad (ops without delayed wgrad do nothing)."""

    # --- extra-tensor channels (core/channels.py; resolved per Sequential by run/channels.py) --
    extra_output_names: tuple[str, ...] = ()
    default_input_channels: dict[str, str] = {}  # extra input name -> channel it subscribes to
    default_output_channels: dict[str, str] = {}  # extra output name -> channel it publishes

    def set_extra_input_channel(self, slot: int | str, channel: str | None) -> BasicOperation:
        """Take extra input `slot` (index or name) from the nearest earlier op in the same
        Sequential that publishes `channel`, not from the caller (None: from the caller, also
        turning off a class default). Returns the op, for use inside a Sequential(...) call."""
        channels.set_input_channel(self, slot, channel)
        return self

    def set_extra_output_channel(
        self, slot: int | str, channel: str | None, *, output_to_caller: bool = False
    ) -> BasicOperation:
        """Publish extra output `slot` (index or name) on `channel` (None: no channel); with
        `output_to_caller` the Sequential also returns it. Returns the op."""
        channels.set_output_channel(self, slot, channel, output_to_caller)
        return self


class FusedOperation(FusibleOperation):
    """Runs the maths of adjacent basic ops together; holds references, owns no parameters."""

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        super().__init__()
        # A plain tuple (not a ModuleList) so the fused op registers no submodules or parameters.
        object.__setattr__(self, "basic_ops", tuple(basic_ops))

    # The op_kwargs names (run/op_kwargs.py) this fused op honours for its basic ops; a window
    # whose ops got others runs unfused (fusion/matcher.py): no keyword argument is dropped.
    honoured_op_kwargs: frozenset[str] = frozenset()

    @property
    def is_fused_op(self) -> bool:
        return True

    def __setattr__(self, name: str, value: Any) -> None:
        # `self.fc1 = basic_ops[0]` in a subclass must not register a submodule: the fused op
        # would then own its basic ops' parameters (fused ops own no parameters).
        if isinstance(value, torch.nn.Module):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


def run_standalone(
    module: torch.nn.Module, input_: Tensor, *extra_inputs: Any, op_kwargs: Any = None
) -> Any:
    """Run a basic or composite op on its own through a one-op `te_seq.Sequential` (built once
    and kept as a plain attribute, so the op does not become its own submodule)."""
    # The one deliberate upward import of core/ (function-level, so importing core/ never
    # loads run/): the standalone call reuses the runtime rather than a second code path.
    from te_seq.run.sequential import Sequential

    chain = module.__dict__.get("_standalone")
    if chain is None:
        chain = module.__dict__["_standalone"] = Sequential(module)
    if op_kwargs:
        return chain(input_, *extra_inputs, op_kwargs=op_kwargs)
    return chain(input_, *extra_inputs)


class CompositeOperation(torch.nn.Module):
    """A module that is a fixed chain of basic ops (e.g. `Linear` = BasicLinear then Bias).

    It owns the parameters (so its state_dict keys are its own); the basic ops it returns from
    `basic_ops()` share those Parameter objects and join the fusion windows of a Sequential.
    """

    def basic_ops(self) -> list[BasicOperation]:
        raise NotImplementedError

    def forward(self, input_: Tensor, *extra_inputs: Any, op_kwargs: Any = None) -> Any:
        """Run the chain alone, as a `te_seq.Sequential` of its basic ops would (`op_kwargs`:
        keyword arguments per index into `basic_ops()`, as for a Sequential)."""
        return run_standalone(self, input_, *extra_inputs, op_kwargs=op_kwargs)
