"""Speculative decoding: propose draft tokens cheaply, verify them all in one
forward of the main model.

Verification is exact for greedy rows (a draft token is kept only if it is
the argmax the main model would have produced at that position, with the same
penalties) and distribution-preserving for sampled rows: draft token d drawn
from q is kept with probability min(1, p(d) / q(d)); on rejection the token is
drawn from the residual max(0, p - q) renormalised; if every draft is kept,
one more token is drawn from p at the next position (Leviathan et al., 2023;
Chen et al., 2023). An n-gram draft is deterministic, so q is one-hot there.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling import SamplingRow, sample, sampling_probs
from engine.sequence import Sequence as EngineSequence

NGRAM_SEARCH_WINDOW = 2048


def ngram_draft(tokens: Sequence[int], max_ngram: int, num_draft: int) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the longest
    suffix (up to max_ngram tokens) of the context, as prompt-lookup decoding
    does. The copy runs on into its own output, so a loop of period p still
    yields num_draft tokens rather than p."""
    if num_draft <= 0:
        return []
    context = list(tokens[-NGRAM_SEARCH_WINDOW:])
    length = len(context)
    for n in range(min(max_ngram, length - 1), 0, -1):
        suffix = context[-n:]
        for start in range(length - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                extended = context + []
                for j in range(num_draft):
                    extended.append(extended[start + n + j])
                return extended[length:]
    return []


@dataclass(frozen=True)
class NgramDrafter:
    """Drafts from the sequence's own context (no second model)."""

    max_ngram: int = 4
    num_draft_tokens: int = 4
    vocab_size: int | None = None

    def __call__(self, sequence: EngineSequence) -> list[int]:
        draft = ngram_draft(sequence.token_ids, self.max_ngram, self.num_draft_tokens)
        if self.vocab_size is not None:
            # the model never emits reserved (embedding) ids: a draft through one is cut there
            draft = list(itertools.takewhile(lambda t: t < self.vocab_size, draft))
        return draft


def verify(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    draft: Sequence[int],
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """Main-model logits [k + 1, V] at the positions of (last token, d_1..d_k)
    -> the tokens to emit: the accepted drafts plus one token from the main model.
    rows[i] carries the settings and the context (generated ids + d_1..d_i) of position i."""
    settings = rows[0].settings
    if settings.is_greedy:
        targets = sample(logits, rows).tolist()
        accepted = 0
        while accepted < len(draft) and targets[accepted] == draft[accepted]:
            accepted += 1
        return [*draft[:accepted], targets[accepted]]
    probs = sampling_probs(logits, rows)
    generator = rows[0].generator
    for i, token in enumerate(draft):
        p = probs[i]
        q = draft_probs[i] if draft_probs is not None else _one_hot(token, p)
        keep = torch.clamp(p[token] / q[token], max=1.0)
        if torch.rand((), generator=generator, device=generator.device).to(p.device) < keep:
            continue
        residual = torch.clamp(p - q, min=0.0)
        return [*draft[:i], draw(residual, generator)]
    return [*draft, draw(probs[len(draft)], generator)]


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q


def draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token from unnormalised non-negative weights (inverse CDF)."""
    cdf = weights.cumsum(0)
    target = torch.rand((), generator=generator, device=generator.device).to(cdf.device) * cdf[-1]
    return int(torch.searchsorted(cdf, target.unsqueeze(0), right=True).clamp(max=weights.shape[0] - 1))
