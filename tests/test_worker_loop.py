"""worker/loop.py's own logic (inbox, cancels, deadlines, drain, failures) with a
stand-in generator and a stand-in publisher: small scripted classes, so each
case is exact and fast. The real engine and Redis behind the same loop are
covered by the service tests (tests/test_worker.py and others)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest

from engine import EngineOutput, FinishReason, Generator, Job, JobRejected, Stage
from producer.protocol import GenerationRequest, GenerationResult, StreamEvent
from worker.loop import EngineLoop, ShuttingDown, Submission
from worker.publisher import Publisher

WAIT_S = 10.0
LONG = 32768  # the protocol's most: runs until cancelled, expired or drained


class StandInTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{t}>" for t in ids)


class StandInGenerator:
    """Plays every job: STARTED, then one token (id 7, text "t") per iterate() until
    max_new_tokens, or CANCELLED after cancel(). `reject` makes enqueue() refuse,
    `crash` makes the next iterate() raise, `fail` ends the named job with an ERROR output."""

    def __init__(self) -> None:
        self.tokenizer = StandInTokenizer()
        self.running: dict[Any, tuple[Job, int]] = {}
        self.cancelled: set[Any] = set()
        self.enqueued: list[Any] = []
        self.reject: str | None = None
        self.crash: str | None = None
        self.fail: set[Any] = set()

    def enqueue(self, jobs: list[Job]) -> None:
        if self.reject is not None:
            raise JobRejected(self.reject)
        for job in jobs:
            self.running[job.identifier] = (job, -1)
            self.enqueued.append(job.identifier)

    def cancel(self, job: Job) -> None:
        if job.identifier in self.running:
            self.cancelled.add(job.identifier)

    def num_active_jobs(self) -> int:
        return len(self.running)

    def iterate(self) -> list[EngineOutput]:
        time.sleep(0.001)
        if self.crash is not None:
            message, self.crash = self.crash, None
            raise RuntimeError(message)
        outputs = []
        for identifier, (job, produced) in list(self.running.items()):
            outputs.append(self._step(identifier, job, produced))
        return outputs

    def _step(self, identifier: Any, job: Job, produced: int) -> EngineOutput:
        if produced < 0:
            self.running[identifier] = (job, 0)
            return EngineOutput(job=job, serial=0, identifier=identifier, stage=Stage.STARTED, eos=False)
        if identifier in self.fail:
            del self.running[identifier]
            return EngineOutput(job=job, serial=0, identifier=identifier, stage=Stage.EOS, eos=True,
                                eos_reason=FinishReason.ERROR, error="sample failed")
        cancelled = identifier in self.cancelled
        produced += 0 if cancelled else 1
        self.running[identifier] = (job, produced)
        done = cancelled or produced >= job.max_new_tokens
        if not done:
            return EngineOutput(job=job, serial=0, identifier=identifier, stage=Stage.STREAMING, eos=False,
                                text="t", token_ids=[7])
        del self.running[identifier]
        return EngineOutput(
            job=job, serial=0, identifier=identifier, stage=Stage.EOS, eos=True, text="" if cancelled else "t",
            token_ids=[] if cancelled else [7],
            eos_reason=FinishReason.CANCELLED if cancelled else FinishReason.MAX_NEW_TOKENS,
            full_completion="t" * produced, completion_ids=[7] * produced, new_tokens=produced,
            prompt_tokens=len(job.input_ids), cached_tokens=0, time_enqueued=0.0, time_prefill=0.0,
            time_generate=0.0)


class StandInPublisher:
    """Records what the loop publishes, in order."""

    def __init__(self) -> None:
        self.events: list[StreamEvent] = []
        self.finals: dict[str, dict[str, Any]] = {}
        self.tenants: dict[str, str | None] = {}
        self._lock = threading.Lock()

    def publish(self, events: list[StreamEvent], finals: dict[str, str] | None = None,
                tenants: dict[str, str | None] | None = None) -> None:
        with self._lock:
            self.events.extend(events)
            self.finals.update({task_id: json.loads(result) for task_id, result in (finals or {}).items()})
            self.tenants.update(tenants or {})

    def kinds(self, identifier: str) -> list[str]:
        with self._lock:
            return [e.event for e in self.events if e.id == identifier]


@pytest.fixture
def generator() -> StandInGenerator:
    return StandInGenerator()


@pytest.fixture
def publisher() -> StandInPublisher:
    return StandInPublisher()


@pytest.fixture
def loop(generator: StandInGenerator, publisher: StandInPublisher) -> Iterator[EngineLoop]:
    loop = EngineLoop(cast(Generator, generator), cast(Publisher, publisher))
    loop.start()
    yield loop
    loop.stop(grace_s=0.0)


def submission(identifier: str, max_new_tokens: int = 3, n: int = 1, task_id: str | None = None,
               deadline: float | None = None, cancel_requested: bool = False, tenant: str | None = None) -> Submission:
    request = GenerationRequest.parse_payload({"prompt": "x", "n": n, "max_new_tokens": max_new_tokens,
                                               "tenant": tenant})
    job = Job([1, 2, 3], max_new_tokens, identifier=identifier)
    jobs = job.samples(n) if n > 1 else [job]
    return Submission(identifier, 1, jobs, request, deadline, task_id or f"task-{identifier}", cancel_requested)


def finished(s: Submission) -> Submission:
    assert s.done.wait(WAIT_S), "the loop never finished the submission"
    return s


def result(s: Submission) -> GenerationResult:
    """The submission's result as the task returns it to the result backend."""
    assert s.result is not None, "the submission has no result"
    return GenerationResult.from_dict(s.result.to_dict())


