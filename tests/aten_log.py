"""Test helpers for the host-path tests: the aten ops a block of code dispatches, by name, in
order (on the GPU each costs host time, an allocation or a view most), and how often a
function is called (decisions made once per call signature)."""

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


def counting_calls(monkeypatch, module, name: str) -> list:
    """Replace ``module.name`` by a wrapper that counts its calls (the list's length)."""
    calls, inner = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls
