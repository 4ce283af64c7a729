"""The worker's result backend (worker/results.py) on the test Redis: a state is stored with SETEX
and PUBLISH and no MULTI/EXEC, genq.generate's STARTED without reading the key first, Celery's
guard of a stored SUCCESS kept for every other write, and what it stores read back by a plain
Celery client (Celery's own backend) as before; chosen for redis:// backends only."""

from __future__ import annotations

import json
import uuid

import redis
from celery import Celery, states
from celery.app.task import Context

from producer.protocol import TASK_NAME
from worker.app import create_app
from worker.results import ResultBackend
from worker.settings import Settings


def _calls(client: redis.Redis, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def _backend(redis_url: str) -> ResultBackend:
    backend = create_app(Settings(redis_url=redis_url)).backend
    assert isinstance(backend, ResultBackend)
    return backend


def test_a_result_is_stored_and_published_without_multi(redis_url: str, redis_client: redis.Redis, client: Celery):
    backend = _backend(redis_url)
    task_id = str(uuid.uuid4())
    key = backend.get_key_for_task(task_id).decode()
    subscriber = redis_client.pubsub()
    subscriber.subscribe(key)
    confirmed = subscriber.get_message(timeout=10)
    assert confirmed is not None and confirmed["type"] == "subscribe"
    multi = _calls(redis_client, "multi")
    backend.mark_as_done(task_id, {"text": "done"}, request=Context(id=task_id, task=TASK_NAME))
    assert _calls(redis_client, "multi") == multi
    message = subscriber.get_message(timeout=10)
    assert message is not None and message["type"] == "message"
    assert json.loads(message["data"])["status"] == states.SUCCESS
    subscriber.close()
    assert redis_client.ttl(key) > 0
    result = client.AsyncResult(task_id)
    assert result.state == states.SUCCESS and result.get(timeout=10) == {"text": "done"}


def test_a_generations_started_state_is_stored_without_reading_it_first(redis_url: str, redis_client: redis.Redis,
                                                                          client: Celery):
    backend = _backend(redis_url)
    task_id = str(uuid.uuid4())
    gets = _calls(redis_client, "get")
    backend.store_result(task_id, {"pid": 1, "hostname": "h"}, states.STARTED,
                         request=Context(id=task_id, task=TASK_NAME))
    assert _calls(redis_client, "get") == gets
    result = client.AsyncResult(task_id)
    assert result.state == states.STARTED and result.info == {"pid": 1, "hostname": "h"}


def test_a_stored_success_is_never_overwritten(redis_url: str, client: Celery):
    backend = _backend(redis_url)
    task_id = str(uuid.uuid4())
    request = Context(id=task_id, task=TASK_NAME)
    backend.mark_as_done(task_id, {"text": "first"}, request=request)
    backend.mark_as_failure(task_id, RuntimeError("late"), request=request, call_errbacks=False)
    backend.store_result(task_id, {"pid": 1}, states.STARTED, request=Context(id=task_id, task="user.task"))
    result = client.AsyncResult(task_id)
    assert result.state == states.SUCCESS and result.get(timeout=10) == {"text": "first"}


def test_the_worker_uses_it_for_redis_urls_only():
    tls = Settings(redis_url="rediss://localhost:6379/0?ssl_cert_reqs=CERT_REQUIRED")
    assert isinstance(create_app(tls).backend, ResultBackend)
    sentinel = create_app(Settings(redis_url="sentinel://localhost:26379", sentinel_master="genq"))
    assert not isinstance(sentinel.backend, ResultBackend)
