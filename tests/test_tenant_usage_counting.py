"""The worker's side of usage accounting (issue 29), on the test Redis: the publisher counts a
terminal event's usage once (a resent pipeline counts nothing twice), under its tenant or the
default one; a failed task counts nothing but frees its API key's slot; the ranking of tenants
by tokens that gives out the metrics' labels; the usage keys' expiry set once, at their first count."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import redis
import redis.asyncio

from producer.protocol import StreamEvent, Usage
from producer.tenants.admission import Admission
from producer.tenants.keys import KeyLimits, KeyStore
from producer.tenants.names import DEFAULT_TENANT, hourly, reservation, running_tasks, tenant_usage, tenants_used
from producer.tenants.ranking import top_tenants
from producer.tenants.settle import HOUR_S, hour_of
from worker.publisher import Publisher


def done(identifier: str, usage: Usage) -> StreamEvent:
    return StreamEvent(id=identifier, seq=1, attempt=1, event="done", finish_reason="stop", usage=usage)


def counts(client: redis.Redis, prefix: str, tenant: str, since: float) -> dict[str, int]:
    """The tenant's counts of the hours from `since` to now (a test may cross an hour's end)."""
    total: Counter[str] = Counter()
    for hour in {hour_of(since), hour_of(time.time())}:
        stored = client.hgetall(hourly(tenant_usage(prefix, tenant), hour))
        total.update({name.decode(): int(value) for name, value in stored.items()})
    return dict(total)


def test_each_task_counts_once_under_its_tenant_and_tenants_rank_by_tokens(redis_url: str,
                                                                          redis_client: redis.Redis):
    prefix, since = f"count-{uuid.uuid4().hex[:8]}", time.time()
    seen: list[tuple[str, Usage]] = []
    publisher = Publisher(redis_client, prefix, stream_maxlen=100, stream_ttl_s=60,
                          on_usage=lambda tenant, usage: seen.append((tenant, usage)))
    usages = {"t-small": Usage(prompt_tokens=4, completion_tokens=6, cached_tokens=2),
              "t-big": Usage(prompt_tokens=70, completion_tokens=30),
              "t-mid": Usage(prompt_tokens=20, completion_tokens=30, cached_tokens=16)}
    for tenant, usage in usages.items():
        publisher.publish([done(f"task-{tenant}", usage)], tenants={f"task-{tenant}": tenant})
    publisher.publish([done("task-t-big", usages["t-big"])], tenants={"task-t-big": "t-big"})  # resent
    publisher.publish([done("task-nobody", Usage(prompt_tokens=1, completion_tokens=1))])

    for tenant, usage in usages.items():
        assert counts(redis_client, prefix, tenant, since) == {**usage.model_dump(), "requests": 1}
    assert counts(redis_client, prefix, DEFAULT_TENANT, since) == {"prompt_tokens": 1, "completion_tokens": 1,
                                                            "cached_tokens": 0, "requests": 1}
    assert sorted(tenant for tenant, _ in seen) == sorted([*usages, DEFAULT_TENANT])
    assert top_tenants(redis_client, prefix, 2, hours=24) == ["t-big", "t-mid"]


def test_a_failed_task_counts_nothing_and_frees_its_keys_slot(redis_url: str, redis_client: redis.Redis):
    prefix, since = f"fail-{uuid.uuid4().hex[:8]}", time.time()
    key, _ = KeyStore(redis_client, prefix).create("failing", "f", KeyLimits(concurrent=1))

    async def admit(identifier: str) -> str:
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            return (await Admission(client, prefix, 600, 600).admit(key, [(identifier, 10)])).refused
        finally:
            await client.aclose()

    assert asyncio.run(admit("first")) == ""
    assert asyncio.run(admit("second")) == "concurrent"
    publisher = Publisher(redis_client, prefix, stream_maxlen=100, stream_ttl_s=60)
    publisher.publish([StreamEvent(id="first", seq=1, attempt=1, event="error", finish_reason="error",
                                   error="the engine failed")], tenants={"first": "failing"})
    assert redis_client.zcard(running_tasks(prefix, key.id)) == 0
    assert not redis_client.exists(reservation(prefix, "first"))
    assert counts(redis_client, prefix, "failing", since) == {}
    assert asyncio.run(admit("second")) == ""


def test_a_final_event_counts_once_when_redis_has_not_loaded_the_settlement_script(redis_client: redis.Redis):
    """The pipeline sends the settlement as a bare EVALSHA (no SCRIPT EXISTS round trip before it):
    a Redis without the script (just restarted, or this worker's first final event) runs it anyway."""
    prefix, since = f"noscript-{uuid.uuid4().hex[:8]}", time.time()
    seen: list[tuple[str, Usage]] = []
    publisher = Publisher(redis_client, prefix, stream_maxlen=100, stream_ttl_s=60,
                          on_usage=lambda tenant, usage: seen.append((tenant, usage)))
    usage = Usage(prompt_tokens=3, completion_tokens=5)
    for identifier in ("task-a", "task-b"):
        redis_client.script_flush()
        publisher.publish([done(identifier, usage)], tenants={identifier: "t-flushed"})
    assert counts(redis_client, prefix, "t-flushed", since) == {"prompt_tokens": 6, "completion_tokens": 10,
                                                                "cached_tokens": 0, "requests": 2}
    assert [tenant for tenant, _ in seen] == ["t-flushed", "t-flushed"]


def test_the_usage_keys_expire_an_hour_past_the_retention_set_at_their_first_count_only(redis_client: redis.Redis):
    prefix, retention = f"ttl-{uuid.uuid4().hex[:8]}", 1000
    publisher = Publisher(redis_client, prefix, stream_maxlen=100, stream_ttl_s=60, usage_retention_s=retention)
    publisher.publish([done("ttl-first", Usage(prompt_tokens=1, completion_tokens=1))], tenants={"ttl-first": "t"})
    hour = hour_of(time.time())
    usage, tenants = hourly(tenant_usage(prefix, "t"), hour), tenants_used(prefix, hour)
    assert retention < redis_client.ttl(usage) <= retention + HOUR_S
    assert retention < redis_client.ttl(tenants) <= retention + HOUR_S
    redis_client.expire(usage, 100)  # marks the expiry: a later count of this hour must leave it be
    redis_client.expire(tenants, 100)
    publisher.publish([done("ttl-second", Usage(prompt_tokens=1, completion_tokens=1))], tenants={"ttl-second": "t"})
    if hour_of(time.time()) == hour:  # the second count landed in the same hour's keys
        assert redis_client.ttl(usage) <= 100 and redis_client.ttl(tenants) <= 100
        assert int(redis_client.hget(usage, "requests") or 0) == 2
