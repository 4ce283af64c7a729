"""The engine loop: ONE thread owns the Generator.

Task threads hand it Submissions; between iterate() calls it drains them into
the generator, applies cancellations and deadlines, then runs one step and
publishes every event of that step in one Redis pipeline before waking the
task threads whose jobs finished. Idle, it sleeps on a condition variable.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from engine import EngineOutput, FinishReason, Generator, Job, JobRejected, QueueFull, Stage
from engine.outputs import TokenLogprob as EngineTokenLogprob
from producer.protocol import (
    Choice,
    GenerationRequest,
    GenerationResult,
    StreamEvent,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
    finish_reason_from_eos,
)
from producer.protocol import FinishReason as FinishReasonName
from worker.publisher import Publisher, PublishingThread

log = logging.getLogger(__name__)

TOKENS_PER_SECOND_WINDOW_S = 10.0
#: How long a cancel for a request this worker has not seen (yet) is remembered.
EARLY_CANCEL_MEMORY_S = 600.0


class ShuttingDown(RuntimeError):
    """The worker stopped taking new jobs; the task is requeued for another worker."""


@dataclass
class Submission:
    """A validated request on its way through the engine. The task thread
    waits on `done`; then exactly one of result / error / requeue / duplicate is set.

    `jobs` holds one engine job, or the request's n samples (Job.samples: identifiers
    (identifier, i)), enqueued together so that they share the prompt's pages; the request
    ends when every sample has, and `outputs` keeps each sample's final engine output."""

    identifier: str
    attempt: int
    jobs: list[Job]
    request: GenerationRequest
    deadline: float | None
    task_id: str = ""
    cancel_requested: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
    error: str | None = None
    requeue: bool = False
    duplicate: bool = False
    seq: int = 0
    expired: bool = False
    started: bool = False
    outputs: dict[int, EngineOutput] = field(default_factory=dict)

    def event(self, kind: str, **fields: Any) -> StreamEvent:
        event = StreamEvent(id=self.identifier, seq=self.seq, attempt=self.attempt, event=kind, **fields)
        self.seq += 1
        return event

    def chunk(self, text: str, token_ids: list[int] | None, logprobs: list[TokenLogprob] | None = None,
              index: int | None = None) -> StreamEvent:
        """The per-token event, built without validation: every field comes from this
        worker (a checked identifier, its own counters, the engine's text and ids), and
        validating it cost more than the rest of the event's path."""
        event = StreamEvent.model_construct(id=self.identifier, seq=self.seq, attempt=self.attempt, event="chunk",
                                            text=text, token_ids=token_ids, logprobs=logprobs, index=index)
        self.seq += 1
        return event


@dataclass
class LoopCounters:
    steps: int = 0
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0
    requeued: int = 0
    peak_active_jobs: int = 0
    busy_s: float = 0.0


