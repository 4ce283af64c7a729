"""What an API key's request becomes before it is queued (the app in-process on the test Redis,
its queue unconsumed): the key's tenant replaces the body's, a priority better than the key's
max_priority (or none) is clamped to it; and the worker's usage labels stay bounded."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from producer.gateway.app import create_app
from producer.gateway.settings import GatewaySettings
from producer.protocol import DEFAULT_KEY_PREFIX
from producer.tenants.keys import KeyLimits, KeyStore
from worker.metrics import OTHER_TENANTS, TenantLabels

TOKEN = "admission-token"


@pytest.fixture
def unconsumed(redis_url: str) -> Iterator[tuple[TestClient, str]]:
    queue = f"genq-unconsumed-{uuid.uuid4().hex[:8]}"
    settings = GatewaySettings(token=TOKEN, redis_url=redis_url, queue=queue)
    with TestClient(create_app(settings)) as client:
        yield client, queue
    redis.Redis.from_url(redis_url).delete(*([queue] + [f"{queue}\x06\x16{level}" for level in range(1, 10)]))


def queued(redis_url: str, queue: str, level: int) -> list[dict[str, Any]]:
    """The kwargs of the messages waiting at one priority level (kombu's list per level)."""
    name = queue if level == 0 else f"{queue}\x06\x16{level}"
    messages = [json.loads(raw) for raw in redis.Redis.from_url(redis_url).lrange(name, 0, -1)]
    return [json.loads(base64.b64decode(message["body"]))[1] for message in messages]


def test_a_keys_request_runs_as_its_tenant_at_no_better_than_its_max_priority(
        unconsumed: tuple[TestClient, str], redis_client: redis.Redis, redis_url: str):
    client, queue = unconsumed
    _, key = KeyStore(redis_client, DEFAULT_KEY_PREFIX).create("prio", "p", KeyLimits(max_priority=3))
    headers = {"Authorization": f"Bearer {key}"}
    for priority in (0, None, 7):
        body = {"prompt": "waits", "tenant": "someone-else", **({} if priority is None else {"priority": priority})}
        assert client.post("/v1/tasks", headers=headers, json=body).status_code == 202
    clamped, kept = queued(redis_url, queue, 3), queued(redis_url, queue, 7)
    assert [(k["priority"], k["tenant"]) for k in clamped] == [(3, "prio"), (3, "prio")]
    assert [(k["priority"], k["tenant"]) for k in kept] == [(7, "prio")]
    admin = client.post("/v1/tasks", headers={"Authorization": f"Bearer {TOKEN}"},
                        json={"prompt": "waits", "tenant": "chosen", "priority": 1})
    assert admin.status_code == 202
    assert [(k["priority"], k["tenant"]) for k in queued(redis_url, queue, 1)] == [(1, "chosen")]


def test_an_unknown_key_is_refused_naming_what_to_send(unconsumed: tuple[TestClient, str]):
    client, _ = unconsumed
    refused = client.post("/v1/tasks", headers={"Authorization": "Bearer gk_0123456789abcdef." + "A" * 43},
                          json={"prompt": "x"})
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"


def test_tenant_labels_are_the_first_n_tenants_and_other():
    label = TenantLabels(2)
    assert [label(t) for t in ("a", "b", "c", "a", "d", "b")] == ["a", "b", OTHER_TENANTS, "a", OTHER_TENANTS, "b"]


def test_an_identifier_in_use_is_refused_before_admission_takes_a_slot(unconsumed: tuple[TestClient, str],
                                                                       redis_client: redis.Redis):
    """The 409 comes first, so the refused copy neither takes a slot nor frees the one its
    identifier's running task holds."""
    client, _ = unconsumed
    _, key = KeyStore(redis_client, DEFAULT_KEY_PREFIX).create("dup", "d", KeyLimits(concurrent=2))
    headers = {"Authorization": f"Bearer {key}"}
    identifier = f"dup-{uuid.uuid4().hex[:8]}"
    assert client.post("/v1/tasks", headers=headers, json={"prompt": "x", "identifier": identifier}).status_code == 202
    again = client.post("/v1/tasks", headers=headers, json={"prompt": "x", "identifier": identifier})
    assert again.status_code == 409 and again.json()["error"]["code"] == "identifier_in_use"
    assert client.post("/v1/tasks", headers=headers, json={"prompt": "x"}).status_code == 202
    refused = client.post("/v1/tasks", headers=headers, json={"prompt": "x"})
    assert refused.status_code == 429 and "2 tasks at once" in refused.json()["error"]["message"]
