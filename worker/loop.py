"""The engine loop: ONE thread owns the Generator.

Task threads hand it Submissions; between iterate() calls it drains them into
the generator, applies cancellations and deadlines, then runs one step and
hands every event of that step (worker/events.py makes them from the engine's
outputs; coalescing, a sample's chunk only when due, and every pending chunk before
a final event) to the publishing thread, which sends them in one Redis pipeline
before waking the task threads whose jobs finished. The final events and
results of the requests that ended in the step are built and published after
that by a third thread, the finishing thread: a result with logprobs is the
heaviest thing the worker makes, and neither the loop nor the other requests'
streams wait for it. The finishing thread builds and encodes each result in
paced slices (worker/pacing.py), so that it does not hold the GIL the loop
needs between its torch ops either. Idle, the loop sleeps on a condition
variable. On shutdown it drains: no new jobs, and those still running when the
grace period ends are requeued.

LoRA adapters are loaded and unloaded through the same inbox (AdapterChange, from the control
listener), between steps, so only the loop thread touches the generator's adapter registry. A
request whose adapter finds every resident slot held by running requests (max_loras) waits in
the loop, as vLLM's scheduler keeps it waiting, and is enqueued once one of them has ended.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from engine import AdaptersBusy, EngineOutput, FinishReason, Generator, Job, JobRejected, QueueFull
from engine.errors import AdapterLoadError
from producer.protocol import FinishReason as WireFinishReason
from producer.protocol import GenerationRequest, StreamEvent, Timings, Usage
from worker.coalescing import Coalescing
from worker.events import Outcome, RequestEvents, StoredResult, sample_of
from worker.pacing import PACER, dumps_paced
from worker.publisher import Publisher, PublishingThread
from worker.thread_names import name_this_thread
from worker.thread_times import thread_times

log = logging.getLogger(__name__)

TOKENS_PER_SECOND_WINDOW_S = 10.0
#: The names of the loop thread and of the thread that publishes its steps' events, the kernel's
#: too (worker/thread_names.py: at most 15 characters).
LOOP_THREAD_NAME = "genq-loop"
PUBLISHER_THREAD_NAME = "genq-publisher"
#: How long a cancel for a request this worker has not seen (yet) is remembered.
EARLY_CANCEL_MEMORY_S = 600.0
#: The engine's figures (GeneratorStats) that stats() reports as they are, under their own names.
ENGINE_STATS = ("active_jobs", "pages_total", "pages_used", "pages_free", "pages_cached", "page_size",
                "generated_tokens", "preemptions", "drafted_tokens", "accepted_draft_tokens")


class ShuttingDown(RuntimeError):
    """The worker stopped taking new jobs; the task is requeued for another worker."""


@dataclass
class Submission:
    """A validated request on its way through the engine. The task thread
    waits on `done`; then exactly one of result / error / requeue / duplicate is set (a request
    that concluded in a step has its `outcome` first, from which the finishing thread builds its
    result).

    `jobs` holds one engine job, or the request's n samples (Job.samples: identifiers
    (identifier, i)), enqueued together so that they share the prompt's pages; the request
    ends when every sample has. `stream` turns the samples' outputs into wire events."""

    identifier: str
    attempt: int
    jobs: list[Job]
    request: GenerationRequest
    deadline: float | None
    task_id: str
    cancel_requested: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    result: StoredResult | None = None
    error: str | None = None
    requeue: bool = False
    duplicate: bool = False
    expired: bool = False
    outcome: Outcome | None = None
    stream: RequestEvents = field(init=False, repr=False)

    def attach(self, token_text: Callable[[int], str], coalescing: Coalescing) -> None:
        """Give the submission its wire stream (the loop knows how token ids read, and the
        worker's default coalescing, which the request's own stream options override)."""
        self.stream = RequestEvents(self.identifier, self.attempt, self.request, len(self.jobs), token_text,
                                    coalescing=coalescing.for_request(self.request.stream))


@dataclass(frozen=True)
class AdapterChange:
    """Load the PEFT adapter directory `path` under `name`, or unload `name` (path None)."""

    name: str
    path: str | None = None


@dataclass
class LoopCounters:
    steps: int = 0
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0
    requeued: int = 0
    adapter_slot_waits: int = 0  # times a request was put back to wait for a resident LoRA adapter slot
    peak_active_jobs: int = 0
    busy_s: float = 0.0


