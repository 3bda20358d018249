"""Differential fuzz campaign: random te_seq chains, fused == unfused == plain PyTorch.

Each example (tests/fuzz_chains.py draws them) is a chain of te_seq basic ops (every op of
te_seq.ops, user subclasses that keep or override the maths, plain torch.nn modules, nested
Sequentials, and the windows the built-in fusions match) over an input [*lead, W] with zero rows
and empty groups likely, random requires_grad on the input, the weights and the extra inputs,
float64 or float32, and a gradient-contract mode per weight (.grad, delayed + backward_dw(),
main_grad +=, overwrite_main_grad, grad_added_to_main_grad with a dummy, zero_out_wgrad), run for
one or two microbatches. It checks that the fused run equals the unfused run
(`te_seq.fusions_disabled()`) and both equal the plain-PyTorch reference (float64), values and
every gradient, and that the contract's side effects hold (.grad untouched or a dummy, the flag
set); or that both runs raise the same exception type naming an op (invalid extra inputs are
drawn on purpose, and must never be accepted silently).

Profiles (hypothesis settings), chosen by the environment variable TE_SEQ_FUZZ:
- "ci" (default): derandomized (the same 1000 examples every run: CI never fails on a new draw),
  no example database written; the GPU test takes 25 examples per backend.
- "long": 12000 random examples, new ones every run; failures are kept in .hypothesis/ and
  replayed first: `TE_SEQ_FUZZ=long python -m pytest tests/test_fuzz.py`.
- "gpu": the GPU test with 300 random examples per backend (CUDA, bf16 and fp32, the torch and
  cute backends): `TE_SEQ_FUZZ=gpu python -m pytest -m gpu tests/test_fuzz.py`.
Every failure found gets a regular test in tests/test_fuzz_regressions.py.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from fuzz_chains import DEFAULT_WIDTHS, Chain, chains
from fuzz_runner import (
    build_model,
    compare,
    contract_violations,
    operate,
    run_reference,
    run_te_seq,
)
from hypothesis import HealthCheck, event, given, note, settings
from op_specs import SPECS

import te_seq
import te_seq.kernels.backend

# Examples are slow-ish by design (a model, three runs); the GPU test's backend fixture is the
# same for every example on purpose.
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
          HealthCheck.function_scoped_fixture]
settings.register_profile("ci", max_examples=1000, derandomize=True, database=None,
                          deadline=None, print_blob=True, suppress_health_check=_QUIET)
settings.register_profile("long", max_examples=12000, deadline=None, print_blob=True,
                          suppress_health_check=_QUIET)
settings.register_profile("gpu", max_examples=300, deadline=None, print_blob=True,
                          suppress_health_check=_QUIET)
PROFILE = os.environ.get("TE_SEQ_FUZZ", "ci")
if PROFILE not in ("ci", "long", "gpu"):
    raise ValueError(f"TE_SEQ_FUZZ={PROFILE!r}: expected ci, long or gpu")
FUZZ = settings(settings.get_profile(PROFILE))
# On a GPU machine the whole suite runs the GPU test under "ci" too: a few examples there (each
# new width may compile a cute kernel), the full count only when asked for with "gpu".
FUZZ_GPU = FUZZ if PROFILE != "ci" else settings(FUZZ, max_examples=25)


def _names_an_op(error: BaseException) -> bool:
    """A clear te_seq error names the op (or the Sequential) it is about."""
    names = set(te_seq.ops.__all__) | {"Sequential", "GroupedMLP"}
    return any(name in str(error) for name in names)


def _trace(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def check_chain(chain: Chain) -> None:
    """The differential check of one chain (see the module docstring)."""
    note(f"chain: {chain!r}")
    model, modes = build_model(chain)
    fused = run_te_seq(chain, model, modes, fused=True)
    violations = [] if fused.error else contract_violations(chain, model, modes)
    model, modes = operate(chain, model, modes)
    unfused = run_te_seq(chain, model, modes, fused=False)
    note(f"fused plan: {fused.plan}")
    for step in fused.plan.fused_steps if fused.plan is not None else ():
        event(f"fused: {step.name}")
    if fused.error or unfused.error:
        event(f"raised: {type(fused.error or unfused.error).__name__}")
        _check_errors(chain, model, fused, unfused)
        return
    assert not chain.bad, f"an invalid extra input was accepted silently: {chain!r}"
    violations += contract_violations(chain, model, modes)
    reference = run_reference(chain, model, modes)
    problems = violations + fused.problems
    problems += compare(fused, unfused, chain.dtype, "fused vs unfused", True)
    problems += compare(fused, reference, chain.dtype, "fused vs reference")
    problems += compare(unfused, reference, chain.dtype, "unfused vs reference")
    assert not problems, "\n".join([repr(chain), str(fused.plan), *problems])


def _check_errors(chain: Chain, model, fused, unfused) -> None:
    for side, outcome in (("fused", fused), ("unfused", unfused)):
        if outcome.error is None:
            other = fused.error or unfused.error
            pytest.fail(f"only one side raised ({side} did not):\n{chain!r}\n{_trace(other)}")
    assert type(fused.error) is type(unfused.error), (
        f"fused raised {type(fused.error).__name__}, unfused {type(unfused.error).__name__}:\n"
        f"{_trace(fused.error)}\n{_trace(unfused.error)}")
    if not chain.strict:
        return  # a promoted dtype may also stop a plain torch module, with torch's own error
    assert _names_an_op(fused.error), f"an unclear error:\n{chain!r}\n{_trace(fused.error)}"
    if not chain.bad:
        pytest.fail(f"a valid chain raised:\n{chain!r}\n{_trace(fused.error)}")


@FUZZ
@given(chain=chains())
def test_fused_equals_unfused_equals_reference(chain: Chain) -> None:
    check_chain(chain)


def test_the_fuzz_can_draw_every_op() -> None:
    """Every basic or composite op te_seq.ops exports is reachable through the spec table
    (op_specs.SPECS, which must cover every op) at a width the fuzz draws. The communication
    ops (AllGather, ReduceScatter, AllReduce) need a process group of several ranks: they are
    checked on spawned gloo ranks in tests/test_distributed_ops.py instead."""
    from te_seq.ops.basic._communication import CommunicationOp

    exported = {name for name in te_seq.ops.__all__
                if isinstance(getattr(te_seq.ops, name), type)
                and issubclass(getattr(te_seq.ops, name),
                               (te_seq.ops.BasicOperation, te_seq.ops.CompositeOperation))
                and not issubclass(getattr(te_seq.ops, name), CommunicationOp)
                and getattr(te_seq.ops, name) not in (te_seq.ops.BasicOperation,
                                                      te_seq.ops.CompositeOperation)}
    drawable = {s.op_name for s in SPECS if s.in_width in DEFAULT_WIDTHS and s.train}
    assert exported <= drawable, f"not drawn by the fuzz: {sorted(exported - drawable)}"


@pytest.fixture(params=["torch", "cute"])
def gpu_backend(request):
    """Each GPU backend in turn (for every example of the test); skips one that is
    unavailable, saying why."""
    available, reason = te_seq.kernels.backend.backend_available(request.param)
    if not available:
        pytest.skip(f"backend {request.param!r} is not available: {reason}")
    with te_seq.backend(request.param):
        yield request.param


@pytest.mark.gpu
@FUZZ_GPU
@given(chain=chains(widths=(16, 32, 64), dtypes=(torch.bfloat16, torch.float32),
                    device="cuda"))
def test_gpu_fused_equals_unfused_equals_reference(gpu_backend: str, chain: Chain) -> None:
    """The same check on CUDA under the cute and torch backends; bf16 judged at bf16 tolerance
    (fuzz_chains.TOLERANCE). Widths are multiples of 16 so the grouped kernels take them."""
    check_chain(chain)
