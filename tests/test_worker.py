"""The worker service end to end: a real redis-server, real `genq worker`
processes, tasks sent with a plain Celery client."""

from __future__ import annotations

import base64
import itertools
import json
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from engine import Generator, Job
from producer.control import request_cancel
from producer.protocol import TASK_NAME, StreamEvent, channel_name, stream_key
from tests.service import chunk_text, next_event, replay
from worker.processes import FlowerProcess, WorkerProcess, wait_until

QUEUE = "genq-test"
ENGINE_OPTIONS = {"cache_tokens": 16384, "page_size": 16}
_names = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def start_worker(
    model_dir: Path, redis_url: str, client: Celery, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(queue: str = QUEUE, **options: Any) -> WorkerProcess:
        name = f"w{next(_names)}"
        process = WorkerProcess(model_dir, redis_url, queue, name, tmp_path_factory.mktemp(name) / "worker.log",
                                {**ENGINE_OPTIONS, "concurrency": 64, **options})
        started.append(process.start())
        process.wait_ready(client)
        return process

    yield start
    for process in started:
        process.stop()


@pytest.fixture(scope="module")
def worker(start_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return start_worker()


def send(client: Celery, queue: str = QUEUE, **kwargs: Any):
    return client.send_task(TASK_NAME, kwargs=kwargs, queue=queue)


def check_stream(events: list[StreamEvent], final_text: str) -> None:
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[0].event == "started" and events[-1].is_terminal
    assert chunk_text(events) == final_text == events[-1].text


def test_64_tasks_at_once_complete_in_one_batch_and_match_the_engine_alone(
    worker: WorkerProcess, client: Celery, redis_client: redis.Redis, model_dir: Path
):
    prompts = [f"Request {i}: " + "once upon a time " * (1 + i % 7) for i in range(64)]
    handles = [send(client, prompt=p, max_new_tokens=24, identifier=f"bulk-{i}") for i, p in enumerate(prompts)]
    results = [h.get(timeout=300) for h in handles]
    stats = worker.engine_stats(client)
    assert stats is not None and stats["peak_active_jobs"] >= 16
    for i, result in enumerate(results):
        assert result["id"] == f"bulk-{i}" and result["finish_reason"] in ("stop", "length")
        check_stream(replay(redis_client, f"bulk-{i}"), result["text"])
    alone = Generator.from_pretrained(model_dir, **ENGINE_OPTIONS)
    assert [r["text"] for r in results] == alone.generate(prompts, max_new_tokens=24)


def test_late_subscriber_gets_the_whole_stream_without_gap_or_duplicate(
    worker: WorkerProcess, client: Celery, redis_client: redis.Redis
):
    identifier = "late-subscriber"
    observer = redis_client.pubsub(ignore_subscribe_messages=True)
    observer.subscribe(channel_name(identifier))
    handle = send(client, prompt="The weather today", max_new_tokens=300, ignore_eos=True, identifier=identifier)
    seen_chunks = 0
    while seen_chunks < 3:
        seen_chunks += next_event(observer).event == "chunk"
    # the documented recipe: SUBSCRIBE first, then read the replay stream, then live
    late = redis_client.pubsub(ignore_subscribe_messages=True)
    late.subscribe(channel_name(identifier))
    events = {(e.attempt, e.seq): e for e in replay(redis_client, identifier)}
    replayed = len(events)
    while not any(e.is_terminal for e in events.values()):
        event = next_event(late)
        events.setdefault((event.attempt, event.seq), event)
    result = handle.get(timeout=60)
    assert replayed >= 4 and len(events) > replayed
    check_stream([events[k] for k in sorted(events)], result["text"])


INVALID_REQUESTS: list[tuple[dict[str, Any], str]] = [
    ({"prompt": "x", "bogus": 1}, "bogus"),
    ({}, "prompt"),
    ({"prompt": "x", "input_ids": [5]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt": "x", "max_new_tokens": 10**6}, "max_new_tokens"),
    ({"prompt": "x", "max_new_tokens": 4, "min_new_tokens": 8}, "min_new_tokens"),
    ({"prompt": "x", "sampling": {"temperature": -1}}, "sampling.temperature"),
    ({"prompt": "x", "sampling": {"temperature": "hot"}}, "sampling.temperature"),
    ({"prompt": "x", "sampling": {"top_p": 0}}, "sampling.top_p"),
    ({"prompt": "x", "sampling": {"token_bias": {"abc": 1.0}}}, "sampling.token_bias"),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop"),
    ({"prompt": "x", "stop": ["s" * 300]}, "stop"),
    ({"input_ids": [5, -1]}, "input_ids"),
    ({"prompt": "x", "priority": 10}, "priority"),
    ({"prompt": "x", "deadline": 2e9, "timeout_s": 5}, "deadline"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"prompt": "x", "identifier": "bad id!"}, "identifier"),
    ({"input_ids": [5, 10**6]}, "vocabulary"),
    ({"input_ids": [5] * 1100, "max_new_tokens": 8}, "max_seq_len"),
    ({"prompt": "x", "sampling": {"banned_token_ids": [10**6]}}, "banned_token_ids"),
]


def test_invalid_requests_fail_clearly_while_valid_ones_finish(
    worker: WorkerProcess, client: Celery, redis_client: redis.Redis
):
    bad = []
    for i, (kwargs, field) in enumerate(INVALID_REQUESTS):
        kwargs = {"identifier": f"invalid-{i}", **kwargs}
        bad.append((send(client, **kwargs), kwargs, field))
    good = [send(client, prompt=f"valid {i}", max_new_tokens=16, identifier=f"valid-{i}") for i in range(4)]
    for handle, kwargs, field in bad:
        handle.get(timeout=120, propagate=False)
        assert handle.state == "FAILURE", kwargs
        message = str(handle.result)
        assert field in message, (field, message)
        stream_id = kwargs["identifier"] if kwargs["identifier"] != "bad id!" else handle.id
        events = replay(redis_client, stream_id)
        assert events[-1].event == "error" and field in (events[-1].error or ""), (field, events)
    for i, handle in enumerate(good):
        result = handle.get(timeout=120)
        assert result["usage"]["completion_tokens"] > 0
        check_stream(replay(redis_client, f"valid-{i}"), result["text"])


def test_cancel_before_start_and_mid_stream_frees_every_page(
    worker: WorkerProcess, client: Celery, redis_client: redis.Redis
):
    idle = worker.engine_stats(client)
    assert idle is not None and idle["pages_used"] == 0
    request_cancel(redis_client, "cancel-early")
    early = send(client, prompt="never runs", max_new_tokens=50, identifier="cancel-early")
    assert early.get(timeout=60)["finish_reason"] == "cancelled"
    assert [e.event for e in replay(redis_client, "cancel-early")] == ["cancelled"]

    watcher = redis_client.pubsub(ignore_subscribe_messages=True)
    watcher.subscribe(channel_name("cancel-mid"))
    mid = send(client, prompt="a long story", max_new_tokens=900, ignore_eos=True, identifier="cancel-mid")
    while next_event(watcher).event != "chunk":
        pass
    request_cancel(redis_client, "cancel-mid")
    result = mid.get(timeout=60)
    assert result["finish_reason"] == "cancelled" and 0 < result["usage"]["completion_tokens"] < 900
    events = replay(redis_client, "cancel-mid")
    assert events[-1].event == "cancelled"
    check_stream(events, result["text"])
    after = worker.engine_stats(client)
    assert after is not None and after["pages_used"] == 0 and after["active_jobs"] == 0


def start_generating(worker: WorkerProcess, client: Celery, name: str, jobs: int, tokens: int = 300) -> list[Any]:
    """Send `jobs` jobs of `tokens` tokens to the worker's queue (identifiers name-0, name-1, ...) and
    wait until it generates them all; their handles."""
    handles = [send(client, worker.queue, prompt=f"{name} {i}", max_new_tokens=tokens, ignore_eos=True,
                    identifier=f"{name}-{i}") for i in range(jobs)]

    def all_generating() -> bool:
        stats = worker.engine_stats(client)
        return bool(stats) and stats["active_jobs"] == jobs and stats["generated_tokens"] >= 2 * jobs

    wait_until(all_generating, 120, f"{jobs} jobs generating on {worker.node}")
    return handles


def test_sigkilled_worker_loses_nothing_its_tasks_complete_on_the_next(
    start_worker: Callable[..., WorkerProcess], client: Celery, redis_client: redis.Redis
):
    # The visibility timeout must outlast a whole generation on the next worker (or the
    # still-running tasks are redelivered again), yet keep the test short.
    queue = "genq-kill"
    first = start_worker(queue, visibility_timeout=20)
    handles = start_generating(first, client, "kill", 20)
    # Generated is not yet published: kill only once every job's first attempt is on its stream.
    wait_until(lambda: all(replay(redis_client, f"kill-{i}") for i in range(20)), 120,
               "every job's attempt-1 events on its replay stream")
    first.kill()
    start_worker(queue, visibility_timeout=20)
    for i, handle in enumerate(handles):
        result = handle.get(timeout=300)
        assert result["attempt"] == 2 and result["usage"]["completion_tokens"] == 300
        events = replay(redis_client, f"kill-{i}")
        assert {e.attempt for e in events} == {1, 2}
        second = [e for e in events if e.attempt == 2]
        check_stream(second, result["text"])


def test_flower_api_shows_the_engine_stats_of_a_running_worker(
    worker: WorkerProcess, redis_url: str, tmp_path: Path
):
    with FlowerProcess(redis_url, tmp_path / "flower.log") as flower:
        engines = wait_until(lambda: flower.engine_stats([worker.node]), 60,
                             "Flower to report the worker's engine stats", interval=0.5)
    engine = engines[worker.node]
    pages = ENGINE_OPTIONS["cache_tokens"] // ENGINE_OPTIONS["page_size"]
    assert f" of {pages:,} pages in use" in engine["genq KV cache"]
    assert {"genq jobs", "genq throughput", "genq tokens", "genq requests"} <= engine.keys()


def test_warm_shutdown_finishes_in_flight_jobs_and_stops_consuming(
    start_worker: Callable[..., WorkerProcess], client: Celery, redis_client: redis.Redis
):
    queue = "genq-warm"
    first = start_worker(queue, shutdown_grace=120)
    running = start_generating(first, client, "warm", 5)
    first.signal(signal.SIGTERM)
    later = send(client, queue, prompt="sent during shutdown", max_new_tokens=8, identifier="warm-later")
    assert first.wait(120) == 0
    for handle in running:
        result = handle.get(timeout=10)
        assert result["attempt"] == 1 and result["usage"]["completion_tokens"] == 300
    start_worker(queue)
    # The stopping worker may still have received it, but never generated it: only the next worker's attempt did.
    result = later.get(timeout=120)
    events = replay(redis_client, "warm-later")
    assert {e.attempt for e in events} == {result["attempt"]}
    check_stream(events, result["text"])


def task_events(watcher: Any) -> list[dict[str, Any]]:
    """Every Celery event (task.multi batches unpacked) that the pattern subscription holds."""
    events: list[dict[str, Any]] = []
    while (message := watcher.get_message(timeout=1.0)) is not None:
        if message["type"] != "pmessage":
            continue
        envelope = json.loads(message["data"])
        body = envelope["body"]
        if envelope.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        decoded = json.loads(body)
        events.extend(decoded if isinstance(decoded, list) else [decoded])
    return events


def test_a_stopping_worker_sends_its_buffered_task_events_before_it_exits(
    start_worker: Callable[..., WorkerProcess], client: Celery, redis_client: redis.Redis
):
    """Task events go out in batches every 100 ms (worker/consumer.py): those of the jobs that
    finish during a warm shutdown still reach Flower, flushed before Celery closes its dispatcher."""
    watcher = redis_client.pubsub()
    watcher.psubscribe("*celeryev*")
    confirmed = watcher.get_message(timeout=10)
    assert confirmed is not None and confirmed["type"] == "psubscribe"
    worker = start_worker("genq-events-stop", shutdown_grace=120)
    running = start_generating(worker, client, "events-stop", 3)
    worker.signal(signal.SIGTERM)
    assert worker.wait(120) == 0
    succeeded = {event["uuid"] for event in task_events(watcher) if event.get("type") == "task-succeeded"}
    watcher.close()
    assert {handle.id for handle in running} <= succeeded


def test_warm_shutdown_past_its_grace_requeues_jobs_for_the_next_worker(
    start_worker: Callable[..., WorkerProcess], client: Celery, redis_client: redis.Redis
):
    queue = "genq-requeue"
    first = start_worker(queue, shutdown_grace=0)
    handles = start_generating(first, client, "requeue", 5, tokens=600)
    first.signal(signal.SIGTERM)
    assert first.wait(120) == 0
    start_worker(queue)
    for i, handle in enumerate(handles):
        result = handle.get(timeout=300)
        assert result["attempt"] == 2 and result["usage"]["completion_tokens"] == 600
        check_stream([e for e in replay(redis_client, f"requeue-{i}") if e.attempt == 2], result["text"])


def test_deadline_ends_a_generation_with_what_it_produced(
    worker: WorkerProcess, client: Celery, redis_client: redis.Redis
):
    handle = send(client, prompt="slowly", max_new_tokens=1000, ignore_eos=True, timeout_s=0.5, identifier="late")
    result = handle.get(timeout=60)
    assert result["finish_reason"] == "deadline" and result["usage"]["completion_tokens"] < 1000
    events = replay(redis_client, "late")
    assert events[-1].event == "done" and events[-1].finish_reason == "deadline"
    check_stream(events, result["text"])
    stats = worker.engine_stats(client)
    assert stats is not None and stats["pages_used"] == 0


def test_chat_messages_are_rendered_with_the_model_chat_template(
    worker: WorkerProcess, client: Celery, model_dir: Path
):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    result = send(client, messages=messages, max_new_tokens=12, identifier="chat-1").get(timeout=60)
    alone = Generator.from_pretrained(model_dir, **ENGINE_OPTIONS)
    prompt_ids = alone.tokenizer.encode_chat(messages)
    assert result["usage"]["prompt_tokens"] == len(prompt_ids)
    alone.enqueue(Job(prompt_ids, 12))
    final = [r for r in iter_results(alone) if r["eos"]][0]
    assert result["text"] == final["full_completion"]


def iter_results(generator: Generator) -> Iterator[dict[str, Any]]:
    while generator.num_remaining_jobs():
        yield from generator.iterate()


def test_a_pickled_task_message_is_refused_unrun(
    worker: WorkerProcess, client: Celery, redis_client: redis.Redis, redis_url: str
):
    pickler = Celery("pickler", broker=redis_url, backend=redis_url)
    pickler.conf.update(task_serializer="pickle", accept_content=["pickle", "json"])
    refused = pickler.send_task(TASK_NAME, kwargs={"prompt": "x", "max_new_tokens": 4, "identifier": "pickled"},
                                queue=QUEUE)
    send(client, prompt="after the pickle", max_new_tokens=4, identifier="after-pickle").get(timeout=60)
    assert redis_client.llen(QUEUE) == 0
    # Never unpickled: the failure names the content type, and only the task id is readable.
    refused.get(timeout=30, propagate=False)
    assert refused.state == "FAILURE" and "content_type" in str(refused.result)
    assert not redis_client.exists(stream_key("pickled"))
    assert [e.event for e in replay(redis_client, refused.id)] == ["error"]


def test_a_second_task_reusing_a_running_identifier_fails_clearly(worker: WorkerProcess, client: Celery,
                                                                   redis_client: redis.Redis):
    watcher = redis_client.pubsub(ignore_subscribe_messages=True)
    watcher.subscribe(channel_name("twice"))
    first = send(client, prompt="first", max_new_tokens=400, ignore_eos=True, identifier="twice")
    while next_event(watcher).event != "chunk":
        pass
    second = send(client, prompt="second", max_new_tokens=4, identifier="twice")
    second.get(timeout=60, propagate=False)
    assert second.state == "FAILURE" and "already generating" in str(second.result)
    result = first.get(timeout=120)
    assert result["usage"]["completion_tokens"] == 400
    events = [e for e in replay(redis_client, "twice") if e.attempt == result["attempt"]]
    assert all(e.event != "error" for e in events)
    check_stream(events, result["text"])
