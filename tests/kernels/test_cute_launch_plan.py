"""Launch plans of the cute functionals (te_seq/kernels/cute/launch_plan.py), on the CPU.

The kernels are stubs (benchmarks/profile_launch.py: ``stubbed_kernels``) that record their
launch arguments: a call whose signature was seen launches exactly what a freshly planned call
launches, and any change of shape, dtype, stride or option is planned (and compiled) anew.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# the stubs replace compile.py's entry points, and compile.py imports the CuTe DSL
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install "
                    "'te_seq[cute]')")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from profile_launch import UNIT_ORDER, stubbed_kernels  # noqa: E402

from te_seq.kernels import cute  # noqa: E402
from te_seq.kernels.cute import Tiling  # noqa: E402
from te_seq.kernels.cute.launch_plan import clear_plans  # noqa: E402

E, H, F, M = 4, 128, 256, 96
BF16 = torch.bfloat16


def _offs(rows: int = M) -> torch.Tensor:
    return torch.tensor([rows // 4, rows // 2, rows // 2, rows], dtype=torch.int32)


def _describe(args: tuple) -> list:
    """A launch's arguments as comparable facts: tensors by dtype, shape, strides and whether
    their data is one of the caller's inputs (its pointer), other values as they are."""
    out = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            out.append((arg.dtype, tuple(arg.shape), arg.stride(), arg.data_ptr()))
        else:
            out.append(arg)
    return out


def _inputs_of(args: tuple) -> list:
    """The arguments' facts without data pointers (outputs are fresh buffers on every call)."""
    return [d[:3] if isinstance(d, tuple) else d for d in _describe(args)]


def _launch_of(stubs: dict, call) -> tuple:
    """(the config, the arguments) of the one GEMM launch ``call()`` makes (besides a dynamic
    wgrad's unit-order launch: `test_dynamic_wgrad_launches_its_unit_order_first`)."""
    before = {cfg: len(stub.calls) for cfg, stub in stubs.items()}
    call()
    new = [(cfg, stub.calls[-1]) for cfg, stub in stubs.items()
           if len(stub.calls) > before.get(cfg, 0) and cfg != UNIT_ORDER]
    assert len(new) == 1, f"expected one launch, got {len(new)}"
    return new[0]


def _calls():
    """One call per functional on fresh random operands (weights as the fused op passes them)."""
    x, dy = torch.randn(M, H).to(BF16), torch.randn(M, H).to(BF16)
    w1t = torch.randn(E, 2 * F, H).to(BF16).transpose(1, 2)  # [E, H, 2F], K-major
    w2 = torch.randn(E, H, F).to(BF16)  # [E, H, F], N-major
    a, h, probs = torch.randn(M, F).to(BF16), torch.randn(M, 2 * F).to(BF16), torch.rand(M)
    offs = _offs()
    return {
        "grouped_mm": lambda: cute.grouped_mm(a, w2.transpose(1, 2), offs),
        "grouped_wgrad": lambda: cute.grouped_wgrad(dy, a, offs),
        "glu_fc1_forward": lambda: cute.glu_fc1_forward(x, w1t, offs, "silu", None, probs),
        "glu_fc2_dgrad": lambda: cute.glu_fc2_dgrad(dy, w2, offs, h, "silu", None, probs),
        "act_fc1_forward": lambda: cute.act_fc1_forward(x, w2, offs, "relu", probs),
        "act_fc2_dgrad": lambda: cute.act_fc2_dgrad(dy, w2, offs, a, "relu", probs),
    }


@pytest.mark.parametrize("name", ["grouped_mm", "grouped_wgrad", "glu_fc1_forward",
                                  "glu_fc2_dgrad", "act_fc1_forward", "act_fc2_dgrad"])
def test_planned_call_launches_what_a_fresh_plan_launches(name):
    call = _calls()[name]
    with stubbed_kernels() as stubs:
        cfg1, first = _launch_of(stubs, call)
        cfg2, again = _launch_of(stubs, call)  # from the plan
        clear_plans()
        cfg3, fresh = _launch_of(stubs, call)  # planned anew
    assert cfg1 == cfg2 == cfg3 and len(set(stubs) - {UNIT_ORDER}) == 1
    assert _inputs_of(again) == _inputs_of(first) == _inputs_of(fresh)
    # inputs and placeholders are the very same tensors; outputs are new buffers per call
    same = [a.data_ptr() == b.data_ptr() for a, b in zip(first, again)
            if isinstance(a, torch.Tensor)]
    assert any(same) and not all(same)


