"""Step scheduling: which sequences run in the next forward, with how many tokens.

Per step, within a token budget (max_chunk_size):
1. running sequences that decode (one uncomputed token) go first, oldest first;
2. running sequences still in prefill get the next chunk of their prompt;
3. waiting sequences are admitted (up to max_batch_size running) when the
   free pages, less those promised to unfinished prefills, cover their whole
   remaining prompt plus the first token they will generate; their first
   chunk runs in this same step.

With prefix caching, a sequence admitted from scratch first takes the
longest run of its full pages that the pool already holds (shared if in use,
revived if parked), never including its last token, and computes only the
rest. Every page a step fills completely is named (hashed) when the step is
scheduled: its content is written in this step's forward before any
attention reads it (each layer writes all K/V before attending), so two
identical prompts admitted in the same step already share pages.

A sequence that needs a page when none is free makes the scheduler preempt
the newest running sequence (vLLM's recompute policy): its pages are freed
and it goes back to the head of the queue with its generated tokens kept, to
be prefilled again later. Admission may pass over a waiting sequence that
does not fit yet, but at most max_skips times; after that nothing overtakes
it, so no job starves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.cache import ROOT_HASH, PagePool, page_hash
from engine.sequence import Sequence


@dataclass
class ScheduledSequence:
    """num_tokens this step; a decoding sequence may also have room (pages and
    budget) for up to draft_room draft tokens, which the generator fills in."""

    sequence: Sequence
    num_tokens: int
    draft_room: int = 0

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last known token, so its
        logits give the next one (and, past it, those of any draft tokens)."""
        sequence = self.sequence
        return sequence.num_computed + self.num_tokens - len(sequence.draft_ids) == len(sequence.token_ids)


