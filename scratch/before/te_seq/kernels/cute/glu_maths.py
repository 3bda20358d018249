"""The GLU epilogues' activation maths in the CuTe DSL: f(gate), f'(gate) and the up-half
transform up(u), up'(u) of each table entry with ``glu_epilogue=True``, on fp32 TensorSSAs
(the formulas of ``te_seq.kernels.activations``; float parameters are compile-time constants).

Imported by ``glu_epilogue`` only (imports cutlass).
"""

from __future__ import annotations

import cutlass.cute as cute

_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_C = 0.044715
_QGELU_ALPHA = 1.702


def act_and_grad(x, act: str, need_grad: bool, params: tuple[float, ...] = ()):
    """(f(x), f'(x) or None) of the gate; ``params`` the entry's values (``param_values``).

    The sigmoid uses the approximate exp and reciprocal (MUFU, ~1e-6 relative; outputs are
    16-bit): an IEEE division per element made the dgrad epilogue's maths cost 0.075 of its
    0.33 ms on shape Q (one H200, 2026-11-22)."""
    if act == "silu":
        sig = sigmoid(x)
        f = x * sig
        df = sig * (1.0 + x * (1.0 - sig)) if need_grad else None
        return f, df
    if act == "gelu":  # tanh approximation
        t = cute.math.tanh(_SQRT_2_OVER_PI * (x + _GELU_C * x * x * x), fastmath=True)
        f = 0.5 * x * (1.0 + t)
        df = None
        if need_grad:
            d_inner = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * x * x)
            df = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner
        return f, df
    if act == "sigmoid":
        sig = sigmoid(x)
        return sig, (sig * (1.0 - sig) if need_grad else None)
    if act == "qgelu":
        return _qgelu(x, _QGELU_ALPHA, need_grad)
    if act == "clamped_qgelu":  # qgelu_alpha(min(x, limit)); the gradient stops above limit
        limit, alpha, _ = params
        inside = x <= limit
        f, df = _qgelu(cute.where(inside, x, limit), alpha, need_grad)
        return f, (cute.where(inside, df, 0.0) if need_grad else None)
    if act == "situ":  # beta1·tanh(x/beta1)·sigmoid(x)
        beta1 = params[0]
        t = cute.math.tanh(x * (1.0 / beta1))  # the precise tanh: 1 - t² must not cancel
        sig = sigmoid(x)
        df = (1.0 - t * t) * sig + beta1 * t * sig * (1.0 - sig) if need_grad else None
        return beta1 * t * sig, df
    pos = x > 0.0
    relu = cute.where(pos, x, 0.0)
    if act == "srelu":  # relu(x)²
        return relu * relu, (2.0 * relu if need_grad else None)
    return relu, (cute.where(pos, cute.full_like(x, 1.0), 0.0) if need_grad else None)


def up_and_grad(u, act: str, need_grad: bool, params: tuple[float, ...] = ()):
    """(up(u), up'(u)) of the up half; (u, None) for the entries that leave it as it is."""
    if act == "clamped_qgelu":  # clamp(u, -limit, limit) + offset; the gradient passes inside
        limit, _, offset = params
        above_low, below_high = u >= -limit, u <= limit
        clamped = cute.where(above_low, cute.where(below_high, u, limit), -limit)
        grad = None
        if need_grad:
            ones = cute.full_like(u, 1.0)
            grad = cute.where(above_low, cute.where(below_high, ones, 0.0), 0.0)
        return clamped + offset, grad
    if act == "situ":  # beta2·tanh(u/beta2)
        beta2 = params[1]
        t = cute.math.tanh(u * (1.0 / beta2))
        return beta2 * t, (1.0 - t * t if need_grad else None)
    return u, None


def _qgelu(x, alpha: float, need_grad: bool):
    """(x·sigmoid(alpha·x), its derivative or None)."""
    sig = sigmoid(alpha * x)
    df = sig + alpha * x * sig * (1.0 - sig) if need_grad else None
    return x * sig, df


def sigmoid(x):
    """1 / (1 + exp(-x)) with the approximate exp and reciprocal (see `act_and_grad`)."""
    return cute.math.rcp(1.0 + cute.math.exp(-x, fastmath=True), approx=True, ftz=True)
