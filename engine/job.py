"""A generation request: its inputs, settings and stop conditions.

Runtime state (pages, generated tokens, detokenizer) lives in the
generator's Sequence for the job; a Job itself is just the request plus the
serial the generator gave it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from engine.constraint_spec import Constraint
from engine.embeddings import Embedding, Span, bidirectional_spans
from engine.sampler_settings import SamplerSettings

MAX_TOP_LOGPROBS = 20


class Job:
    """One request. `stop_conditions=None` stops on the model's EOS ids
    (tokenizer_config + generation_config); pass `[]` to never stop early.
    The default sampler is greedy; pass `gen_settings` to sample.
    `banned_strings` never appear in the output: the generator rewinds and
    bans the token that began one (engine/banned_strings.py).
    `token_healing` (exllamav2's) takes the prompt's last token off and
    regenerates it among the tokens that begin with its text, so a prompt cut
    mid-word ("print('Hel") continues as the model would have tokenized it;
    only the text the regenerated token adds is emitted. Unlike exllamav2 the
    regenerated token counts as a generated token (new_tokens, max_new_tokens).
    `prompt_logprobs=k` (vLLM's) scores every prompt token given the tokens before it, with its
    k best alternatives, from the raw model distribution (log_softmax of the logits: no bias,
    penalty or temperature); the prefill computes them, so such a prompt is never read from the
    prefix cache (engine/prompt_logprobs.py).
    `adapter` names a LoRA adapter registered on the generator (generator.adapters; None: the base
    model); enqueue refuses a name not registered then (docs/engine.md, Adapters).
    `tenant` names who the job counts against (None: the default tenant), for fair admission
    between tenants (issue 29)."""

    def __init__(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        min_new_tokens: int = 0,
        stop_conditions: Iterable[int | str] | str | int | None = None,
        gen_settings: SamplerSettings | None = None,
        identifier: Any = None,
        seed: int | None = None,
        decode_special_tokens: bool = False,
        embeddings: Sequence[Embedding] = (),
        constraint: Constraint | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        prompt_logprobs: int | None = None,
        priority: int = 0,
        max_skips: int | None = None,
        banned_strings: Iterable[str] | str = (),
        token_healing: bool = False,
        adapter: str | None = None,
        tenant: str | None = None,
    ) -> None:
        self.input_ids = _as_token_list(input_ids)
        if not self.input_ids:
            raise ValueError("input_ids is empty: a job needs at least one prompt token")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if not isinstance(min_new_tokens, int) or not 0 <= min_new_tokens <= max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be an integer in [0, max_new_tokens={max_new_tokens}], got {min_new_tokens!r}"
            )
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.stop_token_ids: frozenset[int] | None = None
        self.stop_strings: tuple[str, ...] = ()
        if stop_conditions is not None:
            self.stop_token_ids, self.stop_strings = _split_stop_conditions(stop_conditions)
        self.gen_settings = gen_settings or SamplerSettings.greedy()
        self.identifier = identifier
        if seed is not None and (not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
        self.seed = seed
        self.decode_special_tokens = decode_special_tokens
        self.embeddings = tuple(embeddings)
        self.embedding_rows: dict[int, tuple[Embedding, int]] = {
            token: (embedding, row) for embedding in self.embeddings for row, token in enumerate(embedding.token_ids)
        }
        missing = [e for e in self.embeddings if e.first_id not in self.input_ids]
        if missing:
            raise ValueError(
                f"input_ids lacks the reserved ids of {len(missing)} embedding(s): place embedding.token_ids")
        # prompt positions that attend both ways in prefill (engine/embeddings.py)
        self.bidirectional_spans: tuple[Span, ...] = bidirectional_spans(self.input_ids, self.embeddings)
        if constraint is not None and not isinstance(constraint, Constraint):
            raise ValueError(f"constraint must be an engine.Constraint, got {type(constraint).__name__}")
        self.constraint = constraint
        if not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}")
        # top_logprobs implies logprobs, as in OpenAI's API
        self.logprobs = bool(logprobs) or top_logprobs > 0
        self.top_logprobs = top_logprobs
        if prompt_logprobs is not None and (not isinstance(prompt_logprobs, int) or isinstance(prompt_logprobs, bool)
                                            or not 0 <= prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {prompt_logprobs!r}")
        if prompt_logprobs is not None and self.embeddings:
            raise ValueError("prompt_logprobs: not supported with embeddings (their positions hold no token to score)")
        self.prompt_logprobs = prompt_logprobs
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer (lower is admitted first), got {priority!r}")
        self.priority = priority
        if max_skips is not None and (not isinstance(max_skips, int) or max_skips < 0):
            raise ValueError(f"max_skips must be an integer >= 0 or None (the generator's), got {max_skips!r}")
        self.max_skips = max_skips
        self.banned_strings = _banned_strings(banned_strings)
        self.token_healing = bool(token_healing)
        if adapter is not None and (not isinstance(adapter, str) or not adapter):
            raise ValueError(f"adapter must be None or a non-empty adapter name, got {adapter!r}")
        self.adapter = adapter
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ValueError(f"tenant must be None or a non-empty tenant name, got {tenant!r}")
        self.tenant = tenant
        self.serial: int | None = None

    def samples(self, n: int) -> list[Job]:
        """n parallel samples of this job, as vLLM's n makes child requests: the same prompt and
        settings, seeds seed, seed + 1, ... (or each its own random seed when seed is None),
        identifiers (identifier, i). Enqueued together (generator.enqueue(list)) they are admitted
        in one step and share the prompt's pages, so the prompt is computed once. Only sample 0
        keeps prompt_logprobs (one prompt, scored once); the others read its pages."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        children = []
        for i in range(n):
            child = copy.copy(self)
            child.seed = None if self.seed is None else (self.seed + i) % 2**63
            child.identifier = (self.identifier, i)
            child.serial = None
            if i:
                child.prompt_logprobs = None
            children.append(child)
        return children

    def __repr__(self) -> str:
        return (
            f"Job(serial={self.serial}, identifier={self.identifier!r}, prompt_tokens={len(self.input_ids)}, "
            f"max_new_tokens={self.max_new_tokens})"
        )


def _as_token_list(input_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids tensor must be 1-D or (1, n), got shape {tuple(input_ids.shape)}")
        return [int(t) for t in input_ids.tolist()]
    tokens = list(input_ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ValueError("input_ids must be a list of integers")
    return tokens


def _split_stop_conditions(conditions: Iterable[int | str] | str | int) -> tuple[frozenset[int], tuple[str, ...]]:
    """A bare string is one stop string and a bare int one stop token (iterating "###" would
    otherwise stop on every "#")."""
    if isinstance(conditions, str | int):
        conditions = [conditions]
    token_ids: set[int] = set()
    strings: list[str] = []
    for condition in conditions:
        if isinstance(condition, str):
            if not condition:
                raise ValueError("stop_conditions contains an empty string")
            strings.append(condition)
        elif isinstance(condition, int) and not isinstance(condition, bool):
            token_ids.add(condition)
        else:
            raise ValueError(f"stop_conditions entries must be token ids (int) or strings, got {condition!r}")
    return frozenset(token_ids), tuple(strings)


def _banned_strings(banned: Iterable[str] | str) -> tuple[str, ...]:
    """A bare string is one banned string, as with stop_conditions."""
    strings = [banned] if isinstance(banned, str) else list(banned)
    for index, text in enumerate(strings):
        if not isinstance(text, str) or not text:
            raise ValueError(f"banned_strings[{index}] must be a non-empty string, got {text!r}")
    return tuple(dict.fromkeys(strings))
