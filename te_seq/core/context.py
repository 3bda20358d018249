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

from dataclasses import dataclass
from typing import TypeVar

from torch import Tensor

from te_seq.core.amp import AutocastState
from te_seq.kernels.backend import Backend
from te_seq.kernels.reference import REFERENCE

Record = TypeVar("Record")


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
        recipe: the FP8 recipe of the call (None: no quantization; reserved, always None now).
        process_group: the process group of distributed ops (reserved, always None now).
        autocast: torch.autocast's state at the forward call (None outside autocast); the op
            applies autocast's policy itself (te_seq/core/amp.py), in forward and backward.
        saved: the op's typed record of what backward needs besides tensors (None if nothing).
        to_save: the tensors of `save_for_backward`, until the fuser hands them to autograd.
        saved_tensors: those tensors again, during backward.
    """

    requires_grad: bool = False
    input_requires_grad: bool = False
    weight_requires_grad: bool = False
    backend: Backend = REFERENCE
    recipe: object | None = None
    process_group: object | None = None
    autocast: AutocastState | None = None
    saved: object | None = None
    to_save: tuple[Tensor | None, ...] = ()
    saved_tensors: tuple[Tensor | None, ...] = ()

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        self.to_save = tensors

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
