"""Fused grouped-MLP steps for non-gated activations on the CuTe DSL backend (sm_90a): FC1 +
activation, FC2 dgrad + activation gradient. Kernel: ``act_epilogue.ActGemmKernel``; maths:
``reference.act_forward`` / ``reference.act_backward`` times the row scales (fp32, one rounding
per output).

Shape legend: M rows, E experts, H hidden, F ffn; h = FC1's pre-activation [M, F].
Imports no cutlass until a kernel is first compiled; no host reads of ``offs`` (sync-free,
CUDA-graph capturable once compiled). The cute backend's ``act_fc1_forward`` /
``act_fc2_dgrad`` call these; the grouped MLP uses them when ``<fn>.supports(...)`` is
(True, "") at plan time and composes GEMM + elementwise otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_seq.kernels.activations import act_epilogue_activations

from .glu import _check_probs, epilogue_args
from .launch import (
    _AB_DTYPES,
    GATHER_CLUSTER,
    _check_offs,
    _num_sms,
    _row_major,
    available,
    b_layout,
    b_view,
    coop_cluster,
    gathered_rows,
    no_route,
    tile_n_for,
    tiling_settings,
    varlen_m_clusters,
    with_route,
)
from .launch_plan import LaunchPlan, PlanCache

_ACTS = act_epilogue_activations()
_PLANS = PlanCache()  # non-gated launches by call signature


def _supports(x: Tensor, w: Tensor, act: str) -> tuple[bool, str]:
    """Shared checks; ``w`` is w1t [E, H, F] (fc1) or w2 [E, H, F] (dgrad)."""
    if act not in _ACTS:
        return False, f"act {act!r} has no fused non-gated epilogue (only {_ACTS})"
    if x.dtype not in _AB_DTYPES or w.dtype != x.dtype:
        return False, f"needs bf16/fp16 operands of one dtype, got {x.dtype} and {w.dtype}"
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1]:
        return False, f"needs x [M, H] and w [E, H, F], got {tuple(x.shape)} and {tuple(w.shape)}"
    for name, size in (("H", x.shape[1]), ("F", w.shape[2])):
        if size % 8:
            return False, f"{name}={size} must be a multiple of 8 (TMA rows are 16-byte aligned)"
    if not (x.is_cuda and w.is_cuda):
        return False, "needs CUDA tensors"
    return available()


def _launch(mode: str, x, b, c, offs, act_out, probs, dprobs, h_in, act, gather=None) -> None:
    """Launch over c's M rows (``gather``: int32 [M], x's row of each GEMM row; x is then the
    [T, H] token matrix), the kernel and grid planned (and compiled) once per call signature
    (``launch_plan``)."""
    rows = c.shape[0]
    offs = _check_offs(offs, b.shape[0], x.device)
    signature = (mode, x.dtype, x.device, b.dtype, b.shape, b.stride(), b.device, rows,
                 None if probs is None else probs.dtype, act, gather is None,
                 tiling_settings())  # the cluster reads the environment
    plan = _PLANS.get(signature) or _PLANS.put(
        signature, _plan(mode, x, b, rows, probs, act, gather)
    )
    args = epilogue_args(x, act_out, probs, dprobs, h_in, None)  # no FC1 bias here
    route = no_route(x.device) if gather is None else gather
    plan.kernel(_row_major(x), b_view(b, plan.b_copy), c, offs, plan.clusters, *args, route)


def _plan(mode: str, x: Tensor, b: Tensor, rows: int, probs, act: str, gather) -> LaunchPlan:
    """The `LaunchPlan` of a non-gated launch: its config compiled (once), the grid."""
    from .compile import ActConfig, compile_act

    groups, n = b.shape[0], b.shape[2]
    b_major, b_copy = b_layout(b)
    cluster = coop_cluster() if gather is None else GATHER_CLUSTER
    tile_n = tile_n_for(n, cluster[1])
    cfg = ActConfig(mode, x.dtype, b_major, act, None if probs is None else probs.dtype,
                    cluster, tile_n=tile_n, route=None if gather is None else "gather")
    clusters = varlen_m_clusters(rows, groups, n, tile_n, cluster, _num_sms(x.device.index or 0))
    return LaunchPlan(compile_act(cfg).fn, clusters, b_copy)


class _Fc1Forward:
    """``act_fc1_forward(x, w1t, offs, act, probs) -> (h, a)``."""

    @staticmethod
    def supports(x: Tensor, w1t: Tensor, act: str, gather: bool = False) -> tuple[bool, str]:
        """(True, "") when the fused kernel handles these operands (``gather``: x's rows read
        by index), else (False, why)."""
        return with_route(_supports(x, w1t, act), "gather" if gather else None, x.shape[1])

    def __call__(
        self, x: Tensor, w1t: Tensor, offs: Tensor, act: str, probs: Tensor | None = None,
        gather_rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """h = x_e W1_eᵀ [M, F] (w1t = W1.transpose(1, 2) [E, H, F]) and a = act(h)(·probs)
        [M, F] from the bf16 h, as ``reference.act_forward(h, act)`` (times probs). Rows past
        ``offs[-1]`` get h = 0 and a = act(0)(·probs), as that composition gives them.
        ``gather_rows`` int [M]: GEMM row r is ``x[gather_rows[r]]`` (as ``glu_fc1_forward``)."""
        gather = gather_rows is not None
        ok, why = self.supports(x, w1t, act, gather)
        if not ok:
            raise ValueError(
                f"cute act_fc1_forward: x {tuple(x.shape)}, w1t {tuple(w1t.shape)}: {why}"
            )
        (rows, gather_rows), f = gathered_rows(x, gather_rows, "act_fc1_forward"), w1t.shape[2]
        probs = _check_probs(probs, rows, "act_fc1_forward")
        h = torch.empty(rows, f, dtype=x.dtype, device=x.device)
        a = torch.empty(rows, f, dtype=x.dtype, device=x.device)
        if rows:
            _launch("fc1", x, w1t, h, offs, a, probs, None, None, act, gather_rows)
        return h, a


class _Fc2Dgrad:
    """``act_fc2_dgrad(dy, w2, offs, h, act, probs) -> (dh, a, dprobs)``."""

    @staticmethod
    def supports(dy: Tensor, w2: Tensor, act: str) -> tuple[bool, str]:
        """(True, "") when the fused kernel handles these operands, else (False, why)."""
        return _supports(dy, w2, act)

    def __call__(
        self,
        dy: Tensor,
        w2: Tensor,
        offs: Tensor,
        h: Tensor,
        act: str,
        probs: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """dA = dY_e W2_e (w2 [E, H, F]) never stored; dh = dA·probs·act'(h) [M, F],
        a = act(h)·probs [M, F] and dprobs [M] = Σ_j dA·act(h) (fp32 sums, in probs.dtype; None
        without probs)."""
        ok, why = self.supports(dy, w2, act)
        if not ok:
            raise ValueError(
                f"cute act_fc2_dgrad: dy {tuple(dy.shape)}, w2 {tuple(w2.shape)}: {why}"
            )
        rows, f = dy.shape[0], w2.shape[2]
        if h.shape != (rows, f) or h.dtype != dy.dtype:
            raise ValueError(
                f"cute act_fc2_dgrad: h must be [{rows}, {f}] {dy.dtype}, "
                f"got {tuple(h.shape)} {h.dtype}"
            )
        probs_dtype = None if probs is None else probs.dtype
        probs = _check_probs(probs, rows, "act_fc2_dgrad")
        dh = torch.empty(rows, f, dtype=dy.dtype, device=dy.device)
        a = torch.empty(rows, f, dtype=dy.dtype, device=dy.device)
        dprobs = None if probs is None else torch.zeros(rows, dtype=torch.float32, device=dy.device)
        if rows:
            _launch("dgrad", dy, w2, dh, offs, a, probs, dprobs, h.contiguous(), act)
        if dprobs is not None and probs_dtype != torch.float32:
            dprobs = dprobs.to(probs_dtype)
        return dh, a, dprobs


act_fc1_forward = _Fc1Forward()
act_fc2_dgrad = _Fc2Dgrad()
