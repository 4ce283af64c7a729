"""Perplexity of a text through the engine's own model and paged cache.

Quantizing the KV cache or the weights trades memory for quality; the trade is
judged on real text by perplexity (exp of the mean negative log-likelihood of
each token given those before it), as exllamav2's and llama.cpp's evaluations
do. The text is fed in chunks the way the generator prefills and decodes:
every chunk writes its K/V to the cache (quantized, for a quantized cache) and
attends over the pages written before, so the figure includes exactly the
error a job would see.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.batch import ForwardBatch
from engine.cache import KVCache
from engine.model import CausalLM


@dataclass(frozen=True)
class TextScores:
    """Per position i >= 1 of a text: log p(token i | tokens before it) and the model's top choice there."""

    logprobs: torch.Tensor  # [len - 1] fp32
    predicted: torch.Tensor  # [len - 1] int64

    @property
    def perplexity(self) -> float:
        """exp(mean negative log-likelihood)."""
        return math.exp(-float(self.logprobs.mean()))

    def agreement(self, other: TextScores) -> float:
        """Share of positions where both predict the same next token (teacher-forced greedy agreement)."""
        return float((self.predicted == other.predicted).float().mean())


@torch.inference_mode()
def score_text(model: CausalLM, cache: KVCache, token_ids: Sequence[int], chunk_size: int = 32) -> TextScores:
    """Feed token_ids chunk by chunk over pages 0, 1, ... of `cache` (which must hold them all)."""
    tokens = list(token_ids)
    page_size = cache.page_size
    pages = -(-len(tokens) // page_size)
    if pages > cache.num_pages:
        raise ValueError(f"{len(tokens)} tokens need {pages} pages; the cache has {cache.num_pages}")
    device = cache.k.device
    model.bind_cache(cache)
    table = torch.arange(pages, dtype=torch.int32, device=device)[None]
    logprobs: list[torch.Tensor] = []
    predicted: list[torch.Tensor] = []
    for start in range(0, len(tokens) - 1, chunk_size):
        end = min(start + chunk_size, len(tokens) - 1)
        positions = torch.arange(start, end, device=device)
        batch = ForwardBatch(
            input_ids=torch.tensor(tokens[start:end], device=device),
            positions=positions,
            cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32, device=device),
            context_lens=torch.tensor([end], dtype=torch.int32, device=device),
            page_table=table,
            slot_mapping=positions,
            logits_indices=torch.arange(end - start, device=device),
        )
        chunk = torch.log_softmax(model(batch).float(), dim=-1)
        targets = torch.tensor(tokens[start + 1 : end + 1], device=device)
        logprobs.append(chunk.gather(1, targets[:, None]).squeeze(1))
        predicted.append(chunk.argmax(dim=-1))
    return TextScores(torch.cat(logprobs), torch.cat(predicted))

