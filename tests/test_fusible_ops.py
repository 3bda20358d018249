"""The op matrix: every spec of op_specs.SPECS × dtype × input shape × which inputs need grad.

Each case runs the op inside a te_seq.Sequential on the reference backend (CPU) and compares the
output, the input gradient, the extra-input gradients and the parameter gradients with the spec's
pure-PyTorch reference computed with autograd on float64 copies of the same data.

Grid axes, and why each exists (pruned to keep CI at a few seconds on 2 cores):
- dtype: float64 checks the maths exactly (~1e-12); float32 the usual path; bfloat16/float16 the
  low-precision handling (upcasts, where rounding happens), judged against PyTorch's own error.
  All dtypes run on the base shape only.
- shape: zero rows (empty GEMMs, empty groups everywhere), one row, several rows (the base), a 3-D
  [B, S, H] input (ops must flatten leading dims and restore them), and a non-contiguous
  (transposed) input (ops must not assume strides). Run in float64 (exact) and bfloat16 (where
  low-precision kernels would mis-handle strides), with every input needing grad.
- grad mode: input only (dgrad without wgrad), params only (wgrad without dgrad; the op must not
  need dx), both, and none (torch.no_grad: no context saved, no backward). Base shape, every dtype.
"""

from __future__ import annotations

import pytest
import torch
from op_specs import (
    API_BASIC_OPS,
    SPECS,
    Case,
    OpSpec,
    as_tuple,
    assert_close_to,
    build_case,
    floating,
    leaves_of,
    reference_run,
)

BASE_ROWS = 7
SHAPE_DTYPES = (torch.float64, torch.bfloat16)
GRAD_MODES = ("input", "params", "both", "none")


def make_input(kind: str, width: int, dtype: torch.dtype) -> torch.Tensor:
    """A fresh random input of the given shape kind (values from float64, then cast)."""
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float64).to(dtype)

    if kind == "zero_rows":
        return randn(0, width)
    if kind == "one_row":
        return randn(1, width)
    if kind == "rows":
        return randn(BASE_ROWS, width)
    if kind == "3d":
        return randn(2, 3, width)
    if kind == "non_contiguous":
        x = randn(width, 2 * BASE_ROWS).t()[::2]  # [7, width], strides (2, 14)
        assert not x.is_contiguous()
        return x
    raise AssertionError(kind)


def _cases() -> list:
    cases = []
    for spec in SPECS:
        for dtype in spec.dtypes:
            for mode in GRAD_MODES:
                cases.append(pytest.param(spec, dtype, "rows", mode,
                                          id=f"{spec.name}-{str(dtype)[6:]}-rows-{mode}"))
        for dtype in SHAPE_DTYPES:
            for kind in ("zero_rows", "one_row", "3d", "non_contiguous"):
                cases.append(pytest.param(spec, dtype, kind, "both",
                                          id=f"{spec.name}-{str(dtype)[6:]}-{kind}-both"))
    return cases


def _set_requires_grad(case: Case, mode: str) -> None:
    inputs_need = mode in ("input", "both", "none")
    params_need = mode in ("params", "both", "none")
    case.x.requires_grad_(inputs_need)
    for e in case.extras:
        if floating(e):
            e.requires_grad_(inputs_need and case.spec.extras_need_grad)
    for p in case.params.values():
        p.requires_grad_(params_need)


def _run_te(case: Case, mode: str) -> tuple[torch.Tensor, ...]:
    extras = tuple(e.clone() if floating(e) and not e.requires_grad else e for e in case.extras)
    if mode == "none":
        with torch.no_grad():
            return as_tuple(case.seq(case.x, *extras))
    return as_tuple(case.seq(case.x, *extras))


@pytest.mark.parametrize("spec,dtype,kind,mode", _cases())
def test_op_matrix(spec: OpSpec, dtype: torch.dtype, kind: str, mode: str) -> None:
    case = build_case(spec, dtype, make_input(kind, spec.in_width, dtype))
    _set_requires_grad(case, mode)
    outs = _run_te(case, mode)
    needs_backward = mode != "none" and any(o.requires_grad for o in outs)
    grads_out = [torch.randn(o.shape, dtype=torch.float64).to(dtype) for o in outs]
    ref_outs, ref_grads = reference_run(case, torch.float64, grads_out if needs_backward else None)
    lowp_outs, lowp_grads = (None, None)
    if dtype not in (torch.float64, torch.float32):
        lowp_outs, lowp_grads = reference_run(case, dtype, grads_out if needs_backward else None)
    assert len(outs) == len(ref_outs), f"{len(outs)} outputs, reference gives {len(ref_outs)}"
    for i, (out, ref) in enumerate(zip(outs, ref_outs)):
        assert out.dtype == dtype, f"output {i} dtype {out.dtype}"
        assert_close_to(out, ref, dtype, lowp_outs[i] if lowp_outs else None, f"output {i}")
    if mode == "none":
        assert all(o.grad_fn is None for o in outs), "outputs under no_grad have a grad_fn"
        return
    _check_backward(case, outs, grads_out, ref_grads, lowp_grads, dtype, needs_backward)


def _check_backward(case: Case, outs, grads_out, ref_grads, lowp_grads, dtype,
                    needs_backward: bool) -> None:
    leaves = leaves_of(case)
    if not needs_backward:
        assert not any(t.requires_grad for t in leaves), "something needs grad but no output does"
        return
    live = [(o, g) for o, g in zip(outs, grads_out) if o.requires_grad]
    torch.autograd.backward([o for o, _ in live], [g for _, g in live])
    names = ["input"] + [f"extra{i}" for i in range(len(leaves) - 1 - len(case.params))]
    names += [f"param {n}" for n in case.params]
    for i, (leaf, name) in enumerate(zip(leaves, names)):
        if not leaf.requires_grad:
            assert leaf.grad is None, f"{name} needs no grad but got one"
            continue
        assert leaf.grad is not None, f"{name} needs a grad but got none"
        assert leaf.grad.dtype == leaf.dtype, f"{name} grad dtype {leaf.grad.dtype}"
        lowp = lowp_grads[i] if lowp_grads else None
        assert_close_to(leaf.grad, ref_grads[i], dtype, lowp, f"grad of {name}")


def test_split_sizes_never_get_a_gradient() -> None:
    """Integer extra inputs (split sizes) are passed through untouched and get no gradient."""
    spec = next(s for s in SPECS if s.name == "GroupedLinear-per_group_bias")
    case = build_case(spec, torch.float64, make_input("rows", spec.in_width, torch.float64))
    case.x.requires_grad_(True)
    (splits,) = case.extras
    before = splits.clone()
    case.seq(case.x, splits).sum().backward()
    assert splits.grad is None and torch.equal(splits, before)


def test_every_api_basic_op_has_a_spec() -> None:
    covered = {s.op_name for s in SPECS}
    assert set(API_BASIC_OPS) <= covered, sorted(set(API_BASIC_OPS) - covered)
