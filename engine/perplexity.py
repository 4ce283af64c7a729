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

import torch

from engine.batch import ForwardBatch
from engine.cache import KVCache
from engine.model import CausalLM


@torch.inference_mode()
def token_logprobs(model: CausalLM, cache: KVCache, token_ids: Sequence[int], chunk_size: int = 32) -> torch.Tensor:
    """log p(token_ids[i] | token_ids[:i]) for i >= 1, [len - 1] fp32, computed chunk by chunk
    over pages 0, 1, ... of `cache` (which must hold len(token_ids) tokens)."""
    tokens = list(token_ids)
    page_size = cache.page_size
    pages = -(-len(tokens) // page_size)
    if pages > cache.num_pages:
        raise ValueError(f"{len(tokens)} tokens need {pages} pages; the cache has {cache.num_pages}")
    device = cache.k.device
    model.bind_cache(cache)
    table = torch.arange(pages, dtype=torch.int32, device=device)[None]
    out: list[torch.Tensor] = []
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
        logprobs = torch.log_softmax(model(batch).float(), dim=-1)
        targets = torch.tensor(tokens[start + 1 : end + 1], device=device)
        out.append(logprobs.gather(1, targets[:, None]).squeeze(1))
    return torch.cat(out)


def perplexity(model: CausalLM, cache: KVCache, token_ids: Sequence[int], chunk_size: int = 32) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:] given what precedes each."""
    return math.exp(-float(token_logprobs(model, cache, token_ids, chunk_size).mean()))
