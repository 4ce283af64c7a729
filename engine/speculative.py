"""Speculative decoding: propose draft tokens cheaply, verify them all in one
forward of the main model.

Verification is exact for greedy rows (a draft token is kept only if it is
the argmax the main model would have produced at that position, with the same
penalties) and distribution-preserving for sampled rows: draft token d drawn
from q is kept with probability min(1, p(d) / q(d)); on rejection the token is
drawn from the residual max(0, p - q) renormalised; if every draft is kept,
one more token is drawn from p at the next position (Leviathan et al., 2023;
Chen et al., 2023). An n-gram draft is deterministic, so q is one-hot there.
Every sampler setting is a function of the logits and the context, so verify rows
use them all, except mirostat, whose state moves with each token: the generator
does not draft for such jobs (SamplerSettings.stateful).
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
    rows[i] carries the settings and the context (generated ids + d_1..d_i) of position i.

    Every draft is accepted or rejected in one vectorised pass with k + 1
    uniforms from the row's generator (k acceptance tests, one final draw), and
    the result crosses to the host once, whatever k is."""
    settings = rows[0].settings
    if settings.is_greedy:
        targets = sample(logits, rows).tolist()
        accepted = 0
        while accepted < len(draft) and targets[accepted] == draft[accepted]:
            accepted += 1
        return [*draft[:accepted], targets[accepted]]
    probs = sampling_probs(logits, rows)
    k = len(draft)
    generator = rows[0].generator
    assert generator is not None
    uniform = torch.rand(k + 1, generator=generator, device=generator.device).to(probs.device)
    d = torch.tensor(list(draft), dtype=torch.long, device=probs.device)
    q = draft_probs if draft_probs is not None else _one_hot(d, probs.shape[1], probs.dtype)
    p_d = probs[:k].gather(1, d[:, None]).squeeze(1)
    q_d = q.gather(1, d[:, None]).squeeze(1)
    kept = uniform[:k] < torch.clamp(p_d / q_d, max=1.0)
    first_rejected = kept.to(torch.long).cumprod(0).sum()  # k when every draft is kept
    # the final token: from the residual max(0, p - q) at the first rejection, else from p after the last draft
    weights = torch.cat([torch.clamp(probs[:k] - q, min=0.0), probs[k:]])[first_rejected]
    token = _inverse_cdf(weights, uniform[k])
    accepted, last = torch.stack([first_rejected, token]).tolist()
    return [*draft[:accepted], last]


def _one_hot(tokens: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.nn.functional.one_hot(tokens, vocab).to(dtype)


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token whose CDF segment holds uniform * total mass (a 0-d tensor, no
    sync); the target stays below the total, so it lands on a positive weight."""
    cdf = weights.cumsum(0)
    total = cdf[-1:]
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp(max=weights.shape[0] - 1)[0]


def draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token from unnormalised non-negative weights (inverse CDF)."""
    uniform = torch.rand((), generator=generator, device=generator.device).to(weights.device)
    return int(_inverse_cdf(weights, uniform))