@pytest.mark.parametrize("dynamic", [True, False])
def test_dynamic_wgrad_takes_a_row_of_one_unit_order_launch_per_offs(dynamic):
    """A dynamic wgrad passes its GEMM a row of ``unit_order``'s launch (order and counter, E
    + 1 int32), a different row each call on the same offs, one launch per SLOTS calls and a
    new one for changed offs; a static one launches only the GEMM, with the placeholder."""
    from te_seq.kernels.cute.unit_order import SLOTS

    dy, a, offs = torch.randn(M, H).to(BF16), torch.randn(M, F).to(BF16), _offs()
    tiling = Tiling(128, (2, 1), True, dynamic=dynamic)
    calls = SLOTS + 2
    with stubbed_kernels() as stubs:
        for i in range(calls):
            if i == SLOTS + 1:
                offs.add_(0)  # changed in place (a new version): its rows are made afresh
            cute.grouped_wgrad(dy, a, offs, tiling=tiling)
        (cfg,) = set(stubs) - {UNIT_ORDER}
        assert cfg.dynamic is dynamic
        gemm_calls = stubs[cfg].calls
        order_calls = stubs[UNIT_ORDER].calls if UNIT_ORDER in stubs else []
    assert len(gemm_calls) == calls
    if not dynamic:
        assert order_calls == [] and gemm_calls[0][-1].shape == (1,)  # the unused placeholder
        return
    assert len(order_calls) == 3  # the first SLOTS calls, one more, then the new version
    rows = [launch[1] for launch in order_calls]
    assert all(r.shape == (SLOTS, E + 1) and r.dtype == torch.int32 for r in rows)
    assert all(launch[0] is offs for launch in order_calls)
    given = [call[-1] for call in gemm_calls]
    expect = [(rows[0], i) for i in range(SLOTS)] + [(rows[1], 0), (rows[2], 0)]
    for got, (buf, i) in zip(given, expect):
        assert got.shape == (E + 1,) and got.data_ptr() == buf[i].data_ptr()


def _glu_cfgs(stubs: dict, calls) -> list:
    return [_launch_of(stubs, c)[0] for c in calls]


def test_glu_replans_on_each_change_of_signature():
    x, probs = torch.randn(M, H).to(BF16), torch.rand(M)
    w1 = torch.randn(E, 2 * F, H).to(BF16)
    offs = _offs()
    fc1 = cute.glu_fc1_forward
    calls = [
        lambda: fc1(x, w1.transpose(1, 2), offs, "silu", None, probs),
        lambda: fc1(x, w1.transpose(1, 2).contiguous(), offs, "silu", None, probs),  # b major
        lambda: fc1(x.half(), w1.half().transpose(1, 2), offs, "silu", None, probs),  # dtype
        lambda: fc1(x, w1.transpose(1, 2), offs, "silu", None, None),  # no probs
        lambda: fc1(x, w1.transpose(1, 2), offs, "gelu", None, probs),  # act
        lambda: fc1(x, w1.transpose(1, 2), offs, "silu", 64, probs),  # interleave
        lambda: fc1(x, w1.transpose(1, 2), offs, "silu", None, probs, tiling=Tiling(
            256, (2, 1))),  # tiling
    ]
    with stubbed_kernels() as stubs:
        cfgs = _glu_cfgs(stubs, calls)
        again = _glu_cfgs(stubs, calls)
    assert len(set(cfgs)) == len(calls) and again == cfgs
    assert [c.b_major for c in cfgs[:2]] == ["k", "n"]
    assert cfgs[2].ab_dtype == torch.float16 and cfgs[3].probs_dtype is None
    assert (cfgs[4].act, cfgs[5].interleave, cfgs[6].cluster_mn) == ("gelu", 64, (2, 1))


def test_grid_follows_the_rows():
    """The cluster count comes from M: a call with more rows is planned anew."""
    w2 = torch.randn(E, H, F).to(BF16)
    with stubbed_kernels() as stubs:
        counts = []
        for rows in (96, 4096, 96):
            a = torch.randn(rows, F).to(BF16)
            counts.append(_launch_of(stubs, lambda a=a, r=rows: cute.grouped_mm(
                a, w2.transpose(1, 2), _offs(r)))[1][4])
    assert counts[0] == counts[2] < counts[1]


