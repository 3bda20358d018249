"""A test helper: the aten ops a block of code dispatches, by name, in order (on the GPU each
costs host time, an allocation or a view most), for tests that pin a host path's dispatches."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class AtenLog(TorchDispatchMode):
    """`with AtenLog() as log: ...` then `log.names`: every aten op dispatched inside."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
