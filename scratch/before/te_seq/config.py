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


_tensor_parallel_overlap = True


def tensor_parallel_overlap() -> bool:
    """Whether a sequence-parallel BasicLinear overlaps its all-gather (column) or reduce-scatter
    (row) with its GEMM in forward (default True; te_seq/distributed/overlap.py)."""
    return _tensor_parallel_overlap


def set_tensor_parallel_overlap(enabled: bool) -> None:
    """Turn the forward overlap of sequence-parallel linears on or off (off: the collective,
    then the GEMM). Same values either way."""
    global _tensor_parallel_overlap
    _tensor_parallel_overlap = bool(enabled)


_fp8_token_major_input = False


def fp8_token_major_input() -> bool:
    """Whether an FP8 forward whose wgrad runs on token-major FP8 operands quantizes its input
    along the tokens already in forward and keeps that copy for backward (True), or keeps the
    input as it is and quantizes it along the tokens when the wgrad runs (False, the default:
    activation memory no larger than bf16's). Same values either way; see docs/fp8.md."""
    return _fp8_token_major_input


def set_fp8_token_major_input(enabled: bool) -> None:
    """Choose where the FP8 wgrad's input operand is quantized along the tokens: in forward,
    kept until backward (True: with row-wise scales x is read once less per step, and the
    forward keeps about one byte per input element more), or in backward (False)."""
    global _fp8_token_major_input
    _fp8_token_major_input = bool(enabled)