class EngineLoop:
    def __init__(self, generator: Generator, publisher: Publisher,
                 on_finished: Callable[[Timings, Usage], None] | None = None) -> None:
        self.generator = generator
        self.on_finished = on_finished
        self.publishing = PublishingThread(publisher)
        self.counters = LoopCounters()
        self._early_cancels: dict[str, float] = {}
        self._cond = threading.Condition()
        self._inbox: list[Submission] = []
        self._cancels: set[str] = set()
        self._active: dict[str, Submission] = {}
        self._accepting = True
        self._drain_deadline: float | None = None
        self._exit_when_idle = False
        self._recent_tokens: deque[tuple[float, int]] = deque()
        self._thread = threading.Thread(target=self._run, name="genq-engine-loop", daemon=True)

    # -- called from other threads -------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, submission: Submission) -> None:
        with self._cond:
            if not self._accepting:
                raise ShuttingDown("the worker is shutting down")
            self._inbox.append(submission)
            self.counters.submitted += 1
            self._cond.notify()

    def cancel(self, identifier: str) -> None:
        with self._cond:
            self._cancels.add(identifier)
            self._cond.notify()

    def active_identifiers(self) -> list[str]:
        return list(self._active)

    def lease_holders(self) -> dict[str, str]:
        """identifier -> task id of every job generating here."""
        return {identifier: submission.task_id for identifier, submission in list(self._active.items())}

    def is_running(self, identifier: str, task_id: str) -> bool:
        """Whether this very task (not just its identifier) is generating here."""
        running = self._active.get(identifier)
        return running is not None and running.task_id == task_id

    def begin_shutdown(self, grace_s: float) -> None:
        """Stop accepting jobs; in-flight ones get grace_s to finish, then are
        requeued. A second call can only bring the deadline closer."""
        with self._cond:
            self._accepting = False
            deadline = time.monotonic() + grace_s
            if self._drain_deadline is None or deadline < self._drain_deadline:
                self._drain_deadline = deadline
            self._cond.notify()

    def stop(self, grace_s: float) -> None:
        """Drain (see begin_shutdown), then end the loop thread."""
        self.begin_shutdown(grace_s)
        with self._cond:
            self._exit_when_idle = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()
        self.publishing.stop()

    def stats(self) -> dict[str, Any]:
        """Engine + loop figures for `celery inspect stats` / Flower."""
        engine = self.generator.stats
        return {
            "active_jobs": engine.active_jobs,
            "pending_jobs": engine.pending_jobs + len(self._inbox),
            "pages_total": engine.pages_total,
            "pages_used": engine.pages_used,
            "pages_free": engine.pages_free,
            "pages_cached": engine.pages_cached,
            "page_size": engine.page_size,
            "generated_tokens": engine.generated_tokens,
            "generated_tokens_per_s": round(self._tokens_per_second(), 2),
            "prompt_tokens_computed": engine.computed_prompt_tokens,
            "prompt_tokens_cached": engine.cached_prompt_tokens,
            "prefix_hit_rate": round(engine.prefix_hit_rate, 4),
            "preemptions": engine.preemptions,
            "drafted_tokens": engine.drafted_tokens,
            "accepted_draft_tokens": engine.accepted_draft_tokens,
            "draft_acceptance_rate": round(engine.accepted_draft_tokens / engine.drafted_tokens, 4)
            if engine.drafted_tokens else 0.0,
            **asdict(self.counters),
        }

    def _tokens_per_second(self) -> float:
        """Generated tokens/s over the last window: tokens after the oldest
        sample in it over the time since that sample (0 when idle)."""
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent_tokens) if now - t <= TOKENS_PER_SECOND_WINDOW_S]
        if len(recent) < 2:
            return 0.0
        return sum(n for _, n in recent[1:]) / (now - recent[0][0])

    # -- the loop thread ----------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._cancels or self._active or self._exit_when_idle):
                    self._cond.wait()
                if self._exit_when_idle and not self._active and not self._inbox:
                    return
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, set()
                drain_expired = self._drain_deadline is not None and time.monotonic() >= self._drain_deadline
            started = time.monotonic()
            try:
                self._step(inbox, cancels, requeue_all=drain_expired)
            except Exception as error:  # noqa: BLE001 - one bad step must not take the worker down
                log.exception("engine step failed; failing its jobs")
                self._fail_all(f"engine error: {error}")
            self.counters.busy_s += time.monotonic() - started

    def _step(self, inbox: list[Submission], cancels: set[str], requeue_all: bool) -> None:
        events: list[StreamEvent] = []
        finished: list[Submission] = []
        self._remember_early_cancels(cancels)
        for submission in inbox:
            self._admit(submission, events, finished)
        now = time.time()
        for identifier, submission in self._active.items():
            if requeue_all:
                submission.requeue = True
            elif identifier in cancels:
                pass
            elif submission.deadline is not None and now >= submission.deadline:
                submission.expired = True
            else:
                continue
            for job in submission.jobs:
                self.generator.cancel(job)
        self.counters.peak_active_jobs = max(self.counters.peak_active_jobs, self.generator.num_active_jobs())
        results = self.generator.iterate()
        self.counters.steps += 1
        generated = 0
        for result in results:
            identifier, index = _sample_of(result.identifier)
            submission = self._active.get(identifier)
            if submission is None:
                continue
            generated += len(result.token_ids)
            if self._translate(submission, index, result, events):
                del self._active[identifier]
                finished.append(submission)
        if generated:
            self._recent_tokens.append((time.monotonic(), generated))
            while self._recent_tokens and time.monotonic() - self._recent_tokens[0][0] > TOKENS_PER_SECOND_WINDOW_S:
                self._recent_tokens.popleft()
        finals = {s.task_id: json.dumps(s.result.to_dict()) for s in finished if s.result is not None and s.task_id}
        self.publishing.submit(events, then=lambda: _wake(finished), finals=finals)

    def _remember_early_cancels(self, cancels: set[str]) -> None:
        """A cancel can overtake its request (the task thread has not submitted it
        yet); remember cancels of unknown requests for a while."""
        now = time.monotonic()
        for identifier in cancels - self._active.keys():
            self._early_cancels[identifier] = now
        for identifier, seen in list(self._early_cancels.items()):
            if now - seen > EARLY_CANCEL_MEMORY_S:
                del self._early_cancels[identifier]

    def _admit(self, submission: Submission, events: list[StreamEvent], finished: list[Submission]) -> None:
        running = self._active.get(submission.identifier)
        if running is not None and running.task_id == submission.task_id:
            # A redelivery of a task still generating here (its visibility timeout ran out):
            # the running attempt will answer it.
            submission.duplicate = True
            finished.append(submission)
        elif running is not None:
            # Fail the newcomer without touching the stream: it belongs to the running request.
            self.counters.failed += 1
            submission.error = f"identifier: {submission.identifier!r} is already generating"
            finished.append(submission)
        elif submission.cancel_requested or self._early_cancels.pop(submission.identifier, None) is not None:
            self.counters.cancelled += 1
            events.append(submission.event("cancelled", finish_reason="cancelled"))
            submission.result = _empty_result(submission, "cancelled")
            finished.append(submission)
        else:
            try:
                self.generator.enqueue(submission.jobs)
            except (JobRejected, QueueFull) as error:
                self._reject(submission, str(error), events, finished)
                return
            self._active[submission.identifier] = submission

    def _reject(self, submission: Submission, message: str, events: list[StreamEvent], finished: list[Submission]
                ) -> None:
        self.counters.failed += 1
        submission.error = message
        events.append(submission.event("error", finish_reason="error", error=message))
        finished.append(submission)

    def _translate(self, submission: Submission, index: int, result: EngineOutput, events: list[StreamEvent]
                   ) -> bool:
        """One sample's engine result -> stream events; True when the request has ended (its
        final event and, unless it failed or is requeued, its result are made)."""
        options = submission.request.stream
        if result.stage is Stage.STARTED:
            if not submission.started:
                submission.started = True
                events.append(submission.event("started"))
            return False
        token_ids = result.token_ids if options.include_token_ids else None
        logprobs = self._wire_logprobs(result.logprobs) if result.logprobs else None
        if options.enabled and (result.text or token_ids or logprobs):
            events.append(submission.chunk(result.text, token_ids, logprobs,
                                           index if submission.request.n > 1 else None))
        if not result.eos:
            return False
        if result.eos_reason is FinishReason.ERROR and not submission.requeue:
            # This sample alone failed in the step (the batch carries on); its siblings stop too.
            for job in submission.jobs:
                self.generator.cancel(job)
            self.counters.failed += 1
            submission.error = result.error or "engine error"
            events.append(submission.event("error", finish_reason="error", error=submission.error))
            return True
        submission.outputs[index] = result
        if len(submission.outputs) < len(submission.jobs):
            return False
        if submission.requeue:
            self.counters.requeued += 1
        else:
            self._finish(submission, events)
        return True

    def _finish(self, submission: Submission, events: list[StreamEvent]) -> None:
        """The final event and result of a request whose samples have all ended."""
        outputs = [submission.outputs[i] for i in range(len(submission.jobs))]
        choices = [self._choice(submission, i, output) for i, output in enumerate(outputs)]
        if submission.expired:
            finish_reason, kind = "deadline", "done"
            self.counters.expired += 1
        elif any(output.eos_reason is FinishReason.CANCELLED for output in outputs):
            finish_reason, kind = "cancelled", "cancelled"
            self.counters.cancelled += 1
        else:
            finish_reason, kind = choices[0].finish_reason, "done"
            self.counters.completed += 1
        first = outputs[0]
        usage = Usage(
            prompt_tokens=first.prompt_tokens,
            completion_tokens=sum(output.new_tokens or 0 for output in outputs),
            cached_tokens=first.cached_tokens,
        )
        timings = Timings(queued_s=first.time_enqueued, prefill_s=first.time_prefill,
                          generate_s=max(output.time_generate or 0.0 for output in outputs))
        if self.on_finished is not None:
            self.on_finished(timings, usage)
        include_ids = submission.request.stream.include_token_ids
        many = submission.request.n > 1
        events.append(
            submission.event(
                kind,
                text=choices[0].text,
                token_ids=choices[0].token_ids if include_ids else None,
                logprobs=choices[0].logprobs,
                finish_reason=finish_reason,
                usage=usage,
                timings=timings,
                choices=[c if include_ids else c.model_copy(update={"token_ids": None}) for c in choices]
                if many else None,
            )
        )
        submission.result = GenerationResult(
            id=submission.identifier,
            attempt=submission.attempt,
            text=choices[0].text,
            token_ids=choices[0].token_ids or [],
            logprobs=choices[0].logprobs,
            finish_reason=finish_reason,
            usage=usage,
            timings=timings,
            metadata=submission.request.metadata,
            choices=choices if many else None,
        )

    def _choice(self, submission: Submission, index: int, output: EngineOutput) -> Choice:
        """A sample's whole output; a sample the deadline cut ends in "deadline"."""
        if output.eos_reason is FinishReason.CANCELLED and submission.expired:
            finish_reason: str = "deadline"
        else:
            finish_reason = finish_reason_from_eos(output.eos_reason)
        logprobs = (self._wire_logprobs(output.completion_logprobs)
                    if output.completion_logprobs is not None else None)
        return Choice(index=index, text=output.full_completion or "", token_ids=output.completion_ids or [],
                      logprobs=logprobs, finish_reason=finish_reason)

    def _wire_logprobs(self, logprobs: list[EngineTokenLogprob]) -> list[TokenLogprob]:
        """The engine's logprobs with each token's text, built without re-validation (as chunk())."""
        decode = self._token_text
        return [
            TokenLogprob.model_construct(
                token_id=lp.token_id, token=decode(lp.token_id), logprob=lp.logprob,
                top_logprobs=[TopLogprob.model_construct(token_id=t, token=decode(t), logprob=v) for t, v in lp.top])
            for lp in logprobs
        ]

    def _token_text(self, token_id: int) -> str:
        return self.generator.tokenizer.decode([token_id], skip_special_tokens=False)

    def _fail_all(self, message: str) -> None:
        events: list[StreamEvent] = []
        failed = list(self._active.values())
        self._active.clear()
        for submission in failed:
            for job in submission.jobs:
                self.generator.cancel(job)
            self._reject(submission, message, events, [])
        self.publishing.submit(events, then=lambda: _wake(failed))


def _wake(submissions: list[Submission]) -> None:
    for submission in submissions:
        submission.done.set()


def _sample_of(identifier: object) -> tuple[object, int]:
    """(request identifier, sample index) of an engine result: Job.samples names its
    children (identifier, i); a lone job is sample 0."""
    if isinstance(identifier, tuple):
        return identifier[0], identifier[1]
    return identifier, 0


def _empty_result(submission: Submission, finish_reason: FinishReasonName) -> GenerationResult:
    choices = [Choice(index=i, text="", finish_reason=finish_reason) for i in range(submission.request.n)]
    return GenerationResult(
        id=submission.identifier,
        attempt=submission.attempt,
        text="",
        finish_reason=finish_reason,
        usage=Usage(prompt_tokens=len(submission.jobs[0].input_ids)),
        timings=Timings(),
        metadata=submission.request.metadata,
        choices=choices if submission.request.n > 1 else None,
    )