def run(loop: EngineLoop, s: Submission) -> Submission:
    loop.submit(s)
    return finished(s)


def wait_for(condition: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_request_runs_to_its_end_and_its_result_is_published_with_its_final_event(
        loop: EngineLoop, publisher: StandInPublisher):
    s = run(loop, submission("a", max_new_tokens=3))
    assert s.error is None and not s.requeue
    assert (result(s).text, result(s).finish_reason, result(s).usage.completion_tokens) == ("ttt", "length", 3)
    assert publisher.kinds("a") == ["started", "chunk", "chunk", "chunk", "done"]
    assert [e.seq for e in publisher.events] == [0, 1, 2, 3, 4]
    assert publisher.finals["task-a"] == result(s).to_dict()
    assert (loop.counters.submitted, loop.counters.completed, loop.counters.failed) == (1, 1, 0)
    assert loop.active_identifiers() == []


def test_the_final_event_goes_out_with_its_requests_tenant(loop: EngineLoop, publisher: StandInPublisher):
    """The publisher counts the task's usage under it in the final event's pipeline (issue 29)."""
    run(loop, submission("a", tenant="acme"))
    run(loop, submission("b", cancel_requested=True, tenant="beta"))
    run(loop, submission("c"))
    assert publisher.tenants == {"a": "acme", "b": "beta", "c": None}


def test_a_cancel_stops_a_running_request(loop: EngineLoop, generator: StandInGenerator,
                                          publisher: StandInPublisher):
    s = submission("a", max_new_tokens=LONG)
    loop.submit(s)
    wait_for(lambda: "chunk" in publisher.kinds("a"))
    assert loop.is_running("a", "task-a") and not loop.is_running("a", "another task")
    assert loop.lease_holders() == {"a": "task-a"}
    loop.cancel("a")
    finished(s)
    assert result(s).finish_reason == "cancelled"
    assert publisher.kinds("a")[-1] == "cancelled" and "a" in generator.cancelled
    assert loop.counters.cancelled == 1


@pytest.mark.parametrize("how", ["cancel key seen at start", "cancel message before the request"])
def test_a_request_cancelled_before_it_starts_never_reaches_the_engine(
        how: str, loop: EngineLoop, generator: StandInGenerator, publisher: StandInPublisher):
    if how == "cancel message before the request":
        loop.cancel("b")
        wait_for(lambda: loop.counters.steps > 0)
    s = run(loop, submission("b", n=2, cancel_requested=how == "cancel key seen at start"))
    assert result(s).finish_reason == "cancelled"
    assert [c.finish_reason for c in result(s).choices or []] == ["cancelled", "cancelled"]
    assert result(s).usage.prompt_tokens == 3
    assert publisher.kinds("b") == ["cancelled"] and generator.enqueued == []


def test_a_deadline_ends_the_request_with_what_it_has(loop: EngineLoop, publisher: StandInPublisher):
    s = run(loop, submission("a", max_new_tokens=LONG, deadline=time.time() + 0.05))
    assert result(s).finish_reason == "deadline"
    assert publisher.kinds("a")[-1] == "done" and loop.counters.expired == 1


def test_a_request_the_engine_refuses_fails_with_the_engine_s_message(
        loop: EngineLoop, generator: StandInGenerator, publisher: StandInPublisher):
    generator.reject = "input_ids: 3 tokens + max_new_tokens (9) = 12 exceeds the model's max_seq_len=8"
    s = run(loop, submission("a"))
    assert s.result is None and s.error == generator.reject
    assert [(e.event, e.error) for e in publisher.events] == [("error", generator.reject)]
    assert loop.counters.failed == 1


def test_a_second_delivery_of_a_running_task_is_a_duplicate_and_another_task_on_its_identifier_fails(
        loop: EngineLoop, publisher: StandInPublisher):
    first = submission("a", max_new_tokens=LONG)
    loop.submit(first)
    wait_for(lambda: loop.is_running("a", "task-a"))
    again = run(loop, submission("a"))
    other = run(loop, submission("a", task_id="task-b"))
    assert again.duplicate and again.error is None and again.result is None
    assert other.error == "identifier: 'a' is already generating" and not other.duplicate
    assert "error" not in publisher.kinds("a")  # the stream belongs to the running request
    loop.cancel("a")
    finished(first)


def test_a_failing_sample_stops_its_siblings_and_fails_the_request(
        loop: EngineLoop, generator: StandInGenerator, publisher: StandInPublisher):
    generator.fail.add(("a", 1))
    s = run(loop, submission("a", max_new_tokens=LONG, n=2))
    assert s.error == "sample failed" and s.result is None
    assert ("a", 0) in generator.cancelled
    assert publisher.kinds("a")[-1] == "error"


def test_an_engine_step_that_raises_fails_every_running_request_and_the_loop_goes_on(
        loop: EngineLoop, generator: StandInGenerator, publisher: StandInPublisher):
    s = submission("a", max_new_tokens=LONG)
    loop.submit(s)
    wait_for(lambda: loop.is_running("a", "task-a"))
    generator.crash = "boom"
    finished(s)
    assert s.error == "engine error: boom"
    assert publisher.kinds("a")[-1] == "error" and loop.active_identifiers() == []
    after = run(loop, submission("c"))
    assert result(after).finish_reason == "length"


def test_a_drain_past_its_grace_requeues_running_requests_and_refuses_new_ones(
        generator: StandInGenerator, publisher: StandInPublisher):
    loop = EngineLoop(cast(Generator, generator), cast(Publisher, publisher))
    loop.start()
    s = submission("a", max_new_tokens=LONG)
    loop.submit(s)
    wait_for(lambda: loop.is_running("a", "task-a"))
    loop.stop(grace_s=0.05)
    assert s.done.is_set() and s.requeue and s.result is None and s.error is None
    assert "a" in generator.cancelled and loop.counters.requeued == 1
    assert publisher.kinds("a")[-1] != "done" and "task-a" not in publisher.finals
    with pytest.raises(ShuttingDown):
        loop.submit(submission("late"))


def test_a_drain_lets_requests_that_finish_within_the_grace_period_finish(
        generator: StandInGenerator, publisher: StandInPublisher):
    loop = EngineLoop(cast(Generator, generator), cast(Publisher, publisher))
    loop.start()
    s = submission("a", max_new_tokens=20)
    loop.submit(s)
    loop.stop(grace_s=WAIT_S)
    assert result(s).finish_reason == "length" and not s.requeue
