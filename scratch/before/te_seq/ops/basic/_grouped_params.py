"""Per-group Parameters that are views of one block tensor [G, *shape].

GroupedLinear's per-group weights `weight0..weight{G-1}` [N, K] and biases `bias0..` [N] are
separate Parameters (own state_dict keys, optimizer entries and main_grad buffers), but the
grouped GEMM wants one [G, N, K] tensor. While every Parameter is a view of one block, the GEMM
reads the block with no copy; otherwise each forward stacks them (a copy of every expert weight).

What keeps the block:
- construction allocates it (`ParamBlock.allocate`), `reset_parameters` writes in place, and
  `load_state_dict` (copy, the default) copies into the views;
- module conversions (`.to`, `.cuda`, `.half`, `.double`, `to_empty`, meta init) go through
  `GroupedLinear._apply`, which converts the block once (`convert`) and hands each Parameter its
  view of the result (`settle`);
- `copy.deepcopy` of the module copies the block once and makes the copy's Parameters views of
  it (`seed_deepcopy`; Parameter's own deepcopy would clone each on its own); `torch.save` /
  `torch.load` keep the views, plain `pickle` does not and is re-homed once (`unpickled`);
- Parameters that were given their own storage some other way (`param.data = t`) are
  re-found by address when they lie back to back (e.g. after `load_state_dict(...,
  assign=True)` of a te_seq checkpoint), and re-homed into a fresh block (one copy) by the next
  conversion that moves them. Until then (and for tensor subclasses such as FSDP2's DTensors,
  never touched here) each forward stacks. They are not re-homed behind the user's back: a
  `param.data = t` may alias `t` on purpose.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

_data_ptr = Tensor.data_ptr


class ParamBlock:
    """The block behind the Parameters `names` of one module's parameter table.

    The table is passed in (not kept) because Module conversions may put new Parameter objects
    into it; the Parameters are always looked up by name.
    """

    def __init__(self, names: Sequence[str], block: Tensor | None) -> None:
        self.names = tuple(names)
        self._getter = operator.itemgetter(*self.names)  # a C-level lookup of all G names
        self.block = block

    @staticmethod
    def allocate(
        prefix: str, count: int, shape: tuple[int, ...], device, dtype
    ) -> tuple[ParamBlock, list[torch.nn.Parameter]]:
        """A fresh (uninitialised) block [count, *shape] and one Parameter per view of it."""
        block = torch.empty(count, *shape, device=device, dtype=dtype)
        params = [torch.nn.Parameter(block[g]) for g in range(count)]
        return ParamBlock([f"{prefix}{g}" for g in range(count)], block), params

    def params(self, table: dict) -> tuple[torch.nn.Parameter, ...]:
        found = self._getter(table)
        return found if len(self.names) > 1 else (found,)  # itemgetter of one name: no tuple

    def current(self, table: dict) -> Tensor | None:
        """The block, if every Parameter views it, in order (an address compare, no copy)."""
        params = self.params(table)
        if self.block is not None and _views(params, self.block):
            return self.block
        # Stale (don't keep old storage alive); re-found if the Parameters lie back to back.
        self.block = block_of(params) if _plain(params) else None
        return self.block

    def stacked(self, table: dict) -> Tensor:
        """[G, *shape]: the block, or (when the Parameters no longer view one) a stacked copy.

        Under torch.compile always the stacked copy: traced tensors have no addresses, and the
        gradient must reach each Parameter through the graph."""
        if torch.compiler.is_compiling():
            return torch.stack([table[name] for name in self.names])
        block = self.current(table)
        return block if block is not None else torch.stack(self.params(table))

    def seed_deepcopy(self, table: dict, memo: dict) -> None:
        """Before `copy.deepcopy` of the owning module: put into `memo` one copy of the block and,
        for every Parameter viewing it, a Parameter viewing that copy. Nothing if the Parameters
        view no block or one of them was copied already (tied to something copied earlier)."""
        params = self.params(table)
        block = self.current(table)
        if block is None or id(block) in memo or any(id(p) in memo for p in params):
            return
        copied = block.clone()
        memo[id(block)] = copied
        for g, p in enumerate(params):  # as Parameter.__deepcopy__ does, but a view of the copy
            memo[id(p)] = type(p)(copied[g], p.requires_grad)

    # --- module conversions (GroupedLinear._apply) ------------------------------------------
    def convert(self, table: dict, fn: Callable[[Tensor], Tensor]) -> tuple[dict, list[int]]:
        """Before `Module._apply(fn)`: converts the block once. Returns the replacement for
        each Parameter (by id: its view of fn(block); empty if they view no block) and their
        addresses before the conversion."""
        params = self.params(table)
        before = list(map(_data_ptr, params))
        block = self.current(table)
        if block is None:
            return {}, before
        with torch.no_grad():
            converted = fn(block)
        return {id(p): converted[g] for g, p in enumerate(params)}, before

    def settle(self, table: dict, before: list[int]) -> None:
        """After `Module._apply`: adopt the block the Parameters now view; if the conversion
        moved Parameters that view none, copy them into a fresh block (once)."""
        params = self.params(table)
        if self.current(table) is not None or not _plain(params):
            return
        if list(map(_data_ptr, params)) == before:
            return  # the conversion left them where they were (e.g. aliased on purpose)
        self._rehome(params)

    def unpickled(self, table: dict) -> None:
        """After unpickling the owning module: plain `pickle` gives every Parameter storage of
        its own (torch.save keeps the sharing); nothing else can hold those fresh tensors yet,
        so they are copied into a fresh block (once)."""
        params = self.params(table)
        if self.current(table) is None and _plain(params):
            self._rehome(params)

    def _rehome(self, params: Sequence[torch.nn.Parameter]) -> None:
        first = params[0]
        block = torch.empty(len(params), *first.shape, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for g, p in enumerate(params):
                block[g].copy_(p)
                p.data = block[g]
        self.block = block


def _plain(params: Sequence[Tensor]) -> bool:
    """Plain dense tensors of one shape, dtype and device (not subclasses such as DTensor)."""
    first = params[0]
    return all(
        type(p.data) is Tensor
        and p.layout == torch.strided
        and (p.shape, p.dtype, p.device) == (first.shape, first.dtype, first.device)
        for p in params
    )


def _views(params: Sequence[Tensor], block: Tensor) -> bool:
    """Whether params[g] is block[g] for every g, by address (O(G), but in C)."""
    if len(params) != block.shape[0] or params[0].dtype != block.dtype:
        return False
    base, step = block.data_ptr(), block.stride(0) * block.element_size()
    return list(map(_data_ptr, params)) == list(range(base, base + len(params) * step, step))


def block_of(tensors: Sequence[Tensor]) -> Tensor | None:
    """A [G, *shape] view over tensors that lie back to back in one storage, else None."""
    first = tensors[0]
    needed = (first.storage_offset() + len(tensors) * first.numel()) * first.element_size()
    if not first.is_contiguous() or first.untyped_storage().nbytes() < needed:
        return None
    shape, stride = (len(tensors), *first.shape), (first.numel(), *first.stride())
    block = first.detach().as_strided(shape, stride)  # detached: never part of autograd's graph
    return block if _views_block(list(tensors), block) else None


def _views_block(weights: list[Tensor], block: Tensor) -> bool:
    """Whether weight g is exactly block[g] for every g (same storage, place, shape, dtype)."""
    if block.dtype != weights[0].dtype or block.device != weights[0].device:
        return False
    step = block.stride(0) * block.element_size()
    base = block.data_ptr()
    return all(
        w.data_ptr() == base + g * step
        and w.shape == block.shape[1:]
        and w.stride() == block.stride()[1:]
        for g, w in enumerate(weights)
    )
