"""The "cute" backend: te_seq's CuTe DSL Hopper kernels (``te_seq.kernels.cute``) as a `Backend`.

Only the package's public functionals are used (``available``, ``supports``,
``supports_wgrad``, ``grouped_mm``, ``grouped_wgrad``, ``glu_fc1_forward``, ``glu_fc2_dgrad``,
``act_fc1_forward``, ``act_fc2_dgrad``, ``route_problem``).
Their ``supports`` checks take tensors; at plan time there are none yet, so they get shape
proxies: tensors of the right dtype, device and trailing sizes with no leading rows (E or M = 0),
which allocate no device memory.

Under an FP8 recipe (te_seq.autocast) the backend takes the grouped GEMMs of GroupedLinear and
the fused GroupedMLP where its FP8 kernel runs their forward (``te_seq.kernels.fp8_cute``:
row-wise or per-tensor E4M3 operands, or Float8BlockScaling's 1x128 / 128x128 blocks on its
block-scaled kernel, bf16, sm_90, K and N multiples of 16; core/fp8_gemm.py calls it). With
an E4M3 gradient (not "HYBRID") their dgrad runs on the same FP8 kernel and their wgrad on
``cute.scaled_grouped_wgrad`` (core/fp8_gemm.py, `backward_reason`; block scaling: the dgrad
only); otherwise the dgrad and wgrad GEMMs are emulated on fp32 operands, which the cute
kernels (16-bit only) do not take: ``grouped_mm`` and ``grouped_wgrad`` run those on the
torch backend's functions (``_on_torch``; its exact tiled path on CUDA), as the torch backend
itself does.

Shape legend: M rows, E experts, K reduction dim, N output dim, H hidden, F ffn width.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from te_seq.kernels import cute, fp8_cute, torch_backend
from te_seq.kernels import offsets as offsets_maths
from te_seq.kernels.activations import GluSpec
from te_seq.kernels.backend import register_backend
from te_seq.kernels.gpu_backend import GpuBackend


def _proxy(*sizes: int, dtype: torch.dtype, device: torch.device, **_: Any) -> Tensor:
    """An empty [0, *sizes] tensor: what a `supports` check reads (dtype, device, the trailing
    sizes), without data. Facts the check does not read are ignored."""
    return torch.empty(0, *sizes, dtype=dtype, device=device)


_CUTE_DTYPES = (torch.bfloat16, torch.float16)


def _on_torch(*operands: Tensor) -> bool:
    """Whether a GEMM's operands are not 16-bit (the fp32 dequantized operands of the emulated
    FP8 dgrad / wgrad, or of a forward the FP8 kernel does not take): the cute kernels refuse
    them, so the torch backend's functions run that GEMM."""
    return any(t.dtype not in _CUTE_DTYPES for t in operands)


