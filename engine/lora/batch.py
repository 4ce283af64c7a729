"""A step's adapters: the batch's tokens grouped by adapter, and the grouped LoRA product each
targeted linear adds to its output (the segmented gather-matmul of Punica / S-LoRA: gather a
group's tokens, x @ A^T then @ B^T with that adapter's matrices, scatter-add the delta).

Built by the batch builder only when some row of the step runs an adapter; a step of base-model
jobs carries no LoraBatch and its linears do nothing more."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

import kernels
from engine.lora.adapter import LoraAdapter


@dataclass(frozen=True)
class LoraBatch:
    """groups: (adapter, the flattened batch's token indices that run it), one per adapter in
    the step; tokens of base-model rows are in no group."""

    groups: tuple[tuple[LoraAdapter, torch.Tensor], ...]

    @classmethod
    def build(cls, rows: Iterable[tuple[LoraAdapter | None, int]], device: torch.device) -> LoraBatch | None:
        """rows: each batch row's adapter (None: the base model) and token count, in batch order."""
        indices: dict[LoraAdapter, list[int]] = {}
        offset = 0
        for adapter, count in rows:
            if adapter is not None:
                indices.setdefault(adapter, []).extend(range(offset, offset + count))
            offset += count
        if not indices:
            return None
        return cls(tuple((adapter, torch.tensor(tokens, dtype=torch.long).to(device, non_blocking=True))
                         for adapter, tokens in indices.items()))

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, linear: str) -> torch.Tensor:
        """out (the base linear's output for x, any weight format) plus each group's LoRA delta, in place."""
        for adapter, tokens in self.groups:
            pair = adapter.weights.get((layer, linear))
            if pair is not None:
                kernels.lora_add(out, x, pair[0], pair[1], tokens)
        return out
