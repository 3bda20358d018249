"""Fused FP8 (E4M3) grouped-MLP GLU steps on the CuTe DSL backend (sm_90a): FC1 + activation
and FC2 dgrad + activation gradient with row-wise dequantization scales. Kernel:
``scaled_glu.ScaledGluGemmKernel``; maths: ``glu.glu_fc1_forward`` / ``glu.glu_fc2_dgrad`` on
the dequantized operands (``reference.glu_forward`` / ``reference.glu_backward``), up to the
fp32 summation order.

Shape legend: M rows, E experts, H hidden, F ffn; h [M, 2F] in the activation op's column
layout; g(m) the expert of row m. The scales are *dequantization* scales (te_seq's
``scale_inv``): the operand values are fp32(data) · scale of its row.

    scaled_glu_fc1_forward:  h[m, n] = x_scale[m] · w1_scale[g, n] · Σ_k x[m, k] · w1[g, n, k]
    scaled_glu_fc2_dgrad:    dA[m, j] = dy_scale[m] · w2t_scale[g, j] · Σ_k dy[m, k] · w2t[g, j, k]

(fp32 accumulation, then the 16-bit kernel's GLU epilogue; outputs bf16).
``block_scaled_glu_fc1_forward`` is FC1 + activation under ``Float8BlockScaling`` (x in 1×128
blocks, W1 in 128×128 blocks, the partial sums promoted per 128-element k-tile; kernel
``block_glu.BlockScaledGluGemmKernel``). Imports no cutlass
until a kernel is first compiled; no host reads of ``offs`` (sync-free, CUDA-graph capturable
once compiled).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .block_fp8 import BLOCK, _scale_problem
from .fp8 import FP8_DTYPE, _device_problem, geometry_problem, k_major
from .glu import (
    _ACTS,
    _check_probs,
    _launch,
    fc1_outputs,
    glu_plan,
    layout_problem,
    run_dgrad,
    run_glu_plan,
)
from .launch import Tiling, _check_offs, _row_major, aligned_16, available
from .launch_plan import LaunchPlan, PlanCache, PreparedLaunch

_ALIGN = 16  # H in elements: 16-byte TMA rows of 1-byte data
# the block-scaled FC1's tile: 64 gate + 64 up columns, cooperative (block_glu.py)
BLOCK_GLU_TILING = Tiling(128, (1, 2))


def _operand_problem(x: Tensor, w: Tensor, x_scale: Tensor, w_scale: Tensor) -> str:
    """Why x [M, H], w [E, N, H] (N: 2F or F) and their fp32 scales [M], [E, N] cannot feed
    the kernel ("" when they can)."""
    if x.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE:
        return f"needs float8_e4m3fn operands, got {x.dtype} and {w.dtype}"
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        return f"needs x [M, H] and w [E, N, H], got {tuple(x.shape)} and {tuple(w.shape)}"
    if 0 in w.shape:
        return f"needs E, N and H > 0, got w {tuple(w.shape)}"
    for name, s, shape in (("x_scale", x_scale, (x.shape[0],)), ("w_scale", w_scale, w.shape[:2])):
        if s.dtype != torch.float32 or tuple(s.shape) != tuple(shape):
            return f"{name} must be float32 {list(shape)}, got {s.dtype} {list(s.shape)}"
    return ""


class _Checked(NamedTuple):
    """A call signature whose checks passed, and which operands its launch copies first: w
    not K-major with 16-byte strides (`k_major`), x not row-major, a scale not contiguous."""

    w_copy: bool
    x_copy: bool
    scales_copy: bool


_CHECKED = PlanCache()  # call signatures whose checks passed -> `_Checked`


def _supports(x, w, x_scale, w_scale, act, interleave, fc1: bool) -> tuple[bool, str]:
    """Shared checks; ``w`` is w1 [E, 2F, H] (fc1) or w2t [E, F, H] (dgrad). A signature that
    passed once (dtypes, shapes, strides, devices, options) is not checked again."""
    found, why = _checked(x, w, x_scale, w_scale, act, interleave, fc1)
    return found is not None, why


def _signature(x, w, x_scale, w_scale, act, interleave, fc1: bool) -> tuple:
    return (x.dtype, x.shape, x.stride(), x.device, w.dtype, w.shape, w.stride(), w.device,
            x_scale.dtype, x_scale.shape, x_scale.stride(), x_scale.device, w_scale.dtype,
            w_scale.shape, w_scale.stride(), w_scale.device, act, interleave, fc1)


def _checked(x, w, x_scale, w_scale, act, interleave, fc1: bool
             ) -> tuple[_Checked | None, str]:
    """(the signature's `_Checked`, made by its first call whose checks pass, ""), or (None,
    why) where the checks fail (they run again on every such call)."""
    signature = _signature(x, w, x_scale, w_scale, act, interleave, fc1)
    found = _CHECKED.get(signature)
    if found is not None:
        return found, ""
    ok, why = _check(x, w, x_scale, w_scale, act, interleave, fc1)
    if not ok:
        return None, why
    return _CHECKED.put(signature, _Checked(
        k_major(w) is not w, _row_major(x) is not x,
        not (x_scale.is_contiguous() and w_scale.is_contiguous()))), ""


def _check(x, w, x_scale, w_scale, act, interleave, fc1: bool) -> tuple[bool, str]:
    if act not in _ACTS:
        return False, f"act {act!r} has no fused epilogue (only {_ACTS})"
    if w.dim() != 3 or (fc1 and w.shape[1] % 2):
        return False, f"needs w [E, N, H] (N = 2F for fc1), got {tuple(w.shape)}"
    f = w.shape[1] // 2 if fc1 else w.shape[1]
    why = (
        _operand_problem(x, w, x_scale, w_scale)
        or layout_problem(x.shape[1], f, interleave, fc1, h_align=_ALIGN)
        or _device_problem((x, w, x_scale, w_scale))
    )
    return (False, why) if why else available()


def _kernel_operands(x: Tensor, w: Tensor, x_scale: Tensor, w_scale: Tensor,
                     checked: _Checked) -> tuple:
    """(x, w as [E, H, N] with H contiguous, (x_scale, w_scale)): 16-byte aligned data, copied
    where `checked` (the call signature's) says the layout needs it."""
    w, x = aligned_16(w, checked.w_copy), aligned_16(x, checked.x_copy)
    if checked.scales_copy:
        x_scale, w_scale = x_scale.contiguous(), w_scale.contiguous()
    return x, w.transpose(1, 2), (x_scale, w_scale)


def _block_operands(x: Tensor, w: Tensor, x_scale: Tensor, w_scale: Tensor) -> tuple:
    """(x, w as [E, H, N] with H contiguous, (x_scale, w_scale)) for the block-scaled GLU
    kernel: row-major x and K-major w on 16-byte boundaries, contiguous scales."""
    scales = (x_scale.contiguous(), w_scale.contiguous())
    return aligned_16(x, _row_major(x) is not x), k_major(w).transpose(1, 2), scales


def _refused(op: str, a: tuple[str, Tensor], b: tuple[str, Tensor], why: str) -> ValueError:
    """The ValueError of a refused call: the functional, both operands' shapes and dtypes and
    the reason."""
    (a_name, a_t), (b_name, b_t) = a, b
    return ValueError(f"cute {op}: {a_name} {tuple(a_t.shape)} {a_t.dtype}, "
                      f"{b_name} {tuple(b_t.shape)} {b_t.dtype}: {why}")


def _run_fc1(op: str, x: Tensor, w1: Tensor, offs: Tensor, act: str, interleave: int | None,
             probs: Tensor | None, params: tuple, operands, store_h: bool = True,
             **launch) -> tuple[Tensor | None, Tensor]:
    """An FP8 GLU FC1 on checked operands: h [M, 2F] (``store_h`` False: None unless
    `launch.fc1_writes_h` keeps it) and a [M, F] in bf16, probs checked, and (where x
    has rows) the kernel launched on ``operands()`` = (x, w1 as [E, H, 2F], scales) with
    ``launch``'s options (tiling, block_scaled)."""
    probs, h, a = fc1_outputs(x, w1.shape[1] // 2, probs, store_h, op, torch.bfloat16)
    if x.shape[0]:
        x, w1t, scales = operands()
        h = _launch("fc1", x, w1t, h, offs, a, probs, None, None, act, interleave, params,
                    scales=scales, **launch)
    return h, a


class _ScaledFc1Forward:
    """``scaled_glu_fc1_forward(x, w1, x_scale, w1_scale, offs, act, interleave, probs, params)
    -> (h, a)``."""

    @staticmethod
    def supports(
        x: Tensor, w1: Tensor, x_scale: Tensor, w1_scale: Tensor, act: str,
        interleave: int | None, bias: Tensor | None = None, gather: bool = False,
    ) -> tuple[bool, str]:
        """(True, "") when the fused FP8 kernel handles these operands, else (False, why):
        E4M3 x [M, H] and w1 [E, 2F, H], fp32 x_scale [M] and w1_scale [E, 2F], H a multiple
        of 16, F and ``interleave`` as the 16-bit GLU kernel needs them, CUDA tensors on one
        sm_90 GPU; no bias, no gathered rows."""
        if bias is not None:
            return False, "the FP8 GLU kernel takes no bias"
        if gather:
            return False, "the FP8 GLU kernel reads no gathered rows"
        return _supports(x, w1, x_scale, w1_scale, act, interleave, fc1=True)

    @staticmethod
    def launch_for(x: Tensor, w1: Tensor, x_scale: Tensor, w1_scale: Tensor, act: str,
                   interleave: int | None, probs: Tensor | None = None,
                   params: tuple[float, ...] = (), store_h: bool = True) -> ScaledFc1Launch:
        """A `ScaledFc1Launch`: this call (default tiling) for later calls with operands of
        these facts; ValueError as the call where the kernel cannot take them."""
        return ScaledFc1Launch(x, w1, x_scale, w1_scale, act, interleave, probs, tuple(params),
                               store_h)

    def __call__(
        self,
        x: Tensor,
        w1: Tensor,
        x_scale: Tensor,
        w1_scale: Tensor,
        offs: Tensor,
        act: str,
        interleave: int | None,
        probs: Tensor | None = None,
        params: tuple[float, ...] = (),
        *,
        tiling: Tiling | None = None,
        store_h: bool = True,
    ) -> tuple[Tensor | None, Tensor]:
        """h [M, 2F] bf16 = diag(x_scale) (x_e W1_eᵀ) diag(w1_scale[e]) (fp32 accumulation,
        one rounding) and a [M, F] bf16 = act(gate)·up(·probs) from the bf16 h, as
        ``reference.glu_forward(h, ...)``. x [M, H] and w1 [E, 2F, H] float8_e4m3fn (W1's
        rows in h's column layout), offs int32 [E] cumulative row ends, probs [M] or None,
        ``params`` the activation's float parameters (() for its defaults), ``tiling`` as
        the 16-bit ``glu_fc1_forward``'s (None: the default). Rows past ``offs[-1]`` are
        zeros in h and a. ``store_h=False`` (no backward reads h): h not written (None;
        `launch.fc1_writes_h`), a the same bit for bit. Raises ValueError when ``supports``
        is False."""
        op = _FC1_OP
        checked, why = _checked(x, w1, x_scale, w1_scale, act, interleave, True)
        if checked is None:
            raise _refused(op, ("x", x), ("w1", w1), why)
        return _run_fc1(op, x, w1, offs, act, interleave, probs, params,
                        lambda: _kernel_operands(x, w1, x_scale, w1_scale, checked),
                        store_h, tiling=tiling)


_FC1_OP = "scaled_glu_fc1_forward"
_DGRAD_OP = "scaled_glu_fc2_dgrad"


class ScaledFc1Launch(PreparedLaunch):
    """``scaled_glu_fc1_forward(x, w1, x_scale, w1_scale, offs, act, interleave, probs, params,
    store_h=store_h)`` for calls whose x, w1, scales and probs have the dtypes, shapes, strides
    and devices of the ones it was made from (``scaled_glu_fc1_forward.launch_for``; probs'
    layout may vary): the checks and the plan are found once, at its making, so a call runs
    only its per-call work (probs' layout, h and a, the operands' 16-byte alignment, the
    launch). A caller that cannot vouch for those facts calls ``scaled_glu_fc1_forward``.
    Planned anew as every `PreparedLaunch`. Holds no tensor."""

    def __init__(self, x: Tensor, w1: Tensor, x_scale: Tensor, w1_scale: Tensor, act: str,
                 interleave: int | None, probs: Tensor | None, params: tuple,
                 store_h: bool = True) -> None:
        checked, why = _checked(x, w1, x_scale, w1_scale, act, interleave, True)
        if checked is None:
            raise _refused(_FC1_OP, ("x", x), ("w1", w1), why)
        self._checked, self._args, self._store_h = checked, (act, interleave, params), store_h
        self._groups, self._f = w1.shape[0], w1.shape[1] // 2
        self._planned(x, w1, x_scale, w1_scale, probs)

    def _make_plan(self, x: Tensor, w1: Tensor, x_scale: Tensor, w1_scale: Tensor,
                   probs: Tensor | None) -> LaunchPlan | None:
        """The GLU plan of these operands in the kernel's layout (None without rows)."""
        if not x.shape[0]:
            return None
        x, w1t, _ = _kernel_operands(x, w1, x_scale, w1_scale, self._checked)
        return glu_plan("fc1", x, w1t, x.shape[0], _check_probs(probs, x.shape[0], _FC1_OP),
                        *self._args, scaled=True, store_h=self._store_h)

    def __call__(self, x: Tensor, w1: Tensor, x_scale: Tensor, w1_scale: Tensor, offs: Tensor,
                 probs: Tensor | None) -> tuple[Tensor | None, Tensor]:
        plan = self._current(x, w1, x_scale, w1_scale, probs)
        probs, h, a = fc1_outputs(x, self._f, probs, self._store_h, _FC1_OP,
                                  torch.bfloat16)
        if plan is not None:
            offs = _check_offs(offs, self._groups, x.device)
            x, w1t, scales = _kernel_operands(x, w1, x_scale, w1_scale, self._checked)
            h = run_glu_plan(plan, x, w1t, h, offs, a, probs, None, None, scales=scales)
        return h, a


class _ScaledFc2Dgrad:
    """``scaled_glu_fc2_dgrad(dy, w2t, dy_scale, w2t_scale, offs, h, act, interleave, probs,
    params) -> (dh, a, dprobs)``."""

    @staticmethod
    def supports(
        dy: Tensor, w2t: Tensor, dy_scale: Tensor, w2t_scale: Tensor, act: str,
        interleave: int | None,
    ) -> tuple[bool, str]:
        """(True, "") when the fused FP8 kernel handles these operands, else (False, why):
        E4M3 dy [M, H] and w2t [E, F, H], fp32 dy_scale [M] and w2t_scale [E, F], H a multiple
        of 16, F and ``interleave`` as the 16-bit GLU kernel needs them, CUDA tensors on one
        sm_90 GPU."""
        return _supports(dy, w2t, dy_scale, w2t_scale, act, interleave, fc1=False)

    @staticmethod
    def launch_for(dy: Tensor, w2t: Tensor, dy_scale: Tensor, w2t_scale: Tensor, act: str,
                   interleave: int | None, probs: Tensor | None = None,
                   params: tuple[float, ...] = ()) -> ScaledFc2DgradLaunch:
        """A `ScaledFc2DgradLaunch`: this call (default tiling) for later calls with operands
        of these facts; ValueError as the call where the kernel cannot take them."""
        return ScaledFc2DgradLaunch(dy, w2t, dy_scale, w2t_scale, act, interleave, probs,
                                    tuple(params))

    def __call__(
        self,
        dy: Tensor,
        w2t: Tensor,
        dy_scale: Tensor,
        w2t_scale: Tensor,
        offs: Tensor,
        h: Tensor,
        act: str,
        interleave: int | None,
        probs: Tensor | None = None,
        params: tuple[float, ...] = (),
        *,
        tiling: Tiling | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """dA [M, F] = diag(dy_scale) (dY_e W2_e) diag(w2t_scale[e]) (w2t = W2ᵀ [E, F, H]
        float8_e4m3fn, dy [M, H] float8_e4m3fn) stays in fp32 registers; dh [M, 2F] bf16 =
        ``reference.glu_backward(h, dA, ...)``, a [M, F] bf16 = ``reference.glu_forward(h,
        ...)`` and dprobs [M] (fp32 sums, in probs.dtype; None without probs). h [M, 2F] bf16;
        ``tiling`` as the 16-bit ``glu_fc2_dgrad``'s (None: the default, cooperative).
        Rows past ``offs[-1]`` get dA = 0 (dh and dprobs zero there). Raises ValueError when
        ``supports`` is False or h has the wrong shape or dtype."""
        checked, why = _checked(dy, w2t, dy_scale, w2t_scale, act, interleave, False)
        if checked is None:
            raise _refused(_DGRAD_OP, ("dy", dy), ("w2t", w2t), why)
        dy, w2, scales = _kernel_operands(dy, w2t, dy_scale, w2t_scale, checked)
        return run_dgrad(_DGRAD_OP, dy, w2, offs, h, act, interleave, probs,
                         params, torch.bfloat16, scales, tiling)


class ScaledFc2DgradLaunch(PreparedLaunch):
    """``scaled_glu_fc2_dgrad(dy, w2t, dy_scale, w2t_scale, offs, h, act, interleave, probs,
    params)`` (default tiling) for calls whose dy, w2t, scales and probs have the dtypes,
    shapes, strides and devices of the ones it was made from (``scaled_glu_fc2_dgrad
    .launch_for``; h's and probs' layouts may vary): checked and planned once, at its making
    (anew as every `PreparedLaunch`), as `ScaledFc1Launch`. Holds no tensor."""

    def __init__(self, dy: Tensor, w2t: Tensor, dy_scale: Tensor, w2t_scale: Tensor, act: str,
                 interleave: int | None, probs: Tensor | None, params: tuple) -> None:
        checked, why = _checked(dy, w2t, dy_scale, w2t_scale, act, interleave, False)
        if checked is None:
            raise _refused(_DGRAD_OP, ("dy", dy), ("w2t", w2t), why)
        self._checked, self._args = checked, (act, interleave, params)
        self._planned(dy, w2t, dy_scale, w2t_scale, probs)

    def _make_plan(self, dy: Tensor, w2t: Tensor, dy_scale: Tensor, w2t_scale: Tensor,
                   probs: Tensor | None) -> LaunchPlan | None:
        """The GLU dgrad plan of these operands in the kernel's layout (None without rows)."""
        rows = dy.shape[0]
        if not rows:
            return None
        dy, w2, _ = _kernel_operands(dy, w2t, dy_scale, w2t_scale, self._checked)
        return glu_plan("dgrad", dy, w2, rows, _check_probs(probs, rows, _DGRAD_OP),
                        *self._args, scaled=True)

    def __call__(self, dy: Tensor, w2t: Tensor, dy_scale: Tensor, w2t_scale: Tensor,
                 offs: Tensor, h: Tensor, probs: Tensor | None
                 ) -> tuple[Tensor, Tensor, Tensor | None]:
        plan = self._current(dy, w2t, dy_scale, w2t_scale, probs)
        dy, w2, scales = _kernel_operands(dy, w2t, dy_scale, w2t_scale, self._checked)
        act, interleave, params = self._args
        return run_dgrad(_DGRAD_OP, dy, w2, offs, h, act, interleave, probs, params,
                         torch.bfloat16, scales, plan=plan)


scaled_glu_fc1_forward = _ScaledFc1Forward()
scaled_glu_fc2_dgrad = _ScaledFc2Dgrad()


def _block_problem(x: Tensor, w: Tensor, x_scale: Tensor, w_scale: Tensor, act: str,
                   interleave: int | None, fc1: bool) -> str:
    """Why the block-scaled GLU kernel cannot take E4M3 x [M, H] and w [E, N, H] (N: 2F for
    fc1, F for the dgrad) with their block scales [M, ⌈H/128⌉] and [E, ⌈N/128⌉, ⌈H/128⌉]
    ("" when it can)."""
    if act not in _ACTS:
        return f"act {act!r} has no fused epilogue (only {_ACTS})"
    if x.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE:
        return f"needs float8_e4m3fn operands, got {x.dtype} and {w.dtype}"
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2] or (fc1 and w.shape[1] % 2):
        return (f"needs x [M, H] and w [E, N, H] (N = 2F for fc1), got {tuple(x.shape)} and "
                f"{tuple(w.shape)}")
    f = w.shape[1] // 2 if fc1 else w.shape[1]
    if f % BLOCK:
        return f"F={f} must be a multiple of {BLOCK} (whole weight blocks per half)"
    if fc1 and interleave not in (None, 32, 64):
        return f"glu_interleave_size={interleave} unsupported (None, 32 or 64)"
    return (
        geometry_problem(x, w) or _scale_problem(x, w, x_scale, w_scale)
        or layout_problem(x.shape[1], f, interleave, fc1, h_align=_ALIGN)
        or _device_problem((x, w, x_scale, w_scale))
    )


class _BlockScaledFc1Forward:
    """``block_scaled_glu_fc1_forward(x, w1, x_scale, w1_scale, offs, act, interleave, probs,
    params) -> (h, a)``: FC1 under ``Float8BlockScaling`` with the activation in its epilogue
    (kernel ``block_glu.BlockScaledGluGemmKernel``)."""

    @staticmethod
    def supports(
        x: Tensor, w1: Tensor, x_scale: Tensor, w1_scale: Tensor, act: str,
        interleave: int | None,
    ) -> tuple[bool, str]:
        """(True, "") when the kernel handles these operands, else (False, why): E4M3 x [M, H]
        and w1 [E, 2F, H], fp32 x_scale [M, ⌈H/128⌉] and w1_scale [E, 2F/128, ⌈H/128⌉], H a
        multiple of 16, F of 128, ``interleave`` None, 32 or 64, CUDA tensors on an sm_90 GPU."""
        why = _block_problem(x, w1, x_scale, w1_scale, act, interleave, fc1=True)
        return (False, why) if why else available()

    def __call__(
        self,
        x: Tensor,
        w1: Tensor,
        x_scale: Tensor,
        w1_scale: Tensor,
        offs: Tensor,
        act: str,
        interleave: int | None,
        probs: Tensor | None = None,
        params: tuple[float, ...] = (),
    ) -> tuple[Tensor, Tensor]:
        """h [M, 2F] bf16 with h[m, n] = Σ_kb x_scale[m, kb] · w1_scale[g, n // 128, kb] ·
        Σ_{k in block kb} x[m, k] · w1[g, n, k] (fp32, one rounding; g the expert of row m) and
        a [M, F] bf16 = act(gate)·up(·probs) from the bf16 h, as ``reference.glu_forward(h,
        ...)``. x [M, H] and w1 [E, 2F, H] float8_e4m3fn (W1's rows in h's column layout),
        x_scale fp32 [M, ⌈H/128⌉] and w1_scale fp32 [E, 2F/128, ⌈H/128⌉] dequantization
        scales (``Float8BlockScaling``'s 1×128 and 128×128 blocks), offs int32 [E] cumulative
        row ends, probs [M] or None. Rows past ``offs[-1]`` are zeros in h and a. Sync-free.
        Raises ValueError when ``supports`` is False."""
        op = "block_scaled_glu_fc1_forward"
        ok, why = self.supports(x, w1, x_scale, w1_scale, act, interleave)
        if not ok:
            raise _refused(op, ("x", x), ("w1", w1), why)
        return _run_fc1(op, x, w1, offs, act, interleave, probs, params,
                        lambda: _block_operands(x, w1, x_scale, w1_scale),
                        tiling=BLOCK_GLU_TILING, block_scaled=True)


block_scaled_glu_fc1_forward = _BlockScaledFc1Forward()


class _BlockScaledFc2Dgrad:
    """``block_scaled_glu_fc2_dgrad(dy, w2t, dy_scale, w2t_scale, offs, h, act, interleave,
    probs, params) -> (dh, a, dprobs)``: FC2's dgrad under ``Float8BlockScaling`` with the
    activation's backward in its epilogue (kernel ``block_glu.BlockScaledGluGemmKernel``)."""

    @staticmethod
    def supports(
        dy: Tensor, w2t: Tensor, dy_scale: Tensor, w2t_scale: Tensor, act: str,
        interleave: int | None,
    ) -> tuple[bool, str]:
        """(True, "") when the kernel handles these operands, else (False, why): E4M3 dy
        [M, H] and w2t = W2ᵀ [E, F, H], fp32 dy_scale [M, ⌈H/128⌉] and w2t_scale [E, F/128,
        ⌈H/128⌉], H a multiple of 16, F of 128, ``interleave`` as the 16-bit GLU dgrad takes
        it, CUDA tensors on an sm_90 GPU."""
        why = _block_problem(dy, w2t, dy_scale, w2t_scale, act, interleave, fc1=False)
        return (False, why) if why else available()

    def __call__(
        self,
        dy: Tensor,
        w2t: Tensor,
        dy_scale: Tensor,
        w2t_scale: Tensor,
        offs: Tensor,
        h: Tensor,
        act: str,
        interleave: int | None,
        probs: Tensor | None = None,
        params: tuple[float, ...] = (),
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """dA [M, F] with dA[m, j] = Σ_kb dy_scale[m, kb] · w2t_scale[g, j // 128, kb] ·
        Σ_{k in block kb} dy[m, k] · w2t[g, j, k] stays in fp32 registers; dh [M, 2F] bf16 =
        ``reference.glu_backward(h, dA, ...)``, a [M, F] bf16 = ``reference.glu_forward(h,
        ...)`` and dprobs [M] (fp32 sums, in probs.dtype; None without probs). h [M, 2F] bf16.
        Rows past ``offs[-1]`` get dA = 0. Sync-free. Raises ValueError when ``supports`` is
        False or h has the wrong shape or dtype."""
        op = "block_scaled_glu_fc2_dgrad"
        ok, why = self.supports(dy, w2t, dy_scale, w2t_scale, act, interleave)
        if not ok:
            raise _refused(op, ("dy", dy), ("w2t", w2t), why)
        dy, w2, scales = _block_operands(dy, w2t, dy_scale, w2t_scale)
        return run_dgrad(op, dy, w2, offs, h, act, interleave, probs, params, torch.bfloat16,
                         scales, BLOCK_GLU_TILING, block_scaled=True)


block_scaled_glu_fc2_dgrad = _BlockScaledFc2Dgrad()
