"""The grouped-MLP benchmark on the CPU: its dry run (every variant that can run on the CPU builds,
agrees with the fp32 reference and is timed; the others are skipped with a reason), and the parts
that only run on the GPU host checked here with stand-ins: the QuACK and torchao harnesses wired to
CPU implementations of the semantics their sources document, the grad modes, the bytes bound,
the best-peer ratio and the quack compile-cache keyer wrap. A broken benchmark is caught in CI
rather than on the GPU host."""

import json
import os
import subprocess
import sys
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import grad_modes  # noqa: E402
import mlp_case  # noqa: E402
import mlp_measure  # noqa: E402
import mlp_report  # noqa: E402
import peer_quack  # noqa: E402
import peers  # noqa: E402
from _common import Result, time_host, time_interleaved  # noqa: E402

CPU_VARIANTS = ("te_seq:torch", "kernels:torch", "grouped_mm", "grouped_mm_compiled", "loop")


def _dry_run(tmp_path, *extra):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "benchmarks/bench_grouped_mlp.py", "--dry-run", "--json", str(out),
           "--png", str(tmp_path / "bench.png"), *extra]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    payload = json.loads(out.read_text())
    return result.stdout, payload["meta"], payload["results"]


def _timed(results):
    return {(r["shape"], r["mode"], r["variant"]) for r in results if r["status"] == "ok"}


@pytest.mark.slow  # a subprocess of ~30 s (torch.compile included); CI runs it
def test_bench_grouped_mlp_dry_run(tmp_path):
    stdout, meta, results = _dry_run(tmp_path)
    timed = _timed(results)
    for shape in ("T", "U"):
        for mode in ("fwd", "fwd+bwd"):
            for variant in CPU_VARIANTS:
                assert (shape, mode, variant) in timed, (shape, mode, variant, results)
    # every checked variant within its tolerance of the fp32 reference (bf16 for the compiled
    # peer: torch.compile of _grouped_mm takes bf16 only)
    for r in results:
        if r["status"] == "ok":
            assert r["max_rel_err"] <= r["check_tol"], r
            assert r["ms"] > 0 and r["latency_ms"] > 0 and len(r["latency_runs"]) == len(r["runs"])
            assert r["bytes_bound_gb"] > 0 and r["best_peer"] and r["vs_best_peer"] > 0
            # host time per call: te_seq variants only
            assert (r["host_ms"] is not None) == r["variant"].startswith("te_seq:"), r
    # the GPU-only variants are skipped, each with a reason naming what is missing
    notes = {r["variant"]: r["note"] for r in results if r["status"] == "skipped"}
    assert "quack-kernels" in notes["quack"]
    assert "torchao" in notes["torchao_fp8"] and "torchao" in notes["torchao_fp8_compiled"]
    assert "CUDA" in notes["te_seq:cute"]
    assert meta["burst"] == 10 and meta["act"] == "scaled_swiglu"
    assert meta["grad_modes"] == ["fresh"]
    assert meta["copy_bandwidth_gbs"] > 0
    assert "vs" in stdout and "best peer" in stdout and "%bw" in stdout


def test_graphed_variants_per_recipe_are_skipped_on_the_cpu_with_the_reason(tmp_path):
    """--graphed --fp8: bf16, FP8 and FP8 with bf16 wgrads graphed, each a variant of its own."""
    _, _, results = _dry_run(tmp_path, "--shapes", "T", "--backends", "torch", "--peers", "loop",
                             "--graphed", "--fp8", "--modes", "fwd+bwd")
    notes = {r["variant"]: r["note"] for r in results if r["status"] == "skipped"}
    for name in ("te_seq:torch:graphed", "te_seq:torch:fp8:graphed",
                 "te_seq:torch:fp8:hp-wgrad:graphed"):
        assert "CUDA graphs need CUDA" in notes[name], (name, notes)


@pytest.mark.slow
def test_bench_grouped_mlp_dry_run_grad_modes_without_probs(tmp_path):
    _, meta, results = _dry_run(
        tmp_path, "--shapes", "T", "--act", "swiglu", "--grad-mode", "fresh,accumulate,megatron",
        "--peers", "grouped_mm,loop",
    )
    timed = _timed(results)
    for mode in ("fwd+bwd", "fwd+bwd:accumulate", "fwd+bwd:megatron"):
        for variant in ("te_seq:torch", "grouped_mm", "grouped_mm_compiled", "loop"):
            assert ("T", mode, variant) in timed, (mode, variant, results)
    assert ("T", "fwd+bwd", "kernels:torch") in timed  # raw kernels: fresh mode only
    assert ("T", "fwd+bwd:megatron", "kernels:torch") not in timed
    assert sum(r["mode"] == "fwd" for r in results if r["variant"] == "grouped_mm") == 1
    assert meta["act"] == "swiglu"


@pytest.mark.slow  # a subprocess that compiles (aot_eager: no C++ build)
def test_bench_grouped_mlp_compiled_variant_dry_run(tmp_path):
    """--compile adds te_seq through torch.compile(fullgraph=True), checked against the
    reference and timed with its latency and host time per call, in the grad modes it runs in
    (fresh, accumulate); in megatron mode it is skipped, said why."""
    _, meta, results = _dry_run(
        tmp_path, "--shapes", "T", "--backends", "torch", "--peers", "loop", "--compile",
        "default", "--compile-backend", "aot_eager", "--grad-mode", "fresh,accumulate,megatron",
    )
    compiled = [r for r in results if r["variant"] == "te_seq:torch:compiled"]
    ok = [r for r in compiled if r["status"] == "ok"]
    assert {r["mode"] for r in ok} == {"fwd", "fwd+bwd", "fwd+bwd:accumulate"}, results
    assert all(r["latency_ms"] > 0 and r["host_ms"] > 0 for r in ok)
    assert all(r["max_rel_err"] <= r["check_tol"] for r in ok)
    (megatron,) = [r for r in compiled if r["mode"] == "fwd+bwd:megatron"]
    assert megatron["status"] == "skipped" and "fresh, accumulate only" in megatron["note"]
    eager = [r for r in results if r["variant"] == "te_seq:torch" and r["status"] == "ok"]
    assert len(eager) == 4 and all(r["host_ms"] > 0 for r in eager)
    assert meta["compile"] == ["default"] and meta["compile_backend"] == "aot_eager"


def test_host_time_is_one_call_per_run():
    calls = []
    assert time_host(lambda: calls.append(1), iters=5, device=torch.device("cpu")) >= 0
    assert len(calls) == 5


def test_each_timed_run_is_one_burst_of_calls():
    calls = []
    runs = time_interleaved(
        {"f": lambda: calls.append(1)}, iters=3, warmup=2, device=torch.device("cpu"), burst=4
    )
    assert len(runs["f"]) == 3 and len(calls) == 2 + 3 * 4


def test_interleaved_order_changes_so_no_variant_always_follows_the_same_one():
    """The power state of the GPU carries over between bursts: a fixed cyclic order would give
    every variant the same predecessor in every round (benchmarks/README.md, Protocol)."""
    seq = []
    names = "abcde"
    runs = time_interleaved({n: (lambda n=n: seq.append(n)) for n in names}, iters=40, warmup=0,
                            device=torch.device("cpu"))
    assert all(len(runs[n]) == 40 for n in names)
    rounds = [seq[i:i + 5] for i in range(0, len(seq), 5)]
    assert all(sorted(r) == list(names) for r in rounds)  # each runs once per round
    before = {n: {r[r.index(n) - 1] for r in rounds if r.index(n)} for n in names}
    assert all(len(before[n]) >= 3 for n in names), before


# ------------------------------------------------------------------ grad modes


def _param(value: float) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.full((2, 3), value, dtype=torch.bfloat16))


