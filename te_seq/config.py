"""Plain process-wide switches. A leaf: imports nothing of te_seq.

Backend selection (`te_seq.backend`, `te_seq.set_backend`) lives in te_seq/kernels/backend.py.
"""

from __future__ import annotations

_compile_elementwise = True


def compile_elementwise() -> bool:
    """Whether the GPU backends run activations through `torch.compile` (default True)."""
    return _compile_elementwise


def set_compile_elementwise(enabled: bool) -> None:
    """Turn the compiled elementwise path of the GPU backends on or off (off: plain PyTorch)."""
    global _compile_elementwise
    _compile_elementwise = bool(enabled)
