"""The safety net of an API key's concurrency slots (issue 29): a slot whose task never reports
its end (a gateway or queue lost it) frees itself GENQ_GATEWAY_KEY_SLOT_TTL_S after admission,
and not a moment before. The app runs in-process on the test Redis with its queue unconsumed,
so the admitted task never runs and never settles; every clock reading is Redis's, the one the
admission script compares slot expiries with."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from fastapi.testclient import TestClient

from producer.gateway.app import create_app
from producer.gateway.settings import GatewaySettings
from producer.tenants.keys import KeyLimits, KeyStore
from producer.tenants.names import reservation, running_tasks

TOKEN = "slot-token"
SLOT_TTL_S = 2
POLL_S = 0.05


def redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


@pytest.fixture
def queue(redis_client: redis.Redis) -> Iterator[str]:
    name = f"genq-unconsumed-{uuid.uuid4().hex[:8]}"
    yield name
    redis_client.delete(*([name] + [f"{name}\x06\x16{level}" for level in range(1, 10)]))


def test_a_slot_never_released_frees_itself_after_its_ttl_and_not_before(
        redis_url: str, redis_client: redis.Redis, queue: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GENQ_GATEWAY_KEY_SLOT_TTL_S", str(SLOT_TTL_S))
    prefix = f"slots-{uuid.uuid4().hex[:8]}"
    settings = GatewaySettings(token=TOKEN, redis_url=redis_url, queue=queue, key_prefix=prefix)
    assert settings.key_slot_ttl_s == SLOT_TTL_S
    record, key = KeyStore(redis_client, prefix).create("slots", "s", KeyLimits(concurrent=1))
    headers = {"Authorization": f"Bearer {key}"}
    running = running_tasks(prefix, record.id)
    with TestClient(create_app(settings)) as client:
        admitted_at = redis_ms(redis_client)
        held = client.post("/v1/tasks", headers=headers, json={"prompt": "never runs"})
        assert held.status_code == 202, held.text
        held_id = held.json()["id"]
        [(member, expiry_ms)] = redis_client.zrange(running, 0, -1, withscores=True)
        assert member.decode() == held_id
        assert admitted_at + SLOT_TTL_S * 1000 <= expiry_ms <= redis_ms(redis_client) + SLOT_TTL_S * 1000
        assert abs(redis_client.pexpiretime(reservation(prefix, held_id)) - expiry_ms) <= 1  # goes with the slot

        refusals = 0
        deadline = time.monotonic() + SLOT_TTL_S + 30
        while True:
            before = redis_ms(redis_client)
            answer = client.post("/v1/tasks", headers=headers, json={"prompt": "waits for the slot"})
            after = redis_ms(redis_client)
            if answer.status_code == 202:
                assert after >= expiry_ms, f"the slot was freed {expiry_ms - after} ms before its TTL"
                break
            assert answer.status_code == 429, answer.text
            assert "1 tasks at once" in answer.json()["error"]["message"]
            assert before < expiry_ms, f"the slot still held {before - expiry_ms} ms after its TTL"
            refusals += 1
            assert time.monotonic() < deadline, f"the slot was not freed within {SLOT_TTL_S + 30} s"
            time.sleep(POLL_S)  # polling Redis's clock against the slot's expiry, with a deadline
        assert refusals > 0
        assert [m.decode() for m in redis_client.zrange(running, 0, -1)] == [answer.json()["id"]]
