"""CPU tests of te_seq.graphs: the schedule validator (every rule), the checks that
make_graphed_callables runs before touching CUDA, and the replay bookkeeping driven by stand-in
graphs.

The real captures need a GPU: tests/test_cuda_graphs.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from te_seq.graphs import (
    GraphedCallable,
    ScheduleStep,
    StepKind,
    capture,
    default_order,
    grad_state,
    make_graphed_callables,
    module_delays_wgrad,
    schedule,
    validate_schedule,
)

F, B, W = StepKind.FORWARD, StepKind.BACKWARD, StepKind.WGRAD

# The interleaved schedule of the issue: chunk 1 runs two microbatches before chunk 2's first.
INTERLEAVED = [1, 1, 2, -2, -2.5, 2, -2, -1, -1.5, -2.5, -1, -1.5]


def _triples(steps: list[ScheduleStep]) -> list[tuple[StepKind, int, int]]:
    return [(s.kind, s.chunk, s.microbatch) for s in steps]


# ------------------------------------------------------------------------------------------------
# valid schedules
# ------------------------------------------------------------------------------------------------

def test_interleaved_schedule_resolves_microbatches() -> None:
    steps = validate_schedule(INTERLEAVED, 2, [True, True])
    assert _triples(steps) == [
        (F, 1, 0), (F, 1, 1), (F, 2, 0), (B, 2, 0), (W, 2, 0), (F, 2, 1),
        (B, 2, 1), (B, 1, 0), (W, 1, 0), (W, 2, 1), (B, 1, 1), (W, 1, 1),
    ]
    assert [s.position for s in steps] == list(range(len(INTERLEAVED)))


def test_wgrad_pairs_with_oldest_backward_without_wgrad() -> None:
    # two backwards of chunk 1 before any wgrad: the first wgrad is microbatch 0's
    steps = validate_schedule([1, 1, -1, -1, -1.5, -1.5], 1, [True])
    assert [(s.kind, s.microbatch) for s in steps if s.kind is W] == [(W, 0), (W, 1)]


@pytest.mark.parametrize(
    ("delays", "expected"),
    [
        ([False], [1, -1]),
        ([True], [1, -1, -1.5]),
        ([False, False], [1, 2, -2, -1]),
        ([True, False, True], [1, 2, 3, -3, -3.5, -2, -1, -1.5]),
    ],
)
def test_default_order(delays: list[bool], expected: list[float]) -> None:
    assert default_order(len(delays), delays) == expected
    steps = validate_schedule(None, len(delays), delays)
    assert _triples(steps) == _triples(validate_schedule(expected, len(delays), delays))
    for k, delayed in enumerate(delays, start=1):  # each chunk: fwd, bwd (, wgrad) exactly once
        kinds = [s.kind for s in steps if s.chunk == k]
        assert kinds == ([F, B, W] if delayed else [F, B])


@pytest.mark.parametrize(
    ("order", "num_chunks", "num_steps"),
    [
        ([1, -1, 1, -1], 1, 4),              # sequential microbatches
        ([1, 1, 1, -1, -1, -1], 1, 6),       # all forwards first
        ([1.0, -1.0], 1, 2),                 # floats that are whole numbers
        ((1, 2, -1, -2), 2, 4),              # tuple; chunks need not nest
        (iter([1, 2, -2, -1]), 2, 4),        # any iterable
    ],
)
def test_valid_schedules_without_wgrad(order: object, num_chunks: int, num_steps: int) -> None:
    steps = validate_schedule(order, num_chunks, [False] * num_chunks)  # type: ignore[arg-type]
    assert len(steps) == num_steps and all(s.kind is not W for s in steps)


def test_valid_schedule_accepts_numpy_scalars() -> None:
    np = pytest.importorskip("numpy")
    steps = validate_schedule([np.int64(1), np.int64(-1), np.float64(-1.5)], 1, [True])
    assert _triples(steps) == [(F, 1, 0), (B, 1, 0), (W, 1, 0)]


def test_wgrad_may_come_long_after_its_backward() -> None:
    steps = validate_schedule([1, -1, 1, -1, 1, -1, -1.5, -1.5, -1.5], 1, [True])
    assert [s.microbatch for s in steps if s.kind is W] == [0, 1, 2]


def test_step_str_names_kind_chunk_microbatch() -> None:
    assert str(ScheduleStep(W, 2, 1, 4)) == "wgrad of chunk 2 (microbatch 1)"


# ------------------------------------------------------------------------------------------------
# every rule, with the position and the rule in the message
# ------------------------------------------------------------------------------------------------

ENTRY_RULE = re.escape("rule: entries are k, -k or -(k + 0.5) for a chunk k in 1..2")


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (3, "chunk 3, which does not exist"),       # forward of a chunk that is not there
        (-3, "chunk 3, which does not exist"),      # its backward
        (-3.5, "chunk 3, which does not exist"),    # its wgrad
        (-0.5, "chunk 0, which does not exist"),    # wgrad of chunk 0
        (0, "is not a schedule entry"),
        (1.5, "a positive entry must be a whole chunk number"),
        (-1.25, "is not a schedule entry"),
        (-1.75, "is not a schedule entry"),
        (float("nan"), "is not a schedule entry"),
        (float("-inf"), "is not a schedule entry"),
        ("1", "is not a schedule entry"),
        (True, "is not a schedule entry"),          # bools are not chunk numbers
        (None, "is not a schedule entry"),
    ],
)
def test_bad_entry(bad: object, why: str) -> None:
    order = [1, 2, -2, bad, -1]
    with pytest.raises(ValueError, match=rf"order\[3\] = .*{re.escape(why)}.*{ENTRY_RULE}"):
        validate_schedule(order, 2, [False, False])


def test_backward_before_forward() -> None:
    with pytest.raises(
        ValueError,
        match=r"order\[1\] = -2: backward of chunk 2 has no earlier forward .*rule: a chunk's "
        r"backwards pair one-to-one, in order, with its earlier forwards",
    ):
        validate_schedule([1, -2, 2, -1], 2, [False, False])


def test_more_backwards_than_forwards() -> None:
    with pytest.raises(ValueError, match=r"order\[4\] = -1: backward of chunk 1 has no earlier"):
        validate_schedule([1, -1, 1, -1, -1, 1], 1, [False])


def test_forward_without_backward_names_first_unpaired_forward() -> None:
    with pytest.raises(
        ValueError,
        match=r"order\[2\] = 1: forward of chunk 1 \(microbatch 1\) has no backward after it; "
        r"chunk 1 has 3 forwards but 1 backwards \(rule: forwards and backwards of a chunk "
        r"match in number\)",
    ):
        validate_schedule([2, 1, 1, -1, -2, 1], 2, [False, False])


def test_wgrad_before_its_backward() -> None:
    with pytest.raises(
        ValueError,
        match=r"order\[1\] = -1.5: wgrad of chunk 1 comes before its backward .*rule: each wgrad "
        r"pairs with the oldest backward of its chunk that has no wgrad yet and must come after",
    ):
        validate_schedule([1, -1.5, -1], 1, [True])


def test_second_wgrad_for_one_backward() -> None:
    with pytest.raises(ValueError, match=r"order\[4\] = -1.5: wgrad of chunk 1 comes before"):
        validate_schedule([1, 1, -1, -1.5, -1.5, -1, -1.5], 1, [True])


def test_wgrad_of_other_chunks_backward_does_not_count() -> None:
    # chunk 2's backward does not pair with chunk 1's wgrad
    with pytest.raises(ValueError, match=r"order\[3\] = -1.5: wgrad of chunk 1 comes before"):
        validate_schedule([1, 2, -2, -1.5, -2.5, -1, -1.5], 2, [True, True])


def test_wgrad_for_chunk_that_does_not_delay_wgrad() -> None:
    with pytest.raises(
        ValueError,
        match=r"order\[5\] = -2.5: chunk 2 does not delay wgrad.*rule: only chunks that delay "
        r"wgrad \(delay_wgrad_compute=True\) take wgrad entries",
    ):
        validate_schedule([1, 2, -2, -1, -1.5, -2.5], 2, [True, False])


def test_backward_of_delaying_chunk_without_wgrad() -> None:
    # the interleaved schedule with its last entry dropped: microbatch 1 of chunk 1 lacks a wgrad
    with pytest.raises(
        ValueError,
        match=r"order\[10\] = -1: backward of chunk 1 \(microbatch 1\) has no wgrad entry after "
        r"it \(rule: a chunk that delays wgrad needs exactly one wgrad entry per backward\)",
    ):
        validate_schedule(INTERLEAVED[:-1], 2, [True, True])


def test_oldest_backward_without_wgrad_is_named() -> None:
    with pytest.raises(ValueError, match=r"order\[2\] = -1: backward of chunk 1 \(microbatch 0\)"):
        validate_schedule([1, 1, -1, -1], 1, [True])


@pytest.mark.parametrize("order", [[], [1, -1]])
def test_chunk_missing_from_schedule(order: list[int]) -> None:
    k = 2 if order else 1
    with pytest.raises(
        ValueError,
        match=rf"order has no entry for chunk {k} \(rule: every chunk needs at least one forward",
    ):
        validate_schedule(order, 2, [False, False])


@pytest.mark.parametrize("order", ["1-1", 5, b"\x01"])
def test_order_not_a_sequence(order: object) -> None:
    with pytest.raises(ValueError, match="order must be a sequence of numbers"):
        validate_schedule(order, 1, [False])  # type: ignore[arg-type]


def test_validator_arguments_checked() -> None:
    with pytest.raises(ValueError, match="one delays_wgrad flag per chunk"):
        validate_schedule([1, -1], 2, [False])
    with pytest.raises(ValueError, match="num_chunks >= 1"):
        validate_schedule([], 0, [])


def test_first_violation_wins() -> None:
    # position 1 breaks the entry rule before the missing backward at the end is looked at
    with pytest.raises(ValueError, match=r"order\[1\]"):
        validate_schedule([1, 7, 1], 1, [False])


# ------------------------------------------------------------------------------------------------
# make_graphed_callables: validation before anything touches CUDA
# ------------------------------------------------------------------------------------------------

class _Delayed(torch.nn.Module):
    """A stand-in for a te_seq op with delay_wgrad_compute=True (no te_seq core needed)."""

    def __init__(self) -> None:
        super().__init__()
        self.delay_wgrad_compute = True
        self.weight = torch.nn.Parameter(torch.ones(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()

    def backward_dw(self) -> None:
        pass


def test_module_delays_wgrad_looks_at_submodules() -> None:
    assert not module_delays_wgrad(torch.nn.Linear(2, 2))
    assert module_delays_wgrad(torch.nn.Sequential(torch.nn.ReLU(), _Delayed()))
    off = _Delayed()
    off.delay_wgrad_compute = False
    assert not module_delays_wgrad(torch.nn.Sequential(off))


def test_wgrad_targets_are_outermost_owners_of_backward_dw() -> None:
    inner = _Delayed()
    outer = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(inner))
    assert capture._wgrad_targets(outer) == [inner]
    assert capture._wgrad_targets(inner) == [inner]


def _args() -> tuple[torch.Tensor, ...]:
    return (torch.randn(4, 2),)


def test_schedule_errors_come_before_cuda_and_device_checks() -> None:
    # CPU sample args and (maybe) no CUDA: the schedule error still comes first
    with pytest.raises(ValueError, match=r"order\[2\] = -1.5: chunk 1 does not delay wgrad"):
        make_graphed_callables([torch.nn.Linear(2, 2)], [_args()], order=[1, -1, -1.5])


def test_delay_is_detected_for_schedule_validation() -> None:
    with pytest.raises(ValueError, match=r"order\[1\] = -1: backward of chunk 1 \(microbatch 0\) "
                                         r"has no wgrad entry"):
        make_graphed_callables(_Delayed(), _args(), order=[1, -1])


def test_default_order_of_delaying_chunk_needs_no_order() -> None:
    # passes validation, then stops at the CPU sample argument
    with pytest.raises(ValueError, match=r"sample_args\[0\] argument 0 is on cpu"):
        make_graphed_callables(_Delayed(), _args())


def test_host_sample_args_rejected() -> None:
    split_sizes = torch.tensor([2, 2])
    with pytest.raises(ValueError, match=r"argument 0 is on cpu; .*host split sizes.*baked into"):
        make_graphed_callables(torch.nn.Linear(2, 2), (split_sizes,))


@pytest.mark.parametrize(
    ("callables", "sample_args", "match"),
    [
        ([torch.nn.Linear(2, 2)], [], "1 callables, 0 sample_args"),
        ([], [], "need one of each per callable"),
        ([torch.nn.Linear(2, 2)], [torch.randn(2)], r"sample_args\[0\] must be a tuple"),
        ([torch.nn.Linear(2, 2)], [(torch.randn(2), 3)], "argument 1 is int"),
    ],
)
def test_bad_callables_or_sample_args(callables: list, sample_args: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_graphed_callables(callables, sample_args)


def test_same_module_twice_rejected() -> None:
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"callables\[0\] and callables\[1\] are the same module"):
        make_graphed_callables([m, m], [_args(), _args()])


def test_non_module_rejected() -> None:
    with pytest.raises(TypeError, match=r"callables\[0\] must be a torch.nn.Module"):
        make_graphed_callables([lambda x: x], [_args()])  # type: ignore[list-item]


def test_negative_warmup_rejected() -> None:
    with pytest.raises(ValueError, match="num_warmup_iters must be >= 0"):
        make_graphed_callables(torch.nn.Linear(2, 2), _args(), num_warmup_iters=-1)


def test_non_cuda_sample_args_rejected() -> None:
    sample = (torch.empty(4, 2, device="meta"),)
    with pytest.raises(ValueError, match="argument 0 is on meta; graphed inputs must be CUDA"):
        make_graphed_callables(torch.nn.Linear(2, 2), sample)


# ------------------------------------------------------------------------------------------------
# static inputs and gradient-state helpers
# ------------------------------------------------------------------------------------------------

def test_static_inputs_keep_aliasing_of_shared_split_sizes() -> None:
    x, splits = torch.randn(4, 3, requires_grad=True), torch.tensor([1, 3])
    static = capture._StaticInputs.clone_of([x, splits, splits])
    assert len(static.buffers) == 2 and static.slots == (0, 1, 1)
    per_pos = static.per_position()
    assert per_pos[1] is per_pos[2] and per_pos[0] is not x
    assert per_pos[0].requires_grad and not per_pos[1].requires_grad
    x2, s2 = torch.randn(4, 3), torch.tensor([0, 4])
    users = static.user_tensors(1, [x2, s2, s2])
    static.copy_from(users)
    assert torch.equal(static.buffers[0], x2) and torch.equal(static.buffers[1], s2)
    with pytest.raises(ValueError, match="arguments 1 and 2 were one tensor at capture"):
        static.user_tensors(1, [x2, s2, s2.clone()])
    with pytest.raises(ValueError, match=r"argument 0 is torch.float32 \(5, 3\), captured as"):
        static.user_tensors(1, [torch.randn(5, 3), s2, s2])
    no_grad_sample = capture._StaticInputs.clone_of([torch.randn(4, 3)])
    with pytest.raises(ValueError, match="argument 0 requires grad but its sample did not"):
        no_grad_sample.user_tensors(1, [torch.randn(4, 3, requires_grad=True)])
    s32 = s2.int()
    with pytest.raises(ValueError, match=r"argument 1 is torch.int32 \(2,\), captured as torch"):
        static.user_tensors(1, [x2, s32, s32])


def test_arg_spec_checks_call_shape() -> None:
    spec = capture._ArgSpec(chunk=2, num_positional=1, kwarg_names=("scales",))
    t = torch.zeros(1)
    assert spec.flatten([t], {"scales": t}) == [t, t]
    with pytest.raises(ValueError, match="graphed chunk 2: called with 2 positional"):
        spec.flatten([t, t], {"scales": t})
    with pytest.raises(ValueError, match=r"keywords \['probs'\]"):
        spec.flatten([t], {"probs": t})


def test_recording_flags_records_and_restores() -> None:
    a, b, c = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    a.grad_added_to_main_grad = True
    b.grad_added_to_main_grad = False
    with grad_state._recording_flags([a, b, c]) as raised:
        assert a.grad_added_to_main_grad is False  # reset so the body's effect is visible
        b.grad_added_to_main_grad = True
    assert raised == [b]
    assert a.grad_added_to_main_grad is True and b.grad_added_to_main_grad is False
    assert not hasattr(c, "grad_added_to_main_grad")


def test_grad_state_snapshot_restores_grad_main_grad_and_flag() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    grad = torch.ones(2)
    p.grad, p.main_grad, p.grad_added_to_main_grad = grad, torch.full((2,), 5.0), False
    main_grad = p.main_grad
    states = grad_state._snapshot_grad_state([p])
    p.grad = None
    main_grad.add_(3.0)
    p.grad_added_to_main_grad = True
    grad_state._restore_grad_state(states)
    assert p.grad is grad and p.main_grad is main_grad
    assert torch.equal(main_grad, torch.full((2,), 5.0)) and p.grad_added_to_main_grad is False


# ------------------------------------------------------------------------------------------------
# replay bookkeeping, with stand-in "graphs" (closures writing fixed buffers, as a graph would)
# ------------------------------------------------------------------------------------------------

class _StandInGraph:
    def __init__(self, body: Callable[[], None]) -> None:
        self.body = body

    def replay(self) -> None:
        self.body()


def _linear_chunk(
    delayed: bool, flagged: bool = False, lend: bool = True
) -> tuple[GraphedCallable, dict]:
    """y = x Wᵀ as one microbatch of 'captured' graphs: forward, backward, maybe wgrad. As in a
    shared memory pool, the forward graph uses the weight-gradient buffer as its scratch (an
    earlier-captured graph's scratch may hold a later graph's output), so a lent gradient not
    reclaimed before the next replay would be overwritten. `lend`: a pool of our own."""
    module = torch.nn.Linear(3, 2, bias=False)
    module.delay_wgrad_compute = delayed
    module.backward_dw = lambda: None  # a wgrad target, as a te_seq op would be
    w = module.weight
    if flagged:
        w.grad_added_to_main_grad = False
    x = torch.randn(4, 3, requires_grad=True)
    spec = capture._ArgSpec(1, 1, ())
    chunk = capture._GraphedChunk(1, module, spec, [x], delayed,
                                  lender=grad_state._GradLender(enabled=lend))
    inputs = capture._StaticInputs.clone_of([x])
    sx = inputs.buffers[0]
    out, gy, gx, gw = torch.empty(4, 2), torch.empty(4, 2), torch.empty(4, 3), torch.empty(2, 3)

    def forward() -> None:
        gw.normal_()  # scratch
        out.copy_(sx @ w.detach().t())

    mb = capture._Microbatch(inputs, _StandInGraph(forward), (out,), (True,))
    def wgrad() -> None:
        gw.copy_(gy.t() @ sx)

    def backward() -> None:
        gx.copy_(gy @ w.detach())
        if not delayed:
            wgrad()

    mb.bwd_graph = _StandInGraph(backward)
    mb.grad_outputs = (gy,)
    mb.grad_inputs = (gx, None if delayed else gw)
    mb.bwd_flags = (w,) if flagged else ()
    if delayed:
        mb.wgrad_graph = _StandInGraph(wgrad)
        mb.wgrad_grads = ((w, gw),)
    chunk.microbatches.append(mb)
    order = [1, -1, -1.5] if delayed else [1, -1]
    cursor = schedule._ScheduleCursor(validate_schedule(order, 1, [delayed]))
    return GraphedCallable(chunk, cursor), {"gw": gw}


def _eager_linear_grads(weight: torch.Tensor, xs: list, dys: list) -> tuple[torch.Tensor, list]:
    w = weight.detach().clone().requires_grad_(True)
    gxs = []
    for x, dy in zip(xs, dys):
        xe = x.detach().clone().requires_grad_(True)
        (xe @ w.t()).backward(dy)
        gxs.append(xe.grad)
    return w.grad, gxs


@pytest.mark.parametrize("delayed", [False, True])
def test_replay_accumulates_grads_like_eager(delayed: bool) -> None:
    """Three iterations without zero_grad: `.grad` must be the sum (autograd must not steal the
    static wgrad buffer, or the next replay would overwrite the accumulated gradient)."""
    graphed, _ = _linear_chunk(delayed)
    w = graphed.module.weight
    xs = [torch.randn(4, 3, requires_grad=True) for _ in range(3)]
    dys = [torch.randn(4, 2) for _ in range(3)]
    for x, dy in zip(xs, dys):
        y = graphed(x)
        torch.testing.assert_close(y, x.detach() @ w.detach().t())
        y.backward(dy)
        assert graphed.need_backward_dw() is delayed
        graphed.backward_dw()
        assert not graphed.need_backward_dw()
    ref_w, ref_gx = _eager_linear_grads(w, xs, dys)
    torch.testing.assert_close(w.grad, ref_w)
    for x, gx in zip(xs, ref_gx):
        torch.testing.assert_close(x.grad, gx)


def _step(graphed: GraphedCallable, x: torch.Tensor, dy: torch.Tensor) -> None:
    graphed(x).backward(dy)
    graphed.backward_dw()


@pytest.mark.parametrize("delayed", [False, True])
def test_fresh_grads_are_the_static_buffer_without_a_copy(delayed: bool) -> None:
    """`.grad` set to None before each step (what an optimizer's zero_grad does): the gradient
    handed out is the graph's static buffer itself (no copy), with each step's values."""
    graphed, buffers = _linear_chunk(delayed)
    w = graphed.module.weight
    for _ in range(3):
        w.grad = None
        x, dy = torch.randn(4, 3), torch.randn(4, 2)
        _step(graphed, x, dy)
        assert w.grad.data_ptr() == buffers["gw"].data_ptr()
        torch.testing.assert_close(w.grad, dy.t() @ x)


@pytest.mark.parametrize("delayed", [False, True])
def test_grads_are_copies_when_the_pool_is_shared(delayed: bool) -> None:
    """A pool passed in may be written by graphs the lender does not see: `.grad` is then a
    copy of the static buffer, never the buffer itself."""
    graphed, buffers = _linear_chunk(delayed, lend=False)
    w = graphed.module.weight
    x, dy = torch.randn(4, 3), torch.randn(4, 2)
    _step(graphed, x, dy)
    assert w.grad.data_ptr() != buffers["gw"].data_ptr()
    torch.testing.assert_close(w.grad, dy.t() @ x)


@pytest.mark.parametrize("delayed", [False, True])
def test_a_kept_grad_object_keeps_its_values_when_the_graph_replays(delayed: bool) -> None:
    """Accumulating into a lent `.grad`: before the graph writes its buffer again, `.grad` gets
    memory of its own, in the same tensor object, so a reference to it holds the sum too."""
    graphed, buffers = _linear_chunk(delayed)
    w = graphed.module.weight
    xs, dys = [torch.randn(4, 3) for _ in range(3)], [torch.randn(4, 2) for _ in range(3)]
    _step(graphed, xs[0], dys[0])
    kept = w.grad
    for x, dy in zip(xs[1:], dys[1:]):
        _step(graphed, x, dy)
    expected = sum(dy.t() @ x for x, dy in zip(xs, dys))
    assert w.grad is kept and kept.data_ptr() != buffers["gw"].data_ptr()
    torch.testing.assert_close(kept, expected)


@pytest.mark.parametrize("delayed", [False, True])
def test_a_grad_kept_past_zero_grad_keeps_its_values(delayed: bool) -> None:
    """`kept = w.grad`, then `.grad` set to None: the next replay gives `kept` memory of its own
    first (the graph would overwrite it otherwise), and `.grad` is the buffer again, no copy."""
    graphed, buffers = _linear_chunk(delayed)
    w = graphed.module.weight
    for _ in range(2):
        x, dy = torch.randn(4, 3), torch.randn(4, 2)
        _step(graphed, x, dy)
        kept = w.grad
        w.grad = None
        _step(graphed, torch.randn(4, 3), torch.randn(4, 2))
        torch.testing.assert_close(kept, dy.t() @ x)
        assert kept.data_ptr() != buffers["gw"].data_ptr() == w.grad.data_ptr()
        w.grad = None


def test_a_kept_autograd_grad_result_keeps_its_values() -> None:
    graphed, _ = _linear_chunk(delayed=False)
    w = graphed.module.weight
    x, dy = torch.randn(4, 3), torch.randn(4, 2)
    (first,) = torch.autograd.grad(graphed(x), [w], dy)
    (second,) = torch.autograd.grad(graphed(torch.randn(4, 3)), [w], torch.randn(4, 2))
    torch.testing.assert_close(first, dy.t() @ x)
    assert first.data_ptr() != second.data_ptr()


@pytest.mark.parametrize("delayed", [False, True])
def test_a_kept_view_of_a_lent_grad_is_an_error_not_overwritten(delayed: bool) -> None:
    """A view of an earlier gradient still aliases the graph's buffer and cannot be moved: the
    next replay would overwrite it in place, so it raises, naming the parameter."""
    graphed, _ = _linear_chunk(delayed)
    w = graphed.module.weight
    _step(graphed, torch.randn(4, 3), torch.randn(4, 2))
    stale = w.grad.view(-1)
    w.grad = None
    before = stale.clone()
    for _ in range(2):  # refused at the next replay (the forward), and again until dropped
        with pytest.raises(RuntimeError, match=r"chunk 1: the gradient of weight from an "
                                               r"earlier replay is still referenced through "
                                               r"a view \(1 tensor"):
            graphed(torch.randn(4, 3))
    assert torch.equal(stale, before)
    del stale
    _step(graphed, torch.randn(4, 3), torch.randn(4, 2))


def test_replay_sets_grad_added_to_main_grad_again() -> None:
    graphed, _ = _linear_chunk(delayed=False, flagged=True)
    w = graphed.module.weight
    graphed(torch.randn(4, 3)).sum().backward()
    assert w.grad_added_to_main_grad is True


def test_replay_out_of_order_is_a_runtime_error() -> None:
    graphed, _ = _linear_chunk(delayed=True)
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"expects order\[0\] = forward of chunk 1 \(micro"
                                           r"batch 0\), but got wgrad of chunk 1"):
        graphed.backward_dw()
    y = graphed(x)
    with pytest.raises(RuntimeError, match=r"expects order\[1\] = backward of chunk 1"):
        graphed(x)
    y.sum().backward()
    graphed.backward_dw()
    graphed(x).sum().backward()  # the schedule wraps around for the next iteration


def test_eval_mode_and_no_grad_run_the_module_eagerly() -> None:
    graphed, _ = _linear_chunk(delayed=False)
    x = torch.randn(4, 3)
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), graphed.module(x))
    graphed.module.eval()
    torch.testing.assert_close(graphed(x), graphed.module(x))
    graphed.module.train()
    graphed(x).sum().backward()  # the schedule was not advanced by the eager calls


def test_backward_dw_of_chunk_without_delay_is_a_no_op() -> None:
    graphed, _ = _linear_chunk(delayed=False)
    graphed.backward_dw()
    graphed(torch.randn(4, 3)).sum().backward()


# ------------------------------------------------------------------------------------------------
# import boundaries: graphs is lazy, the schedule checker is pure Python
# ------------------------------------------------------------------------------------------------

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_te_seq_does_not_import_graphs() -> None:
    code = "import sys, te_seq; print('te_seq.graphs' in sys.modules)"
    assert _run_python(code) == "False"


def test_schedule_module_needs_neither_torch_nor_te_seq() -> None:
    # load the file on its own (importing te_seq.graphs.schedule would run the package __init__)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('schedule', {schedule.__file__!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['schedule'] = module\n"
        "spec.loader.exec_module(module)\n"
        "steps = module.validate_schedule([1, -1, -1.5], 1, [True])\n"
        "print(len(steps), [m for m in sys.modules if m.split('.')[0] in ('torch', 'te_seq')])"
    )
    assert _run_python(code) == "3 []"
