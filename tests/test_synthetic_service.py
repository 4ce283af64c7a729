"""A real `genq worker --synthetic-rate` (engine/synthetic.py) behind a real Redis: its text
streams end to end as the real engine's does, a cancel ends it, and its model card says it is
synthetic."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from pydantic import ValidationError

from producer.client import GenqClient
from producer.model_card import card_key
from producer.model_routes import live_cards
from tests.gateway_service import celery_client, model_dir, running_worker  # noqa: F401 - fixtures
from tests.service import chunk_text
from worker.processes import WorkerProcess
from worker.settings import Settings

QUEUE = "genq-synthetic"
RATE = 500
"""Slow enough that a 900-token request runs for seconds (one job: 1.8 s), to cancel it meanwhile."""


@pytest.fixture(scope="module")
def worker(model_dir: Path, redis_url: str, celery_client: Celery,  # noqa: F811 - the fixtures imported above
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    with running_worker(model_dir, redis_url, celery_client, tmp_path_factory.mktemp("synthetic"), QUEUE,
                        "synthetic", synthetic_rate=RATE) as process:
        yield process


@pytest.fixture(scope="module")
def client(worker: WorkerProcess, redis_url: str) -> Iterator[GenqClient]:
    with GenqClient(redis_url, queue=QUEUE) as client:
        yield client


def test_text_streams_end_to_end_and_stops_where_asked(client: GenqClient):
    handle = client.submit({"prompt": "Once upon a time", "max_new_tokens": 24})
    events = list(handle.events(timeout=60))
    result = handle.result(timeout=60)
    assert events[0].event == "started" and events[-1].is_terminal
    assert [e.seq for e in events] == list(range(len(events)))
    assert chunk_text(events) == result.text
    assert result.finish_reason == "length" and result.usage.completion_tokens == 24
    assert re.fullmatch(r"( [a-z]{3,}){24}", result.text)
    words = result.text.split(" ")[1:]
    stop = f" {words[3]} {words[4]}"
    stopped = client.submit({"prompt": "Another prompt", "max_new_tokens": 24, "stop": [stop]}).result(timeout=60)
    assert stopped.finish_reason == "stop" and stopped.text == "".join(f" {w}" for w in words[:3])


def test_a_cancel_ends_a_running_request(client: GenqClient):
    handle = client.submit({"prompt": "a long story", "max_new_tokens": 900})
    events = handle.events(timeout=60)
    while next(events).event != "chunk":
        pass
    handle.cancel()
    result = handle.result(timeout=60)
    assert result.finish_reason == "cancelled" and 0 < result.usage.completion_tokens < 900


def test_the_model_card_says_the_engine_is_synthetic(worker: WorkerProcess, redis_client: redis.Redis):
    key = card_key(QUEUE, "genq")
    assert key is not None
    (card,) = live_cards(redis_client.hgetall(key), key)
    assert card.model == f"{worker.model} (synthetic engine, {RATE} tokens/s)"


def test_the_option_refuses_what_needs_a_model():
    with pytest.raises(ValidationError, match="GENQ_SYNTHETIC_RATE: the synthetic engine has no model for "
                                              "GENQ_LORA, GENQ_DRAFT_MODEL"):
        Settings(model="m", synthetic_rate=1000, lora=["a=/x"], draft_model="/d")
    with pytest.raises(ValidationError, match="synthetic_rate"):
        Settings(model="m", synthetic_rate=0)
    with pytest.raises(ValidationError, match="GENQ_SYNTHETIC_STEP_MS: only with GENQ_SYNTHETIC_RATE"):
        Settings(model="m", synthetic_step_ms=15)
