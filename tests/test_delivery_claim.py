"""The delivery's Redis checks in one script (worker/redelivery.py CLAIM, RELEASE), on a real Redis:
each outcome decide() branches on, in the order it took them before they were one round trip
(issue 30: the worker's CPU per request)."""

from __future__ import annotations

import json

import pytest
import redis

from producer.protocol import attempt_key, cancel_key, final_key, lease_key
from worker.redelivery import LEASE_S, Claim, Redeliveries

TTL_S = 60


@pytest.fixture
def redeliveries(redis_url: str, request: pytest.FixtureRequest) -> Redeliveries:
    """A prefix of the test's own on the session's Redis, through a client that does not decode
    replies, as the worker's."""
    return Redeliveries(redis.Redis.from_url(redis_url), f"claim-{request.node.name}", TTL_S)


def keys_of(redeliveries: Redeliveries, identifier: str, task_id: str) -> tuple[str, str, str, str]:
    prefix = redeliveries.key_prefix
    return (final_key(task_id, prefix), lease_key(identifier, prefix), attempt_key(identifier, prefix),
            cancel_key(identifier, prefix))


def test_a_first_delivery_takes_the_lease_and_begins_attempt_one(redeliveries: Redeliveries):
    client = redeliveries.client
    _, lease, attempt, _ = keys_of(redeliveries, "req", "task-1")
    assert redeliveries.claim("req", "task-1", lambda: False) == Claim(attempt=1)
    assert client.get(lease) == b"task-1" and 0 < client.ttl(lease) <= LEASE_S
    assert client.get(attempt) == b"1" and 0 < client.ttl(attempt) <= TTL_S


def test_the_lease_holder_is_named_and_no_attempt_begins(redeliveries: Redeliveries):
    _, _, attempt, _ = keys_of(redeliveries, "req", "task-1")
    redeliveries.claim("req", "task-1", lambda: False)
    assert redeliveries.claim("req", "task-1", lambda: False) == Claim(holder="task-1")
    assert redeliveries.claim("req", "task-2", lambda: False) == Claim(holder="task-1")
    assert redeliveries.client.get(attempt) == b"1"


def test_a_published_final_answers_before_the_lease_is_looked_at(redeliveries: Redeliveries):
    final, lease, attempt, _ = keys_of(redeliveries, "req", "task-1")
    redeliveries.client.set(final, json.dumps({"text": "done"}))
    redeliveries.client.set(lease, "task-0")
    assert redeliveries.claim("req", "task-1", lambda: False) == Claim(final={"text": "done"})
    assert redeliveries.client.get(lease) == b"task-0" and not redeliveries.client.exists(attempt)


def test_an_identifier_generating_here_takes_the_lease_but_begins_no_attempt(redeliveries: Redeliveries):
    _, lease, attempt, _ = keys_of(redeliveries, "req", "task-1")
    assert redeliveries.claim("req", "task-1", lambda: True) == Claim(active=True)
    assert redeliveries.client.get(lease) == b"task-1" and not redeliveries.client.exists(attempt)


def test_a_cancel_and_earlier_attempts_are_seen_by_the_next_attempt(redeliveries: Redeliveries):
    _, lease, attempt, cancel = keys_of(redeliveries, "req", "task-1")
    redeliveries.client.set(attempt, 2)
    redeliveries.client.set(cancel, 1)
    assert redeliveries.claim("req", "task-1", lambda: False) == Claim(attempt=3, cancel_requested=True)


def test_the_lease_is_released_only_by_its_holder(redeliveries: Redeliveries):
    _, lease, _, _ = keys_of(redeliveries, "req", "task-1")
    redeliveries.claim("req", "task-1", lambda: False)
    redeliveries.release_lease("req", "task-2")
    assert redeliveries.client.get(lease) == b"task-1"
    redeliveries.release_lease("req", "task-1")
    assert not redeliveries.client.exists(lease)


def test_a_claim_after_redis_forgot_its_scripts_loads_them_again(redeliveries: Redeliveries):
    redeliveries.client.script_flush()
    assert redeliveries.claim("req", "task-1", lambda: False) == Claim(attempt=1)
    redeliveries.client.script_flush()
    redeliveries.release_lease("req", "task-1")
    assert not redeliveries.client.exists(keys_of(redeliveries, "req", "task-1")[1])
