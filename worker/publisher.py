"""Publishes stream events to Redis: per engine step, ONE pipeline carrying
every event of the step, each both PUBLISHed on its request's channel (live
subscribers) and XADDed to its replay stream (late or reconnecting ones)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import redis

from producer.protocol import STREAM_FIELD, StreamEvent, cancel_key, channel_name, stream_key


class Publisher:
    def __init__(self, client: redis.Redis, key_prefix: str, stream_maxlen: int, stream_ttl_s: int) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.stream_maxlen = stream_maxlen
        self.stream_ttl_s = stream_ttl_s

    def publish(self, events: Sequence[StreamEvent]) -> None:
        if not events:
            return
        pipe = self.client.pipeline(transaction=False)
        expiring: set[str] = set()
        for event in events:
            payload = event.to_json()
            key = stream_key(event.id, self.key_prefix)
            pipe.publish(channel_name(event.id, self.key_prefix), payload)
            pipe.xadd(key, {STREAM_FIELD: payload}, maxlen=self.stream_maxlen, approximate=True)
            expiring.add(key)
        for key in expiring:
            pipe.expire(key, self.stream_ttl_s)
        pipe.execute()

    def next_attempt(self, identifier: str) -> int:
        """1 for the first delivery of a request, 2 for its first redelivery, ..."""
        key = f"{self.key_prefix}:attempt:{identifier}"
        pipe = self.client.pipeline(transaction=True)
        pipe.incr(key)
        pipe.expire(key, self.stream_ttl_s)
        return int(pipe.execute()[0])

    def cancel_requested(self, identifiers: Iterable[str]) -> set[str]:
        """Which of these requests have a cancel key set (cancelled before they reached the engine)."""
        ids = list(identifiers)
        if not ids:
            return set()
        pipe = self.client.pipeline(transaction=False)
        for identifier in ids:
            pipe.exists(cancel_key(identifier, self.key_prefix))
        return {identifier for identifier, exists in zip(ids, pipe.execute()) if exists}
