"""What the communication ops share: the process group, checked, and handed to the context."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from te_seq.core import checks
from te_seq.core.context import OperationContext
from te_seq.core.operation import BasicOperation
from te_seq.distributed import resolve_group


@dataclass(frozen=True)
class _SharedGroup:
    """Holds a process group; a deep copy of the op shares it (groups cannot be copied)."""

    group: dist.ProcessGroup | None

    def __deepcopy__(self, memo: dict) -> _SharedGroup:
        return self


class CommunicationOp(BasicOperation):
    """A basic op that runs one collective along the first (token) dimension of its input on
    `process_group` (None: the default group). The fuser hands the group to each call through
    `OperationContext.process_group`. Holds no parameters; any input shape with at least one
    dimension; every rank of the group must run the op (a collective), with equal shapes."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"{checks.op_name(self)}: process_group must be a "
                f"torch.distributed.ProcessGroup or None, got {type(process_group).__name__}"
            )
        self._group = _SharedGroup(process_group)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group (None: the default group); the fuser copies it into each call's context."""
        return self._group.group

    def group(self, ctx: OperationContext) -> object:
        """The call's group (the context's, which the fuser filled from this op)."""
        return resolve_group(checks.op_name(self), ctx.process_group)

    def pre_forward_checks(self, input_: Tensor, extra_inputs: tuple) -> None:
        name = checks.op_name(self)
        resolve_group(name, self.process_group)
        if input_.dim() == 0:
            raise ValueError(f"{name}: needs an input with a first (token) dimension, got a "
                             "0-d tensor")

    def extra_repr(self) -> str:
        group = "default" if self.process_group is None else "given"
        return f"process_group={group}"