class EngineLoop:
    def __init__(self, generator: Generator, publisher: Publisher,
                 on_finished: Callable[[Timings, Usage], None] | None = None,
                 on_adapters: Callable[[list[str]], None] | None = None,
                 coalescing: Coalescing | None = None) -> None:
        """on_adapters(names): called on the loop thread after a load or unload changed the adapters;
        coalescing: the worker's default for requests that do not set their own (none: every step)."""
        self.generator = generator
        self.coalescing = coalescing or Coalescing()
        self.on_finished = on_finished
        self.on_adapters = on_adapters
        self.publishing = PublishingThread(publisher, PUBLISHER_THREAD_NAME)
        self.finishing = PublishingThread(publisher, "genq-finisher")
        self.counters = LoopCounters()
        self._early_cancels: dict[str, float] = {}
        self._cond = threading.Condition()
        self._inbox: list[Submission] = []
        self._adapter_changes: list[AdapterChange] = []
        self._waiting_for_adapter: list[Submission] = []
        self._cancels: set[str] = set()
        self._active: dict[str, Submission] = {}
        self._accepting = True
        self._drain_deadline: float | None = None
        self._exit_when_idle = False
        self._recent_tokens: deque[tuple[float, int]] = deque()
        self._token_texts: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, name=LOOP_THREAD_NAME, daemon=True)
        self._native_id: int | None = None

    # -- called from other threads -------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, submission: Submission) -> None:
        with self._cond:
            if not self._accepting:
                raise ShuttingDown("the worker is shutting down")
            submission.attach(self._token_text, self.coalescing)
            self._inbox.append(submission)
            self.counters.submitted += 1
            self._cond.notify()

    def change_adapter(self, change: AdapterChange) -> None:
        """Load or unload an adapter before the next step (applied in the order asked)."""
        with self._cond:
            self._adapter_changes.append(change)
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
        self.finishing.stop()

    def stats(self) -> dict[str, Any]:
        """Engine + loop figures for `celery inspect stats` / Flower."""
        engine = self.generator.stats
        return {
            **{name: getattr(engine, name) for name in ENGINE_STATS},
            "pending_jobs": engine.pending_jobs + len(self._inbox) + len(self._waiting_for_adapter),
            "generated_tokens_per_s": round(self._tokens_per_second(), 2),
            "prompt_tokens_computed": engine.computed_prompt_tokens,
            "prompt_tokens_cached": engine.cached_prompt_tokens,
            "prefix_hit_rate": round(engine.prefix_hit_rate, 4),
            "draft_acceptance_rate": round(engine.accepted_draft_tokens / engine.drafted_tokens, 4)
            if engine.drafted_tokens else 0.0,
            "lora_adapters": len(self.generator.adapters),
            "lora_resident": len(self.generator.adapters.resident()),
            "lora_evictions": self.generator.adapters.evictions,
            "forward_wait_s": round(engine.forward_wait_s, 6),
            **asdict(self.counters),
            **self._thread_times(),
        }

    def _thread_times(self) -> dict[str, float]:
        """The loop thread's CPU and run-queue seconds so far and the monotonic clock, read with the
        counters: two readings split the steps between them into the loop's work, its wait for a core
        and the rest (bench/celery_gil.py)."""
        times = thread_times(self._native_id)
        return {} if times is None else {"loop_cpu_s": round(times.cpu_s, 6),
                                          "loop_run_queue_s": round(times.run_queue_s, 6),
                                          "loop_clock_s": round(time.monotonic(), 6)}

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
        name_this_thread()
        self._native_id = threading.get_native_id()
        while True:
            with self._cond:
                while not (self._inbox or self._cancels or self._active or self._adapter_changes
                           or self._waiting_for_adapter or self._exit_when_idle):
                    self._cond.wait()
                if self._exit_when_idle and not self._active and not self._inbox and not self._waiting_for_adapter:
                    return
                changes, self._adapter_changes = self._adapter_changes, []
                inbox, self._inbox = self._waiting_for_adapter + self._inbox, []
                self._waiting_for_adapter = []
                cancels, self._cancels = self._cancels, set()
                drain_expired = self._drain_deadline is not None and time.monotonic() >= self._drain_deadline
            started = time.monotonic()
            for change in changes:
                self._change_adapter(change)
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
        if requeue_all:
            for submission in self._waiting_for_adapter:
                submission.requeue = True
                self.counters.requeued += 1
                finished.append(submission)
            self._waiting_for_adapter = []
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
        stepped = time.monotonic()
        for result in results:
            identifier, index = sample_of(result.identifier)
            owner = self._active.get(identifier)
            if owner is None:
                continue
            generated += len(result.token_ids)
            if self._on_output(owner, index, result, events, stepped):
                del self._active[identifier]
                finished.append(owner)
        for submission in self._active.values():
            if submission.stream.next_due <= stepped:
                events.extend(submission.stream.due(stepped))
        if generated:
            self._recent_tokens.append((time.monotonic(), generated))
            while self._recent_tokens and time.monotonic() - self._recent_tokens[0][0] > TOKENS_PER_SECOND_WINDOW_S:
                self._recent_tokens.popleft()
        self._publish(events, finished)

    def _publish(self, events: list[StreamEvent], finished: list[Submission]) -> None:
        """The step's events go out first (with the results of requests that ended without
        reaching the engine); their tasks wake then. The concluded requests (an `outcome`) are
        handed to the finishing thread after that, so each final event follows its request's
        chunks, and their tasks wake once it is out: a result never precedes its stream."""
        now = [s for s in finished if s.outcome is None]
        concluded = [s for s in finished if s.outcome is not None]

        def published() -> None:
            _wake(now)
            if concluded:
                self.finishing.submit(partial(_endings, concluded), then=partial(_wake, concluded))

        self.publishing.submit(partial(_with_results, events, now), then=published)

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
            ending = submission.stream.cancelled(prompt_tokens=len(submission.jobs[0].input_ids))
            events.append(ending.event)
            submission.result = ending.result
            finished.append(submission)
        else:
            try:
                self.generator.enqueue(submission.jobs)
            except AdaptersBusy:
                self.counters.adapter_slot_waits += 1
                self._waiting_for_adapter.append(submission)
            except (JobRejected, QueueFull) as error:
                self._fail(submission, str(error), events)
                finished.append(submission)
            else:
                self._active[submission.identifier] = submission

    def _change_adapter(self, change: AdapterChange) -> None:
        """Apply a load or unload between steps; a refused one is logged naming the adapter and why
        (control messages have no reply: the model card shows the adapters loaded)."""
        adapters = self.generator.adapters
        try:
            if change.path is None:
                adapters.unregister(change.name)
                log.info("unloaded LoRA adapter %r: requests naming it are refused, those admitted finish", change.name)
            else:
                adapters.register(change.name, change.path)
                log.info("loaded LoRA adapter %r from %s", change.name, change.path)
        except (AdapterLoadError, KeyError) as error:
            log.error("LoRA adapter %r not %s: %s", change.name, "unloaded" if change.path is None else "loaded",
                      error.args[0] if error.args else error)
            return
        if self.on_adapters is not None:
            self.on_adapters(adapters.names())

    def _fail(self, submission: Submission, message: str, events: list[StreamEvent]) -> None:
        """End the request with an error event after its pending text; its jobs stop (cancelling
        one the engine never took does nothing)."""
        for job in submission.jobs:
            self.generator.cancel(job)
        self.counters.failed += 1
        submission.error = message
        events.extend(submission.stream.flush())
        events.append(submission.stream.error(message))

    def _on_output(self, submission: Submission, index: int, output: EngineOutput, events: list[StreamEvent],
                   now: float) -> bool:
        """One sample's engine output -> stream events; True when the request has ended (its
        final event is made, or, when it concluded, its `outcome` is set for the finishing thread).
        A sample that ended sends its pending chunk first, so every final event follows its text."""
        stream = submission.stream
        events.extend(stream.progress(index, output, now))
        if not output.eos:
            return False
        events.extend(stream.flush(index))
        if output.eos_reason is FinishReason.ERROR and not submission.requeue:
            # This sample alone failed in the step (the batch carries on); its siblings stop too.
            self._fail(submission, output.error or "engine error", events)
            return True
        if not stream.record(index, output):
            return False
        if submission.requeue:
            self.counters.requeued += 1
            return True
        outcome = submission.outcome = stream.conclude(submission.expired)
        self._count_ending(outcome.finish_reason)
        if self.on_finished is not None:
            self.on_finished(outcome.timings, outcome.usage)
        return True

    def _count_ending(self, finish_reason: WireFinishReason) -> None:
        if finish_reason == "deadline":
            self.counters.expired += 1
        elif finish_reason == "cancelled":
            self.counters.cancelled += 1
        else:
            self.counters.completed += 1

    def _token_text(self, token_id: int) -> str:
        """A token's text alone, for logprobs; remembered, since a logprob list names the same
        tokens again and again (20 alternatives a token). Called by the loop and the finishing
        thread: a lost race decodes a token twice, alike."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.generator.tokenizer.decode([token_id],
                                                                                  skip_special_tokens=False)
        return text

    def _fail_all(self, message: str) -> None:
        events: list[StreamEvent] = []
        failed = list(self._active.values())
        self._active.clear()
        for submission in failed:
            self._fail(submission, message, events)
        self.publishing.submit(partial(_with_results, events, []), then=partial(_wake, failed))


def _with_results(events: list[StreamEvent], finished: list[Submission]
                  ) -> tuple[list[StreamEvent], dict[str, str], dict[str, str | None]]:
    """A step's events, the results (task id -> JSON) of the finished tasks that have one, and
    the finished requests' tenants (their usage is counted as the events go out)."""
    return (events, {s.task_id: json.dumps(s.result.to_dict()) for s in finished if s.result is not None},
            _tenants(finished))


def _tenants(submissions: list[Submission]) -> dict[str, str | None]:
    return {s.identifier: s.request.tenant for s in submissions}


def _endings(concluded: list[Submission]) -> tuple[list[StreamEvent], dict[str, str], dict[str, str | None]]:
    """On the finishing thread: the concluded requests' final events, and their results (task
    id -> JSON), each built and encoded in one paced turn."""
    events, finals = [], {}
    for submission in concluded:
        assert submission.outcome is not None, "_publish hands over only concluded requests"
        with PACER.turn() as pace:
            ending = submission.stream.finish(submission.outcome, pace)
            submission.result = ending.result
            finals[submission.task_id] = dumps_paced(ending.result.to_dict(), pace)
        events.append(ending.event)
    return events, finals, _tenants(concluded)


def _wake(submissions: list[Submission]) -> None:
    for submission in submissions:
        submission.done.set()