def test_megatron_hook_adds_grad_into_main_grad_and_frees_it():
    p = _param(1.0)
    state = grad_modes.GradState("megatron", [p])
    assert p.main_grad.dtype == torch.float32 and p.grad_added_to_main_grad is False
    for _ in range(2):  # two microbatches accumulate
        (p * 3.0).sum().backward()
        assert p.grad is None
    assert torch.equal(p.main_grad, torch.full((2, 3), 6.0))
    p.grad_added_to_main_grad = True  # an op that wrote main_grad itself: the hook only frees
    (p * 3.0).sum().backward()
    assert p.grad is None and torch.equal(state.weight_grads()[0], torch.full((2, 3), 6.0))
    state.reset()
    assert p.main_grad.abs().sum() == 0 and p.grad_added_to_main_grad is False


def test_profiled_mlp_in_megatron_mode_writes_main_grad_only():
    """profile_host.build(main_grad=True) with GradState("megatron"), as profile_kernels.py
    --grad-mode megatron runs it: each weight's wgrad lands in its fp32 main_grad (equal to a
    fresh-grad run's .grad), the flag is set, and no .grad is left."""
    import profile_host

    case = mlp_case.make_case("U", torch.device("cpu"), torch.float32)
    grads, weights = {}, None
    for megatron in (False, True):
        mlp, forward = profile_host.build(case, "torch", main_grad=megatron)
        if megatron:
            mlp.load_state_dict(weights)  # the fresh run's weights
            grad_modes.GradState("megatron", list(mlp.parameters()))
        weights = mlp.state_dict()
        forward().backward(torch.ones(case.x.shape))
        grads[megatron] = list(mlp.parameters())
    for fresh, megatron in zip(grads[False], grads[True], strict=True):
        assert megatron.grad is None and megatron.grad_added_to_main_grad
        assert fresh.grad is not None and fresh.grad.abs().sum() > 0
        torch.testing.assert_close(megatron.main_grad, fresh.grad.float())


