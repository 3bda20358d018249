"""Which kernels quantize an FP8 GEMM's operands: the one place that decides.

    rows(t, block, rule, backend_name)          t [R, C] along C (`fp8_reference.quantize`)
    token_major(t, offs, rule, backend_name)    t [T, C] along each group's tokens, laid out
                                                token-major (`fp8_wgrad.quantize_token_major`)
    rows_and_token_major(t, offs, rule, ...)    both (row-wise blocks), in one kernel pair
    rows_keeping_group_amax(t, offs, rule, ...) `rows` and t's (group, column) maxima in one
                                                read; `token_major_from_amax` then makes
                                                `token_major` from them in one more
    token_major_blocks(t, offs, rule, ...)      t along each group's tokens in 1x128 blocks,
                                                token-major (`Float8BlockScaling`'s wgrad
                                                operands: `quantize_token_major_blocks`)

On the cute backend, row-wise blocks of 16-bit CUDA data (E4M3 or E5M2, margin 0, C a multiple
of 16)
run te_seq's CuTe DSL kernels (`te_seq.kernels.cute.quant`: one launch per row-wise operand,
two per token-major one, or one where the groups fill a 512-token strip (`strips_reason`: over
256 and up to 512 tokens a group on average), one per block-scaled token-major one, which takes
fp32 data too);
everything else runs the torch definitions (compiled regions on CUDA,
`compiled_maths`). Both give the same bits (tests/kernels/test_cute_quant.py), so the choice
never changes a result. `reason` says why the kernels do not apply.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_seq.kernels import cute, fp8_wgrad
from te_seq.kernels import fp8_reference as ref

# (backend, block, rule, t's dtype, rank, width, device) -> `reason`'s answer: it depends on
# nothing else (the device's capability and the DSL's presence do not change in a process).
# The block and the rule enter the key as their field values (hashing or comparing the frozen
# dataclasses themselves is a Python call each). `clear_reasons()` forgets them (tests that
# fake a GPU; core/fp8_gemm.py's clear_decisions).
_REASONS: dict[tuple, str] = {}


def reason(t: Tensor, block: ref.QuantBlock, rule: ref.ScaleRule, backend_name: str) -> str:
    """Why t is not quantized by the cute kernels ("" when it is), decided once per set of
    the facts it reads."""
    key = (backend_name, block.rows, block.cols, rule.fmt, rule.margin, rule.power_of_two,
           t.dtype, t.shape[-1:], t.dim(), t.device)
    found = _REASONS.get(key)
    if found is None:
        found = _REASONS[key] = _reason(t, block, rule, backend_name)
    return found


def clear_reasons() -> None:
    """Forget `reason`'s answers."""
    _REASONS.clear()


def _reason(t: Tensor, block: ref.QuantBlock, rule: ref.ScaleRule, backend_name: str) -> str:
    if backend_name != "cute":
        return f"the {backend_name} backend quantizes with torch"
    if block != ref.ROWWISE:
        return f"blocks {block} are not row-wise"
    return cute.quant_problem(t, rule.dtype, rule.margin)


def group_amax_reason(t: Tensor, rule: ref.ScaleRule, backend_name: str) -> str:
    """Why `rows_keeping_group_amax` does not run the cute kernel pair ("" when it does),
    decided once per set of facts as `reason`."""
    key = ("group amax", backend_name, rule.fmt, rule.margin, rule.power_of_two, t.dtype,
           t.shape[-1:], t.dim(), t.device)
    found = _REASONS.get(key)
    if found is None:
        found = _REASONS[key] = reason(t, ref.ROWWISE, rule, backend_name) or \
            cute.group_amax_problem(t, rule.dtype, rule.margin)
    return found


def strips_reason(t: Tensor, offs: Tensor, rule: ref.ScaleRule, backend_name: str) -> str:
    """Why `token_major` does not take the one-read strip kernel ("" when it does): `reason`'s
    conditions, and over half and at most `cute.STRIP_TOKENS` tokens per group on average
    (`cute.strips_fit`; the host knows the rows and the groups, not the split)."""
    why = reason(t, ref.ROWWISE, rule, backend_name)
    rows, groups = t.shape[0], offs.shape[0]
    if why or cute.strips_fit(rows, groups):
        return why
    return (f"{rows} tokens in {groups} groups: not over {cute.STRIP_TOKENS // 2} and up to "
            f"{cute.STRIP_TOKENS} a group on average")


def blocks_reason(t: Tensor, rule: ref.ScaleRule, backend_name: str) -> str:
    """Why t is not quantized along its tokens in 1x128 blocks by the cute kernel ("" when it
    is): the row-wise kernels' conditions on t and the rule, fp32 data allowed too."""
    if backend_name != "cute":
        return f"the {backend_name} backend quantizes with torch"
    return cute.quant_problem(t, rule.dtype, rule.margin, fp32=True)


