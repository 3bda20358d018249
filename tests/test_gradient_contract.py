"""The gradient contract (docs/gradient_contract.md) for every op with weights.

Every case runs three microbatches through te_seq and checks `.grad`, `main_grad`, the
`grad_added_to_main_grad` flag and dX after every event (backward, backward_dw) against plain
PyTorch autograd in float64 on the same parameter values.

Shape legend: T rows (tokens), G groups (experts), K in_features, N out_features; the MLP maps
H -> 2F (SwiGLU) -> H.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from megatron_like import MegatronLikeDDP

import te_seq
from te_seq import kernels, ops

SIZES = [5, 0, 11]  # includes an empty group: its wgrad must be exactly zero, not skipped
G, T = len(SIZES), sum(SIZES)
K, N = 8, 12  # single linears
H, FFN = 8, 6  # the MLP
MICROBATCHES = 3

# Every op with weights, in every form the contract must treat alike (fused or not, one grouped
# weight or one per group). A bias (Bias op or GroupedLinear bias) rides along everywhere: biases
# always get their real gradient at once.
KINDS = ("basic", "grouped", "grouped_single", "grouped_mlp", "grouped_mlp_unfused")


def _cuda_param(backend: str):
    ok = torch.cuda.is_available() and kernels.backend_available(backend)[0]
    return pytest.param(
        ("cuda", backend), id=f"cuda-{backend}",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not ok, reason=f"needs CUDA + {backend}")],
    )


# CPU runs in CI; the same cases run on the GPU backends where present.
DEVICES = [pytest.param(("cpu", "reference"), id="cpu"), _cuda_param("torch"), _cuda_param("cute")]


@dataclass(frozen=True)
class Config:
    """One row of the contract table (plus the flag attributes the parameter carries)."""

    accumulate_into_main_grad: bool = False
    delay_wgrad_compute: bool = False
    flag: bool = False  # the parameter has `grad_added_to_main_grad`
    zero_out: bool = False  # the parameter has `zero_out_wgrad = True`


CONFIGS = {
    "default": Config(),
    "default+flag": Config(flag=True),  # the flag is ignored without main_grad
    "delayed": Config(delay_wgrad_compute=True),
    "delayed+flag": Config(delay_wgrad_compute=True, flag=True),
    "main_grad": Config(accumulate_into_main_grad=True),
    "main_grad+flag": Config(accumulate_into_main_grad=True, flag=True),
    "main_grad+flag+zero_out": Config(accumulate_into_main_grad=True, flag=True, zero_out=True),
    "delayed+main_grad": Config(True, True),
    "delayed+main_grad+flag": Config(True, True, flag=True),
    "delayed+main_grad+flag+zero_out": Config(True, True, flag=True, zero_out=True),
}
# backward_dw() right after each backward, or all three deferred to the end (FIFO).
TABLE_CASES = [
    pytest.param(name, sched, id=f"{name}-{sched}")
    for name, cfg in CONFIGS.items()
    for sched in (("after_each", "deferred") if cfg.delay_wgrad_compute else ("now",))
]


# --- building the models and their plain-PyTorch references --------------------------------------
def build(kind: str, cfg: Config, device: str, dtype: torch.dtype) -> te_seq.Sequential:
    opts = dict(device=device, dtype=dtype, accumulate_into_main_grad=cfg.accumulate_into_main_grad,
                delay_wgrad_compute=cfg.delay_wgrad_compute)
    torch.manual_seed(0)
    if kind == "basic":
        bias = ops.Bias(N, device=device, dtype=dtype)
        return te_seq.Sequential(ops.BasicLinear(K, N, **opts), bias)
    if kind in ("grouped", "grouped_single"):
        single = kind == "grouped_single"
        return te_seq.Sequential(ops.GroupedLinear(
            G, K, N, single_grouped_weight=single, single_grouped_bias=single, **opts))
    return te_seq.Sequential(
        ops.GroupedLinear(G, H, 2 * FFN, **opts), ops.SwiGLU(), ops.GroupedLinear(G, FFN, H, **opts)
    )


def _group_params(p: dict, prefix: str, single: bool) -> list[tuple]:
    if single:
        return [(p[f"{prefix}.weight"][g], p[f"{prefix}.bias"][g]) for g in range(G)]
    return [(p[f"{prefix}.weight{g}"], p[f"{prefix}.bias{g}"]) for g in range(G)]


def _grouped_ref(x, wb: list[tuple]):
    chunks = x.split(SIZES)
    return torch.cat([F.linear(c, w, b) for c, (w, b) in zip(chunks, wb)])


def reference(kind: str, p: dict, x):
    """Plain PyTorch forward with parameters `p` (named as in the Sequential)."""
    if kind == "basic":
        return F.linear(x, p["0.weight"], p["1.bias"])
    if kind in ("grouped", "grouped_single"):
        return _grouped_ref(x, _group_params(p, "0", kind == "grouped_single"))
    h = _grouped_ref(x, _group_params(p, "0", False))  # [T, 2F]
    a = F.silu(h[:, :FFN]) * h[:, FFN:]  # [T, F]
    return _grouped_ref(a, _group_params(p, "2", False))


def in_features(kind: str) -> int:
    return H if kind.startswith("grouped_mlp") else K


@dataclass
class Data:
    """Inputs, output grads, and the float64 reference dX and per-microbatch parameter grads."""

    xs: list
    dys: list
    dxs: list
    grads: dict  # name -> [grad of microbatch 1, 2, 3]


def make_data(kind: str, seq: te_seq.Sequential, device: str, dtype: torch.dtype) -> Data:
    gen = torch.Generator().manual_seed(1)
    ref_p = {n: p.detach().double().cpu().requires_grad_() for n, p in seq.named_parameters()}
    xs, dys, dxs, grads = [], [], [], {n: [] for n in ref_p}
    for _ in range(MICROBATCHES):
        x = torch.randn(T, in_features(kind), generator=gen, dtype=torch.float64)
        x = x.to(dtype).double().requires_grad_()  # values exactly representable in `dtype`
        y = reference(kind, ref_p, x)
        dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype).double()
        got = torch.autograd.grad(y, [x, *ref_p.values()], dy)
        xs.append(x.detach().to(device, dtype))
        dys.append(dy.to(device, dtype))
        dxs.append(got[0])
        for name, g in zip(ref_p, got[1:]):
            grads[name].append(g)
    return Data(xs, dys, dxs, grads)


def dtype_for(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.bfloat16


def assert_close(actual, expected, dtype: torch.dtype, what: str) -> None:
    assert actual is not None, f"{what}: is None, expected a tensor"
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual.double().cpu(), expected, rtol=tol, atol=tol * scale,
                               msg=lambda m: f"{what}: {m}")


def run_microbatch(seq, kind: str, data: Data, i: int, backend: str, dtype) -> None:
    """Forward and backward of microbatch i; checks dX and (for the MLP) the fusion plan."""
    x = data.xs[i].clone().requires_grad_()
    splits = torch.tensor(SIZES)
    extra = [] if kind == "basic" else [splits] * (2 if kind.startswith("grouped_mlp") else 1)
    with te_seq.backend(backend):
        if kind == "grouped_mlp_unfused":
            with te_seq.fusions_disabled("grouped_mlp"):
                y = seq(x, *extra)
        else:
            y = seq(x, *extra)
    names = [s.name for s in seq.fusion_plan().backward]
    assert ("GroupedMLP" in names) == (kind == "grouped_mlp"), names
    y.backward(data.dys[i])
    assert_close(x.grad, data.dxs[i], dtype, f"dX of microbatch {i + 1}")


# --- the contract table, checked after every event ------------------------------------------
@dataclass
class Tracker:
    """Expected state of every parameter, given how many backwards and wgrads have run."""

    seq: te_seq.Sequential
    cfg: Config
    overwrite: bool
    data: Data
    dtype: torch.dtype
    main0: dict

    def check(self, backwards: int, wgrads: int) -> None:
        for name, p in self.seq.named_parameters():
            if "weight" in name:
                self._check_weight(name, p, backwards, wgrads)
            else:  # biases: the real gradient at once, main_grad untouched
                self._check_grad(name, p, backwards)
                assert torch.equal(p.main_grad, self.main0[name]), f"{name}: main_grad touched"

    def _sum(self, name: str, count: int):
        return sum(self.data.grads[name][:count])

    def _check_grad(self, name: str, p, count: int) -> None:
        if count == 0:
            assert p.grad is None, f"{name}: .grad set before any gradient"
        else:
            assert_close(p.grad, self._sum(name, count), self.dtype, f"{name}.grad")

    def _check_weight(self, name: str, p, backwards: int, wgrads: int) -> None:
        cfg = self.cfg
        if not cfg.accumulate_into_main_grad:  # real wgrads in .grad; the attributes ignored
            self._check_grad(name, p, wgrads)
            assert torch.equal(p.main_grad, self.main0[name]), f"{name}: main_grad touched"
            assert getattr(p, "grad_added_to_main_grad", False) is False
            return
        if self.overwrite and wgrads:
            expected = self.data.grads[name][wgrads - 1]  # FIFO: the last one computed
        else:
            expected = self.main0[name].double().cpu() + self._sum(name, wgrads)
        assert_close(p.main_grad, expected, self.dtype, f"{name}.main_grad after {wgrads} wgrads")
        if not cfg.flag:
            assert p.grad is None, f"{name}: autograd got a tensor, expected None"
            return
        assert p.grad_added_to_main_grad is (backwards > 0), f"{name}: flag"
        assert (p.grad is None) == (backwards == 0), f"{name}: dummy missing"
        if backwards:
            assert p.grad.shape == p.shape and p.grad.dtype == p.dtype
            if cfg.zero_out:
                assert not p.grad.any(), f"{name}: zero_out_wgrad dummy is not zero"


def equip(seq, cfg: Config, overwrite: bool) -> dict:
    """Give every parameter the contract attributes; returns the initial main_grad values."""
    main0 = {}
    gen = torch.Generator().manual_seed(2)
    for name, p in seq.named_parameters():
        p.main_grad = torch.randn(p.shape, generator=gen).to(p.device)  # fp32, non-zero
        main0[name] = p.main_grad.clone()
        p.overwrite_main_grad = overwrite
        if cfg.flag:
            p.grad_added_to_main_grad = False
        if cfg.zero_out:
            p.zero_out_wgrad = True
    return main0


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("mode", ["accumulate", "overwrite"])
@pytest.mark.parametrize(("config_name", "schedule"), TABLE_CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_contract_table(kind, config_name, schedule, mode, dev) -> None:
    device, backend = dev
    cfg, dtype = CONFIGS[config_name], dtype_for(device)
    seq = build(kind, cfg, device, dtype)
    data = make_data(kind, seq, device, dtype)
    overwrite = mode == "overwrite"
    tracker = Tracker(seq, cfg, overwrite, data, dtype, equip(seq, cfg, overwrite))
    wgrads = 0
    for i in range(MICROBATCHES):
        run_microbatch(seq, kind, data, i, backend, dtype)
        wgrads += 0 if cfg.delay_wgrad_compute else 1
        assert seq.need_backward_dw() is cfg.delay_wgrad_compute
        tracker.check(i + 1, wgrads)
        if schedule == "after_each":
            seq.backward_dw()
            wgrads += 1
            assert not seq.need_backward_dw()
            tracker.check(i + 1, wgrads)
    if schedule == "deferred":
        for _ in range(MICROBATCHES):
            assert seq.need_backward_dw()
            seq.backward_dw()
            wgrads += 1
            tracker.check(MICROBATCHES, wgrads)
    assert not seq.need_backward_dw()
    seq.backward_dw()  # nothing pending: a no-op
    tracker.check(MICROBATCHES, MICROBATCHES)


# --- a Megatron-style trainer: nothing counted twice or lost -------------------------------------
WRAPPER_CASES = [
    pytest.param(acc, delay, sched, id=f"{'main_grad' if acc else 'grad'}-"
                 f"{'delayed' if delay else 'now'}-{sched}")
    for acc in (False, True)
    for delay in (False, True)
    for sched in (("after_each", "deferred") if delay else ("now",))
]


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("zero_out", [False, True], ids=["dummy", "zero_out"])
@pytest.mark.parametrize("mode", ["accumulate", "overwrite"])
@pytest.mark.parametrize(("acc", "delay", "schedule"), WRAPPER_CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_megatron_wrapper_counts_every_wgrad_once(kind, acc, delay, schedule, mode, zero_out,
                                                  dev) -> None:
    device, backend = dev
    cfg, dtype = Config(acc, delay), dtype_for(device)
    seq = build(kind, cfg, device, dtype)
    data = make_data(kind, seq, device, dtype)
    ddp = MegatronLikeDDP(seq, zero_out_wgrad=zero_out, overwrite_main_grad=mode == "overwrite")
    for i in range(MICROBATCHES):
        run_microbatch(seq, kind, data, i, backend, dtype)
        if schedule == "after_each":
            seq.backward_dw()
    while seq.need_backward_dw():
        seq.backward_dw()
    ddp.finish_delayed()
    for name, p in seq.named_parameters():
        assert p.grad is None, f"{name}: .grad left behind"
        if acc and "weight" in name and mode == "overwrite":
            expected = data.grads[name][-1]  # overwrite_main_grad: the last wgrad only
        else:
            expected = sum(data.grads[name])
        assert_close(p.main_grad, expected, dtype, f"{name}.main_grad")


def test_megatron_wrapper_second_iteration_after_zero_grad_buffer() -> None:
    # Flags are reset by zero_grad_buffer(); the op sets them again on the next iteration.
    cfg = Config(accumulate_into_main_grad=True, delay_wgrad_compute=True)
    seq = build("grouped_mlp", cfg, "cpu", torch.float32)
    data = make_data("grouped_mlp", seq, "cpu", torch.float32)
    ddp = MegatronLikeDDP(seq)
    for _ in range(2):
        ddp.zero_grad_buffer()
        for i in range(MICROBATCHES):
            run_microbatch(seq, "grouped_mlp", data, i, "reference", torch.float32)
            seq.backward_dw()
        for name, p in seq.named_parameters():
            assert_close(p.main_grad, sum(data.grads[name]), torch.float32, name)
    assert ddp.hook_calls > 0


# --- attributes read when the wgrad is computed; the Parameter of the forward ------------------
def _basic(cfg: Config) -> te_seq.Sequential:
    return build("basic", cfg, "cpu", torch.float32)


def test_overwrite_main_grad_is_read_when_the_delayed_wgrad_runs() -> None:
    seq = _basic(Config(True, True))
    data = make_data("basic", seq, "cpu", torch.float32)
    w = seq[0].weight
    w.main_grad = torch.full(w.shape, 7.0)
    w.overwrite_main_grad = False
    run_microbatch(seq, "basic", data, 0, "reference", torch.float32)
    w.overwrite_main_grad = True  # changed between backward and backward_dw
    seq.backward_dw()
    assert_close(w.main_grad, data.grads["0.weight"][0], torch.float32, "main_grad")


def test_main_grad_swapped_before_the_delayed_wgrad_runs_is_the_one_written() -> None:
    seq = _basic(Config(True, True))
    data = make_data("basic", seq, "cpu", torch.float32)
    w = seq[0].weight
    first = w.main_grad = torch.zeros(w.shape)
    run_microbatch(seq, "basic", data, 0, "reference", torch.float32)
    w.main_grad = torch.zeros(w.shape)
    seq.backward_dw()
    assert not first.any()
    assert_close(w.main_grad, data.grads["0.weight"][0], torch.float32, "main_grad")


@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed"])
def test_weight_replaced_after_forward_still_gets_the_forwards_gradient(delay) -> None:
    seq = _basic(Config(True, delay))
    data = make_data("basic", seq, "cpu", torch.float32)
    old = seq[0].weight
    old.main_grad = torch.zeros(old.shape)
    x = data.xs[0].clone().requires_grad_()
    y = seq(x)
    new = torch.nn.Parameter(old.detach().clone())
    new.main_grad = torch.zeros(new.shape)
    seq[0].weight = new  # after forward, before backward
    y.backward(data.dys[0])
    seq.backward_dw()
    assert_close(old.main_grad, data.grads["0.weight"][0], torch.float32, "forward's weight")
    assert not new.main_grad.any(), "the replacement Parameter got the forward's gradient"


@pytest.mark.parametrize(("kind", "param"), [("basic", "weight"), ("grouped", "weight1"),
                                             ("grouped_single", "weight")])
def test_weight_freed_before_backward_dw_raises(kind, param) -> None:
    seq = build(kind, Config(delay_wgrad_compute=True), "cpu", torch.float32)
    data = make_data(kind, seq, "cpu", torch.float32)
    run_microbatch(seq, kind, data, 0, "reference", torch.float32)
    setattr(seq[0], param, torch.nn.Parameter(getattr(seq[0], param).detach().clone()))
    gc.collect()  # the forward's Parameter now has no owner left
    pattern = rf"GroupedLinear\.{param}: the weight used in forward was freed" if kind != "basic" \
        else r"BasicLinear\.weight: the weight used in forward was freed"
    with pytest.raises(RuntimeError, match=pattern):
        seq.backward_dw()


# --- missing or wrong main_grad: RuntimeError naming the parameter, never in forward ----------
@pytest.mark.parametrize(("kind", "param"), [
    ("basic", r"BasicLinear\.weight"), ("grouped", r"GroupedLinear\.weight0"),
    ("grouped_single", r"GroupedLinear\.weight"), ("grouped_mlp", r"GroupedLinear\.weight0"),
])
def test_missing_main_grad_raises_in_backward_not_forward(kind, param) -> None:
    seq = build(kind, Config(accumulate_into_main_grad=True), "cpu", torch.float32)
    data = make_data(kind, seq, "cpu", torch.float32)
    x = data.xs[0].clone().requires_grad_()
    extra = [] if kind == "basic" else [torch.tensor(SIZES)] * (2 if kind == "grouped_mlp" else 1)
    y = seq(x, *extra)  # forward is fine
    with pytest.raises(RuntimeError, match=param + r": accumulate_into_main_grad=True but the "
                       r"parameter has no `main_grad`"):
        y.backward(data.dys[0])


def test_missing_main_grad_with_delay_raises_in_backward_dw_and_keeps_the_wgrad() -> None:
    seq = build("grouped", Config(True, True), "cpu", torch.float32)
    data = make_data("grouped", seq, "cpu", torch.float32)
    run_microbatch(seq, "grouped", data, 0, "reference", torch.float32)  # backward is fine
    with pytest.raises(RuntimeError, match=r"GroupedLinear\.weight0: .* no `main_grad`"):
        seq.backward_dw()
    assert seq.need_backward_dw()  # nothing lost: fix the parameter and run it again
    for name, p in seq.named_parameters():
        p.main_grad = torch.zeros(p.shape)
    seq.backward_dw()
    assert not seq.need_backward_dw()
    assert_close(seq[0].weight1.main_grad, data.grads["0.weight1"][0], torch.float32, "weight1")


def test_main_grad_of_wrong_shape_raises() -> None:
    seq = _basic(Config(accumulate_into_main_grad=True))
    seq[0].weight.main_grad = torch.zeros(K, N)
    data = make_data("basic", seq, "cpu", torch.float32)
    with pytest.raises(RuntimeError, match=r"BasicLinear\.weight: main_grad has shape \(8, 12\), "
                       r"expected the weight's shape \(12, 8\)"):
        run_microbatch(seq, "basic", data, 0, "reference", torch.float32)


def test_frozen_weight_needs_no_main_grad_and_gets_nothing() -> None:
    seq = build("grouped", Config(accumulate_into_main_grad=True), "cpu", torch.float32)
    data = make_data("grouped", seq, "cpu", torch.float32)
    seq[0].weight1.requires_grad_(False)  # no main_grad on it: must not be asked for
    for name in ("weight0", "weight2"):
        getattr(seq[0], name).main_grad = torch.zeros(N, K)
    run_microbatch(seq, "grouped", data, 0, "reference", torch.float32)
    assert seq[0].weight1.grad is None
    assert_close(seq[0].weight2.main_grad, data.grads["0.weight2"][0], torch.float32, "weight2")


# --- dummies never alias anything ---------------------------------------------------------------
@pytest.mark.parametrize("kind", ["grouped", "grouped_mlp"])
def test_dummies_are_fresh_tensors(kind) -> None:
    # The dummy autograd gets (flag set, no zero_out) is a fresh tensor per weight: it shares
    # storage with no other .grad and no main_grad, so in-place writes stay local.
    cfg = Config(accumulate_into_main_grad=True, flag=True)
    seq = build(kind, cfg, "cpu", torch.float32)
    data = make_data(kind, seq, "cpu", torch.float32)
    equip(seq, cfg, overwrite=False)
    run_microbatch(seq, kind, data, 0, "reference", torch.float32)
    dummies = [p.grad for n, p in seq.named_parameters() if "weight" in n]
    others = [p.main_grad for p in seq.parameters()]
    others += [p.grad for n, p in seq.named_parameters() if "weight" not in n]
    ptr = [t.untyped_storage().data_ptr() for t in dummies]
    assert len(set(ptr)) == len(ptr), "two dummies share storage"
    assert not set(ptr) & {t.untyped_storage().data_ptr() for t in others}
    rest = dummies[1:] + others
    before = [t.clone() for t in rest]
    dummies[0].fill_(123.0)  # an in-place write through one weight's .grad
    for t, b in zip(rest, before):  # uninitialised dummies may hold NaN bit patterns
        torch.testing.assert_close(t, b, rtol=0, atol=0, equal_nan=True)


# --- tied weights --------------------------------------------------------------------------------
@pytest.mark.parametrize("acc", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("schedule", ["after_each", "deferred"])
def test_tied_weights_with_delayed_wgrad(acc, schedule) -> None:
    # W used by two delayed BasicLinears and once by plain PyTorch: y = (x Wᵀ) Wᵀ + x Wᵀ.
    torch.manual_seed(0)
    first = ops.BasicLinear(K, K, accumulate_into_main_grad=acc, delay_wgrad_compute=True)
    second = ops.BasicLinear(K, K, accumulate_into_main_grad=acc, delay_wgrad_compute=True)
    second.weight = first.weight
    seq, w = te_seq.Sequential(first, second), first.weight
    if acc:
        w.main_grad = torch.zeros(K, K)
    w_ref = w.detach().double().requires_grad_()
    for i in range(MICROBATCHES):
        x = torch.randn(T, K)
        (seq(x) + F.linear(x, w)).square().sum().backward()
        ref_x = x.double()
        (F.linear(F.linear(ref_x, w_ref), w_ref) + F.linear(ref_x, w_ref)).square().sum().backward()
        if schedule == "after_each":
            seq.backward_dw()
    while seq.need_backward_dw():
        seq.backward_dw()
    got = w.main_grad + w.grad if acc else w.grad  # plain-PyTorch use always lands in .grad
    assert_close(got, w_ref.grad, torch.float32, "tied weight")


# --- saved tensors go through saved-tensor hooks -------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_save_on_cpu(kind) -> None:
    cfg = Config(delay_wgrad_compute=True)
    seq = build(kind, cfg, "cpu", torch.float32)
    data = make_data(kind, seq, "cpu", torch.float32)
    for i in range(MICROBATCHES):
        with torch.autograd.graph.save_on_cpu():
            run_microbatch(seq, kind, data, i, "reference", torch.float32)
    for _ in range(MICROBATCHES):
        seq.backward_dw()
    for name, p in seq.named_parameters():
        assert_close(p.grad, sum(data.grads[name]), torch.float32, name)


@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed"])
@pytest.mark.parametrize("kind", ["basic", "grouped_mlp"])
def test_saved_activations_pass_hooks_and_are_freed_once_the_wgrad_ran(kind, delay) -> None:
    seq = build(kind, Config(delay_wgrad_compute=delay), "cpu", torch.float32)
    data = make_data(kind, seq, "cpu", torch.float32)
    storages: list[weakref.ref] = []

    def pack(t):
        copy = t.clone()  # a private copy: alive only while te_seq still holds the saved tensor
        storages.append(weakref.ref(copy.untyped_storage()))
        return copy

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_microbatch(seq, kind, data, 0, "reference", torch.float32)
    gc.collect()
    assert storages, "no saved tensor went through the hooks"
    alive = sum(r() is not None for r in storages)
    assert (alive > 0) == delay  # the queued wgrad holds its activations, nothing else does
    seq.backward_dw()
    gc.collect()
    assert all(r() is None for r in storages)


# --- biases and norm weights: real gradients at once ---------------------------------------------
def test_norm_weight_gets_its_gradient_at_once() -> None:
    torch.manual_seed(0)
    norm = ops.RMSNorm(K)
    seq = te_seq.Sequential(norm, ops.BasicLinear(K, N, delay_wgrad_compute=True))
    x = torch.randn(T, K)
    seq(x).sum().backward()
    assert seq[1].weight.grad is None and seq.need_backward_dw()
    w_ref = norm.weight.detach().clone().requires_grad_()
    lin = seq[1].weight.detach()
    F.linear(F.rms_norm(x, (K,), w_ref, eps=1e-5), lin).sum().backward()
    assert_close(norm.weight.grad, w_ref.grad.double(), torch.float32, "norm weight")


def test_constructor_options_are_exposed() -> None:
    op = ops.GroupedLinear(2, 4, 4, accumulate_into_main_grad=True, delay_wgrad_compute=True)
    assert op.accumulate_into_main_grad and op.delay_wgrad_compute
    lin = ops.BasicLinear(4, 4)
    assert not lin.accumulate_into_main_grad and not lin.delay_wgrad_compute
    assert not lin.need_backward_dw()
    lin.backward_dw()  # nothing pending: a no-op
