"""Malformed and hostile task messages against a real `genq worker`: each is
refused (logged, acknowledged, failed where an id can be read) and the worker
keeps serving valid tasks and answering `inspect ping` (issue 17, cases 1, 2, 6)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from producer.protocol import MAX_PROMPT_CHARS, TASK_NAME
from tests.service import RawPublisher, replay
from worker.processes import WorkerProcess

QUEUE = "genq-hostile"
EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


@pytest.fixture(scope="module")
def worker(module_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker(QUEUE, "hostile", cache_tokens=8192)


@pytest.fixture()
def raw(redis_url: str) -> Iterator[RawPublisher]:
    publisher = RawPublisher(redis_url)
    yield publisher
    publisher.close()


def headers(task_id: str | None, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"lang": "py", "task": TASK_NAME, "retries": 0, "timelimit": [None, None]}
    if task_id is not None:
        base["id"] = task_id
    return {**base, **extra}


def send_valid(client: Celery, identifier: str) -> AsyncResult:
    kwargs = {"prompt": f"valid {identifier}", "max_new_tokens": 4, "ignore_eos": True, "identifier": identifier}
    return client.send_task(TASK_NAME, kwargs=kwargs, queue=QUEUE)


def assert_serving(worker: WorkerProcess, client: Celery, identifier: str) -> None:
    """The worker answers ping and runs a valid task to completion."""
    assert worker.ping(client, timeout=10), worker.log_tail()
    result = send_valid(client, identifier).get(timeout=60)
    assert result["id"] == identifier and result["usage"]["completion_tokens"] == 4


def assert_refused(client: Celery, redis_client: redis.Redis, task_id: str, stream_id: str, field: str) -> None:
    handle = AsyncResult(task_id, app=client)
    handle.get(timeout=30, propagate=False)
    assert handle.state == "FAILURE" and field in str(handle.result), (field, handle.state, handle.result)
    events = replay(redis_client, stream_id)
    assert events and events[-1].event == "error" and field in (events[-1].error or ""), (field, events)


def test_a_body_that_is_an_object_is_refused_and_the_worker_keeps_serving(
    worker: WorkerProcess, client: Celery, redis_client: redis.Redis, raw: RawPublisher
):
    raw.publish(QUEUE, {"prompt": "x", "max_new_tokens": 4}, headers("poison-body"))
    assert_refused(client, redis_client, "poison-body", "poison-body", "body")
    assert_serving(worker, client, "after-poison-body")
    assert redis_client.llen(QUEUE) == 0
    assert "refused a task message (task id 'poison-body'" in worker.log_path.read_text()


def test_a_message_without_an_id_header_is_refused_and_the_worker_answers_ping(
    worker: WorkerProcess, client: Celery, redis_client: redis.Redis, raw: RawPublisher
):
    raw.publish(QUEUE, [[], {"prompt": "x", "identifier": "no-id-header"}, EMBED], headers(None))
    assert_serving(worker, client, "after-no-id")
    assert redis_client.llen(QUEUE) == 0
    log = worker.log_path.read_text()
    assert "refused a task message (task id None, identifier 'no-id-header'): id:" in log
    # No task id: no stored result, but the producer watching its identifier is told.
    events = replay(redis_client, "no-id-header")
    assert [e.event for e in events] == ["error"] and "id:" in (events[0].error or "")


MALFORMED_KWARGS: list[tuple[str, list[Any], str]] = [
    ("kwargs-list", [[], ["prompt", "x"], EMBED], "kwargs"),
    ("kwargs-string", [[], "prompt=x", EMBED], "kwargs"),
    ("kwargs-self", [[], {"prompt": "x", "self": 1, "identifier": "kwargs-self"}, EMBED], "self"),
    ("kwargs-positional", [["x", 4], {}, EMBED], "args"),
    ("kwargs-long-input", [[], {"input_ids": [5] * 5000, "identifier": "kwargs-long-input"}, EMBED], "input_ids"),
    ("kwargs-callbacks", [[], {"prompt": "x"}, {**EMBED, "callbacks": [1]}], "embed.callbacks"),
]


def test_malformed_kwargs_fail_with_a_stored_failure_and_an_error_event_naming_the_field(
    worker: WorkerProcess, client: Celery, redis_client: redis.Redis, raw: RawPublisher
):
    for task_id, body, _ in MALFORMED_KWARGS:
        raw.publish(QUEUE, body, headers(task_id))
    for task_id, _, field in MALFORMED_KWARGS:
        assert_refused(client, redis_client, task_id, task_id, field)
    assert_serving(worker, client, "after-kwargs")


def hostile_messages() -> Iterator[tuple[Any, dict[str, Any] | None, str, str, bool]]:
    """(body, headers, content_type, content_encoding, failure stored?) for every
    kind of malformed message, each with a fresh task id."""

    def fresh() -> str:
        return f"hostile-{uuid.uuid4().hex[:12]}"

    json_bodies: list[Any] = [
        {}, {"prompt": "x"}, "a string", 12, None, True, [], [1], [1, 2], [1, 2, 3, 4], [[[[[[[]]]]]]],
        [{}, {}, {}], ["x", {}, {}], [[1], {"prompt": "x"}, EMBED], [[], [], EMBED], [[], None, EMBED],
        [[], {"prompt": "x"}, "embed"], [[], {"prompt": "x"}, {"chain": "x"}],
        [[], {"prompt": "x"}, {"chord": [{"task": "x"}]}], [[], {"prompt": "x", "max_new_tokens": 10**30}, EMBED],
        [[], {"prompt": "x", "sampling": {"seed": 2**200}}, EMBED],
        [[], {"prompt": "x", "sampling": {"temperature": 1e308}}, EMBED], [[], {"prompt": "x", "self": 2}, EMBED],
        [[], {"prompt": 5}, EMBED], [[], {"prompt": ["x"]}, EMBED], [[], {"input_ids": "1,2,3"}, EMBED],
        [[], {"input_ids": [2**70]}, EMBED], [[], {"prompt": "x", "priority": -1}, EMBED],
        [[], {"prompt": "x", "metadata": {"k": {"nested": [1, 2]}}}, EMBED],
        [[], {"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, EMBED], [[], {"input_ids": [1] * 200_000}, EMBED],
        [[], {"messages": "hello"}, EMBED], [[], {"prompt": "x", "stop": [{"s": 1}]}, EMBED],
    ]
    for body in json_bodies:
        yield body, headers(fresh()), "application/json", "utf-8", True
    bad_headers: list[dict[str, Any]] = [
        {"timelimit": "abc"}, {"timelimit": [1]}, {"eta": "not a date"}, {"eta": 5}, {"expires": "never"},
        {"retries": "x"}, {"shadow": 5}, {"ignore_result": "yes"}, {"argsrepr": {}}, {"root_id": [1]},
    ]
    valid_body = [[], {"prompt": "x", "max_new_tokens": 2}, EMBED]
    for extra in bad_headers:
        yield valid_body, headers(fresh(), **extra), "application/json", "utf-8", True
    for task_id in (None, 12, "", "x" * 300, ["list"]):
        yield valid_body, {**headers(None), "id": task_id}, "application/json", "utf-8", False
    # Ids that would make unsafe Redis keys: refused without storing anything under them.
    for task_id in ("a b", "new\nline", "glob*?[", "nul\x00", "x" * 200):
        yield {"prompt": "x"}, headers(task_id), "application/json", "utf-8", False
    yield valid_body, headers(None), "application/json", "utf-8", False
    yield valid_body, {"id": fresh(), "task": ["unhashable"]}, "application/json", "utf-8", False
    yield valid_body, {"task": "no.such.task"}, "application/json", "utf-8", False
    yield valid_body, {"id": fresh(), "task": "no.such.task"}, "application/json", "utf-8", True
    raw_bodies: list[tuple[bytes, str, str]] = [
        (b"\xff\xfe\xfa invalid utf-8", "application/json", "utf-8"),
        (b"{not json", "application/json", "utf-8"),
        (b"", "application/json", "utf-8"),
        (b"\x80\x04\x95 pickle bytes", "application/x-python-serialize", "binary"),
        (b"- yaml", "application/x-yaml", "utf-8"),
        (b"plain", "text/plain", "utf-8"),
        (b"??", "weird/type", "binary"),
        (b"[[], {}, {}]", "application/json", "no-such-encoding"),
    ]
    for body, content_type, encoding in raw_bodies:
        yield body, headers(fresh()), content_type, encoding, True


def test_hundreds_of_hostile_messages_interleaved_with_valid_tasks_never_stop_the_worker(
    worker: WorkerProcess, client: Celery, redis_client: redis.Redis, raw: RawPublisher
):
    kinds = list(hostile_messages())
    sent: list[tuple[str, bool]] = []
    valid: list[tuple[str, AsyncResult]] = []
    for round_ in range(4):
        for i, (body, message_headers, content_type, encoding, stored) in enumerate(kinds):
            raw.publish(QUEUE, body, message_headers, content_type, encoding)
            sent.append(((message_headers or {}).get("id"), stored))
            if i % 8 == 0:
                identifier = f"interleaved-{round_}-{i}"
                valid.append((identifier, send_valid(client, identifier)))
        assert worker.ping(client, timeout=10), worker.log_tail()  # while the round is being consumed
        valid[-1][1].get(timeout=120)
        assert worker.ping(client, timeout=10), worker.log_tail()  # and once it has been
    assert len(sent) >= 200
    for identifier, handle in valid:
        result = handle.get(timeout=120)
        assert result["id"] == identifier and result["usage"]["completion_tokens"] == 4
        assert [e.event for e in replay(redis_client, identifier)][-1] == "done"
    for task_id, stored in sent:
        if stored:
            handle = AsyncResult(task_id, app=client)
            handle.get(timeout=30, propagate=False)
            assert handle.state == "FAILURE", (task_id, handle.state)
    assert redis_client.llen(QUEUE) == 0
    unsafe = [key for key in redis_client.keys("*") if re.search(rb"[\s*?\[\]\x00]", key) or b"x" * 200 in key]
    assert not unsafe, unsafe
    assert_serving(worker, client, "after-hostile")
