"""Resident adapters' A and B stacked per fused linear, one slot per adapter (vLLM's
lora_a_stacked / lora_b_stacked), so a step's LoRA delta over many adapters is a few batched ops
per linear instead of a gather-matmul-scatter per adapter (engine/lora/batch.py).

A fused linear keeps one A^T for all its targeted slices (the shrink reads the step's x once for
q, k and v, or gate and up) and one B^T per output slice, so the expand multiplies no zero block
(a placed B of gate_up is half zeros, of qkv two thirds): with many adapters a step reads every
adapter's weights for a few rows each, and the bytes read are what the product costs.

A slot is filled when a step on the torch reference path first runs the adapter and freed when
the registry offloads it or the adapter is garbage collected (unregistered, its last job ended).
A slice's rank is padded to the largest slotted one with zeros, and a slice or linear an adapter
does not target is all zeros in its slot: zeros add exactly nothing, so the result equals the
per-adapter product. The Triton path keeps its per-adapter kernels and never fills a slot (no
second copy on a GPU)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from engine.lora.adapter import LinearKey, LoraAdapter, LoraSlice
from kernels.lora import Scratch

#: One linear's stacked weights for a step's slots, in order: A^T, and per output slice (its first
#: out column, its first column of A^T, B^T), as kernels.lora.lora_add_segments_reference takes them.
SegmentWeights = tuple[torch.Tensor, tuple[tuple[int, int, torch.Tensor], ...]]


@dataclass
class StackedSlice:
    """One output slice of a stacked linear: its first output column, its first column in the
    linear's A^T, and B^T [slots, rank, width] (transposed so torch.bmm reads it contiguously)."""

    start: int
    column: int
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.b.shape[1]


@dataclass
class StackedLinear:
    """A fused linear's slots: A^T [slots, in, columns], each targeted slice's rank columns at its
    StackedSlice.column; slices by slice index, only those some slotted adapter targets."""

    a: torch.Tensor
    slices: dict[int, StackedSlice]


class LoraSlots:
    def __init__(self) -> None:
        self.linears: dict[LinearKey, StackedLinear] = {}
        self._slots: dict[int, int] = {}  # id(adapter) -> slot
        self._finalizers: dict[int, weakref.finalize[[int], LoraAdapter]] = {}
        self._free: list[int] = []
        self.capacity = 0
        self.scratch = Scratch()  # the batched product's delta, reused across linears and steps
        self._chosen: tuple[tuple[int, ...], dict[LinearKey, SegmentWeights]] | None = None

    def slot(self, adapter: LoraAdapter) -> int:
        """The adapter's slot, filled with its weights on first use."""
        slot = self._slots.get(id(adapter))
        if slot is not None:
            return slot
        if not self._free:
            self._resize(max(4, 2 * self.capacity))
        slot = self._free.pop()
        self._chosen = None
        for linear in self.linears.values():
            linear.a[slot].zero_()
            for part in linear.slices.values():
                part.b[slot].zero_()
        for key, (a, b) in adapter.weights.items():
            linear = self._fit(key, adapter.slices[key], a)
            row = 0
            for target in adapter.slices[key]:
                part = linear.slices[target.index]
                linear.a[slot, :, part.column : part.column + target.rank] = a[row : row + target.rank].t()
                part.b[slot, : target.rank] = b[target.start : target.start + target.width, row : row + target.rank].t()
                row += target.rank
        self._slots[id(adapter)] = slot
        self._finalizers[id(adapter)] = weakref.finalize(adapter, self._free_slot, id(adapter))
        return slot

    def weights(self, slots: tuple[int, ...]) -> dict[LinearKey, SegmentWeights]:
        """Every stacked linear's weights of these slots, in this order: views when they are the
        first slots in order (a step of the adapters slotted first), else copies. The last
        selection is kept until a slot is filled or freed, as consecutive steps usually run the
        same adapters."""
        if self._chosen is not None and self._chosen[0] == slots:
            return self._chosen[1]
        if slots == tuple(range(len(slots))):
            def pick(stacked: torch.Tensor) -> torch.Tensor:
                return stacked.narrow(0, 0, len(slots))
        else:
            chosen = torch.tensor(slots, dtype=torch.long).to(next(iter(self.linears.values())).a.device)

            def pick(stacked: torch.Tensor) -> torch.Tensor:
                return stacked.index_select(0, chosen)
        weights = {key: (pick(linear.a), tuple((part.start, part.column, pick(part.b))
                                               for part in linear.slices.values()))
                   for key, linear in self.linears.items()}
        self._chosen = (slots, weights)
        return weights

    def _fit(self, key: LinearKey, targets: tuple[LoraSlice, ...], a: torch.Tensor) -> StackedLinear:
        """The linear's stacked buffers, widened (zeros, slots kept) to hold every slice in
        `targets` at its rank; slices stay in slice order along A^T's columns."""
        linear = self.linears.get(key)
        if linear is None:
            linear = self.linears[key] = StackedLinear(a.new_zeros(self.capacity, a.shape[1], 0), {})
        ranks = {index: part.rank for index, part in linear.slices.items()}
        widths = {target.index: target.width for target in targets}
        starts = {target.index: target.start for target in targets}
        for target in targets:
            ranks[target.index] = max(ranks.get(target.index, 0), target.rank)
        if all(index in linear.slices and linear.slices[index].rank == rank for index, rank in ranks.items()):
            return linear
        new_a = a.new_zeros(self.capacity, a.shape[1], sum(ranks.values()))
        slices: dict[int, StackedSlice] = {}
        column = 0
        for index in sorted(ranks):
            old = linear.slices.get(index)
            if old is None:
                b = a.new_zeros(self.capacity, ranks[index], widths[index])
                slices[index] = StackedSlice(starts[index], column, b)
            else:
                new_a[:, :, column : column + old.rank] = linear.a[:, :, old.column : old.column + old.rank]
                slices[index] = StackedSlice(old.start, column, _padded(old.b, 1, ranks[index]))
            column += ranks[index]
        linear = self.linears[key] = StackedLinear(new_a, slices)
        return linear

    def release(self, adapter: LoraAdapter) -> None:
        """Free the adapter's slot, if it has one (the registry moved it to host memory)."""
        finalizer = self._finalizers.get(id(adapter))
        if finalizer is not None:
            finalizer.detach()
        self._free_slot(id(adapter))

    def _free_slot(self, key: int) -> None:
        self._finalizers.pop(key, None)
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot)
            self._chosen = None  # may hold a copy of the freed slot's weights

    def _resize(self, capacity: int) -> None:
        """Room for `capacity` slots, the old ones copied in."""
        for linear in self.linears.values():
            linear.a = _padded(linear.a, 0, capacity)
            for part in linear.slices.values():
                part.b = _padded(part.b, 0, capacity)
        self._free.extend(range(capacity - 1, self.capacity - 1, -1))
        self.capacity = capacity

    def __len__(self) -> int:
        return len(self._slots)


def _padded(old: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """old widened to `size` along `dim` with zeros."""
    if old.shape[dim] == size:
        return old
    shape = list(old.shape)
    shape[dim] = size
    new = old.new_zeros(shape)
    new.narrow(dim, 0, old.shape[dim]).copy_(old)
    return new