def test_unaligned_b_is_copied_on_every_call():
    """B whose strides TMA cannot take is copied per call (the plan keeps only that it must
    be), so a later call with new values launches those values."""
    a = torch.randn(M, H).to(BF16)
    padded = torch.randn(E, H, F + 4).to(BF16)
    b = padded[:, :, :F]  # N-major, row stride F + 4: not 16-byte aligned
    with stubbed_kernels() as stubs:
        _, first = _launch_of(stubs, lambda: cute.grouped_mm(a, b, _offs()))
        padded.copy_(torch.randn_like(padded))
        _, again = _launch_of(stubs, lambda: cute.grouped_mm(a, b, _offs()))
    for launched in (first, again):
        assert launched[1].data_ptr() != b.data_ptr()
    assert torch.equal(again[1], b.permute(2, 1, 0))
    assert not torch.equal(first[1], again[1])


def test_default_tiling_follows_the_environment(tiling_env):
    """TE_SEQ_PINGPONG=0 turns the plain GEMM's ping-pong default off, also after a plan."""
    a, w2 = torch.randn(M, F).to(BF16), torch.randn(E, H, F).to(BF16)
    call = lambda: cute.grouped_mm(a, w2.transpose(1, 2), _offs())  # noqa: E731
    with stubbed_kernels() as stubs:
        tiling_env("TE_SEQ_PINGPONG", None)
        on = _launch_of(stubs, call)[0]
        tiling_env("TE_SEQ_PINGPONG", "0")
        off = _launch_of(stubs, call)[0]
    assert on.pingpong and not off.pingpong


def test_wgrad_cluster_and_max_k_follow_the_environment(tiling_env):
    """TE_SEQ_WGRAD_CLUSTER picks the ping-pong wgrads' cluster and TE_SEQ_PINGPONG_MAX_K the
    longest K in ping-pong and TE_SEQ_PINGPONG_TILE_N the width, also after a plan of the same
    call (the plans' signatures)."""
    a, w2, dy = torch.randn(M, F).to(BF16), torch.randn(E, H, F).to(BF16), torch.randn(M, H)
    mm = lambda: cute.grouped_mm(a, w2.transpose(1, 2), _offs())  # noqa: E731, K = F = 256
    wgrad = lambda: cute.grouped_wgrad(dy.to(BF16), a, _offs())  # noqa: E731
    with stubbed_kernels() as stubs:
        default = _launch_of(stubs, wgrad)[0]
        tiling_env("TE_SEQ_WGRAD_CLUSTER", "1x2")
        wide = _launch_of(stubs, wgrad)[0]
        assert _launch_of(stubs, mm)[0].pingpong
        tiling_env("TE_SEQ_PINGPONG_TILE_N", "192")
        assert _launch_of(stubs, mm)[0].tile_n == 192
        tiling_env("TE_SEQ_PINGPONG_MAX_K", str(F - 8))
        assert not _launch_of(stubs, mm)[0].pingpong
    assert default.pingpong and wide.pingpong
    assert (default.cluster_mn, wide.cluster_mn) == ((2, 1), (1, 2))


def test_varlen_m_cluster_follows_the_environment(tiling_env):
    """TE_SEQ_MM_CLUSTER picks the ping-pong varlen-M GEMM's cluster, and its tile width is
    fitted to that cluster's units (N = 2048: 192 wide in 2x1, the default, 128 in 1x2)."""
    a, w1 = torch.randn(M, H).to(BF16), torch.randn(E, 2048, H).to(BF16)
    mm = lambda: cute.grouped_mm(a, w1.transpose(1, 2), _offs())  # noqa: E731, K = H
    with stubbed_kernels() as stubs:
        default = _launch_of(stubs, mm)[0]
        tiling_env("TE_SEQ_MM_CLUSTER", "1x2")
        wide = _launch_of(stubs, mm)[0]
    assert (default.cluster_mn, default.tile_n, default.pingpong) == ((2, 1), 192, True)
    assert (wide.cluster_mn, wide.tile_n, wide.pingpong) == ((1, 2), 128, True)


