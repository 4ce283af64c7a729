"""The publisher's expiries, on a Redis of the test's own (its command counts are this test's alone):
a stream and its attempt counter always carry one, while the chunks between a stream's first event
and its refreshes send no EXPIRE (issue 30: commands per token)."""

from __future__ import annotations

from pathlib import Path

import redis

from producer.protocol import StreamEvent, attempt_key, stream_key
from worker.processes import RedisServer
from worker.publisher import EXPIRY_REFRESH_EVENTS, Publisher

TTL_S = 60


def expires_sent(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_expire", {}).get("calls", 0))


def test_a_stream_and_its_attempt_counter_expire_with_one_expire_per_begin_end_and_refresh(tmp_path: Path):
    with RedisServer(tmp_path, persistence="none") as server:
        check_expiries(redis.Redis.from_url(server.url))


def check_expiries(redis_client: redis.Redis) -> None:
    prefix, identifier = "expiry", "req"
    publisher = Publisher(redis_client, prefix, stream_maxlen=100, stream_ttl_s=TTL_S)
    attempt, _ = publisher.begin_attempt(identifier)
    chunks = EXPIRY_REFRESH_EVENTS + 1
    before = expires_sent(redis_client)
    publisher.publish([StreamEvent(id=identifier, seq=0, attempt=attempt, event="started")])
    assert expires_sent(redis_client) - before == 1  # the stream's; begin_attempt set the counter's
    for seq in range(1, chunks + 1):
        publisher.publish([StreamEvent(id=identifier, seq=seq, attempt=attempt, event="chunk", text=" a")])
    assert expires_sent(redis_client) - before == 3  # seq 64 refreshes both
    for key in (stream_key(identifier, prefix), attempt_key(identifier, prefix)):
        assert 0 < redis_client.ttl(key) <= TTL_S
    publisher.publish([StreamEvent(id=identifier, seq=chunks + 1, attempt=attempt, event="error", error="x",
                                   finish_reason="error")])
    assert expires_sent(redis_client) - before == 5
    assert redis_client.xlen(stream_key(identifier, prefix)) == chunks + 2
