"""The flattened, variable-length batch one model forward runs over."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lora.batch import LoraBatch


@dataclass
class ForwardBatch:
    """Tokens of many sequences in one tensor, plus where each one's K/V lives.

    input_ids, positions, slot_mapping: [T], one entry per token this step.
    cu_seqlens_q: [B + 1] int32 offsets of each sequence's tokens.
    context_lens: [B] int32 sequence lengths including this step's tokens.
    page_table: [B, max_pages] int32 physical pages per sequence.
    logits_indices: [N] rows of T whose next-token logits are wanted.
    embeddings: optional (rows [M], vectors [M, hidden]) that replace the
    token embeddings of those rows (a job's Embedding objects).
    lora: the step's tokens grouped by LoRA adapter, None when every row runs the base model.
    bidirectional: per sequence, the [start, end) position runs whose
    positions attend to each other both ways (Gemma 3's images in prefill:
    engine/embeddings.py); None when no sequence of the step has one.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    embeddings: tuple[torch.Tensor, torch.Tensor] | None = None
    lora: LoraBatch | None = None
    bidirectional: tuple[tuple[tuple[int, int], ...], ...] | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
