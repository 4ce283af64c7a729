"""A step's adapters: the batch's tokens grouped by adapter, and the grouped LoRA product each
targeted linear adds to its output (the segmented gather-matmul of Punica / S-LoRA: gather a
group's tokens, x @ A^T then @ B^T with that adapter's matrices, scatter-add the delta).

On the torch reference path a step runs every group at once: the groups' tokens in one padded
layout against the adapters' slots of the stacked weights (engine/lora/slots.py), a few batched ops
per linear instead of four per adapter (and, when one adapter runs every row, no gather or scatter
at all). A layout whose padding would more than double the rows (a long prompt next to
single-token rows) and the Triton path (its kernels gather a group's rows themselves) take the
product per group.

Built by the batch builder only when some row of the step runs an adapter; a step of base-model
jobs carries no LoraBatch and its linears do nothing more."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

import kernels
from engine.lora.adapter import LinearKey, LoraAdapter
from engine.lora.slots import LoraSlots, SegmentWeights
from kernels.lora import Scratch, lora_add_segments_reference

#: The padded layout is used while its rows are at most this many times the adapter tokens.
MAX_PADDING = 2


@dataclass(frozen=True)
class Segments:
    """The step's adapter tokens in lora_add_segments_reference's layout: weights[(layer, linear)]
    the groups' stacked weights, gather / valid / tokens as that function takes them (all None
    when one adapter runs every row of the step: no gather, no scatter)."""

    weights: dict[LinearKey, SegmentWeights]
    gather: torch.Tensor | None
    valid: torch.Tensor | None
    tokens: torch.Tensor | None
    scratch: Scratch

    @classmethod
    def build(cls, indices: list[list[int]], slots: list[int], stacked: LoraSlots, rows: int,
              device: torch.device) -> Segments | None:
        """indices: each group's token indices; slots: each group's slot; rows: the step's tokens.
        None when padding every group to the largest would more than MAX_PADDING times the rows."""
        longest = max(len(group) for group in indices)
        total = sum(len(group) for group in indices)
        if longest * len(indices) > MAX_PADDING * total:
            return None
        weights = stacked.weights(tuple(slots))
        if len(indices) == 1 and indices[0] == list(range(rows)):
            return cls(weights, None, None, None, stacked.scratch)
        gather: list[int] = []
        valid: list[int] = []
        for position, group in enumerate(indices):
            valid.extend(range(position * longest, position * longest + len(group)))
            gather.extend(group + group[:1] * (longest - len(group)))

        def put(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

        return cls(weights, put(gather), None if len(valid) == len(gather) else put(valid),
                   put([token for group in indices for token in group]), stacked.scratch)

    def add(self, out: torch.Tensor, x: torch.Tensor, key: LinearKey) -> None:
        stacked = self.weights.get(key)
        if stacked is not None:
            lora_add_segments_reference(out, x, stacked[0], stacked[1], self.gather, self.valid, self.tokens,
                                        self.scratch)


@dataclass(frozen=True)
class LoraBatch:
    """groups: (adapter, the flattened batch's token indices that run it), one per adapter in
    the step, where the product runs per group (empty where segments run it); tokens of
    base-model rows are in no group. segments: the step's groups in the padded layout of the
    batched product, or None."""

    groups: tuple[tuple[LoraAdapter, torch.Tensor], ...]
    segments: Segments | None = None

    @classmethod
    def build(cls, rows: Iterable[tuple[LoraAdapter | None, int]], device: torch.device,
              slots: LoraSlots | None = None) -> LoraBatch | None:
        """rows: each batch row's adapter (None: the base model) and token count, in batch order;
        slots: the stacked weights the batched product reads (None: always per group)."""
        indices: dict[LoraAdapter, list[int]] = {}
        offset = 0
        for adapter, count in rows:
            if adapter is not None:
                indices.setdefault(adapter, []).extend(range(offset, offset + count))
            offset += count
        if not indices:
            return None
        if slots is not None and not kernels.triton_enabled(torch.empty(0, device=device)):
            by_slot = sorted((slots.slot(adapter), tokens) for adapter, tokens in indices.items())
            segments = Segments.build([tokens for _, tokens in by_slot], [slot for slot, _ in by_slot], slots,
                                      offset, device)
            if segments is not None:
                return cls((), segments)
        return cls(tuple((adapter, torch.tensor(tokens, dtype=torch.long).to(device, non_blocking=True))
                         for adapter, tokens in indices.items()))

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, linear: str) -> torch.Tensor:
        """out (the base linear's output for x, any weight format) plus each group's LoRA delta, in place."""
        if self.segments is not None:
            self.segments.add(out, x, (layer, linear))
            return out
        for adapter, tokens in self.groups:
            pair = adapter.weights.get((layer, linear))
            if pair is not None:
                kernels.lora_add(out, x, pair[0], pair[1], tokens)
        return out