def rows(t: Tensor, block: ref.QuantBlock, rule: ref.ScaleRule,
         backend_name: str) -> ref.QuantizedTensor:
    """t [R, C] quantized along C with `block` under `rule` (`fp8_reference.quantize`). 1 x bc
    blocks that cut rows into whole blocks are the rows of t seen as [R·C/bc, bc]."""
    if ref.splits_rows(t, block):
        if reason(t, ref.ROWWISE, rule, backend_name):
            flat = ref.quantize(t.reshape(-1, block.cols), ref.ROWWISE, rule)
            return ref.row_blocks_from_rows(t, block, flat)
        data, scale_inv = cute.quantize_row_blocks(t, block.cols, rule.power_of_two, rule.dtype)
        return ref.QuantizedTensor(data, scale_inv, block, rule)
    if reason(t, block, rule, backend_name):
        return ref.quantize(t, block, rule)
    data, scale_inv = cute.quantize_rows(t, rule.power_of_two, rule.dtype)
    return ref.QuantizedTensor(data, scale_inv, block, rule)


def prepare_rows(t: Tensor, block: ref.QuantBlock, rule: ref.ScaleRule, backend_name: str):
    """``run(t, block, rule, backend_name) -> QuantizedTensor``, equal to `rows` of those
    arguments for later calls whose t has this one's dtype, shape and device and whose block,
    rule and backend are these (the caller vouches for them): the cute row kernel's launch
    prepared once (``cute.quantize_rows_launch``) where t has this one's strides too (an
    input's layout may change between calls), `rows` otherwise; None where `rows` does not
    launch that kernel (1 x bc blocks, the torch quantizer, an empty t)."""
    if ref.splits_rows(t, block) or reason(t, block, rule, backend_name) or not t.numel():
        return None
    launch, strides = cute.quantize_rows_launch(t, rule.power_of_two, rule.dtype), t.stride()

    def run(t: Tensor, *fixed) -> ref.QuantizedTensor:
        if t.stride() != strides:
            return rows(t, block, rule, backend_name)
        data, scale_inv = launch(t)
        return ref.QuantizedTensor(data, scale_inv, block, rule)

    return run


def token_major(t: Tensor, offs: Tensor, rule: ref.ScaleRule,
                backend_name: str) -> fp8_wgrad.TokenMajor:
    """t [T, C] quantized along the tokens of each group (`offs` int32 [G] row ends), one scale
    per (group, column), token-major (`fp8_wgrad.quantize_token_major`)."""
    if reason(t, ref.ROWWISE, rule, backend_name):
        return fp8_wgrad.quantize_token_major(t, offs, rule)
    if not strips_reason(t, offs, rule, backend_name):  # one read of t, one launch
        return _token_major_in_strips(t, offs, rule)
    table, padded_offs = span_table(offs, t.shape[0])  # the maxima pass, then the cast
    data, scale_inv = cute.quantize_spans(t, table, offs.shape[0], rule.power_of_two,
                                          rule.dtype)
    return fp8_wgrad.TokenMajor(data, scale_inv, padded_offs)


def _token_major_in_strips(t: Tensor, offs: Tensor, rule: ref.ScaleRule
                           ) -> fp8_wgrad.TokenMajor:
    """`token_major` on the strip kernel (`strips_reason` found none against it)."""
    table, padded_offs = span_table(offs, t.shape[0])
    data, scale_inv = cute.quantize_spans_in_strips(t, offs, padded_offs, table.shape[0],
                                                    rule.power_of_two, rule.dtype)
    return fp8_wgrad.TokenMajor(data, scale_inv, padded_offs)


def token_major_blocks(t: Tensor, offs: Tensor, rule: ref.ScaleRule,
                       backend_name: str) -> fp8_wgrad.BlockTokenMajor:
    """t [T, C] quantized along the tokens of each group (`offs` int32 [G] row ends) in 1x128
    blocks, one scale per (128-token block, column), token-major
    (`fp8_wgrad.quantize_token_major_blocks`, bit for bit)."""
    if blocks_reason(t, rule, backend_name):
        return fp8_wgrad.quantize_token_major_blocks(t, offs, rule)
    table, padded_offs = span_table(offs, t.shape[0])
    data, scale_inv = cute.quantize_span_blocks(t, table, rule.power_of_two, rule.dtype)
    return fp8_wgrad.BlockTokenMajor(data, scale_inv, padded_offs)