def test_half_tiles_follow_the_environment(tiling_env):
    """TE_SEQ_HALF_TILES=1 compiles the ping-pong varlen-M GEMM with half tiles (an expert's
    last tile with <= 64 rows runs one 64-row atom); the default and cooperative tilings keep
    full tiles, as do the wgrads."""
    a, w1 = torch.randn(M, H).to(BF16), torch.randn(E, 2048, H).to(BF16)
    dy = torch.randn(M, H).to(BF16)
    mm = lambda t=None: cute.grouped_mm(a, w1.transpose(1, 2), _offs(), tiling=t)  # noqa: E731
    wgrad = lambda: cute.grouped_wgrad(dy, a, _offs())  # noqa: E731
    with stubbed_kernels() as stubs:
        default = _launch_of(stubs, mm)[0]
        tiling_env("TE_SEQ_HALF_TILES", "1")
        half = _launch_of(stubs, mm)[0]
        coop = _launch_of(stubs, lambda: mm(Tiling(256, (1, 2))))[0]
        wg = _launch_of(stubs, wgrad)[0]
    assert default.pingpong and not default.half_tiles
    assert half.pingpong and half.half_tiles
    assert not coop.pingpong and not coop.half_tiles
    assert wg.pingpong and not wg.half_tiles


@pytest.mark.parametrize(("name", "value", "match"), [
    ("TE_SEQ_WGRAD_CLUSTER", "2x2", r"TE_SEQ_WGRAD_CLUSTER must be one of \['1x2', '2x1'\]"),
    ("TE_SEQ_MM_CLUSTER", "1x1", r"TE_SEQ_MM_CLUSTER must be one of \['1x2', '2x1'\]"),
    ("TE_SEQ_HALF_TILES", "yes", r"TE_SEQ_HALF_TILES must be one of \['0', '1'\]"),
    ("TE_SEQ_PINGPONG_MAX_K", "big", "TE_SEQ_PINGPONG_MAX_K must be an integer, got 'big'"),
    ("TE_SEQ_PINGPONG_TILE_N", "256",
     r"TE_SEQ_PINGPONG_TILE_N must be one of \['128', '192'\], got '256'"),
])
def test_bad_tiling_settings_are_refused_by_name(tiling_env, name, value, match):
    a, dy = torch.randn(M, F).to(BF16), torch.randn(M, H).to(BF16)
    w2 = torch.randn(E, H, F).to(BF16)
    tiling_env(name, value)
    with stubbed_kernels(), pytest.raises(ValueError, match=match):
        cute.grouped_wgrad(dy, a, _offs())
        cute.grouped_mm(a, w2.transpose(1, 2), _offs())


def test_errors_stay_after_a_plan():
    """A planned signature does not bypass the checks of a call that differs from it."""
    a, w2 = torch.randn(M, F).to(BF16), torch.randn(E, H, F).to(BF16)
    with stubbed_kernels():
        cute.grouped_mm(a, w2.transpose(1, 2), _offs())
        with pytest.raises(ValueError, match="offs must be 1-D of length 4"):
            cute.grouped_mm(a, w2.transpose(1, 2), _offs()[:3])
        with pytest.raises(ValueError, match="ping-pong tiling"):
            cute.grouped_mm(a, w2.transpose(1, 2), _offs(), bias=torch.randn(E, H).to(BF16),
                            tiling=Tiling(128, (1, 2), True))
        with pytest.raises(ValueError, match="bias_scales must hold one float per row"):
            cute.grouped_mm(a, w2.transpose(1, 2), _offs(), bias=torch.randn(E, H).to(BF16),
                            bias_scales=torch.rand(M + 1))


def test_glu_fc1_checks_once_per_signature_and_refuses_on_every_call(monkeypatch):
    """An FC1 call's operand checks run once per signature (their answer is the plan's); a
    refused call is refused again each time, and keeps no plan."""
    from te_seq.kernels.cute import glu

    seen = []
    supports = glu._Fc1Forward.supports

    def counting(*args, **kwargs):
        seen.append(args[0].shape)
        return supports(*args, **kwargs)

    monkeypatch.setattr(glu._Fc1Forward, "supports", staticmethod(counting))
    x, probs = torch.randn(M, H).to(BF16), torch.rand(M)
    w1t = torch.randn(E, 2 * F, H).to(BF16).transpose(1, 2)
    with stubbed_kernels():
        for _ in range(3):
            cute.glu_fc1_forward(x, w1t, _offs(), "silu", None, probs)
        assert len(seen) == 1
        x2 = torch.randn(2 * M, H).to(BF16)  # more rows: a new signature, checked again
        cute.glu_fc1_forward(x2, w1t, _offs(2 * M), "silu", None, torch.rand(2 * M))
        assert len(seen) == 2
        planned = len(glu._FC1_CHECKED)
        for _ in range(2):
            with pytest.raises(ValueError, match="glu_fc1_forward.*no fused epilogue"):
                cute.glu_fc1_forward(x, w1t, _offs(), "tanh", None, probs)
        assert len(seen) == 4 and len(glu._FC1_CHECKED) == planned


