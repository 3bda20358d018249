"""The fused grouped MLP says in fusion_plan() whether its activation runs in the GEMM
epilogues (cute) or after the GEMMs, and why — checked through GroupedMLP.plan_note directly,
since the cute backend itself needs a Hopper GPU (its `supports` answers on any machine)."""

import torch

import te_seq
from te_seq import ops
from te_seq.kernels import get_backend
from te_seq.ops.fused import GroupedMLP

CUTE = get_backend("cute")


def _mlp(act, bias=False, dtype=torch.bfloat16, ffn=128):
    width = 2 * ffn if act in (ops.SwiGLU, ops.ScaledSwiGLU, ops.GEGLU, ops.ReGLU) else ffn
    return GroupedMLP([ops.GroupedLinear(4, 64, width, bias=bias, dtype=dtype), act(),
                       ops.GroupedLinear(4, ffn, 64, bias=False, dtype=dtype)])


def test_backends_without_epilogues_say_so():
    cpu = torch.device("cpu")
    for name in ("torch", "reference"):
        assert _mlp(ops.SwiGLU).plan_note(get_backend(name), torch.bfloat16, cpu) == (
            f"activation after the GEMMs (the {name} backend has no fused activation epilogue)"
        )


def test_note_names_what_has_no_fused_epilogue():
    cpu = torch.device("cpu")
    erf_gelu = _mlp(lambda: ops.GELU(approximate="none")).plan_note(CUTE, torch.bfloat16, cpu)
    assert "act 'gelu_erf' has no fused non-gated epilogue" in erf_gelu
    assert "an FC1 bias" in _mlp(ops.SwiGLU, bias=True).plan_note(CUTE, torch.bfloat16, cpu)


def test_note_gives_the_kernel_reason():
    cpu = torch.device("cpu")
    note = _mlp(ops.SwiGLU, dtype=torch.float32).plan_note(CUTE, torch.float32, cpu)
    assert note.startswith("activation after the GEMMs (FC1: needs bf16/fp16"), note
    note = _mlp(ops.SwiGLU, ffn=96).plan_note(CUTE, torch.bfloat16, cpu)
    assert "F=96 must be a multiple of 128" in note, note


def test_plan_shows_the_backend_reason():
    mlp = te_seq.Sequential(ops.GroupedLinear(2, 8, 16), ops.SwiGLU(), ops.GroupedLinear(2, 8, 8))
    splits = torch.tensor([3, 2])
    mlp(torch.randn(5, 8), splits, splits)
    (step,) = mlp.fusion_plan().forward
    assert step.backend == "reference"
    assert step.backend_reason == (
        "data on cpu: auto runs the reference there; "
        "activation after the GEMMs (the reference backend has no fused activation epilogue)"
    )
    assert "(data on cpu" in str(mlp.fusion_plan())
