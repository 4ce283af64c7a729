"""Step scheduling policy: which sequences run in the next forward, with how
many tokens. Pages, hashes and prefix lookup belong to the KV manager; the
scheduler only decides, and learns what happened through update_from_output.

Per step, within a token budget (max_chunk_size):
1. running sequences that decode (one uncomputed token) go first, oldest first;
   while few decode, each also gets room (pages and budget) for draft tokens;
2. running sequences still in prefill get the next chunk of their prompt;
3. waiting sequences are admitted (up to max_batch_size running) when the
   free pages, less those promised to unfinished prefills, cover their whole
   remaining prompt plus the first token they will generate; their first
   chunk runs in this same step.

A prefill chunk never splits a bidirectional span (Gemma 3's images, whose
positions attend to each other both ways: engine/embeddings.py): a chunk that
would end inside one ends before it and the span runs whole in a later step,
as vLLM's scheduler does with disable_chunked_mm_input (which it forces for
such models). Admission refuses a span longer than max_chunk_size.

With prefix caching, a sequence admitted from scratch first takes the
longest cached prefix the KV manager finds and computes only the rest. Every
page a step fills completely is named when the step is scheduled: its content
is written in this step's forward before any attention reads it (each layer
writes all K/V before attending), so two identical prompts admitted in the
same step already share pages.

A sequence that needs a page when none is free makes the scheduler preempt
the newest running sequence (vLLM's recompute policy): its pages are freed
and it goes back to the head of the queue with its generated tokens kept, to
be prefilled again later. Admission may pass over a waiting sequence that
does not fit yet, but at most max_skips times (the job's own, else the
generator's); after that nothing overtakes it, so no job starves.

Waiting sequences are offered for admission by priority class (the job's
priority, lower first) and, within a class, fairly between tenants: weighted
fair queueing over the tokens each tenant's jobs had computed
(engine/fair_share.py). When the most urgent waiting sequence is of a
strictly more urgent class than some running ones and the batch is full (or
the free pages do not cover it), those running ones are preempted as under
page pressure, least urgent class first and newest first within it; a
running job is never preempted for one of its own class.

A newcomer step (newcomer_first, on by default): when the sequence first in
that order is a newcomer (of a class more urgent than every running
sequence, or of the most urgent running class and a tenant with nothing
running) and the batch has room, the step admits the newcomers first in that
order and nothing else: the running sequences skip it. So another tenant's
(or a more urgent class's) first token waits for its own prefill alone, not
beside the flood's rows (vLLM's v0 scheduler ran every prefill in a step of
its own). Two newcomer steps never follow each other, so however many arrive
the running sequences decode at least every other step; a tenant that already
runs a sequence gets no such step unless its class is more urgent than every
running one.

The schedule a step returns is immutable. After the forward, the generator
appends the sampled tokens to the sequences and calls update_from_output with
how many draft tokens each kept and which sequences finished; only then does
the scheduler advance what is computed, give back pages of rejected drafts
and of positions out of a sliding window, and drop finished sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from engine.embeddings import span_containing
from engine.fair_share import FairQueue
from engine.kv_manager import CachedPrefix, KVManager
from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """num_tokens known tokens of the sequence computed this step, plus room
    (pages and budget) for up to draft_room draft tokens after them. samples:
    the step computes the sequence's last known token, so its logits give the
    next one (and, past it, those of any draft tokens)."""

    sequence: Sequence
    num_tokens: int
    samples: bool
    draft_room: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSequence, ...] = ()
    started: tuple[Sequence, ...] = ()
    preempted: tuple[Sequence, ...] = ()


@dataclass
class _Draft:
    """The schedule being built."""

    budget: int
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    started: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    chosen: set[int] = field(default_factory=set)

    def freeze(self) -> SchedulerOutput:
        return SchedulerOutput(tuple(self.scheduled), tuple(self.started), tuple(self.preempted))


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        max_batch_size: int,
        max_chunk_size: int,
        max_skips: int = 16,
        num_draft_tokens: int = 0,
        max_speculative_batch: int = 0,
        tenant_weights: Mapping[str, float] | None = None,
        newcomer_first: bool = True,
    ) -> None:
        self.kv = kv
        self.num_draft_tokens = num_draft_tokens
        self.max_speculative_batch = max_speculative_batch
        self.max_batch_size = max_batch_size
        self.max_chunk_size = max_chunk_size
        self.max_skips = max_skips
        self.waiting = FairQueue(tenant_weights)
        self._running: dict[int, Sequence] = {}
        # serial -> the schedule entry of a plain decode (one token, sampled, no draft room): the
        # same immutable entry every step the sequence decodes, built once instead of per step
        self._decode_items: dict[int, ScheduledSequence] = {}
        self.num_preemptions = 0
        self.newcomer_first = newcomer_first
        self._newcomer_step = False  # the last step was a newcomer step

    @property
    def running(self) -> list[Sequence]:
        """Running sequences, oldest admission first."""
        return list(self._running.values())

    @property
    def num_running(self) -> int:
        return len(self._running)

    def add(self, sequence: Sequence) -> None:
        """Queue a sequence behind its tenant's waiting ones of the same priority class."""
        self.waiting.add(sequence)

    def remove(self, sequence: Sequence) -> None:
        """Drop a finished or cancelled sequence and free its pages now."""
        self._decode_items.pop(sequence.serial, None)
        if self._running.pop(sequence.serial, None) is not None:
            self.waiting.stopped(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        self.kv.free(sequence)

    def requeue(self, sequence: Sequence) -> None:
        """Between steps, send a sequence whose generated tokens were taken back (a banned-string
        rewind) to the head of the queue to be prefilled again, as a preemption does: its pages
        go back (named ones stay in the prefix cache, so the kept prefix is found again). It may
        have finished meanwhile (removed), then it simply runs again."""
        self._decode_items.pop(sequence.serial, None)
        running = self._running.pop(sequence.serial, None) is not None
        if not running and sequence in self.waiting:
            self.waiting.remove(sequence)
        self.kv.free(sequence)
        self.kv.forget_hashes_past(sequence, len(sequence.token_ids))
        sequence.num_computed = 0
        self.waiting.add(sequence, front=True)
        if running:
            self.waiting.stopped(sequence)

    def schedule(self) -> SchedulerOutput:
        step = _Draft(self.max_chunk_size)
        if self.waiting and self._running:
            self._preempt_for_urgent(step)
        if self._newcomers_first(step):
            return step.freeze()
        # One pass sorts the running sequences; one preempted below leaves _running and is skipped.
        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        for sequence in self._running.values():
            uncomputed = len(sequence.token_ids) - sequence.num_computed
            if uncomputed == 1:
                decoding.append(sequence)
            elif uncomputed > 1:
                prefilling.append(sequence)
        self._schedule_decodes(decoding, step)

        for sequence in prefilling:
            if step.budget == 0:
                break
            if sequence.serial in step.chosen or sequence.serial not in self._running:
                continue
            chunk = _whole_spans(sequence, sequence.num_computed, min(sequence.num_uncomputed, step.budget))
            if chunk and self._grow(sequence, sequence.num_computed + chunk, step):
                self._schedule(sequence, chunk, step)

        if self.waiting:
            self._admit(step)
        return step.freeze()

    def _schedule_decodes(self, decoding: list[Sequence], step: _Draft) -> None:
        """Schedule the decoding sequences' next token. A plain decode that changes none of its pages
        (KVManager.steady: nearly every one, every step) takes the inline path: its cached entry, no
        page growth or naming."""
        # Speculation pays while decoding is memory-bound; a large batch is compute-bound already.
        drafts = self.num_draft_tokens if len(decoding) <= self.max_speculative_batch else 0
        running, chosen, scheduled, steady = self._running, step.chosen, step.scheduled, self.kv.steady
        for sequence in decoding:
            if step.budget == 0:
                break
            serial = sequence.serial
            if serial not in running:
                continue
            length = len(sequence.token_ids)
            if not drafts and steady(sequence, length):
                scheduled.append(self._decode_item(sequence))
                chosen.add(serial)
                step.budget -= 1
                continue
            room = max(0, min(drafts, step.budget - 1, sequence.job.max_new_tokens - sequence.num_generated - 1)
                       ) if drafts else 0
            if self._grow(sequence, length + room, step):
                self._schedule(sequence, 1, step, draft_room=room)

    def _decode_item(self, sequence: Sequence) -> ScheduledSequence:
        """The sequence's plain decode entry (one token, sampled, no draft room), built once."""
        item = self._decode_items.get(sequence.serial)
        if item is None:
            item = self._decode_items[sequence.serial] = ScheduledSequence(sequence, 1, True)
        return item

    def update_from_output(
        self, output: SchedulerOutput, accepted_drafts: Mapping[int, int], finished: Iterable[Sequence]
    ) -> None:
        """After the forward: the scheduled tokens (and accepted_drafts[serial]
        draft tokens) are computed; finished sequences leave and free their pages."""
        kv, running, charge = self.kv, self._running, self.waiting.charge
        for item in output.scheduled:
            sequence = item.sequence
            if sequence.serial not in running:
                continue
            computed = item.num_tokens + accepted_drafts.get(sequence.serial, 0) if accepted_drafts else item.num_tokens
            sequence.num_computed += computed
            charge(sequence, computed)
            if item.draft_room:
                kv.trim(sequence, len(sequence.token_ids))
            kv.release_out_of_window(sequence)
        for sequence in finished:
            self.remove(sequence)

    def _promised(self) -> int:
        """Pages the running prefills still need for their whole prompts."""
        kv = self.kv
        return sum(kv.pages_for(len(s.token_ids)) - len(s.pages)
                   for s in self._running.values() if s.num_uncomputed > 1)

    def _pages_needed(self, sequence: Sequence, prefix: CachedPrefix) -> int:
        """Free pages admitting the sequence takes: its whole prompt and first token, less its cached
        prefix (parked pages of which count: reviving them takes them from the free ones)."""
        return self.kv.pages_for(len(sequence.token_ids) + 1) - len(prefix.pages) + prefix.num_parked

    def _preempt_for_urgent(self, step: _Draft) -> None:
        """Make room for the first waiting sequence by preempting running ones of a strictly less
        urgent class (least urgent class first, newest first), while the batch is full or the
        free pages do not cover it; none when even all of their pages would not cover it."""
        urgent = self.waiting.most_urgent()
        if urgent is None or max(s.job.priority for s in self._running.values()) <= urgent:
            return
        head = next(iter(self.waiting))
        victims = sorted((s for s in reversed(self._running.values()) if s.job.priority > urgent),
                         key=lambda s: -s.job.priority)
        needed = self._pages_needed(head, self.kv.cached_prefix(head))
        if self.kv.num_free - self._promised() + sum(len(v.pages) for v in victims) < needed:
            return
        for victim in victims:
            if len(self._running) < self.max_batch_size and self.kv.num_free - self._promised() >= needed:
                return
            self._preempt(victim, step)

    def _newcomers_first(self, step: _Draft) -> bool:
        """A newcomer step: admit the newcomers first in the waiting order (_is_newcomer) in a step
        of their own (the running sequences skip it). True if it ran."""
        was_newcomer_step, self._newcomer_step = self._newcomer_step, False
        if not (self.newcomer_first and self.waiting and self._running) or was_newcomer_step \
                or len(self._running) >= self.max_batch_size:
            return False
        most_urgent = min(s.job.priority for s in self._running.values())
        if not self._is_newcomer(next(iter(self.waiting)), most_urgent):
            return False
        self._admit(step, lambda sequence: self._is_newcomer(sequence, most_urgent))
        self._newcomer_step = bool(step.scheduled)
        return self._newcomer_step

    def _is_newcomer(self, sequence: Sequence, running_priority: int) -> bool:
        """Of a class more urgent than every running sequence (running_priority: the most urgent
        of them), or of as urgent a class and a tenant with nothing running."""
        priority = sequence.job.priority
        return priority < running_priority or (
            priority == running_priority and not self.waiting.running(sequence.job.tenant))

    def _admit(self, step: _Draft, only: Callable[[Sequence], bool] | None = None) -> None:
        """Admit waiting sequences in the waiting order (while `only` holds for them, when given)."""
        kv = self.kv
        promised = self._promised()
        passed_over: list[Sequence] = []
        for sequence in self.waiting:
            if step.budget == 0 or len(self._running) >= self.max_batch_size:
                break
            if only is not None and not only(sequence):
                break
            if any(s.skips >= self._skip_limit(s) for s in passed_over):
                break
            prefix = kv.cached_prefix(sequence)
            start = len(prefix.pages) * kv.page_size
            chunk = _whole_spans(sequence, start, min(len(sequence.token_ids) - start, step.budget))
            if not chunk:
                break  # its next image needs more of this step's budget than is left
            if kv.num_free - promised < self._pages_needed(sequence, prefix):
                passed_over.append(sequence)
                continue
            for earlier in passed_over:
                earlier.skips += 1
            kv.take_prefix(sequence, prefix)
            if sequence.time_started is None:
                sequence.cached_tokens = sequence.num_computed
                step.started.append(sequence)
            self.waiting.started(sequence)
            self._running[sequence.serial] = sequence
            kv.grow(sequence, sequence.num_computed + chunk)
            promised += kv.pages_for(len(sequence.token_ids)) - len(sequence.pages)
            self._schedule(sequence, chunk, step)

    def _skip_limit(self, sequence: Sequence) -> int:
        return sequence.job.max_skips if sequence.job.max_skips is not None else self.max_skips

    def _schedule(self, sequence: Sequence, num_tokens: int, step: _Draft, draft_room: int = 0) -> None:
        """Add the sequence's next num_tokens known tokens to this step and name
        the pages they complete (never pages that only draft tokens reach)."""
        end = sequence.num_computed + num_tokens
        samples = end == len(sequence.token_ids)
        if num_tokens == 1 and samples and not draft_room:
            item = self._decode_item(sequence)
        else:
            item = ScheduledSequence(sequence, num_tokens, samples, draft_room)
        step.scheduled.append(item)
        step.chosen.add(sequence.serial)
        step.budget -= num_tokens + draft_room
        self.kv.name_full_pages(sequence, end)

    def _grow(self, sequence: Sequence, num_tokens: int, step: _Draft) -> bool:
        """Give the sequence pages for num_tokens tokens, preempting the newest
        unscheduled running sequences as needed. False if it was itself preempted."""
        needed = self.kv.pages_missing(sequence, num_tokens)
        if not needed:
            return True
        while needed > self.kv.num_free:
            victim = next((s for s in reversed(self._running.values()) if s.serial not in step.chosen), None)
            if victim is None:
                return False
            self._preempt(victim, step)
            if victim is sequence:
                return False
        self.kv.grow(sequence, num_tokens)
        return True

    def _preempt(self, sequence: Sequence, step: _Draft) -> None:
        del self._running[sequence.serial]
        self._decode_items.pop(sequence.serial, None)
        self.kv.free(sequence)
        sequence.num_computed = 0
        self.waiting.add(sequence, front=True)
        self.waiting.stopped(sequence)  # after add: a tenant with nothing else keeps its counter
        step.preempted.append(sequence)
        self.num_preemptions += 1


def _whole_spans(sequence: Sequence, start: int, chunk: int) -> int:
    """chunk tokens from start, cut back to the start of a bidirectional span it would end inside
    (0 when that span begins at start: it waits for a step with budget for all of it)."""
    span = span_containing(sequence.job.bidirectional_spans, start + chunk)
    return chunk if span is None else max(0, span[0] - start)