def test_glu_fc1_checked_plan_copies_unaligned_weights_on_every_call():
    """A w1t whose strides TMA cannot take is copied per call on the checked path too."""
    x, probs = torch.randn(M, H).to(BF16), torch.rand(M)
    # [E, H, 2F] N-major, row stride 2F + 4: not 16-byte aligned
    w1t = torch.randn(E, H, 2 * F + 4).to(BF16)[:, :, : 2 * F]
    with stubbed_kernels() as stubs:
        _, first = _launch_of(stubs, lambda: cute.glu_fc1_forward(x, w1t, _offs(), "silu",
                                                                  None, probs))
        w1t.copy_(torch.randn_like(w1t))
        _, again = _launch_of(stubs, lambda: cute.glu_fc1_forward(x, w1t, _offs(), "silu",
                                                                  None, probs))
    for launched in (first, again):
        assert launched[1].data_ptr() != w1t.data_ptr()
    assert torch.equal(again[1], w1t.permute(2, 1, 0))
    assert not torch.equal(first[1], again[1])


def test_fc1_launch_launches_what_the_functional_launches():
    """`glu_fc1_forward.launch_for` (W1 untransposed) launches the functional's kernel with
    the same arguments (B the same view of W1's memory); after `clear_plans` it plans anew."""
    from te_seq.kernels.cute import glu

    x, probs = torch.randn(M, H).to(BF16), torch.rand(M)
    w1 = torch.randn(E, 2 * F, H).to(BF16)
    with stubbed_kernels() as stubs:
        launch = cute.glu_fc1_forward.launch_for(x, w1, "silu", None, probs)
        cfg1, direct = _launch_of(stubs, lambda: cute.glu_fc1_forward(
            x, w1.transpose(1, 2), _offs(), "silu", None, probs))
        cfg2, launched = _launch_of(stubs, lambda: launch(x, w1, _offs(), probs))
        clear_plans()
        assert len(glu._FC1_CHECKED) == 0
        cfg3, again = _launch_of(stubs, lambda: launch(x, w1, _offs(), probs))
        assert len(glu._FC1_CHECKED) == 1
    assert cfg1 == cfg2 == cfg3
    assert _inputs_of(launched) == _inputs_of(direct) == _inputs_of(again)
    assert launched[1].data_ptr() == direct[1].data_ptr() == w1.data_ptr()


def test_fc1_launch_follows_a_change_of_the_tiling_settings(tiling_env):
    """A prepared FC1 launch (the grouped MLP's steady path) takes a new TE_SEQ_PINGPONG at
    its next call, as the functional does."""
    x, probs = torch.randn(M, H).to(BF16), torch.rand(M)
    w1 = torch.randn(E, 2 * F, H).to(BF16)
    tiling_env("TE_SEQ_PINGPONG", None)
    tiling_env("TE_SEQ_PINGPONG_MAX_K", None)
    with stubbed_kernels() as stubs:
        launch = cute.glu_fc1_forward.launch_for(x, w1, "silu", None, probs)
        on = _launch_of(stubs, lambda: launch(x, w1, _offs(), probs))[0]
        tiling_env("TE_SEQ_PINGPONG", "0")
        off = _launch_of(stubs, lambda: launch(x, w1, _offs(), probs))[0]
    assert on.pingpong and not off.pingpong


def test_fc1_192_wide_tiles_need_f_a_multiple_of_96():
    x, probs = torch.randn(M, H).to(BF16), torch.rand(M)
    w1t = torch.randn(E, 2 * F, H).to(BF16).transpose(1, 2)  # F = 256
    with stubbed_kernels(), pytest.raises(ValueError, match="F=256 is not a multiple of 96"):
        cute.glu_fc1_forward(x, w1t, _offs(), "silu", None, probs,
                             tiling=Tiling(192, (1, 2), True))