@dataclass
class Schedule:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    started: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        max_batch_size: int,
        max_chunk_size: int,
        max_skips: int = 16,
        prefix_caching: bool = True,
        num_draft_tokens: int = 0,
        max_speculative_batch: int = 0,
    ) -> None:
        self.pool = pool
        self.prefix_caching = prefix_caching
        self.num_draft_tokens = num_draft_tokens
        self.max_speculative_batch = max_speculative_batch
        self.page_size = page_size
        self.max_batch_size = max_batch_size
        self.max_chunk_size = max_chunk_size
        self.max_skips = max_skips
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    def remove(self, sequence: Sequence) -> None:
        """Drop a finished or cancelled sequence and free its pages now."""
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        self._free_pages(sequence)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def schedule(self) -> Schedule:
        schedule = Schedule()
        budget = self.max_chunk_size
        scheduled: set[int] = set()

        decoding = [s for s in self.running if s.num_uncomputed == 1]
        # Speculation pays while decoding is memory-bound; a large batch is compute-bound already.
        drafts = self.num_draft_tokens if len(decoding) <= self.max_speculative_batch else 0
        for sequence in decoding:
            if budget == 0:
                break
            if sequence.serial in scheduled or sequence not in self.running:
                continue
            room = max(0, min(drafts, budget - 1, sequence.job.max_new_tokens - sequence.num_generated - 1))
            if self._grow(sequence, len(sequence.token_ids) + room, scheduled, schedule):
                self._schedule(sequence, 1 + room, schedule, draft_room=room)
                scheduled.add(sequence.serial)
                budget -= 1 + room

        for sequence in [s for s in self.running if s.num_uncomputed > 1]:
            if budget == 0:
                break
            if sequence.serial in scheduled or sequence not in self.running:
                continue
            chunk = min(sequence.num_uncomputed, budget)
            if self._grow(sequence, sequence.num_computed + chunk, scheduled, schedule):
                self._schedule(sequence, chunk, schedule)
                scheduled.add(sequence.serial)
                budget -= chunk

        budget = self._admit(budget, schedule)
        return schedule

    def _admit(self, budget: int, schedule: Schedule) -> int:
        promised = sum(
            self.pages_for(len(s.token_ids)) - len(s.pages) for s in self.running if s.num_uncomputed > 1
        )
        passed_over: list[Sequence] = []
        for sequence in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_batch_size:
                break
            if any(s.skips >= self.max_skips for s in passed_over):
                break
            cached = self._cached_prefix(sequence)
            revived = sum(1 for page in cached if self.pool.is_parked(page))
            needed = self.pages_for(len(sequence.token_ids) + 1) - len(cached) + revived
            if self.pool.num_free - promised < needed:
                passed_over.append(sequence)
                continue
            for earlier in passed_over:
                earlier.skips += 1
            self.pool.retain(cached)
            sequence.pages = cached
            sequence.registered_pages = len(cached)
            sequence.num_computed = len(cached) * self.page_size
            if sequence.time_started is None:
                sequence.cached_tokens = sequence.num_computed
                schedule.started.append(sequence)
            chunk = min(sequence.num_uncomputed, budget)
            self.waiting.remove(sequence)
            self.running.append(sequence)
            sequence.pages.extend(self.pool.allocate(self.pages_for(sequence.num_computed + chunk) - len(cached)))
            promised += self.pages_for(len(sequence.token_ids)) - len(sequence.pages)
            self._schedule(sequence, chunk, schedule)
            budget -= chunk
        return budget

    def _cached_prefix(self, sequence: Sequence) -> list[int]:
        """The pages already holding this sequence's leading full pages; the
        page with its last token is never taken (its logits are needed)."""
        if not self.prefix_caching:
            return []
        usable = (len(sequence.token_ids) - 1) // self.page_size
        self._hash_pages(sequence, usable)
        pages: list[int] = []
        for digest in sequence.page_hashes[:usable]:
            page = self.pool.lookup(digest)
            if page is None:
                break
            pages.append(page)
        return pages

    def _hash_pages(self, sequence: Sequence, count: int) -> None:
        """Extend the sequence's chain of full-page hashes to `count` pages."""
        size = self.page_size
        hashes = sequence.page_hashes
        tokens = sequence.token_ids
        while len(hashes) < count:
            k = len(hashes)
            hashes.append(page_hash(hashes[-1] if hashes else ROOT_HASH, tokens[k * size : (k + 1) * size]))

    def _schedule(self, sequence: Sequence, num_tokens: int, schedule: Schedule, draft_room: int = 0) -> None:
        """Add the sequence's next num_tokens to this step and name the pages its
        known tokens complete (never pages that only draft tokens reach)."""
        schedule.scheduled.append(ScheduledSequence(sequence, num_tokens, draft_room))
        if self.prefix_caching:
            known = min(sequence.num_computed + num_tokens, len(sequence.token_ids))
            full = known // self.page_size
            self._hash_pages(sequence, full)
            for k in range(sequence.registered_pages, full):
                self.pool.register(sequence.pages[k], sequence.page_hashes[k])
            sequence.registered_pages = max(sequence.registered_pages, full)

    def _grow(self, sequence: Sequence, num_tokens: int, scheduled: set[int], schedule: Schedule) -> bool:
        """Give the sequence pages for num_tokens tokens, preempting the newest
        unscheduled running sequences as needed. False if it was itself preempted."""
        needed = self.pages_for(num_tokens) - len(sequence.pages)
        while needed > self.pool.num_free:
            victim = next((s for s in reversed(self.running) if s.serial not in scheduled), None)
            if victim is None:
                return False
            self._preempt(victim, schedule)
            if victim is sequence:
                return False
        if needed > 0:
            sequence.pages.extend(self.pool.allocate(needed))
        return True

    def _preempt(self, sequence: Sequence, schedule: Schedule) -> None:
        self.running.remove(sequence)
        self._free_pages(sequence)
        sequence.num_computed = 0
        self.waiting.appendleft(sequence)
        schedule.preempted.append(sequence)
        self.num_preemptions += 1

    def trim_pages(self, sequence: Sequence, num_tokens: int) -> None:
        """Give back pages past num_tokens (those only rejected draft tokens used)."""
        keep = self.pages_for(num_tokens)
        if len(sequence.pages) > keep:
            self.pool.release(sequence.pages[keep:])
            del sequence.pages[keep:]

    def _free_pages(self, sequence: Sequence) -> None:
        self.pool.release(sequence.pages)
        sequence.pages = []
        sequence.registered_pages = 0
