"""Typed results of Generator.iterate().

A slotted dataclass per result instead of a 16-key dict: the worker and
other callers read attributes, the engine builds one object per job and
step without hashing keys. The exllamav2 dict shape stays available two
ways: item access (result["text"], result.get("eos_string")) reads the
same fields, and as_dict() returns the plain dict with exactly the keys the
dict-based API had (the final-result keys only on eos, eos_token_id or
eos_string only when that was the trigger). Stage and FinishReason are
StrEnums, so comparisons with the old strings and JSON encoding still work.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from engine.job import Job


class Stage(StrEnum):
    STARTED = "started"
    PREFILL = "prefill"  # a prompt chunk computed, more to come: curr_progress / max_progress tokens
    STREAMING = "streaming"
    EOS = "eos"


class FinishReason(StrEnum):
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    MAX_NEW_TOKENS = "max_new_tokens"
    CANCELLED = "cancelled"
    CONSTRAINT_COMPLETE = "constraint_complete"  # the job's constraint admits nothing more
    ERROR = "error"  # this job failed inside a step (its error says why); the others went on


_ALWAYS = ("job", "serial", "identifier", "stage", "eos", "text", "token_ids")
EXLLAMAV2_NAMES = {
    "eos_triggering_token_id": "eos_token_id",
    "eos_triggering_token_str": "eos_token_str",
    "eos_triggering_string": "eos_string",
}
"""exllamav2's result keys for the fields genq names shorter; item access takes either."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability, and the most likely alternatives at
    its position (token id, log-probability; best first; tokens the job could
    not take, such as those a constraint rules out, are left out), from the distribution
    the job samples from: the logits after its biases, bans, penalties and
    constraint, divided by its temperature (1 for greedy jobs), before top-k,
    top-p and min-p truncation."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class EngineOutput:
    """One job's result of one step. The fields after token_ids are set on
    the final (eos) result only."""

    job: Job
    serial: int
    identifier: Any
    stage: Stage
    eos: bool
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, for jobs that ask (Job(logprobs=...))
    # Job(prompt_logprobs=k): one per prompt token (job.input_ids), the first None, from the raw model
    # distribution (engine/prompt_logprobs.py); on the job's first result after its prefill, and its final one
    prompt_logprobs: list[TokenLogprob | None] | None = None
    curr_progress: int | None = None  # prefill stage: prompt tokens computed (or cached) so far
    max_progress: int | None = None  # prefill stage: prompt tokens in all
    eos_reason: FinishReason | None = None
    eos_token_id: int | None = None
    eos_token_str: str | None = None  # the stop token's text
    eos_string: str | None = None
    error: str | None = None  # eos_reason error only
    full_completion: str | None = None
    completion_ids: list[int] | None = None
    completion_logprobs: list[TokenLogprob] | None = None
    new_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    accepted_draft_tokens: int | None = None
    rejected_draft_tokens: int | None = None
    time_enqueued: float | None = None
    time_prefill: float | None = None
    time_generate: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The exllamav2-style dict this result used to be."""
        return {name: getattr(self, name) for name in self.keys()}

    def keys(self) -> list[str]:
        if not self.eos:
            return [*_ALWAYS, *(name for name in _STEP_OPTIONAL if getattr(self, name) is not None)]
        return [name for name in _ALL if name not in _OPTIONAL or getattr(self, name) is not None]

    def __contains__(self, key: object) -> bool:
        key = EXLLAMAV2_NAMES.get(key, key)  # type: ignore[call-overload]
        if key in _ALWAYS:
            return True
        if key in _STEP_OPTIONAL:
            return getattr(self, key) is not None
        if not self.eos or key not in _ALL:
            return False
        return key not in _OPTIONAL or getattr(self, key) is not None

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        return getattr(self, EXLLAMAV2_NAMES.get(key, key))

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, EXLLAMAV2_NAMES.get(key, key)) if key in self else default


_ALL = tuple(f.name for f in fields(EngineOutput))
_STEP_OPTIONAL = ("logprobs", "prompt_logprobs", "curr_progress", "max_progress")
"""Keys of any result, present only when set."""
_OPTIONAL = frozenset({"eos_token_id", "eos_token_str", "eos_string", "error", "completion_logprobs",
                       *_STEP_OPTIONAL})
"""Keys present only when set: the stop trigger that applied, logprobs for jobs that asked."""