def test_fc1_launch_refuses_what_the_functional_refuses():
    x, w1 = torch.randn(M, H).to(BF16), torch.randn(E, 2 * F, H).to(BF16)
    with stubbed_kernels(), pytest.raises(ValueError, match="no fused epilogue"):
        cute.glu_fc1_forward.launch_for(x, w1, "tanh", None, None)


def _fp8_operands(n: int, strided_w: bool = False) -> tuple:
    """(x [M, H] E4M3, w [E, n, H] E4M3 (``strided_w``: an H-major copy's [E, n, H] view),
    x_scale [M], w_scale [E, n]) on the CPU (the stubs never read them)."""
    fp8 = torch.float8_e4m3fn
    x = torch.randn(M, H).to(fp8)
    w = torch.randn(E, H, n).to(fp8).transpose(1, 2) if strided_w else \
        torch.randn(E, n, H).to(fp8)
    return x, w, torch.rand(M), torch.rand(E, n)


@pytest.mark.parametrize("store_h", [True, False])
@pytest.mark.parametrize("strided_w", [False, True])
def test_scaled_fc1_launch_launches_what_the_functional_launches(store_h, strided_w):
    """`scaled_glu_fc1_forward.launch_for` launches the functional's kernel with the same
    arguments (W1 copied the same way where its layout needs it); after `clear_plans` it plans
    anew and launches the same again."""
    x, w1, xs, ws = _fp8_operands(2 * F, strided_w)
    probs = torch.rand(M)
    with stubbed_kernels() as stubs:
        launch = cute.scaled_glu_fc1_forward.launch_for(x, w1, xs, ws, "silu", None, probs,
                                                        store_h=store_h)
        cfg1, direct = _launch_of(stubs, lambda: cute.scaled_glu_fc1_forward(
            x, w1, xs, ws, _offs(), "silu", None, probs, store_h=store_h))
        cfg2, launched = _launch_of(stubs, lambda: launch(x, w1, xs, ws, _offs(), probs))
        clear_plans()
        cfg3, again = _launch_of(stubs, lambda: launch(x, w1, xs, ws, _offs(), probs))
        h, a = launch(x, w1, xs, ws, _offs(), probs)
    assert cfg1 == cfg2 == cfg3 and cfg1.scaled and cfg1.store_h == store_h
    assert _inputs_of(launched) == _inputs_of(direct) == _inputs_of(again)
    assert launched[0].data_ptr() == x.data_ptr()
    assert (launched[1].data_ptr() == w1.data_ptr()) == (not strided_w)  # copied K-major
    assert (h is None) == (not store_h) and a.shape == (M, F)


@pytest.mark.parametrize("with_probs", [True, False])
def test_scaled_dgrad_launch_launches_what_the_functional_launches(with_probs):
    """`scaled_glu_fc2_dgrad.launch_for` launches the functional's kernel with the same
    arguments (h, probs and dprobs included), also after `clear_plans`."""
    dy, w2t, dys, ws = _fp8_operands(F)  # dy [M, H], W2ᵀ [E, F, H]
    h = torch.randn(M, 2 * F).to(BF16)
    probs = torch.rand(M) if with_probs else None
    with stubbed_kernels() as stubs:
        launch = cute.scaled_glu_fc2_dgrad.launch_for(dy, w2t, dys, ws, "silu", None, probs)
        cfg1, direct = _launch_of(stubs, lambda: cute.scaled_glu_fc2_dgrad(
            dy, w2t, dys, ws, _offs(), h, "silu", None, probs))
        cfg2, launched = _launch_of(stubs, lambda: launch(dy, w2t, dys, ws, _offs(), h, probs))
        clear_plans()
        cfg3, again = _launch_of(stubs, lambda: launch(dy, w2t, dys, ws, _offs(), h, probs))
        dh, a, dprobs = launch(dy, w2t, dys, ws, _offs(), h, probs)
    assert cfg1 == cfg2 == cfg3 and cfg1.scaled and cfg1.mode == "dgrad"
    assert _inputs_of(launched) == _inputs_of(direct) == _inputs_of(again)
    assert launched[0].data_ptr() == dy.data_ptr()
    assert dh.shape == (M, 2 * F) and a.shape == (M, F) and (dprobs is None) == (not with_probs)


