"""`kernel_op`: the custom-op boundary of te_seq's kernels (te_seq/kernels/_torch_op.py).

A toy kernel stands in for the real ones: it counts how often its Python body runs, so each test
can tell whether a call went straight to the function (eager bypass), through the dispatcher, or
only through the fake implementation (tracing).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from te_seq.kernels._torch_op import kernel_op, tracing

RUNS = {"body": 0, "fake": 0}


def _fake_scaled_rows(x: torch.Tensor, scales: torch.Tensor | None, repeat: int) -> torch.Tensor:
    RUNS["fake"] += 1
    return x.new_empty(x.shape[0] * repeat, x.shape[1])


@kernel_op("te_seq_test::scaled_rows", fake=_fake_scaled_rows)
def scaled_rows(x: torch.Tensor, scales: torch.Tensor | None, repeat: int) -> torch.Tensor:
    """y = x · scales[:, None] (scales optional), rows repeated `repeat` times."""
    RUNS["body"] += 1
    y = x if scales is None else x * scales[:, None]
    return y.repeat(repeat, 1)


def _fake_add_into(out: torch.Tensor, x: torch.Tensor) -> None:
    RUNS["fake"] += 1


@kernel_op("te_seq_test::add_into", fake=_fake_add_into, mutates_args=("out",))
def add_into(out: torch.Tensor, x: torch.Tensor) -> None:
    """out += x."""
    RUNS["body"] += 1
    out.add_(x)


@pytest.fixture(autouse=True)
def _reset_counts():
    RUNS.update(body=0, fake=0)


def _data():
    torch.manual_seed(0)
    return torch.randn(5, 3, dtype=torch.float64), torch.rand(5, dtype=torch.float64)


def test_eager_runs_the_function_directly():
    x, s = _data()
    y = scaled_rows(x, s, 2)
    assert torch.equal(y, (x * s[:, None]).repeat(2, 1))
    assert RUNS == {"body": 1, "fake": 0}
    assert not tracing((x, s))


def test_the_registered_op_matches_and_passes_opcheck():
    x, s = _data()
    assert torch.equal(scaled_rows.op(x, s, 3), scaled_rows(x, s, 3))
    torch.library.opcheck(scaled_rows.op, (x, s, 2))
    torch.library.opcheck(scaled_rows.op, (x, None, 1))
    out = torch.zeros_like(x)
    torch.library.opcheck(add_into.op, (out, x))


def test_fake_mode_uses_the_fake_implementation_only():
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(4, 6))
        y = scaled_rows(x, None, 2)
    assert tuple(y.shape) == (8, 6)
    assert RUNS["body"] == 0 and RUNS["fake"] >= 1


def test_fullgraph_compile_sees_one_opaque_op():
    x, s = _data()

    def model(x, s):
        return scaled_rows(torch.sin(x), s, 2).sum(0)

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, s), model(x, s), rtol=0, atol=0)


def test_fullgraph_compile_of_a_mutating_op():
    x, _ = _data()

    def model(x):
        out = torch.ones_like(x)
        add_into(out, x)
        return out * 2

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), (x + 1) * 2, rtol=0, atol=0)


def test_eager_bypass_skips_the_dispatcher():
    """Reports the host time one dispatcher round trip costs (no timed assertion: the number is
    information, printed with -s); the assertion is that the bypass really is the direct call."""
    x = torch.randn(8, 8)
    calls = 2000

    def per_call(fn) -> float:
        for _ in range(200):  # warm-up: the first calls of a fresh op pay one-time costs
            fn(x, None, 1)
        start = time.perf_counter()
        for _ in range(calls):
            fn(x, None, 1)
        return (time.perf_counter() - start) / calls * 1e6

    direct, bypass, dispatched = (
        per_call(scaled_rows.eager),
        per_call(scaled_rows),
        per_call(scaled_rows.op),
    )
    print(f"\nper call (us): direct {direct:.1f}, bypass {bypass:.1f}, custom op {dispatched:.1f}")
    assert RUNS["body"] == 3 * (calls + 200)
    assert scaled_rows.eager is not scaled_rows.op
