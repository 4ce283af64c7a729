"""Publishes stream events to Redis: per engine step, ONE pipeline carrying
every event of the step, each both PUBLISHed on its request's channel (live
subscribers) and XADDed to its replay stream (late or reconnecting ones)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import redis

from producer.protocol import STREAM_FIELD, StreamEvent, cancel_key, channel_name, stream_key

log = logging.getLogger(__name__)

EXPIRY_REFRESH_EVENTS = 64
PUBLISH_ATTEMPTS = 5


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
        for event in events:
            payload = event.to_json()
            key = stream_key(event.id, self.key_prefix)
            pipe.publish(channel_name(event.id, self.key_prefix), payload)
            pipe.xadd(key, {STREAM_FIELD: payload}, maxlen=self.stream_maxlen, approximate=True)
            # The expiry is (re)set when a stream begins and ends and every EXPIRY_REFRESH_EVENTS
            # events in between (not per chunk: it is a third of the commands).
            if event.event == "started" or event.is_terminal or event.seq % EXPIRY_REFRESH_EVENTS == 0:
                pipe.expire(key, self.stream_ttl_s)
        pipe.execute()

    def begin_attempt(self, identifier: str) -> tuple[int, bool]:
        """(attempt number, cancel requested?) in one round trip: 1 for the first
        delivery of a request, 2 for its first redelivery, ..."""
        key = f"{self.key_prefix}:attempt:{identifier}"
        pipe = self.client.pipeline(transaction=True)
        pipe.incr(key)
        pipe.expire(key, self.stream_ttl_s)
        pipe.exists(cancel_key(identifier, self.key_prefix))
        attempt, _, cancelled = pipe.execute()
        return int(attempt), bool(cancelled)


class PublishingThread:
    """Publishes each step's events off the engine loop, in order, so the next
    forward overlaps the Redis round trip; `then` runs after the step's events
    are out (it wakes the task threads, so a result never precedes its stream)."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self._queue: queue.SimpleQueue[tuple[list[StreamEvent], Callable[[], None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="genq-publisher", daemon=True)
        self._thread.start()

    def submit(self, events: list[StreamEvent], then: Callable[[], None]) -> None:
        self._queue.put((events, then))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            events, then = item
            try:
                self._publish_with_retries(events)
            finally:
                then()

    def _publish_with_retries(self, events: list[StreamEvent]) -> None:
        """A lost step would leave readers without their events (maybe the
        final one), so a failing Redis is retried with backoff before giving up."""
        for attempt in range(1, PUBLISH_ATTEMPTS + 1):
            try:
                self.publisher.publish(events)
                return
            except redis.RedisError:
                if attempt == PUBLISH_ATTEMPTS:
                    log.exception("gave up publishing %d stream events", len(events))
                    return
                log.warning("publishing %d stream events failed (try %d); retrying", len(events), attempt)
                time.sleep(0.1 * 2**attempt)