def rows_and_token_major(t: Tensor, offs: Tensor, rule: ref.ScaleRule, backend_name: str
                         ) -> tuple[ref.QuantizedTensor, fp8_wgrad.TokenMajor]:
    """(`rows(t, ROWWISE, ...)`, `token_major(t, offs, ...)`): an operand both GEMMs of a
    grouped linear read (x, dy, dh). The cute kernels make both in two passes over t: where
    the strips fit (`strips_reason`), the plain row cast and the strip cast (which takes its
    maxima itself); else the row-wise cast taking each group's column maxima on its way, then
    the token-major cast from them (`rows_keeping_group_amax`, `token_major_from_amax`; rows
    wider than their maxima allow: a maxima pass, then one cast writing both forms). Rows
    past the last group's end have unspecified row-wise data (the grouped GEMMs write zeros
    for them whatever they hold)."""
    if reason(t, ref.ROWWISE, rule, backend_name):
        return ref.quantize(t, ref.ROWWISE, rule), fp8_wgrad.quantize_token_major(t, offs, rule)
    if not strips_reason(t, offs, rule, backend_name):  # the row cast, then one strip read
        return rows(t, ref.ROWWISE, rule, backend_name), _token_major_in_strips(t, offs, rule)
    if not group_amax_reason(t, rule, backend_name):
        forward, amax = rows_keeping_group_amax(t, offs, rule, backend_name)
        return forward, token_major_from_amax(t, offs, amax, rule)
    table, padded_offs = span_table(offs, t.shape[0])
    data, scale_inv, row_data, row_scale_inv = cute.quantize_rows_and_spans(
        t, table, offs.shape[0], rule.power_of_two, rule.dtype)
    return (ref.QuantizedTensor(row_data, row_scale_inv, ref.ROWWISE, rule),
            fp8_wgrad.TokenMajor(data, scale_inv, padded_offs))


def rows_keeping_group_amax(t: Tensor, offs: Tensor, rule: ref.ScaleRule, backend_name: str
                            ) -> tuple[ref.QuantizedTensor, Tensor | None]:
    """(`rows(t, ROWWISE, ...)`, max |t| per (group, column) fp32 [G, C] with nan as inf, or
    None): where the cute kernels run, one read of t makes both
    (`cute.quantize_rows_and_group_amax`), and `token_major_from_amax` later makes
    `token_major(t, ...)` from the maxima in one more read; elsewhere, and where the strips
    fit (`strips_reason`: their one read needs no maxima), the maxima are None (the caller
    then quantizes along the tokens with `token_major`). Rows past the last group's end
    have unspecified row-wise data, as with `rows_and_token_major`."""
    if group_amax_reason(t, rule, backend_name) or not strips_reason(t, offs, rule,
                                                                     backend_name):
        return rows(t, ref.ROWWISE, rule, backend_name), None  # strips need no maxima
    table, _ = span_table(offs, t.shape[0])
    data, scale_inv, amax = cute.quantize_rows_and_group_amax(
        t, table, offs.shape[0], rule.power_of_two, rule.dtype)
    return ref.QuantizedTensor(data, scale_inv, ref.ROWWISE, rule), amax


def token_major_from_amax(t: Tensor, offs: Tensor, amax: Tensor, rule: ref.ScaleRule
                          ) -> fp8_wgrad.TokenMajor:
    """`token_major(t, offs, rule, "cute")` from `rows_keeping_group_amax`'s maxima of the same
    t: one cast pass (bitwise the same result)."""
    table, padded_offs = span_table(offs, t.shape[0])
    data, scale_inv = cute.quantize_spans_from_group_amax(t, table, amax, rule.power_of_two,
                                                          rule.dtype)
    return fp8_wgrad.TokenMajor(data, scale_inv, padded_offs)


# on the offs tensor: ((its version, rows), (table, padded offs)). One step's token-major
# operands (x, the activation, dy, dh) share their group offsets, so the table is built once
# per step; an attribute of the tensor (one lookup, gone with it; a weak-keyed dictionary
# costs ~8 Python calls a lookup).
_TABLE_ATTR = "_te_seq_span_table"


