"""The fused grouped MLP says in fusion_plan() whether its activation runs in the GEMM
epilogues (cute) or after the GEMMs, and why — checked through GroupedMLP.plan_note directly,
since the cute backend itself needs a Hopper GPU (its `supports` answers on any machine)."""

import torch

import te_seq
from te_seq import ops
from te_seq.kernels import Backend, get_backend
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
    assert "an FC1 bias with a non-gated activation" in _mlp(ops.GELU, bias=True).plan_note(
        CUTE, torch.bfloat16, cpu)
    scaled = GroupedMLP([ops.GroupedLinear(4, 64, 256, scale_bias=True, dtype=torch.bfloat16),
                         ops.SwiGLU(), ops.GroupedLinear(4, 128, 64, dtype=torch.bfloat16)])
    note = scaled.plan_note(CUTE, torch.bfloat16, cpu)
    assert "an FC1 bias scaled per row (scale_bias) has no fused epilogue" in note, note


class _EpilogueEverywhere(Backend):
    """Claims every kernel (records the facts FC1's epilogue is asked with)."""

    name = "epilogue_everywhere"

    def __init__(self):
        self.asked = []

    def implements(self, kernel):
        return True

    def supports(self, kernel, **static):
        self.asked.append((kernel, static))
        return True, ""


def test_fc1_bias_keeps_the_fused_epilogue_and_is_asked_for():
    backend = _EpilogueEverywhere()
    cpu = torch.device("cpu")
    note = _mlp(ops.SwiGLU, bias=True).plan_note(backend, torch.bfloat16, cpu)
    assert note == "activation fused into the FC1 and FC2-dgrad epilogues", note
    facts = dict(backend.asked)
    assert facts["glu_fc1_forward"]["bias"] is True
    assert "bias" not in facts["glu_fc2_dgrad"]
    backend.asked.clear()
    _mlp(ops.SwiGLU).plan_note(backend, torch.bfloat16, cpu)
    assert "bias" not in dict(backend.asked)["glu_fc1_forward"]


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


def _mlp_of(groups, single):
    kw = {"dtype": torch.bfloat16, "single_grouped_weight": single}
    return GroupedMLP([ops.GroupedLinear(groups, 64, 256, bias=False, **kw), ops.SwiGLU(),
                       ops.GroupedLinear(groups, 128, 64, bias=False, **kw)])


def test_many_per_expert_weights_get_a_host_time_hint():
    """One weight Parameter per expert costs autograd host time per Parameter: from
    PER_EXPERT_HINT_GROUPS experts the note says so and names the fix; one grouped weight per
    linear, or few experts, keep the note as it was."""
    from te_seq.ops.basic.grouped_linear import PER_EXPERT_HINT_GROUPS

    cpu = torch.device("cpu")
    many = PER_EXPERT_HINT_GROUPS
    mlp = _mlp_of(many, single=False)
    note = mlp.plan_note(CUTE, torch.bfloat16, cpu)
    hint = (f"; 2 x {many} per-expert weight Parameters cost autograd host time each step: "
            "single_grouped_weight=True avoids it")
    assert note == _mlp_of(many, single=True).plan_note(CUTE, torch.bfloat16, cpu) + hint, note
    for groups, single in ((many, True), (many - 1, False)):
        note = _mlp_of(groups, single).plan_note(CUTE, torch.bfloat16, cpu)
        assert "per-expert" not in note, (groups, single, note)


def test_the_hint_reaches_fusion_plan():
    mlp = te_seq.Sequential(
        ops.GroupedLinear(64, 64, 256, bias=False, dtype=torch.bfloat16), ops.SwiGLU(),
        ops.GroupedLinear(64, 128, 64, bias=False, dtype=torch.bfloat16))
    x = torch.randn(128, 64, dtype=torch.bfloat16)
    splits = torch.full((64,), 2, dtype=torch.int64)
    with te_seq.backend("torch"):
        mlp(x, splits, splits)
        plan = mlp.fusion_plan()
    assert "2 x 64 per-expert weight Parameters" in str(plan), plan


def test_an_unfused_grouped_linear_gets_the_hint_too():
    lin = ops.GroupedLinear(64, 64, 32, bias=False, dtype=torch.bfloat16)
    mlp = te_seq.Sequential(lin)
    x = torch.randn(128, 64, dtype=torch.bfloat16)
    with te_seq.backend("torch"):
        mlp(x, torch.full((64,), 2, dtype=torch.int64))
        plan = str(mlp.fusion_plan())
    assert "64 per-expert weight Parameters cost autograd host time" in plan, plan
    assert "x 64" not in plan, plan
    one = ops.GroupedLinear(64, 64, 32, bias=False, single_grouped_weight=True)
    assert one.plan_note(get_backend("torch"), torch.float32, torch.device("cpu")) == ""