def test_host_timeline_orders_the_steps_and_unwraps_them(capsys):
    """profile_host.timeline: each step the forward takes is printed once per entry and
    return, in call order (the Sequential before the fuser before the fused op, FC1's rows
    before FC2's), and afterwards every wrapped function is the original again."""
    import profile_host

    case = mlp_case.make_case("U", torch.device("cpu"), torch.float32)
    mlp, forward = profile_host.build(case, "torch")
    originals = [(owner, name, getattr(owner, name))
                 for _, owner, name in profile_host._timeline_steps()]
    profile_host.timeline(mlp, forward, torch.device("cpu"), iters=3)
    labels = [line.split("us  ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    order = ["Sequential.forward", "Fuser.run_eager", "_FuserFunction.apply",
             "GroupedMLP.fuser_forward", "fc1_rows (first call of a signature)", "fc2_rows",
             "fc2_rows returned", "GroupedMLP.fuser_forward returned", "call returned"]
    assert [label for label in labels if label in order] == order
    for owner, name, original in originals:
        assert getattr(owner, name) == original, name  # == : a classmethod binds anew
    y = forward()  # still runs, unwrapped
    assert y.shape == (case.x.shape[0], case.shape.H)


@pytest.mark.parametrize(("grad_mode", "expected"), [("fresh", 3.0), ("accumulate", 6.0)])
def test_fresh_drops_grad_accumulate_keeps_it(grad_mode, expected):
    p, x = _param(1.0), torch.ones(2, 3, requires_grad=True)
    state = grad_modes.GradState(grad_mode, [p])
    for _ in range(2):
        state.before_step([x])
        (p * x * 3.0).sum().backward()
    assert torch.equal(state.weight_grads()[0].float(), torch.full((2, 3), expected))
    assert torch.equal(x.grad, torch.full((2, 3), 3.0))  # inputs' grads never accumulate


def test_unknown_grad_mode_is_an_error():
    with pytest.raises(ValueError, match="grad mode 'sometimes'"):
        grad_modes.GradState("sometimes", [])


# ------------------------------------------------------------------ bytes bound, best peer


def test_bytes_bound_formula():
    s = mlp_case.Shape(E=2, H=8, F=4, M=10)
    W = 3 * 2 * 4 * 8  # weight elements
    fwd = 2 * (2 * 10 * 8 + W) + 4 * 10
    assert mlp_report.bytes_bound(s, "fwd", 2, True) == fwd
    bwd_no_wgrad = 2 * (3 * 10 * 8 + W) + 2 * 4 * 10
    assert mlp_report.bytes_bound(s, "fwd+bwd", 2, True) == fwd + bwd_no_wgrad + 2 * W
    assert mlp_report.bytes_bound(s, "fwd+bwd:accumulate", 2, True) == fwd + bwd_no_wgrad + 4 * W
    assert mlp_report.bytes_bound(s, "fwd+bwd:megatron", 2, True) == fwd + bwd_no_wgrad + 8 * W
    assert mlp_report.bytes_bound(s, "fwd", 2, False) == 2 * (2 * 10 * 8 + W)
    assert mlp_report.flops(s, "fwd+bwd:megatron") == 3 * mlp_report.flops(s, "fwd")


def _timed_result(variant, ms, is_peer=True, precision="bf16"):
    r = Result("Q", "fwd+bwd", variant, "ok", ms=ms)
    r.is_peer, r.precision = is_peer, precision
    return r


def test_vs_is_against_the_best_bf16_peer():
    rows = [
        _timed_result("te_seq:cute", 1.0, is_peer=False),
        _timed_result("grouped_mm", 2.0),
        _timed_result("grouped_mm_compiled", 1.5),
        _timed_result("torchao_fp8", 0.5, precision="fp8"),  # faster, but not a bf16 baseline
    ]
    mlp_report.annotate(rows, {("Q", "fwd+bwd"): 2e9}, bandwidth_gbs=4000.0)
    assert {r.best_peer for r in rows} == {"grouped_mm_compiled"}
    assert [r.vs_best_peer for r in rows] == [1.5, 0.75, 1.0, 3.0]
    assert rows[0].bound_ms == pytest.approx(0.5) and rows[0].pct_bound == pytest.approx(50.0)


# ------------------------------------------------------------------ QuACK, with a stand-in


def _segments(cu):
    return list(zip(cu[:-1].tolist(), cu[1:].tolist()))


class FakeQuack(types.SimpleNamespace):
    """quack.gemm_interface's gemm / gemm_gated / gemm_dgated on the CPU, as its sources define
    them (gemm_act_ref, gemm_dact_ref, epilogue.library.dgated_mod): gated columns interleave
    gate and up; varlen-M A is k-major (total_M, K), B (L, K, N); varlen-K A is m-major
    (M, total_K), B n-major (total_K, N), out (L, M, N)."""

    calls: list = []

    @classmethod
    def gemm(cls, A, B, cu_seqlens_m=None, cu_seqlens_k=None, tuned=True):
        cls.calls.append(("gemm", "varlen_m" if cu_seqlens_m is not None else "varlen_k", tuned))
        if cu_seqlens_m is not None:
            assert A.stride(1) == 1 and B.shape[0] == len(cu_seqlens_m) - 1
            out = A.new_empty(A.shape[0], B.shape[-1])
            for e, (lo, hi) in enumerate(_segments(cu_seqlens_m)):
                out[lo:hi] = A[lo:hi] @ B[e]
            return out
        assert A.stride(0) == 1 and B.stride(1) == 1, "varlen_k: m-major A, n-major B"
        return torch.stack([A[:, lo:hi] @ B[lo:hi] for lo, hi in _segments(cu_seqlens_k)])

    @classmethod
    def gemm_gated(cls, A, B, activation, cu_seqlens_m, store_preact, tuned):
        assert activation == "swiglu"
        pre = cls.gemm(A, B, cu_seqlens_m=cu_seqlens_m, tuned=tuned)
        return (pre if store_preact else None), F.silu(pre[:, ::2]) * pre[:, 1::2]

    @classmethod
    def gemm_dgated(cls, A, B, PreAct, activation, cu_seqlens_m, tuned,
                    colvec_scale=None, colvec_reduce=False):
        acc = cls.gemm(A, B, cu_seqlens_m=cu_seqlens_m, tuned=tuned)  # dout [M, F]
        gate, up = PreAct[:, ::2], PreAct[:, 1::2]
        dout = acc * colvec_scale[:, None] if colvec_scale is not None else acc
        sig = torch.sigmoid(gate)
        out = gate * sig * up
        dgate, dup = dout * up * sig * (1 + gate * (1 - sig)), dout * gate * sig
        dx = torch.stack([dgate, dup], dim=-1).reshape(PreAct.shape)
        post = out * colvec_scale[:, None] if colvec_scale is not None else out
        reduce = [(out * acc).sum(-1).float()] if colvec_reduce else []  # unscaled dout
        return (dx, post, *reduce)


@pytest.mark.parametrize("act", mlp_case.ACTS)
@pytest.mark.parametrize("grad_mode", grad_modes.GRAD_MODES)
def test_quack_harness_matches_the_reference(act, grad_mode):
    """The harness's GEMM calls, layouts (interleaved W1), probs scale and reduce, varlen-K
    wgrads and de-interleave give the reference's y, dx, dW1, dW2, dprobs (shape T: an empty
    expert, sizes not multiples of 8)."""
    case = mlp_case.make_case("T", torch.device("cpu"), torch.float32, act=act)
    FakeQuack.calls.clear()
    peer = peer_quack.QuackPeer(case, grad_mode, qk=FakeQuack)
    check = mlp_measure.check_variants([peer], mlp_case.reference_outputs(case), torch.float32)
    assert check["quack"].ok, check["quack"]
    kinds = [c[1] for c in FakeQuack.calls]
    assert kinds.count("varlen_k") >= 2 and not any(c[2] for c in FakeQuack.calls)  # untuned


def test_interleave_round_trip():
    w = torch.arange(2 * 6 * 3.0).reshape(2, 6, 3)  # E=2, 2F=6, H=3
    il = peer_quack.interleave_gate_up(w)
    assert torch.equal(il[:, 0], w[:, 0]) and torch.equal(il[:, 1], w[:, 3])  # gate_0, up_0
    assert torch.equal(peer_quack.deinterleave_gate_up(il), w)


def test_quack_unavailable_names_the_package(monkeypatch):
    monkeypatch.setattr(peer_quack.importlib.util, "find_spec", lambda name: None)
    case = mlp_case.make_case("U", torch.device("cpu"), torch.float32)
    assert "quack-kernels" in peer_quack.quack_unavailable(case)
    with pytest.raises(RuntimeError, match="quack-kernels is not installed"):
        peer_quack.QuackPeer(case, "fresh")


def test_keyer_wrap_keys_what_it_cannot_key_by_identity():
    """quack 0.6.5's keyer raises TypeError on values it cannot fingerprint (a ContextVar of the
    DSL); the wrap keys exactly those by identity, keeps the rest, and is idempotent."""
    import contextvars

    def semantic_value_key(value, seen):  # the keyer's shape: recursion via the module global
        if isinstance(value, (int, str)):
            return value
        if isinstance(value, tuple):
            return ("tuple", tuple(identity.semantic_value_key(v, seen) for v in value))
        raise TypeError(f"epilogue fn depends on {value!r}")

    identity = types.SimpleNamespace(semantic_value_key=semantic_value_key)
    var = contextvars.ContextVar("dsl_state")
    with pytest.raises(TypeError, match="epilogue fn depends on"):
        identity.semantic_value_key((1, var), set())
    peer_quack.key_unkeyable_by_identity(identity)
    wrapped = identity.semantic_value_key
    peer_quack.key_unkeyable_by_identity(identity)
    assert identity.semantic_value_key is wrapped
    key = wrapped((1, var), set())
    assert key == ("tuple", (1, ("by_identity", "_contextvars", "ContextVar", id(var))))
    assert wrapped(("a", 2), set()) == ("tuple", ("a", 2))


# ------------------------------------------------------------------ torchao FP8, with a stand-in


def _fake_fp8_mm(A, B_t, offs, out_dtype, float8_dtype, pad_token_groups_for_grouped_mm):
    """torchao 0.18's argument contract (row-major A, column-major B_t [E, K, N], int32 offs,
    no padding), computed without quantization."""
    assert A.stride(-2) != 1 and B_t.stride(-2) == 1 and offs.dtype == torch.int32
    assert float8_dtype == torch.float8_e4m3fn and pad_token_groups_for_grouped_mm is False
    return torch._grouped_mm(A, B_t, offs=offs)


@pytest.fixture
def fake_torchao(monkeypatch):
    """torchao.prototype.moe_training with `_fake_fp8_mm` as its FP8 grouped GEMM."""
    moe = types.ModuleType("torchao.prototype.moe_training")
    moe._to_fp8_rowwise_then_scaled_grouped_mm = _fake_fp8_mm
    for name in ("torchao", "torchao.prototype"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, moe.__name__, moe)


def test_torchao_harness_calls_the_fp8_grouped_mm_as_torchao_asks(fake_torchao, monkeypatch):
    monkeypatch.setattr(peers, "torchao_fp8_unavailable", lambda case: "")
    case = mlp_case.make_case("U", torch.device("cpu"), torch.float32)
    peer = peers.TorchaoFP8Peer(case, peers.SharedWeights(case, "megatron"), None)
    assert peer.precision == "fp8" and peer.is_peer
    check = mlp_measure.check_variants([peer], mlp_case.reference_outputs(case), torch.float32)
    assert check["torchao_fp8"].ok and check["torchao_fp8"].max_rel_err < 1e-5


def test_torchao_skips_on_the_cpu_and_for_unaligned_groups(fake_torchao):
    case = mlp_case.make_case("T", torch.device("cpu"), torch.float32)
    assert "CUDA" in peers.torchao_fp8_unavailable(case)
    case.x = types.SimpleNamespace(device=torch.device("cuda"))  # only the device is read
    assert "multiples of 16" in peers.torchao_fp8_unavailable(case)


def test_bench_moe_block_dry_run(tmp_path):
    """The fused-vs-unfused MoE block benchmark on the CPU: both variants timed per shape and
    mode, the fused plan one MoeBlock step, the unfused one the dispatch / MLP / combine chain,
    and the two agree."""
    out = tmp_path / "moe.json"
    cmd = [sys.executable, "benchmarks/bench_moe_block.py", "--device", "cpu", "--dry-run",
           "--json", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    got = {(r["shape"], r["mode"], r["variant"]) for r in results if r["status"] == "ok"}
    for shape in ("T", "U"):
        for mode in ("fwd", "fwd+bwd"):
            assert {(shape, mode, "fused:reference"), (shape, mode, "unfused:reference")} <= got
    for r in results:
        assert r["max_rel_err"] < 1e-5, r
        plan = "MoeBlock@reference" if r["variant"].startswith("fused") else "GroupedMLP@reference"
        assert plan in r["note"], r


def test_bench_quant_dry_run(tmp_path):
    """The quantization benchmark on the CPU: the torch definitions timed for every operand and
    kind of the tiny shape with their traffic counted, the cute kernels skipped with a reason
    (or timed, where they can run)."""
    out = tmp_path / "quant.json"
    cmd = [sys.executable, "benchmarks/bench_quant.py", "--dry-run", "--json", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    kinds = {"spans", "rows_and_spans", "rows", "blocks"}
    timed = {(r["operand"], r["kind"]) for r in results if r["backend"] == "torch"
             and r["status"] == "ok" and r["ms"] > 0 and r["gb_per_s"] > 0}
    assert {kind for _, kind in timed} == kinds and len(timed) == 12, results
    for r in results:
        if r["backend"] == "cute":
            assert r["status"] == "ok" or r["reason"], r
    m, c, g = 256, 64, 4  # the dry shape's x: width P = 256 + 4 · 128 = 768
    spans = next(r for r in results if r["C"] == c and r["kind"] == "spans")
    assert spans["bytes"] == 2 * m * c + c * 768 + 4 * g * c
    blocks = next(r for r in results if r["C"] == c and r["kind"] == "blocks")
    assert blocks["bytes"] == 2 * m * c + c * 768 + 4 * (768 // 128) * c  # scale per block
    bad = subprocess.run([sys.executable, "benchmarks/bench_quant.py", "--shapes", "Q,nope"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unknown shapes" in bad.stderr


def test_bench_quant_weights_dry_run(tmp_path):
    """--weights times both weights' two FP8 forms per backend (the torch definitions wherever
    the kernels cannot run), traffic counted as w read once and both forms written."""
    out = tmp_path / "weights.json"
    cmd = [sys.executable, "benchmarks/bench_quant.py", "--dry-run", "--weights", "--json",
           str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert {(r["operand"], r["backend"]) for r in results if r["status"] == "ok"} == {
        (w, b) for w in ("W1 [E,2F,H]", "W2 [E,H,F]") for b in ("torch", "cute")}
    e, h, f = 4, 64, 48  # the dry shape
    w1 = next(r for r in results if r["operand"] == "W1 [E,2F,H]")
    assert w1["bytes"] == e * 2 * f * h * 4 + 4 * e * (2 * f + h)
    # the cute pair's two launches and a row-wise pass alone: timed where the pair runs,
    # else skipped with the reason (here N = 96 and 64, no multiples of 128, and a CPU)
    halves = [r for r in results if r["kind"].startswith("w:")]
    assert sorted((r["operand"], r["kind"]) for r in halves) == sorted(
        (w, k) for w in ("W1 [E,2F,H]", "W2 [E,H,F]")
        for k in ("w:rows+amax", "w:cast along N", "w:rows alone"))
    for r in halves:
        assert r["status"] == "ok" or "no multiple of 128" in r["reason"], r


@pytest.mark.slow  # a subprocess of ~20 s; CI runs it
def test_bench_grouped_mlp_fp8_variants_dry_run(tmp_path):
    """--fp8 times te_seq under Float8RowwiseScaling, its :tm-fwd, :hp-wgrad and
    :hp-wgrad:requant forms (the emulated FP8 of the torch backend on the CPU), each checked
    against the reference."""
    _, _, results = _dry_run(tmp_path, "--shapes", "U", "--backends", "torch", "--peers", "",
                             "--fp8")
    timed = _timed(results)
    for variant in ("te_seq:torch:fp8", "te_seq:torch:fp8:tm-fwd", "te_seq:torch:fp8:hp-wgrad",
                    "te_seq:torch:fp8:hp-wgrad:requant"):
        for mode in ("fwd", "fwd+bwd"):
            assert ("U", mode, variant) in timed, (mode, variant, results)
    fp8 = [r for r in results if r["variant"].startswith("te_seq:torch:fp8")]
    assert all(r["max_rel_err"] <= r["check_tol"] for r in fp8 if r["status"] == "ok")


def test_env_variant_sets_its_variables_only_while_it_runs(monkeypatch):
    import bench_grouped_mlp as bench

    assert bench.parse_env_variant("wg21:TE_SEQ_WGRAD_CLUSTER=2x1,TE_SEQ_PINGPONG_MAX_K=4096") == (
        "wg21", {"TE_SEQ_WGRAD_CLUSTER": "2x1", "TE_SEQ_PINGPONG_MAX_K": "4096"})
    for bad in ("noenv", "name:", ":A=1", "name:A"):
        with pytest.raises(ValueError, match="--env-variant wants NAME:VAR=VALUE"):
            bench.parse_env_variant(bad)
    monkeypatch.setenv("TE_SEQ_PROBE_B", "before")
    monkeypatch.delenv("TE_SEQ_PROBE_A", raising=False)
    seen = []
    monkeypatch.setattr(bench.TeSeqVariant, "run", lambda self, x, probs: seen.append(
        (os.environ.get("TE_SEQ_PROBE_A"), os.environ.get("TE_SEQ_PROBE_B"))) or x)
    case = mlp_case.make_case("T", torch.device("cpu"), torch.float32)
    base = bench.TeSeqVariant(case, "torch", "fresh")
    v = bench.TeSeqEnvVariant(base, "probe", {"TE_SEQ_PROBE_A": "1", "TE_SEQ_PROBE_B": "2"})
    v.forward()
    assert v.name == "te_seq:torch:probe" and seen == [("1", "2")]
    assert v.mlp is base.mlp and v.x is base.x  # the same module and inputs: only env differs
    assert "TE_SEQ_PROBE_A" not in os.environ and os.environ["TE_SEQ_PROBE_B"] == "before"


def test_env_variant_of_an_fp8_base_keeps_its_recipe(monkeypatch):
    """`--env-base te_seq:torch:fp8:hp-wgrad`: its env variant runs the base's own module under
    the base's recipe with the variables set; a base not built in the run is skipped, said
    why."""
    import bench_grouped_mlp as bench

    from te_seq.core.fp8 import active_recipe

    seen = []
    monkeypatch.setattr(bench.TeSeqVariant, "run", lambda self, x, probs: seen.append(
        (os.environ.get("TE_SEQ_PROBE_A"), str(active_recipe()))) or x)
    case = mlp_case.make_case("T", torch.device("cpu"), torch.float32)
    b = bench._Builder(case, "fresh")
    b.fp8, b.env_variants = True, [bench.parse_env_variant("probe:TE_SEQ_PROBE_A=1")]
    b.env_bases = ["te_seq:torch:fp8:hp-wgrad", "te_seq:none"]
    bench._build_te_seq(b, ["torch"])
    bench._build_env_variants(b)
    built = {v.name: v for v in b.variants}
    v = built["te_seq:torch:fp8:hp-wgrad:probe"]
    base = built["te_seq:torch:fp8:hp-wgrad"]
    assert v.mlp is base.mlp and v.precision == "fp8" and v.recipe is base.recipe
    v.forward()
    assert seen == [("1", str(base.recipe))]
    assert [r.variant for r in b.skipped] == ["te_seq:none:probe"]
    assert "--env-base te_seq:none is not a variant of this run" in b.skipped[0].note


def test_aa_adds_the_base_again_with_nothing_set(monkeypatch):
    """`--aa`: BASE:aa for every `--env-base`, the base's own module run with the environment
    as it is (the A/A yardstick of an --env-variant comparison), noted as such."""
    import bench_grouped_mlp as bench

    monkeypatch.setenv("TE_SEQ_PROBE_A", "kept")
    seen = []
    monkeypatch.setattr(bench.TeSeqVariant, "run", lambda self, x, probs: seen.append(
        os.environ.get("TE_SEQ_PROBE_A")) or x)
    case = mlp_case.make_case("T", torch.device("cpu"), torch.float32)
    args = bench.parse_args(["--dry-run", "--backends", "torch", "--peers", "", "--aa",
                             "--env-variant", "probe:TE_SEQ_PROBE_A=1",
                             "--env-base", "te_seq:torch"])
    variants, _ = bench.build_variants(case, args, "fresh")
    built = {v.name: v for v in variants}
    aa, probe = built["te_seq:torch:aa"], built["te_seq:torch:probe"]
    assert aa.mlp is built["te_seq:torch"].mlp and aa.env == {} and aa.note == bench.AA_NOTE
    aa.forward()
    probe.forward()
    assert seen == ["kept", "1"] and os.environ["TE_SEQ_PROBE_A"] == "kept"


def test_quack_gemms_compute_the_four_gemms_of_the_gemm_benchmark():
    """bench_grouped_gemm.py --quack: QuACK's varlen GEMMs (CPU stand-in with its documented
    semantics) on the benchmark's operands give the reference's results, GEMM for GEMM."""
    import bench_grouped_gemm

    from te_seq.kernels import reference

    e, h, f, sizes = 3, 16, 8, [5, 0, 7]
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    m = sum(sizes)
    x, act, dh = torch.randn(m, h), torch.randn(m, f), torch.randn(m, 2 * f)
    w1, w2 = torch.randn(e, 2 * f, h), torch.randn(e, h, f)
    got = {k: fn() for k, fn in bench_grouped_gemm.quack_gemms(
        FakeQuack, x, w1, w2, act, dh, offs).items()}
    want = {
        "fc1_fwd": reference.grouped_mm(x, w1.transpose(1, 2), offs),
        "fc2_fwd": reference.grouped_mm(act, w2.transpose(1, 2), offs),
        "fc1_dgrad": reference.grouped_mm(dh, w1, offs),
        "fc1_wgrad": reference.grouped_wgrad(dh, x, offs),
    }
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)


def test_gemm_benchmark_tilings_include_the_default_choice():
    """bench_grouped_gemm.py --tilings: "default" leaves the choice to te_seq (tiling=None), so
    the table shows what a user gets next to the explicit tilings."""
    import bench_grouped_gemm

    from te_seq.kernels.cute import Tiling

    got = bench_grouped_gemm.parse_tilings("default,256:1x2,128:2x1p,192:2x1pd,256:1x2d")
    assert got == {"default": None, "256:1x2": Tiling(256, (1, 2), False),
                   "128:2x1p": Tiling(128, (2, 1), True),
                   # "d": dynamic work units (the wgrads only; run_shape skips it elsewhere)
                   "192:2x1pd": Tiling(192, (2, 1), True, dynamic=True),
                   "256:1x2d": Tiling(256, (1, 2), False, dynamic=True)}


def test_gemm_benchmark_exact_splits_match_the_mlp_benchmarks(monkeypatch):
    """bench_grouped_gemm.py --exact-splits: A, B and Q get the MLP benchmark's m / e rows per
    expert (its default jitters them); Z keeps its Zipf split either way."""
    import bench_grouped_gemm

    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    e, _, _, m = bench_grouped_gemm.SHAPES["Q"]
    assert len(set(bench_grouped_gemm.split_sizes("Q", e, m, gen()))) > 1
    zipf = bench_grouped_gemm.split_sizes("Z", e, m, gen())
    monkeypatch.setattr(bench_grouped_gemm, "EXACT_SPLITS", True)
    assert bench_grouped_gemm.split_sizes("Q", e, m, gen()) == [m // e] * e
    assert bench_grouped_gemm.split_sizes("Z", e, m, gen()) == zipf


def test_schedule_model_shows_static_units_unbalanced_only_under_skew():
    """benchmarks/schedule_model.py (the kernel README's case for dynamic wgrad units): on Z's
    Zipf split the FC2 wgrad's 32 units per expert leave a static stride ~1.3x its balanced
    time and longest-first dynamic units balanced; 66 units per expert (one per cluster) and
    uniform Q are balanced either way."""
    import schedule_model
    from mlp_case import SHAPES, _uniform_counts, zipf_counts

    z, q = SHAPES["Z"], SHAPES["Q"]
    skewed = schedule_model.spans(zipf_counts(z.E, z.M, 0), 32, 66)
    assert skewed["static"] > 1.2 and skewed["dynamic, longest first"] < 1.01
    assert schedule_model.spans(zipf_counts(z.E, z.M, 0), 66, 66)["static"] < 1.01
    uniform = schedule_model.spans(_uniform_counts(q.E, q.M), 66, 66)
    assert all(v < 1.01 for v in uniform.values())


def test_schedule_model_counts_the_varlen_m_tiles_of_each_cluster_shape():
    """A whole 2x1 unit holds 256 rows of one expert: one with <= 128 rows left runs both
    CTAs, so whole units match 1x2's tile count on uniform 256-row experts (Q) and run more
    elsewhere; split tails (the kernels' 2x1) run 1x2's count on every split."""
    import schedule_model
    from mlp_case import SHAPES, split_counts

    sizes = [256, 260, 100, 0, 129, 383, 385]
    assert schedule_model.varlen_m_tiles(sizes, 1) == 2 + 3 + 1 + 0 + 2 + 3 + 4
    assert schedule_model.varlen_m_tiles(sizes, 2) == 2 * (1 + 2 + 1 + 0 + 1 + 2 + 2)
    assert schedule_model.varlen_m_tiles(sizes, 2, split_tail=True) == 2 + 3 + 1 + 0 + 2 + 3 + 4
    q = schedule_model.varlen_m_report(split_counts(SHAPES["Q"]))
    assert q == {"1x2": 1.0, "2x1 whole": 1.0, "2x1": 1.0}
    for name in ("J", "Z"):
        got = schedule_model.varlen_m_report(split_counts(SHAPES[name]))
        assert 1.1 < got["1x2"] < got["2x1 whole"] - 0.1
        assert got["2x1"] == got["1x2"]


def test_step_roofline_counts_every_gemm_once_and_each_tensor_it_moves():
    """benchmarks/step_roofline.py: the kernels of a step do the benchmark's 18·M·H·F FLOPs in
    every precision; bf16 moves 2·(6 [M, H] + 14 [M, F] + 3 W1 + 3 W2) bytes (x, y, dy, dx,
    and dy and x again for the wgrads; h, dh five times and a four times; each weight read
    twice and its gradient written once); FP8 moves less on Q, its all-FP8 form more than with
    bf16 wgrads (the token-major passes)."""
    import step_roofline
    from mlp_case import SHAPES
    from mlp_report import flops

    for name in ("A", "B", "Q", "U"):
        shape = SHAPES[name]
        for precision in step_roofline.PRECISIONS:
            kernels = step_roofline.step_kernels(shape, precision)
            assert sum(k.flops for k in kernels) == flops(shape, "fwd+bwd")
            assert all(k.read > 0 and k.written > 0 for k in kernels)
    q = SHAPES["Q"]
    x, a = q.M * q.H, q.M * q.F
    w1, w2 = q.E * 2 * q.F * q.H, q.E * q.H * q.F
    moved = {p: sum(k.bytes for k in step_roofline.step_kernels(q, p))
             for p in step_roofline.PRECISIONS}
    assert moved["bf16"] == 2 * (6 * x + 14 * a + 3 * w1 + 3 * w2)
    assert moved["fp8"] < moved["fp8all"] < moved["bf16"]
    # the wgrads' gradients: bf16 .grad read as well (accumulate), fp32 main_grad read and
    # written instead (megatron); nothing else changes
    for precision in step_roofline.PRECISIONS:
        for mode, extra in (("accumulate", 2), ("megatron", 6)):
            kernels = step_roofline.step_kernels(q, precision, mode)
            assert sum(k.bytes for k in kernels) == moved[precision] + extra * (w1 + w2)
            assert sum(k.flops for k in kernels) == flops(q, "fwd+bwd")
    with pytest.raises(ValueError, match="precision must be one of"):
        step_roofline.step_kernels(q, "fp16")
    with pytest.raises(ValueError, match="grad_mode one of"):
        step_roofline.step_kernels(q, "bf16", "fp32")


def test_step_roofline_bound_takes_each_kernels_slower_limit():
    """A kernel's bound is the larger of its bytes at the copy rate and its FLOPs at its
    precision's peak; the step's is their sum. On Q every bf16 GEMM's two limits lie within
    40 % of each other (near the machine's balance) and the GLU dgrad is bound by its bytes."""
    import step_roofline
    from mlp_case import SHAPES

    rates = step_roofline.Rates(bandwidth=1e12, bf16=1e15, fp8=2e15)
    gemm = step_roofline.Kernel("g", 3e9, 1e9, 4e15, fp8=True)
    assert rates.memory_s(gemm) == 4e-3 and rates.compute_s(gemm) == 2.0
    assert rates.bound_s(gemm) == 2.0
    copy = step_roofline.Kernel("c", 3e9, 1e9, 0)
    assert step_roofline.step_bound_s([gemm, copy], rates) == 2.0 + 4e-3
    h200 = step_roofline.Rates()
    q = {k.name: k for k in step_roofline.step_kernels(SHAPES["Q"], "bf16")}
    for k in q.values():
        assert 1 / 1.4 < h200.memory_s(k) / h200.compute_s(k) < 1.4, k.name
    assert h200.memory_s(q["GLU dgrad"]) > 1.3 * h200.compute_s(q["GLU dgrad"])


def test_step_roofline_prints_each_shape(capsys, monkeypatch):
    import step_roofline

    monkeypatch.setattr(sys, "argv", ["step_roofline.py", "--shapes", "Q", "--kernels"])
    step_roofline.main()
    out = capsys.readouterr().out
    assert "Q bf16" in out and "GLU dgrad" in out and "Q bound bf16 / FP8: 1.18x" in out
    monkeypatch.setattr(sys, "argv", ["step_roofline.py", "--shapes", "Q", "--grad-mode",
                                      "megatron"])
    step_roofline.main()
    out = capsys.readouterr().out
    assert "gradients megatron" in out and "Q bf16       8.76 GB" in out


def test_jittered_shape_splits_near_uniform():
    """Shape J (Q's widths as a balanced router splits them): every expert 0.9-1.1x the mean
    (±1 row of rounding), not all equal, summing to M; deterministic per seed."""
    from mlp_case import SHAPES, split_counts

    j = SHAPES["J"]
    counts = split_counts(j)
    mean = j.M / j.E
    assert sum(counts) == j.M and len(counts) == j.E
    assert all(0.9 * mean - 1 <= c <= 1.1 * mean + 1 for c in counts)
    assert len(set(counts)) > j.E // 4
    assert counts == split_counts(j) != split_counts(j, seed=1)
    assert split_counts(SHAPES["Q"]) == [j.M // j.E] * j.E


def _grouped(x, b, sizes):
    """x's rows of group g times b[g], for a CPU stand-in of the varlen GEMMs."""
    return torch.cat([xg @ b[g] for g, xg in enumerate(x.split(sizes))])


def test_fc1_layout_variants_give_fc1s_a_from_each_kernels_w1_layout(monkeypatch):
    """`bench_grouped_gemm.fc1_layout_variants` hands each kernel the same W1 in its layout:
    ours interleaved in 64-row blocks (the kernel's interleave=64), QuACK's gate/up row by row;
    with CPU stand-ins of the three kernels every variant reproduces SwiGLU(x W1ᵀ)·probs, and
    QuACK's stored pre-activation is x W1ᵀ with gate and up interleaved."""
    import bench_grouped_gemm

    from te_seq.kernels import GluSpec, cute, reference

    sizes, h, f = [5, 0, 7], 64, 128
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes), h, dtype=torch.float64)
    w1t = torch.randn(len(sizes), 2 * f, h, dtype=torch.float64).transpose(1, 2)
    probs = torch.rand(sum(sizes), dtype=torch.float64)

    def ours(x_, w1t_, offs_, act, interleave, probs_, store_h=True):
        hh = _grouped(x_, w1t_, sizes)
        assert interleave == 64 and not store_h
        hh = hh.view(-1, f // 64, 2, 64).transpose(1, 2).reshape(-1, 2 * f)  # -> [gate | up]
        return None, reference.REFERENCE.glu_forward(hh, GluSpec(act), probs_)

    def gated(x_, w, activation, cu_seqlens_m, store_preact):
        hh = _grouped(x_, w, sizes)
        return (hh if store_preact else None), F.silu(hh[:, 0::2]) * hh[:, 1::2]

    monkeypatch.setattr(cute, "glu_fc1_forward", ours)
    qk = types.SimpleNamespace(gemm_gated=gated,
                               gemm=lambda x_, w, cu_seqlens_m: _grouped(x_, w, sizes))
    h_ref = _grouped(x, w1t, sizes)
    a_ref = reference.REFERENCE.glu_forward(h_ref, GluSpec("silu"), probs)
    got = {k: fn() for k, fn in bench_grouped_gemm.fc1_layout_variants(
        qk, x, w1t, offs, probs).items()}
    torch.testing.assert_close(got["fused_no_h_il64"][1], a_ref)
    torch.testing.assert_close(got["quack_gated_no_h"][1], a_ref)
    pre, a_h = got["quack_gated_h"]
    torch.testing.assert_close(a_h, a_ref)
    torch.testing.assert_close(pre[:, 0::2], h_ref[:, :f])  # gate, up interleaved row by row
    torch.testing.assert_close(pre[:, 1::2], h_ref[:, f:])
    torch.testing.assert_close(got["quack_mm"][0], h_ref)


@pytest.mark.slow  # a subprocess that compiles two kernels for sm_90a
def test_fc1_probe_kernel_compiles_and_keeps_its_mainloop():
    """benchmarks/probe_fc1.py's variant kernels compile, and their PTX has as many WGMMAs as
    the real FC1's (the compiler kept the mainloops they are there to time); the real FC1
    converts fewer values to bf16 than the one computing a from the rounded h (it computes a
    from the fp32 accumulators: a is its only conversion)."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    result = subprocess.run([sys.executable, "benchmarks/probe_fc1.py", "--compile-only"],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "WGMMAs in the PTX" in result.stdout and "conversions to bf16" in result.stdout


@pytest.mark.slow  # subprocesses that compile two wgrad kernels per variant for sm_90a (~1 min)
def test_wgrad_epilogue_probe_variants_compile_and_keep_the_mainloop():
    """benchmarks/probe_wgrad_epilogue.py's timing variants compile for sm_90a, keep the
    wgrads' WGMMAs (the main loop they time) and remove what each says (the probe's own
    check, which raises otherwise); a 2-slot store ring gives the FP8 wgrad a fifth stage,
    64-column subtiles halve its TMA stores, the direct stores replace the ring's."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    variants = ("cut=all,cut=stage,cut=const,cut=tma,cut=fence,cut=scale,ring=2,cols=64+ring=2,"
                "cut=direct")
    result = subprocess.run([sys.executable, "benchmarks/probe_wgrad_epilogue.py",
                             "--compile-only", "--variants", variants],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "each cut removes what it says" in result.stdout


def test_wgrad_epilogue_probe_check_catches_a_cut_that_misses():
    """The probe's PTX check fails a variant that lost WGMMAs, a cut that left what it
    removes, and a store ring that did not add a stage; the variant specs parse into the
    child's flags and its result lines into ms per (shape, gemm, precision, variant)."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    import probe_wgrad_epilogue as probe

    fp8, bf16 = probe.COMPILE_CONFIGS
    base = {"wgmma": 24, "stmatrix": 24, "fence": 6, "tma_store": 6, "mbarrier_init": 8,
            "selp": 37, "fmul": 384, "cvt": 96, "st_global": 0}

    def counts(**fp8_changes):
        return {fp8: {**base, **fp8_changes}, bf16: dict(base)}

    good = {"none": counts(), "cut=all": counts(stmatrix=0, tma_store=0, fence=0, fmul=0),
            "cut=tma": counts(tma_store=0), "ring=2": counts(mbarrier_init=10),
            "cut=const": counts(cvt=0, fmul=0), "cols=64+ring=2": counts(tma_store=3),
            "cut=direct": counts(stmatrix=0, tma_store=0, fence=0, st_global=96)}
    assert probe.check_variants(good) == []
    bad = {"none": counts(), "cut=all": counts(stmatrix=3, tma_store=0),
           "cut=stage": counts(stmatrix=0, wgmma=12), "ring=2": counts(),
           "cut=scale": counts(), "cut=const": counts(stmatrix=0), "cols=64": counts(),
           "cut=direct": counts(stmatrix=0, tma_store=0, fence=0)}
    problems = " ".join(probe.check_variants(bad))
    for needle in ("cut=all: stmatrix 3", "cut=stage fp8_wgrad_pp192_2x1: 12 WGMMAs",
                   "ring=2: 8 mbarriers", "cut=scale: fmul 384, not below",
                   "cut=const: stmatrix 0 against none's 24", "cut=const: cvt 96, not below",
                   "cols=64: 6 TMA stores, none has 6 of 32 columns",
                   "cut=direct: st_global 0, not above none's 0"):
        assert needle in problems
    assert probe._child_args("cut=tma+ring=2") == ["--cut", "tma", "--store-ring", "2"]
    assert probe._child_args("none") == []
    assert probe._child_args("cols=64+ring=2") == ["--epi-cols", "64", "--store-ring", "2"]
    with pytest.raises(ValueError, match="cutt=x"):
        probe._child_args("cutt=x")
    times = defaultdict(list)
    probe._collect("cut=tma B fc1 bf16 1.6525ms 665TF bits 91d5  fp8 1.2158ms 904TF bits 91d5",
                   times)
    assert dict(times) == {("B", "fc1", "bf16", "cut=tma", "ms"): [1.6525],
                           ("B", "fc1", "fp8", "cut=tma", "ms"): [1.2158]}


def test_wgrad_epilogue_probe_reports_cycles_from_the_sampled_clock():
    """With sampled windows the probe's result line adds each kernel's median clock, its
    cycles (ms x GHz) and power, only from the samples inside that kernel's window, and the
    variants' table collects the cycles beside the ms."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    import time

    import probe_wgrad_epilogue as probe

    base = float(int(time.time()))
    stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(base))
    lines = [f"{stamp}.100, 1500, 690, 48", f"{stamp}.200, 1490, 700, 49",
             f"{stamp}.600, 1800, 600, 47", f"{stamp}.700, 1780, 610, 47"]
    cells = {"bf16": (2.0, 500.0, "aa11", (base + 0.05, base + 0.3)),
             "fp8": (1.0, 1000.0, "bb22", (base + 0.55, base + 0.75))}
    line = probe._result_line("none", "B", "fc1", cells, lines)
    assert line == ("none B fc1 bf16 2.0000ms 500TF 1495MHz 2.9900Mcyc 695W bits aa11  "
                    "fp8 1.0000ms 1000TF 1790MHz 1.7900Mcyc 605W bits bb22")
    times = defaultdict(list)
    probe._collect(line, times)
    assert times[("B", "fc1", "bf16", "none", "Mcyc")] == [2.99]
    assert times[("B", "fc1", "fp8", "none", "ms")] == [1.0]
    assert times[("B", "fc1", "fp8", "none", "Mcyc")] == [1.79]
    unsampled = probe._result_line("none", "B", "fc1", {"bf16": (2.0, 500.0, "aa11", None)},
                                   lines)
    assert unsampled == "none B fc1 bf16 2.0000ms 500TF bits aa11"
    with_reasons = [f"{stamp}.100, 1500, 690, 48, 0x0000000000000004",
                    f"{stamp}.200, 1490, 700, 49, 0x000000000000000C", "0x4 garbage"]
    line = probe._result_line("none", "B", "fc1", {"bf16": cells["bf16"]}, with_reasons)
    assert line.endswith("695W slowdown=sw_power_cap:100%,hw_slowdown:50% bits aa11")


def test_probe_clocks_names_the_slowdown_reasons_of_a_window():
    import time

    import probe_clocks

    base = float(int(time.time()))
    stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(base))
    lines = [f"{stamp}.100, 1400, 690, 48, 0x0000000000000000",
             f"{stamp}.200, 1500, 692, 49, 0x0000000000000080",
             f"{stamp}.800, 1600, 694, 50, 0x0000000000000004"]
    assert probe_clocks.reasons_between(lines, base, base + 0.5) == "hw_power_brake:50%"
    assert probe_clocks.reasons_between(lines, base + 0.1, base + 0.15) == "none"
    assert probe_clocks.reasons_between([ln.rsplit(",", 1)[0] for ln in lines], base,
                                        base + 1) == ""
    assert probe_clocks.samples_between(lines, base + 0.7, base + 1) == [(1600.0, 694.0, 50.0)]


def test_ncu_stalls_reads_a_source_page_and_ranks_instructions():
    """ncu_stalls.py on a source page as ncu writes it (the kernel's name first, numbers with
    thousands separators, "(Not Issued)" twins of the reason columns): the samples per
    reason, the instructions by samples, each with its leading reasons."""
    import ncu_stalls

    page = [
        '"Kernel Name","kernel_x"',
        '"Address","Source","Warp Stall Sampling (All Samples)",'
        '"Warp Stall Sampling (Not-issued Samples)","stall_barrier","stall_wait",'
        '"stall_long_sb","stall_barrier (Not Issued)"',
        '"0x10","BAR.SYNC 0x1, 0x80","1,200","1,100","1,000","200","0","999"',
        '"0x20","WARPGROUP.DEPBAR.LE gsb0, 0x1","300","250","0","300","0","0"',
        '"0x30","LDG.E R2, [R4]","500","480","0","100","400","0"',
    ]
    ins = ncu_stalls.read_source_page(page)
    assert [i.samples for i in ins] == [1200, 300, 500]
    assert ins[0].reasons == {"barrier": 1000, "wait": 200, "long_sb": 0}
    assert ins[2].leading(1) == [("long_sb", 400)]
    text = ncu_stalls.summary(ins, top=2)
    assert "2000 samples" in text and "barrier" in text.splitlines()[1]
    top = [line for line in text.splitlines() if line.strip().startswith(("1200", "500"))]
    assert len(top) == 2 and "BAR.SYNC" in top[0] and "LDG" in top[1]
    with pytest.raises(ValueError, match="not an ncu source page"):
        ncu_stalls.read_source_page(['"Address","Source"'])


def test_ncu_stalls_accounts_instructions_per_offset_range():
    """--ranges: per range of offsets from the kernel's first instruction, the samples, the
    warp instructions executed and the opcodes by count (modifiers and predicates dropped)."""
    import ncu_stalls

    page = [
        '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
        '"stall_wait"',
        '"0x7f00","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24","10","4,096","10"',
        '"0x7f10","@!P0  BRA 0x7f00","5","100","5"',
        '"0x7f20","F2F.BF16.F32 R95, R95","3","2,048","3"',
        '"0x7f30","F2F.BF16.F32 R96, R96","2","2,048","2"',
        '"0x7f40","FMUL R1, R2, R3","0","1,024","0"',
    ]
    ins = ncu_stalls.read_source_page(page)
    assert [i.opcode for i in ins] == ["HGMMA", "BRA", "F2F", "F2F", "FMUL"]
    ranges = ncu_stalls.parse_ranges("main=0x0-0x20,epi=0x20-0x50")
    assert ranges == [("main", 0, 0x20), ("epi", 0x20, 0x50)]
    main, epi = ncu_stalls.by_range(ins, ranges).splitlines()[1:]
    assert "15 samples" in main and "4196 warp instructions" in main
    assert "5 samples" in epi and "5120 warp instructions" in epi
    assert epi.index("F2F 4096") < epi.index("FMUL 1024")
    assert "+0x00010" in ncu_stalls.summary(ins, top=2)  # the BRA's offset
    with pytest.raises(ValueError, match="name=START-END"):
        ncu_stalls.parse_ranges("main=0x0")


@pytest.mark.parametrize("forward", [True, False])
def test_ncu_target_runs_its_steps_on_the_cpu(forward):
    import ncu_target

    step = ncu_target.make_step("U", "swiglu", forward, "", "cpu")
    for _ in range(2):
        step()


def test_probe_clocks_keeps_the_samples_inside_each_window():
    import time

    import probe_clocks

    def stamp(epoch):
        return time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(int(epoch))) + \
            f".{int(round((epoch % 1) * 1000)):03d}"

    base = float(int(time.time()))
    lines = [f"{stamp(base + 0.5)}, 1400, 690.5, 48", f"{stamp(base + 2.25)}, 1500, 600.0, 49",
             "garbage line", f"{stamp(base + 9)}, [N/A], 700, 50",
             f"{stamp(base + 4)}, 1300, 695.0, 50"]
    got = probe_clocks.samples_between(lines, base + 1, base + 5)
    assert got == [(1500.0, 600.0, 49.0), (1300.0, 695.0, 50.0)]
    assert probe_clocks.samples_between(lines, base, base + 0.6) == [(1400.0, 690.5, 48.0)]


def test_probe_clocks_report_gives_rate_clock_and_cycles_per_window(capsys):
    import time

    import probe_clocks

    base = float(int(time.time()))
    stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(base))
    lines = [f"{stamp}.100, 1400, 690, 48", f"{stamp}.200, 1500, 692, 49",
             f"{stamp}.300, 1600, 694, 50", f"{stamp}.900, 1000, 300, 40"]
    windows = [("cute", base + 0.05, base + 0.35, 2.0), ("dense", base + 0.85, base + 0.95, 1.6),
               ("quack", base + 5, base + 6, 1.9)]
    rows = probe_clocks.report(windows, lines, mlp_flops=1e12)
    assert [r["variant"] for r in rows] == ["cute", "dense"]  # quack: no samples in its window
    cute, dense = rows
    assert (cute["mhz"], cute["watts"], cute["samples"]) == (1500.0, 692.0, 3)
    assert cute["tflops"] == pytest.approx(500.0) and cute["ms_x_ghz"] == pytest.approx(3.0)
    assert dense["tflops"] == pytest.approx(2 * 8192**3 / 1.6e-3 / 1e12)
    assert "no nvidia-smi samples" in capsys.readouterr().out


def test_probe_clocks_env_variant_runs_with_its_environment(monkeypatch):
    import probe_clocks

    seen = []
    monkeypatch.setattr(probe_clocks, "step_fn", lambda mlp, forward, recipe: lambda: seen.append(
        (os.environ.get("TE_SEQ_PROBE_X"), recipe)))
    monkeypatch.delenv("TE_SEQ_PROBE_X", raising=False)
    case = mlp_case.make_case("U", torch.device("cpu"), torch.float32, act="swiglu")
    envs = {"x": {"TE_SEQ_PROBE_X": "7"}}
    probe_clocks.make_step("cute:x", case, envs, backend="torch")()
    probe_clocks.make_step("cute", case, envs, backend="torch")()
    probe_clocks.make_step("cute:fp8", case, envs, backend="torch")()
    probe_clocks.make_step("cute:fp8/x", case, envs, backend="torch")()
    assert [env for env, _ in seen] == ["7", None, None, "7"]
    assert seen[3][1].fp8_wgrad is False
    for bad in ("cute:y", "cute:fp8/y", "quack/x"):
        with pytest.raises(ValueError, match=f"unknown variant '{bad}'.*cute:fp8/x"):
            probe_clocks.make_step(bad, case, envs, backend="torch")
    assert seen[0][1] is None and seen[2][1].fp8_wgrad is False
    assert "TE_SEQ_PROBE_X" not in os.environ


def test_probe_autograd_threads_times_both_settings_on_the_cpu():
    import probe_autograd_threads as probe

    rows = probe.compare("cpu smoke", probe.spin_step(50, "cpu"), bursts=2)
    assert [threads for threads, _, _ in rows] == [True, False]
    assert all(host > 0 and wall >= host for _, host, wall in rows)
    assert probe._Spin.spent and min(probe._Spin.spent) > 0
    assert torch.autograd.is_multithreading_enabled()


def test_probe_clocks_megatron_mode_gives_the_weights_main_grad(monkeypatch):
    import probe_clocks

    built = []
    monkeypatch.setattr(probe_clocks, "step_fn", lambda mlp, forward, recipe: built.append(mlp))
    case = mlp_case.make_case("U", torch.device("cpu"), torch.float32, act="swiglu")
    probe_clocks.make_step("cute", case, {}, backend="torch", grad_mode="megatron")
    probe_clocks.make_step("cute", case, {}, backend="torch")
    megatron, fresh = (list(mlp.parameters()) for mlp in built)
    assert all(p.main_grad.dtype == torch.float32 and p.main_grad.shape == p.shape
               for p in megatron)
    assert not any(hasattr(p, "main_grad") for p in fresh)


def test_host_feed_times_both_autograd_thread_settings_and_restores_the_default():
    import profile_kernels

    calls = []

    def step():
        calls.append(torch.autograd.is_multithreading_enabled())

    feed = profile_kernels.host_feed(step, bursts=3, burst=4)
    assert list(feed) == ["threads", "calling thread"]
    assert calls == [True] * 12 + [False] * 12
    assert all(wall >= host > 0 for host, wall in feed.values())
    assert torch.autograd.is_multithreading_enabled()


def test_host_stage_times_count_each_layer_and_unwrap_them():
    """profile_host.stage_times on the CPU: per call of a fresh-grads step, the Sequential,
    the fused op's forward and backward and Tensor.backward are each entered once, the two
    weight gradients twice; a layer's inclusive time holds the layers inside it; under an FP8
    recipe the FP8 forward runs once and its two grouped GEMMs; every wrapped function is the
    original again afterwards."""
    import profile_host

    import te_seq

    cpu = torch.device("cpu")
    case = mlp_case.make_case("U", cpu, torch.float32)
    mlp, forward = profile_host.build(case, "torch")
    originals = [(owner, name, getattr(owner, name))
                 for _, owner, name in profile_host._stage_steps()]
    step = profile_host.fresh_step(forward, [*mlp.parameters(), *forward.inputs])
    stages = profile_host.stage_times(step, cpu, iters=4)
    entries = {label: n for label, (_, n) in stages.items()}
    assert entries["Sequential.forward"] == entries["Tensor.backward"] == 1
    assert entries["GroupedMLP.fuser_forward"] == entries["GroupedMLP.fuser_backward"] == 1
    assert entries["GroupedLinear.weight_grads"] == 2
    assert "FP8 forward (_grouped_mlp_fp8)" not in entries  # bf16: no FP8 layer entered
    assert stages["Sequential.forward"][0] >= stages["GroupedMLP.fuser_forward"][0] > 0
    assert stages["Tensor.backward"][0] >= stages["GroupedMLP.fuser_backward"][0] > 0

    def fp8_forward():
        with te_seq.autocast(recipe=te_seq.recipe.Float8RowwiseScaling(fp8_wgrad=False)):
            return forward()

    fp8 = profile_host.stage_times(fp8_forward, cpu, iters=2)
    assert fp8["FP8 forward (_grouped_mlp_fp8)"][1] == 1
    assert fp8["fp8_gemm.grouped_forward"][1] == 2  # FC1 and FC2
    for owner, name, original in originals:
        assert getattr(owner, name) == original, name


def test_bench_expert_parallel_dry_run(tmp_path):
    """The expert-parallel benchmark on 2 CPU ranks (gloo, torchrun --standalone): te_seq's EP
    block in both modes equals the plain PyTorch block, and the tensor-parallel linears' overlap
    equals the plain collective + GEMM; every variant timed."""
    out = tmp_path / "ep.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "benchmarks/bench_expert_parallel.py", "--device", "cpu", "--dry-run",
           "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    got = {(r["shape"], r["mode"], r["variant"]) for r in results if r["status"] == "ok"}
    for shape in ("T", "U"):
        for variant in ("torch", "te_seq", "te_seq:capacity1.25"):
            assert (shape, "fwd+bwd", variant) in got
    for shape, mode in (("tp column", "fwd"), ("tp row", "fwd"), ("tp mlp", "fwd+bwd")):
        assert {(shape, mode, "overlap"), (shape, mode, "plain")} <= got
    for r in results:
        assert r["max_rel_err"] < 1e-5 and r["ms"] > 0, r
