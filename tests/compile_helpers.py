"""Shared by the torch.compile tests (CPU and GPU): a clean dynamo per test and a compile backend
that counts the graphs it is handed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch._dynamo.utils import counters


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test starts and ends with dynamo's caches and counters empty."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class CountingBackend:
    """A torch.compile backend that counts the graphs it compiles (frames and recompiles),
    then hands them to a real backend ("aot_eager" or "inductor")."""

    def __init__(self, inner: str = "aot_eager") -> None:
        self.inner = torch._dynamo.lookup_backend(inner)
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        return self.inner(gm, example_inputs)
