"""Resident adapters' A and B stacked per fused linear, one slot per adapter (vLLM's
lora_a_stacked / lora_b_stacked), so a step's LoRA delta over many adapters is a few batched ops
per linear instead of a gather-matmul-scatter per adapter (engine/lora/batch.py).

A slot is filled when a step on the torch reference path first runs the adapter and freed when
the registry offloads it or the adapter is garbage collected (unregistered, its last job ended).
A fused linear's ranks are padded to the largest slotted one with zeros and a linear an adapter does not target is
all zeros in its slot: zeros add exactly nothing, so the result equals the per-adapter product.
The Triton path keeps its per-adapter kernels and never fills a slot (no second copy on a GPU)."""

from __future__ import annotations

import weakref

import torch

from engine.lora.adapter import LinearKey, LoraAdapter


class LoraSlots:
    def __init__(self) -> None:
        # A^T [slots, in, rank] and B^T [slots, rank, out]: transposed so torch.bmm reads them
        # contiguously (half the time of transposed views on the 2-core CPU)
        self.a: dict[LinearKey, torch.Tensor] = {}
        self.b: dict[LinearKey, torch.Tensor] = {}
        self._slots: dict[int, int] = {}  # id(adapter) -> slot
        self._finalizers: dict[int, weakref.finalize[[int], LoraAdapter]] = {}
        self._free: list[int] = []
        self.capacity = 0

    def slot(self, adapter: LoraAdapter) -> int:
        """The adapter's slot, filled with its weights on first use."""
        slot = self._slots.get(id(adapter))
        if slot is not None:
            return slot
        if not self._free:
            self._resize(max(4, 2 * self.capacity))
        slot = self._free.pop()
        for key, a in self.a.items():
            a[slot].zero_()
            self.b[key][slot].zero_()
        for key, (a, b) in adapter.weights.items():
            if key not in self.a:
                self.a[key] = a.new_zeros(self.capacity, a.shape[1], 0)
                self.b[key] = b.new_zeros(self.capacity, 0, b.shape[0])
            if a.shape[0] > self.a[key].shape[2]:
                self.a[key] = _padded(self.a[key], 2, a.shape[0])
                self.b[key] = _padded(self.b[key], 1, a.shape[0])
            self.a[key][slot, :, : a.shape[0]] = a.t()
            self.b[key][slot, : b.shape[1]] = b.t()
        self._slots[id(adapter)] = slot
        self._finalizers[id(adapter)] = weakref.finalize(adapter, self._free_slot, id(adapter))
        return slot

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

    def _resize(self, capacity: int) -> None:
        """Room for `capacity` slots, the old ones copied in."""
        for stacked in (self.a, self.b):
            for key, old in stacked.items():
                stacked[key] = _padded(old, 0, capacity)
        self._free.extend(range(capacity - 1, self.capacity - 1, -1))
        self.capacity = capacity

    def __len__(self) -> int:
        return len(self._slots)


def _padded(old: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """old widened to `size` along `dim` with zeros."""
    shape = list(old.shape)
    shape[dim] = size
    new = old.new_zeros(shape)
    new.narrow(dim, 0, old.shape[dim]).copy_(old)
    return new
