"""Publishes stream events to Redis: per engine step, ONE pipeline carrying
every event of the step, each both PUBLISHed on its request's channel (live
subscribers) and XADDed to its replay stream (late or reconnecting ones). With
chunk coalescing (worker/coalescing.py) a step carries a merged chunk per sample
only when one is due, so the commands per generated token fall with the interval.

Each stream entry's ID is `{attempt}-{seq}`, so a pipeline resent after Redis
dropped the connection mid-reply (it may have applied it) cannot add an event
twice: Redis refuses an ID not above the stream's last one, and that refusal is
the proof the event is already there. Live subscribers may see a resent
PUBLISH twice; readers skip events at or before their (attempt, seq) cursor.

A stream is trimmed to `stream_maxlen` events, or to its attempt's events so
far when that is more: the attempt being streamed is never cut, whatever its
length (n samples of max_new_tokens chunks each), so a reader arriving at any
time before the stream expires rebuilds the whole text; only the events of
earlier attempts, which readers discard, are trimmed.

The same pipeline records each finished task's result under
`{prefix}:final:{task id}`: a worker killed after the final event but before
Celery stored the result leaves a redelivered message, and the next worker
answers it from this record instead of generating (and streaming) it again.
Once Celery has stored the result the record is deleted (forget_final): the
result backend is the one stored copy of a result.

Each terminal event also settles its task in that pipeline (producer/tenants/settle.py): its
usage, the final event's own, counted once under its tenant (and its API key, if a gateway
admitted it with one) in the hourly usage hashes, and what its admission reserved given back.
`on_usage(tenant, usage)` then sees each task counted (the Prometheus counters)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import redis

from producer.protocol import (
    STREAM_FIELD,
    StreamEvent,
    Usage,
    attempt_key,
    cancel_key,
    channel_name,
    final_key,
    stream_key,
)
from producer.tenants.settle import DEFAULT_USAGE_RETENTION_S, SETTLE, Refund, Settlement, hour_of
from worker.redelivery import with_redis_retries
from worker.thread_names import name_this_thread

log = logging.getLogger(__name__)

EXPIRY_REFRESH_EVENTS = 64


class Publisher:
    def __init__(self, client: redis.Redis, key_prefix: str, stream_maxlen: int, stream_ttl_s: int,
                 final_ttl_s: int | None = None, usage_retention_s: int = DEFAULT_USAGE_RETENTION_S,
                 on_usage: Callable[[str, Usage], None] | None = None) -> None:
        self.client = client
        self.usage_retention_s = usage_retention_s
        self.on_usage = on_usage
        self._settle = client.register_script(SETTLE)
        self.final_ttl_s = final_ttl_s or stream_ttl_s
        self.key_prefix = key_prefix
        self.stream_maxlen = stream_maxlen
        self.stream_ttl_s = stream_ttl_s

    def publish(self, events: Sequence[StreamEvent], finals: Mapping[str, str] | None = None,
                tenants: Mapping[str, str | None] | None = None) -> None:
        """events, finals: task id -> its result as JSON, and tenants: request identifier -> the
        tenant its usage counts under (absent or None: the default tenant)."""
        if not events and not finals:
            return
        pipe = self.client.pipeline(transaction=False)
        hour = hour_of(time.time())
        settled: dict[int, tuple[Settlement, list[str], list[str | int]]] = {}
        for event in events:
            payload = event.to_json()
            key = stream_key(event.id, self.key_prefix)
            pipe.publish(channel_name(event.id, self.key_prefix), payload)
            # The trim keeps at least maxlen entries (approximate: whole nodes only), and this
            # attempt has seq + 1 of them so far.
            pipe.xadd(key, {STREAM_FIELD: payload}, id=f"{event.attempt}-{event.seq}",
                      maxlen=max(self.stream_maxlen, event.seq + 1), approximate=True)
            # The expiry is (re)set when a stream begins and ends and every EXPIRY_REFRESH_EVENTS
            # events in between (not per chunk: it is a third of the commands). The attempt counter
            # lives as long as its stream, so a reused identifier's IDs always grow: begin_attempt
            # set its expiry as the attempt began, so the first event leaves it be.
            refresh = event.seq % EXPIRY_REFRESH_EVENTS == 0
            if event.event == "started" or event.is_terminal or refresh:
                pipe.expire(key, self.stream_ttl_s)
            if event.is_terminal or (refresh and event.seq > 0):
                pipe.expire(attempt_key(event.id, self.key_prefix), self.stream_ttl_s)
            if event.is_terminal:
                settlement = _settlement(event, (tenants or {}).get(event.id))
                keys = settlement.keys(self.key_prefix, hour)
                args = settlement.args(hour, self.usage_retention_s, self.stream_ttl_s)
                settled[len(pipe)] = (settlement, keys, args)
                # EVALSHA alone: the script object would make the pipeline ask SCRIPT EXISTS first,
                # a round trip more per final event; a script not loaded yet is run below.
                pipe.evalsha(self._settle.sha, len(keys), *keys, *args)
        for task_id, result in (finals or {}).items():
            pipe.set(final_key(task_id, self.key_prefix), result, ex=self.final_ttl_s)
        replies = pipe.execute(raise_on_error=False)
        for index, reply in enumerate(replies):
            if isinstance(reply, redis.exceptions.NoScriptError) and index in settled:
                # Not loaded yet (this worker's first final event, or Redis restarted): once more
                # on its own (the call loads the script).
                _, keys, args = settled[index]
                replies[index] = self._settle(keys=keys, args=args)
            elif isinstance(reply, redis.ResponseError) and not _already_added(reply):
                raise reply
        for index, (settlement, _, _) in settled.items():
            if replies[index] == 1 and settlement.usage is not None and self.on_usage is not None:
                self.on_usage(settlement.tenant_name, settlement.usage)

    def forget_final(self, task_id: str) -> None:
        """Drop a task's final record once the result backend holds its result (a redelivery
        then finds the result there). Not deleted (Redis away), it expires."""
        try:
            self.client.delete(final_key(task_id, self.key_prefix))
        except redis.RedisError:
            log.warning("could not delete the final record of task %s; it expires in %d s", task_id,
                        self.final_ttl_s)

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


def _settlement(event: StreamEvent, tenant: str | None) -> Settlement:
    """A terminal event's: one with a result (not `error`) counts its usage and refunds the
    tokens it did not use; a failure counts nothing and keeps its reservation charged."""
    if event.event == "error" or event.usage is None:
        return Settlement(event.id, tenant, None, Refund.NONE)
    return Settlement(event.id, tenant, event.usage, Refund.UNUSED)


def _already_added(error: redis.ResponseError) -> bool:
    """XADD's refusal of an explicit ID at or below the stream's last entry."""
    return "equal or smaller than the target stream top item" in str(error)


Step = Callable[[], tuple[list[StreamEvent], dict[str, str], dict[str, str | None]]]
"""Builds a step's events, finals (task id -> result JSON) and the tenants of the requests that
ended (identifier -> tenant), on the publishing thread."""


class PublishingThread:
    """Builds and publishes steps' events off the engine loop, in order, so the
    next forward overlaps the Redis round trip; `then` runs after a step's
    events are out (it wakes the task threads, so a result never precedes its
    stream). The engine loop has two: one for each step's events, one for the
    final events and results of the requests that ended (worker/loop.py)."""

    def __init__(self, publisher: Publisher, name: str) -> None:
        self.publisher = publisher
        self._queue: queue.SimpleQueue[tuple[Step, Callable[[], None]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, step: Step, then: Callable[[], None]) -> None:
        self._queue.put((step, then))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        name_this_thread()
        while (item := self._queue.get()) is not None:
            step, then = item
            try:
                events, finals, tenants = step()
                self._publish_with_retries(events, finals, tenants)
            except Exception:  # noqa: BLE001 - the thread must outlive one bad step, or every later one hangs
                log.exception("could not build or publish a step's events")
            finally:
                then()

    def _publish_with_retries(self, events: list[StreamEvent], finals: dict[str, str],
                              tenants: dict[str, str | None]) -> None:
        """A lost step would leave readers without their events (maybe the
        final one), so a restarting Redis is waited for (with backoff) before giving up."""
        try:
            with_redis_retries(lambda: self.publisher.publish(events, finals, tenants),
                               f"publishing {len(events)} stream events")
        except redis.RedisError:
            log.exception("gave up publishing %d stream events", len(events))