def test_scaled_mm_launch_launches_what_the_functional_launches():
    """`scaled_mm_launch` launches `scaled_grouped_mm`'s kernel with the same arguments, also
    after `clear_plans`; a zero-row call launches nothing and returns zero rows."""
    x, w, xs, ws = _fp8_operands(F)
    with stubbed_kernels() as stubs:
        launch = cute.scaled_mm_launch(x, w, xs, ws, _offs())
        cfg1, direct = _launch_of(stubs, lambda: cute.scaled_grouped_mm(x, w, xs, ws, _offs()))
        cfg2, launched = _launch_of(stubs, lambda: launch(x, w, xs, ws, _offs()))
        clear_plans()
        cfg3, again = _launch_of(stubs, lambda: launch(x, w, xs, ws, _offs()))
        empty, none = x[:0], xs[:0]
        launched_before = sum(len(stub.calls) for stub in stubs.values())
        out = cute.scaled_mm_launch(empty, w, none, ws, _offs(0))(empty, w, none, ws, _offs(0))
        assert sum(len(stub.calls) for stub in stubs.values()) == launched_before
    assert cfg1 == cfg2 == cfg3 and cfg1.scaled
    assert _inputs_of(launched) == _inputs_of(direct) == _inputs_of(again)
    assert launched[0].data_ptr() == x.data_ptr() and launched[1].data_ptr() == w.data_ptr()
    assert out.shape == (0, F)


def test_fp8_launches_refuse_what_the_functionals_refuse():
    x, w1, xs, ws = _fp8_operands(2 * F)
    with stubbed_kernels():
        with pytest.raises(ValueError, match="scaled_glu_fc1_forward.*no fused epilogue"):
            cute.scaled_glu_fc1_forward.launch_for(x, w1, xs, ws, "tanh", None)
        with pytest.raises(ValueError, match="scaled_grouped_mm.*a_scale must be float32"):
            cute.scaled_mm_launch(x, w1, xs[:5], ws, _offs())
        with pytest.raises(ValueError, match="scaled_glu_fc2_dgrad.*float8_e4m3fn operands"):
            cute.scaled_glu_fc2_dgrad.launch_for(x.to(BF16), w1, xs, ws, "silu", None)


def test_fc1_without_h_only_where_checked_on_a_gpu():
    """`glu_fc1_forward(store_h=False)`: the plain call and the gathered one launch the h-less
    kernel with a as its h operand and return no h; with a bias (a kernel not yet checked on a
    GPU without h) it launches the h-writing kernel and returns h."""
    x = torch.randn(M, H).to(BF16)
    w1t = torch.randn(E, 2 * F, H).to(BF16).transpose(1, 2)
    bias, rows = torch.randn(E, 2 * F).to(BF16), torch.arange(M, dtype=torch.int32).flip(0)
    with stubbed_kernels() as stubs:
        calls = {
            "plain": lambda: cute.glu_fc1_forward(x, w1t, _offs(), "silu", None, store_h=False),
            "bias": lambda: cute.glu_fc1_forward(x, w1t, _offs(), "silu", None, bias=bias,
                                                 store_h=False),
            "gather": lambda: cute.glu_fc1_forward(x, w1t, _offs(), "silu", None,
                                                   gather_rows=rows, store_h=False),
        }
        for name, call in calls.items():
            (cfg, args), (h, a) = _launch_of(stubs, call), call()
            assert cfg.store_h == (name == "bias"), name
            assert (h is None) == (name != "bias"), name
            assert (args[2] is args[5]) == (name != "bias"), name
            assert (cfg.route == "gather") == (name == "gather"), name
            assert a.shape == (M, F)


def test_a_prepared_launch_plans_again_only_when_its_plan_is_out_of_date(tiling_env):
    """`PreparedLaunch` (the steady launches' one staleness rule): the plan made at its making
    serves every call until `clear_plans` or a change of the tiling settings, after which
    the next call plans again from that call's operands, once."""
    from te_seq.kernels.cute.launch_plan import PreparedLaunch

    class Counted(PreparedLaunch):
        def __init__(self, operand):
            self.made = []
            self._planned(operand)

        def _make_plan(self, operand):
            self.made.append(operand)
            return f"plan of {operand}"

    tiling_env("TE_SEQ_PINGPONG", None)
    launch = Counted("first")
    assert [launch._current("second") for _ in range(3)] == ["plan of first"] * 3
    clear_plans()
    assert launch._current("third") == launch._current("fourth") == "plan of third"
    tiling_env("TE_SEQ_PINGPONG", "0")
    assert launch._current("fifth") == launch._current("sixth") == "plan of fifth"
    assert launch.made == ["first", "third", "fifth"]
