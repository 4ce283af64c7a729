"""Per-job runtime state the generator and scheduler work on."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.banned_strings import BannedStringGuard
from engine.constraints import ConstraintState
from engine.detokenizer import IncrementalDetokenizer
from engine.job import Job
from engine.outputs import TokenLogprob
from engine.stops import StopStringMatcher


@dataclass(eq=False)
class Sequence:
    """A job's tokens and where they stand: token_ids holds prompt + generated
    tokens, of which the first num_computed have K/V in the cache pages.
    pages[k] is the physical page of logical page k (kv_manager.HOLE once a
    sliding window released it); the first released_pages entries are holes.
    page_version moves whenever pages change, so batch builders can cache them.
    Identity, not field equality: the scheduler keeps sequences in sets and dicts."""

    job: Job
    serial: int
    token_ids: list[int]
    num_prompt_tokens: int
    stop_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher | None
    rng: torch.Generator | None
    time_enqueued: float
    seed: int = 0
    pages: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)
    registered_pages: int = 0
    released_pages: int = 0
    page_version: int = 0
    num_computed: int = 0
    cached_tokens: int = 0
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0
    skips: int = 0
    time_started: float | None = None
    time_first_token: float | None = None
    completion: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    constraint: ConstraintState | None = None
    constraint_done_at: int | None = None  # generated-token count at which the constraint completed
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output_ids entry, if the job asks
    banned_guard: BannedStringGuard | None = None
    # generated-token index -> token ids banned there (a rewind's); replaced, never mutated, since
    # the sampler may read it on the overlap thread
    banned_at: dict[int, frozenset[int]] = field(default_factory=dict)
    rewinds: int = 0
    # token healing: the prompt's last token was taken off; the first generated token must be one of
    # heal_mask ([vocab] bool, on the CPU) and the removed token's text (heal_prefix) is not emitted again
    heal_mask: torch.Tensor | None = None
    heal_prefix: str = ""
    heal_pending: int = 0  # characters of heal_prefix the released text has still to drop

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def append(self, token: int) -> None:
        self.token_ids.append(token)
        self.output_ids.append(token)

    @property
    def banned_now(self) -> frozenset[int]:
        """Token ids a rewind banned at the position of the next generated token."""
        return self.banned_at.get(self.num_generated, frozenset()) if self.banned_at else frozenset()

    def rewind(self, keep: int) -> int:
        """Drop every generated token from index keep on; how many were dropped."""
        dropped = len(self.output_ids) - keep
        if dropped > 0:
            del self.token_ids[-dropped:], self.output_ids[-dropped:]
            del self.logprobs[keep:]
        return max(dropped, 0)