def span_table(offs: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """(table int32 [P / 128, 4], padded span ends int32 [G]) for `rows` tokens grouped by
    `offs`: per padded 128-token block, (its first row, its valid rows, its group, 1 on its
    group's first block), as `cute.quantize_spans` reads it; blocks past the last span have
    group G and no rows. Cached per `offs` tensor (and its version); no host sync. On a GPU
    with the CuTe DSL one kernel makes it (`cute.span_table`), else torch ops."""
    key = (offs._version, rows)
    cached = getattr(offs, _TABLE_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    if offs.is_cuda and cute.available()[0]:
        blocks = fp8_wgrad.padded_width(rows, offs.shape[0]) // fp8_wgrad.WGRAD_PAD
        made = cute.span_table(offs, blocks)  # one launch
    else:
        made = _build_table(offs, rows)  # the same table from torch ops (the definition)
    if not torch.compiler.is_compiling():
        setattr(offs, _TABLE_ATTR, (key, made))
    return made


def _build_table(offs: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    groups, pad = offs.shape[0], fp8_wgrad.WGRAD_PAD
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    spans = (counts + pad - 1) // pad * pad
    padded_ends = torch.cumsum(spans, 0)
    starts = torch.arange(0, fp8_wgrad.padded_width(rows, groups), pad, device=offs.device)
    group = torch.searchsorted(padded_ends, starts, right=True)  # G past the last span
    g = group.clamp(max=groups - 1)
    within = starts - (padded_ends - spans)[g]
    inside = group < groups
    valid = torch.where(inside, (counts[g] - within).clamp(0, pad), 0)
    first_row = torch.where(inside, (ends - counts)[g] + within, 0)
    first = inside & (within == 0)
    table = torch.stack([first_row, valid, group, first.long()], 1).to(torch.int32)
    return table, padded_ends.to(torch.int32)


def stacked_weight_rows(w: Tensor, rule: ref.ScaleRule, backend_name: str
                        ) -> tuple[ref.QuantizedTensor, ref.QuantizedTensor]:
    """Each expert's W_g [N, K] of w [G, N, K] quantized row-wise along K (the forward GEMM's
    operand: data [G, N, K], scale_inv [G, N, 1]) and along N (the rows of W_gᵀ, the dgrad's
    operand: data [G, K, N], scale_inv [G, K, 1]): bitwise `fp8_reference.quantize_stacked`
    of w and of w.transpose(1, 2). After every optimizer step all of them are quantized again.

    On the cute kernels (contiguous 16-bit w, N a multiple of 128, K of 16 up to 16384) that is
    two reads of w: `rows_keeping_group_amax` of w as [G·N, K] with each expert a group (the
    forward form and each (expert, column) maximum), then `token_major_from_amax` (the
    experts' columns cast along N, laid out [K, G·N]); the dgrad form is its [G, K, N] view.
    Experts of up to `cute.STRIP_TOKENS` rows take the row cast and `token_major`'s strips.
    Elsewhere the torch definitions (eager: several fp32 passes over w per form)."""
    g, n, k = w.shape
    flat = w.reshape(g * n, k)
    if stacked_weight_reason(w, rule, backend_name):
        return (ref.quantize_stacked(w, ref.ROWWISE, rule),
                ref.quantize_stacked(w.transpose(1, 2), ref.ROWWISE, rule))
    offs = _expert_ends(g, n, w.device)
    along_k, amax = rows_keeping_group_amax(flat, offs, rule, backend_name)
    along_n = token_major(flat, offs, rule, backend_name) if amax is None else \
        token_major_from_amax(flat, offs, amax, rule)  # no maxima: experts of <= 512 rows
    data = along_n.data[:, : g * n].reshape(k, g, n).permute(1, 0, 2)
    return (ref.QuantizedTensor(along_k.data.reshape(g, n, k),
                                along_k.scale_inv.reshape(g, n, 1), ref.ROWWISE, rule),
            ref.QuantizedTensor(data, along_n.scale_inv.reshape(g, k, 1), ref.ROWWISE, rule))


def stacked_weight_reason(w: Tensor, rule: ref.ScaleRule, backend_name: str) -> str:
    """Why `stacked_weight_rows` does not make w [G, N, K]'s two forms on the cute kernel pair
    ("" when it does)."""
    g, n, k = w.shape
    if g == 0:
        return "no experts"
    if n % fp8_wgrad.WGRAD_PAD:
        return f"N={n} is no multiple of {fp8_wgrad.WGRAD_PAD}"
    if not w.is_contiguous():
        return "w is not contiguous"
    return group_amax_reason(w.reshape(g * n, k), rule, backend_name)


_EXPERT_ENDS: dict[tuple[int, int, torch.device], Tensor] = {}


def _expert_ends(groups: int, rows: int, device: torch.device) -> Tensor:
    """int32 [G] = rows, 2 rows, ..., G rows: the group ends of G stacked [rows, K] matrices.
    Cached per (G, rows, device), except while a CUDA graph is captured (the tensor would
    live in the graph's memory pool); its span table is cached on it (`span_table`)."""
    key = (groups, rows, device)
    found = _EXPERT_ENDS.get(key)
    if found is None:
        found = torch.arange(1, groups + 1, dtype=torch.int32, device=device) * rows
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _EXPERT_ENDS[key] = found
    return found


__all__ = ["blocks_reason", "group_amax_reason", "reason", "rows", "rows_and_token_major",
           "rows_keeping_group_amax", "span_table", "stacked_weight_rows", "token_major",
           "token_major_blocks", "token_major_from_amax"]
