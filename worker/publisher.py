"""Publishes stream events to Redis: per engine step, ONE pipeline carrying
every event of the step, each both PUBLISHed on its request's channel (live
subscribers) and XADDed to its replay stream (late or reconnecting ones).

The same pipeline records each finished task's result under
`{prefix}:final:{task id}`: a worker killed after the final event but before
Celery stored the result leaves a redelivered message, and the next worker
answers it from this record instead of generating (and streaming) it again."""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis

from producer.protocol import STREAM_FIELD, StreamEvent, attempt_key, cancel_key, channel_name, stream_key
from worker.redelivery import with_redis_retries

log = logging.getLogger(__name__)

EXPIRY_REFRESH_EVENTS = 64


class Publisher:
    def __init__(self, client: redis.Redis, key_prefix: str, stream_maxlen: int, stream_ttl_s: int,
                 final_ttl_s: int | None = None) -> None:
        self.client = client
        self.final_ttl_s = final_ttl_s or stream_ttl_s
        self.key_prefix = key_prefix
        self.stream_maxlen = stream_maxlen
        self.stream_ttl_s = stream_ttl_s

    def publish(self, events: Sequence[StreamEvent], finals: Mapping[str, str] | None = None) -> None:
        """events, and finals: task id -> its result as JSON."""
        if not events and not finals:
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
        for task_id, result in (finals or {}).items():
            pipe.set(final_key(task_id, self.key_prefix), result, ex=self.final_ttl_s)
        pipe.execute()

    def final_result(self, task_id: str) -> dict[str, Any] | None:
        """The result this task's final event was published with, if any."""
        stored = self.client.get(final_key(task_id, self.key_prefix))
        return json.loads(stored) if stored is not None else None

    def begin_attempt(self, identifier: str) -> tuple[int, bool]:
        """(attempt number, cancel requested?) in one round trip: 1 for the first
        delivery of a request, 2 for its first redelivery, ..."""
        key = attempt_key(identifier, self.key_prefix)
        pipe = self.client.pipeline(transaction=True)
        pipe.incr(key)
        pipe.expire(key, self.stream_ttl_s)
        pipe.exists(cancel_key(identifier, self.key_prefix))
        attempt, _, cancelled = pipe.execute()
        return int(attempt), bool(cancelled)


def final_key(task_id: str, prefix: str) -> str:
    return f"{prefix}:final:{task_id}"


class PublishingThread:
    """Publishes each step's events off the engine loop, in order, so the next
    forward overlaps the Redis round trip; `then` runs after the step's events
    are out (it wakes the task threads, so a result never precedes its stream)."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self._queue: queue.SimpleQueue[tuple[list[StreamEvent], dict[str, str], Callable[[], None]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name="genq-publisher", daemon=True)
        self._thread.start()

    def submit(self, events: list[StreamEvent], then: Callable[[], None], finals: dict[str, str] | None = None
               ) -> None:
        self._queue.put((events, finals or {}, then))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            events, finals, then = item
            try:
                self._publish_with_retries(events, finals)
            finally:
                then()

    def _publish_with_retries(self, events: list[StreamEvent], finals: dict[str, str]) -> None:
        """A lost step would leave readers without their events (maybe the
        final one), so a restarting Redis is waited for (with backoff) before giving up."""
        try:
            with_redis_retries(lambda: self.publisher.publish(events, finals),
                               f"publishing {len(events)} stream events")
        except redis.RedisError:
            log.exception("gave up publishing %d stream events", len(events))
