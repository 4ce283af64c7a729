"""The request field `n` through the service: one task, n samples from one real worker."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery

from producer.cli import request_from_args
from producer.client import GenqClient
from producer.protocol import TASK_NAME, GenerationRequest, GenerationResult, ProtocolError
from tests.gateway_service import QUEUE
from tests.service import replay
from worker.cli import build_parser
from worker.processes import WorkerProcess

BASE: dict[str, Any] = {"prompt": "the cat sat on the mat and", "max_new_tokens": 12, "ignore_eos": True,
                        "stream": {"include_token_ids": True}}


def send(client: Celery, identifier: str, **request: Any) -> GenerationResult:
    handle = client.send_task(TASK_NAME, queue=QUEUE, task_id=identifier,
                              kwargs={**BASE, "identifier": identifier, **request})
    return GenerationResult.from_dict(handle.get(timeout=120))


@pytest.mark.parametrize(("n", "expected"), [
    (0, "n: Input should be greater than or equal to 1"),
    (17, "n: Input should be less than or equal to 16"),
    ("2", "n: Input should be a valid integer"),
])
def test_n_is_validated_naming_it(n: Any, expected: str) -> None:
    with pytest.raises(ProtocolError) as error:
        GenerationRequest.parse_payload({"prompt": "hi", "n": n})
    assert expected in str(error.value)


def test_each_sample_is_the_request_alone_with_seed_plus_its_index(
        worker: WorkerProcess, celery_client: Celery, redis_client: redis.Redis) -> None:
    sampling = {"temperature": 1.0, "top_k": 40}
    many = send(celery_client, "n-three", n=3, sampling={**sampling, "seed": 7})
    assert many.choices is not None and [c.index for c in many.choices] == [0, 1, 2]
    alone = [send(celery_client, f"n-alone-{i}", sampling={**sampling, "seed": 7 + i}) for i in range(3)]
    assert [(c.text, c.token_ids) for c in many.choices] == [(a.text, a.token_ids) for a in alone]
    assert len({c.text for c in many.choices}) > 1, "three seeds drew the same text"
    assert (many.text, many.token_ids, many.finish_reason) == (alone[0].text, alone[0].token_ids, "length")
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * 12

    events = replay(redis_client, "n-three")
    assert [e.event for e in events].count("started") == 1 and events[-1].event == "done"
    for choice in many.choices:
        chunks = [e for e in events if e.event == "chunk" and e.index == choice.index]
        assert "".join(e.text for e in chunks) == choice.text
        assert [t for e in chunks for t in e.token_ids or []] == choice.token_ids
    assert events[-1].choices == many.choices and events[-1].text == many.choices[0].text
    assert [e.seq for e in events] == list(range(len(events)))


def test_a_single_sample_request_has_no_index_or_choices(worker: WorkerProcess, celery_client: Celery,
                                                          redis_client: redis.Redis) -> None:
    single = send(celery_client, "n-one", n=1)
    assert single.choices is None
    assert all(e.index is None and e.choices is None for e in replay(redis_client, "n-one"))


def test_the_client_streams_sample_zero_and_cancelling_ends_every_sample(
        worker: WorkerProcess, redis_url: str) -> None:
    with GenqClient(redis_url, queue=QUEUE) as genq:
        handle = genq.submit({**BASE, "n": 2, "sampling": {"temperature": 1.0, "seed": 3}})
        streamed = "".join(handle.stream(timeout=60))
        result = handle.result(timeout=60)
        assert result.choices is not None and streamed == result.choices[0].text == result.text

        long = genq.submit({**BASE, "n": 4, "max_new_tokens": 900, "sampling": {"temperature": 1.0}})
        for event in long.events(timeout=60):
            if event.event == "chunk":
                long.cancel()
                break
        cancelled = long.result(timeout=60)
        assert cancelled.finish_reason == "cancelled" and cancelled.choices is not None
        assert len(cancelled.choices) == 4 and cancelled.usage.completion_tokens < 4 * 900


def test_the_cli_sends_n() -> None:
    args = build_parser().parse_args(["submit", "hello", "--n", "3", "--seed", "1", "--temperature", "0.7"])
    request = request_from_args(args)
    assert request["n"] == 3
    assert GenerationRequest.parse_payload(request).n == 3