class CuteBackend(GpuBackend):
    """GEMMs and fused GLU epilogues from ``te_seq.kernels.cute`` (CUDA sm_90+, bf16/fp16,
    widths that are multiples of 8), the compiled elementwise maths of `GpuBackend`."""

    name = "cute"
    auto_priority = 20
    # routed rows inside the kernels (te_seq/kernels/cute/routed.py): FC1 reads the token rows
    # by index in its loads; a plain GEMM writes its rows by index in its epilogue
    gather_kernels = frozenset({"grouped_mm", "glu_fc1_forward", "act_fc1_forward"})
    scatter_kernels = frozenset({"grouped_mm"})
    fc1_h_optional = True

    def available(self) -> tuple[bool, str]:
        return cute.available()

    def supports(self, kernel: str, **static: Any) -> tuple[bool, str]:
        if static.get("recipe") is not None:
            return self._supports_fp8(kernel, **static)
        check = {
            "grouped_mm": self._supports_mm,
            "grouped_wgrad": self._supports_wgrad,
            "glu_fc1_forward": self._supports_fc1,
            "glu_fc2_dgrad": self._supports_dgrad,
            "act_fc1_forward": self._supports_act_fc1,
            "act_fc2_dgrad": self._supports_act_dgrad,
        }.get(kernel)
        return super().supports(kernel, **static) if check is None else check(**static)

    @staticmethod
    def _supports_fp8(kernel: str, *, recipe: Any, dtype: torch.dtype, device: torch.device,
                      k: int | None = None, n: int | None = None, grouped: bool = True,
                      **_: Any) -> tuple[bool, str]:
        """Under `recipe`: the GEMMs of a grouped op whose forward the cute FP8 kernel runs
        (the dgrad / wgrad GEMMs then run emulated, see the module docstring). Anything else is
        declined with the reason, so the plan runs torch or the reference: never bf16 in
        place of FP8."""
        where = f"the cute backend has no FP8 kernels for {recipe}"
        if kernel not in ("grouped_mm", "grouped_wgrad") or k is None or n is None:
            return False, f"{where}: {kernel} under a recipe"
        if not grouped:
            return False, f"{where}: a plain linear (its FP8 kernel is grouped only)"
        why = fp8_cute.recipe_reason(recipe, dtype, device, [(k, n)])
        return (False, f"{where}: {why}") if why else (True, "")

    @staticmethod
    def _supports_mm(*, k: int, n: int, **where: Any) -> tuple[bool, str]:
        return cute.supports(_proxy(k, **where), _proxy(k, n, **where))  # a [M, K], b [E, K, N]

    @staticmethod
    def _supports_wgrad(*, k: int, n: int, **where: Any) -> tuple[bool, str]:
        return cute.supports_wgrad(_proxy(n, **where), _proxy(k, **where))  # dy [M, N], x [M, K]

    @staticmethod
    def _supports_fc1(
        *, hidden: int, ffn: int, glu: GluSpec, bias: bool = False, **where: Any
    ) -> tuple[bool, str]:
        x, w1t = _proxy(hidden, **where), _proxy(hidden, 2 * ffn, **where)  # [M, H], [E, H, 2F]
        b1 = _proxy(2 * ffn, **where) if bias else None  # [E, 2F] in the data's dtype
        return cute.glu_fc1_forward.supports(x, w1t, glu.act, glu.glu_interleave_size, bias=b1)

    @staticmethod
    def _supports_dgrad(*, hidden: int, ffn: int, glu: GluSpec, **where: Any) -> tuple[bool, str]:
        dy, w2 = _proxy(hidden, **where), _proxy(hidden, ffn, **where)  # [M, H], [E, H, F]
        return cute.glu_fc2_dgrad.supports(dy, w2, glu.act, glu.glu_interleave_size)

    @staticmethod
    def _supports_act_fc1(*, hidden: int, ffn: int, act: str, **where: Any) -> tuple[bool, str]:
        x, w1t = _proxy(hidden, **where), _proxy(hidden, ffn, **where)  # [M, H], [E, H, F]
        return cute.act_fc1_forward.supports(x, w1t, act)

    @staticmethod
    def _supports_act_dgrad(*, hidden: int, ffn: int, act: str, **where: Any) -> tuple[bool, str]:
        dy, w2 = _proxy(hidden, **where), _proxy(hidden, ffn, **where)  # [M, H], [E, H, F]
        return cute.act_fc2_dgrad.supports(dy, w2, act)

    def routes_natively(self, kernel: str, what: str, **static: Any) -> bool:
        """Gathered rows need K (``k`` or ``hidden``) to be a multiple of the 64-column
        k-tile; scattered rows need nothing more than the GEMM itself."""
        kernels = self.gather_kernels if what == "gather" else self.scatter_kernels
        if kernel not in kernels:
            return False
        k = static.get("k", static.get("hidden"))
        return k is None or not cute.route_problem(what, k)

    # --- kernels ------------------------------------------------------------------------------
    def grouped_mm(self, a, b, offs, bias=None, bias_scales=None, *, gather_rows=None,
                   scatter_rows=None) -> Tensor:
        if _on_torch(a, b) and gather_rows is None and scatter_rows is None:
            return torch_backend.TORCH.grouped_mm(a, b, offs, bias, bias_scales)
        if gather_rows is not None and scatter_rows is not None:
            # one routed side per kernel: gather in the loads, then place the rows
            res = cute.grouped_mm(a, b, offs, bias=bias, bias_scales=bias_scales,
                                  gather_rows=gather_rows)
            return torch.empty_like(res).index_copy_(0, scatter_rows, res)
        return cute.grouped_mm(a, b, offs, bias=bias, bias_scales=bias_scales,
                               gather_rows=gather_rows, scatter_rows=scatter_rows)

    def grouped_wgrad(self, grad_out, x, offs, out=None, accumulate=False) -> Tensor:
        if _on_torch(grad_out, x):
            return torch_backend.grouped_wgrad(grad_out, x, offs, out=out, accumulate=accumulate)
        return cute.grouped_wgrad(grad_out, x, offs, out=out, accumulate=accumulate)

    def glu_fc1_forward(self, x, w1t, offs, glu: GluSpec, probs=None, bias=None, *,
                        gather_rows=None, store_h=True):
        il = glu.glu_interleave_size
        return cute.glu_fc1_forward(x, w1t, offs, glu.act, il, probs, glu.params, bias=bias,
                                    gather_rows=gather_rows, store_h=store_h)

    def glu_fc2_dgrad(self, dy, w2, offs, h, glu: GluSpec, probs=None):
        il = glu.glu_interleave_size
        return cute.glu_fc2_dgrad(dy, w2, offs, h, glu.act, il, probs, glu.params)

    def act_fc1_forward(self, x, w1t, offs, act: str, probs=None, *,
                        gather_rows=None) -> tuple[Tensor, Tensor]:
        return cute.act_fc1_forward(x, w1t, offs, act, probs, gather_rows=gather_rows)

    def act_fc2_dgrad(self, dy, w2, offs, h, act: str, probs=None):
        return cute.act_fc2_dgrad(dy, w2, offs, h, act, probs)

    # --- launches prepared for a steady state (ops/fused/grouped_mlp.py) --------------------
    def prepare_glu_fc1_forward(self, x: Tensor, w1: Tensor, glu: GluSpec,
                                probs: Tensor | None = None, store_h: bool = True) -> Callable:
        """``run(x, w1, offs, probs) -> (h, a)``, equal to ``glu_fc1_forward(x,
        w1.transpose(1, 2), offs, glu, probs, store_h=store_h)`` for later calls whose operands
        have these ones' dtypes, shapes, strides and devices (the caller vouches for them):
        checked and planned once, here (``cute.glu_fc1_forward.launch_for``)."""
        return cute.glu_fc1_forward.launch_for(x, w1, glu.act, glu.glu_interleave_size, probs,
                                               glu.params, store_h)

    def prepare_group_offsets(self, splits: Tensor, rows: int,
                              device: torch.device) -> Callable | None:
        """``run(splits) -> (offs, check)`` for later calls whose split sizes have these ones'
        dtype, shape and device, when ``group_offsets(splits, rows, device)`` is the offsets
        kernel's launch (None otherwise: the caller calls ``group_offsets``): offs equal to
        its result, and ``check()`` its device-side assert, which the caller issues after its
        first launch on offs (bad split sizes make offs all zeros: that launch reads no row),
        so that the first GEMM is launched one launch sooner."""
        if splits.device != device or cute.offsets_problem(splits):
            return None
        return functools.partial(_offsets_and_check, rows=rows)

    def group_offsets(self, splits: Tensor, rows: int, device: torch.device) -> Tensor:
        """Device split sizes: one launch for the offsets and their check
        (``cute.group_offsets``) plus the device-side assert, in place of ~9 small torch kernels;
        host split sizes and traced code: the default torch ops."""
        if splits.device != device or cute.offsets_problem(splits):
            return super().group_offsets(splits, rows, device)
        return _kernel_offsets(splits, rows)


def _kernel_offsets(splits: Tensor, rows: int) -> Tensor:
    """The offsets kernel's offs of device split sizes, its check asserted on the device."""
    offs, check = _offsets_and_check(splits, rows)
    check()
    return offs


def _offsets_and_check(splits: Tensor, rows: int) -> tuple[Tensor, Callable[[], None]]:
    """(the offsets kernel's offs of device split sizes, the device-side assert on their
    check, not yet issued)."""
    offs, ok = cute.group_offsets(splits, rows)
    return offs, functools.partial(torch._assert_async, ok, offsets_maths.SPLITS_MESSAGE)


CUTE = register_backend(CuteBackend())
