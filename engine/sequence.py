"""A job's tokens and where they stand: what the scheduler, the KV manager and the runner read.

Text state (detokenizer, stop strings, banned strings) lives in the output processor
(engine/output_processor.py), sampling state (seed, constraint, bans) in the sampler's
SamplingState (engine/sampling_state.py), so the layers below the step never see text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.job import Job

if TYPE_CHECKING:
    from engine.lora.adapter import LoraAdapter


@dataclass(eq=False)
class Sequence:
    """token_ids holds prompt + generated tokens, of which the first num_computed have K/V in the
    cache pages. pages[k] is the physical page of logical page k (kv_manager.HOLE once a sliding
    window released it); the first released_pages entries are holes. page_version moves whenever
    pages change, so batch builders can cache them. prompt_scored: the prompt's log-probabilities
    are complete (jobs asking for them). adapter: the LoRA adapter the job was admitted with (None:
    the base model), held until the job ends even if its name is unregistered. Identity, not field
    equality: the scheduler keeps sequences in sets and dicts."""

    job: Job
    serial: int
    token_ids: list[int]
    num_prompt_tokens: int
    time_enqueued: float
    pages: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)
    registered_pages: int = 0
    released_pages: int = 0
    page_version: int = 0
    num_computed: int = 0
    cached_tokens: int = 0
    skips: int = 0
    time_started: float | None = None
    time_first_token: float | None = None
    output_ids: list[int] = field(default_factory=list)
    prompt_scored: bool = False
    adapter: LoraAdapter | None = None

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def scores_prompt(self) -> bool:
        """The job asks for prompt log-probabilities not computed yet: every prompt position's
        logits are needed, so none may come from the prefix cache."""
        return self.job.prompt_logprobs is not None and not self.prompt_scored

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def append(self, token: int) -> None:
        self.token_ids.append(token)
        self.output_ids.append(token)

    def rewind(self, keep: int) -> int:
        """Drop every generated token from index keep on; how many were dropped."""
        dropped = len(self.output_ids) - keep
        if dropped > 0:
            del self.token_ids[-dropped:], self.output_ids[-dropped:]
        return max(dropped, 0)
