"""OperationContext: the per-call state of one basic op, shared by its forward and backward.

The fuser (run/fuser.py) makes one context per basic op per call, also inside a fused op, and
fills the per-call fields before the op runs. The op's own per-call state goes in two places:

- tensors through `save_for_backward` (they reach the autograd context, so saved-tensor hooks
  such as `torch.autograd.graph.save_on_cpu` apply), read back as `saved_tensors`;
- everything else as one frozen record in `saved` (e.g. `AddSaved`, `LinearSaved`), written by
  the op's one save method that forward fusions call too, and read back with `saved_as(kind)`.

te_seq's own ops keep to those two places (tests/test_context.py runs every op and fusion with a
context that rejects any other attribute), so a forward fusion never has to copy untyped state by
hand. A user op may still set attributes of its own on its context, as TransformerEngine's
contexts allow: the fields below are the ones the fuser fills and reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from te_seq.core.amp import AutocastState
from te_seq.kernels.backend import Backend
from te_seq.kernels.reference import REFERENCE

Record = TypeVar("Record")


def _storage_key(t: Tensor) -> tuple | None:
    """Which allocation `t` views (None where a tensor subclass has no storage of its own)."""
    try:
        return t.device, t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


@dataclass(frozen=True, eq=False)
class CallInputs:
    """What one `Sequential` call was given: its input, its extra inputs, and (lazily) the
    parameters of its modules. Ops that write into an extra input in place ask `aliased` first.

    Why: autograd checks that a saved tensor was not modified before backward by its version
    counter, but the fuser hands saved tensors to autograd only after the whole forward of its
    run has returned, so an in-place write during that forward into memory an earlier op saved
    (e.g. the Sequential's input, given again as `AddExtraInput`'s residual) would go unseen and
    corrupt the gradient. Extra inputs exist before the call, so what an extra input can share
    memory with inside it is one of these tensors or a result computed from one of them as a view
    (or in place): checking these suffices. (A tensor saved by an autograd node outside the call
    is protected by autograd's own version check.)
    """

    input_: Tensor
    extra_inputs: tuple
    parameters: Callable[[], Iterable[Tensor]]

    def aliased(self, tensor: Tensor) -> bool:
        """Whether `tensor`'s memory is reachable through another tensor of the call: the input,
        another extra input (or the same tensor given twice), or a parameter. Compares storages
        (views of one allocation count as shared), on the host; no data is read. A tensor
        whose storage cannot be told counts as aliased (the op then runs out of place)."""
        if torch.compiler.is_compiling():
            return False  # traced in-place writes are functionalized: saved values stay right
        key = _storage_key(tensor)
        if key is None:
            return True
        skipped_self = False
        others = (self.input_, *self.extra_inputs)
        for other in others:
            if other is tensor and not skipped_self:
                skipped_self = True  # its own slot among the extra inputs
                continue
            if isinstance(other, Tensor) and _storage_key(other) == key:
                return True
        return any(_storage_key(p) == key for p in self.parameters())


@dataclass(eq=False)
class OperationContext:
    """Per-basic-op, per-call state; its contents are private to the op that owns it.

    Attributes:
        requires_grad: this op's backward will run (autograd is recording and its input, its own
            parameters or its extra inputs need a gradient).
        input_requires_grad: the op's input needs a gradient (dgrad must be computed).
        weight_requires_grad: some parameter of the op needs a gradient (wgrad must be computed).
        backend: the kernel backend of the plan step running the op in this phase (forward or
            backward; the fuser sets it before each step).
        recipe: the FP8 recipe of the call (`te_seq.autocast`; None: no quantization).
        process_group: the process group of a distributed op (its `process_group` attribute;
            None for other ops and for the default group).
        call_inputs: what the Sequential call was given (None outside a Sequential): an op that
            writes into an extra input in place checks `call_inputs.aliased(extra)` first.
        autocast: torch.autocast's state at the forward call (None outside autocast); the op
            applies autocast's policy itself (te_seq/core/amp.py), in forward and backward.
        saved: the op's typed record of what backward needs besides tensors (None if nothing).
        to_save: the tensors of `save_for_backward`, until the fuser hands them to autograd.
        saved_versions: their version counters when saved; the fuser checks them before handing
            them to autograd (an in-place write in between would corrupt the gradient unseen).
        saved_tensors: those tensors again, during backward.
        signature_checked: this call's signature (shapes, dtypes, devices, requires_grad, the
            ops' attributes...) passed the input checks before (run/fast_path.py): a fused op
            checking its inner ops may run only their `value_checks`.
        steady: a dict shared by the eager calls of one signature (run/fast_path.py; None
            otherwise): an op may keep there, on the call that is not `signature_checked`,
            what it decided from the signature's facts, and reuse it on the calls that are.
    """

    requires_grad: bool = False
    input_requires_grad: bool = False
    weight_requires_grad: bool = False
    backend: Backend | None = None  # None: the reference (set in __post_init__)
    recipe: object | None = None
    process_group: object | None = None
    call_inputs: CallInputs | None = None
    autocast: AutocastState | None = None
    saved: object | None = None
    to_save: tuple[Tensor | None, ...] = ()
    saved_versions: tuple[int, ...] = ()
    saved_tensors: tuple[Tensor | None, ...] = ()
    signature_checked: bool = False
    steady: dict | None = None

    def __post_init__(self) -> None:
        # The default is filled here, not in the field: torch.compile (torch 2.11) cannot trace a
        # dataclass __init__ whose default is an object (measured on the GPU host, 2026-11-24).
        if self.backend is None:
            self.backend = REFERENCE

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        self.to_save = tensors
        if not torch.compiler.is_compiling():  # a traced graph has no version counters to read
            self.saved_versions = tuple([-1 if t is None else t._version for t in tensors])

    def modified_saved_tensor(self) -> int | None:
        """The index of the first saved tensor written in place since it was saved, else None."""
        for index, (t, version) in enumerate(zip(self.to_save, self.saved_versions)):
            if t is not None and t._version != version:
                return index
        return None

    def saved_as(self, kind: type[Record]) -> Record:
        """`saved`, checked to be a `kind` record (a forward fusion that skipped the op's save
        method would otherwise surface as an AttributeError deep in backward)."""
        record = self.saved
        if not isinstance(record, kind):
            raise RuntimeError(
                f"the context holds {type(record).__name__}, expected {kind.__name__}: the "
                "forward that ran this op did not fill its context as the op's own forward would"
            )
        return record
