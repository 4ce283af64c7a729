"""Chunk coalescing (issue 30): a sample's chunks merged and published at most every so many
milliseconds or tokens, instead of one chunk event (a PUBLISH and an XADD) per engine step.

At GPU token rates one event per token per job makes Redis and the readers the bottleneck; a
merged chunk carries what the steps since the last one produced, in order (texts, token ids
and logprobs concatenated), so a reader's text is the same. The pending pieces live on the
engine loop's side (worker/events.py keeps one PendingChunk per sample), never in the engine: a
worker that dies with some pending loses nothing the redelivered attempt does not regenerate,
just as a step whose pipeline had not gone out yet was lost before coalescing."""

from __future__ import annotations

from dataclasses import dataclass, field

from producer.protocol import StreamOptions, TokenLogprob

PromptScores = tuple[list[int], list[TokenLogprob | None]]
"""The prompt's token ids and log-probabilities, on the one chunk that carries them."""


@dataclass(frozen=True)
class Coalescing:
    """When a sample's pending chunk goes out: once `interval_s` has passed since its last one,
    or once `tokens` tokens wait (each trigger off at 0; both off: every step, as without)."""

    interval_s: float = 0.0
    tokens: int = 0

    @classmethod
    def of(cls, interval_ms: int, tokens: int) -> Coalescing:
        return cls(interval_ms / 1000, tokens)

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0 or self.tokens > 0

    def for_request(self, options: StreamOptions) -> Coalescing:
        """A request's own values where it gives them; this one's (the worker's default) elsewhere."""
        interval_s = self.interval_s if options.coalesce_ms is None else options.coalesce_ms / 1000
        tokens = self.tokens if options.coalesce_tokens is None else options.coalesce_tokens
        return Coalescing(interval_s, tokens)

    def due(self, pending: PendingChunk, last_sent: float, now: float) -> bool:
        return ((self.tokens > 0 and pending.tokens >= self.tokens)
                or (self.interval_s > 0 and now - last_sent >= self.interval_s))


@dataclass(slots=True)
class PendingChunk:
    """What one sample produced since its last published chunk, merged in order."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None
    tokens: int = 0
    prompt: PromptScores | None = None

    def add(self, text: str, token_ids: list[int] | None, logprobs: list[TokenLogprob] | None, tokens: int,
            prompt: PromptScores | None) -> None:
        """One step's piece; `tokens` counts the step's tokens whether or not their ids are sent."""
        if text:
            self.texts.append(text)
        if token_ids:  # copied on the first piece: the engine's lists are not ours to extend
            if self.token_ids is None:
                self.token_ids = list(token_ids)
            else:
                self.token_ids.extend(token_ids)
        if logprobs:
            if self.logprobs is None:
                self.logprobs = list(logprobs)
            else:
                self.logprobs.extend(logprobs)
        if prompt is not None:
            self.prompt = prompt
        self.tokens += tokens

    @property
    def empty(self) -> bool:
        """Nothing to send yet (only tokens whose text is held back): no chunk is made of it."""
        return not (self.texts or self.token_ids or self.logprobs or self.prompt)

    @property
    def text(self) -> str:
        return "".join(self.texts)
