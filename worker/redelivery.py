"""A message delivered twice must not run its request twice.

kombu redelivers a task message whose acknowledgement it never saw: after a
worker is killed (visibility timeout), and after a Redis restart, when it puts
a disconnected worker's unacknowledged messages back on the queue even though
that worker is still generating them or has just finished them (its ack went
to the dead connection); a producer's watchdog may also resend a request that
seems lost. So before running, every delivery asks:

* finished? Its result (success or failure) is stored: acknowledge, run nothing.
  (Identifiers and task ids are fresh per request, docs/protocol.md.)
* running? The identifier's lease (`{prefix}:running:{id}`, taken with SET NX
  by the worker that runs it and refreshed while it runs) is held. By this
  task id: another worker is generating it, so a copy is re-sent to run after
  the lease time and this one acknowledged; if that worker dies, the lease
  lapses and the copy runs it. By another task id: a second request reusing a
  running identifier, which fails.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from celery import states
from celery.backends.base import Backend

from producer.protocol import lease_key

log = logging.getLogger(__name__)
T = TypeVar("T")

LEASE_S = 15
"""How long a running job's lease lasts without a refresh (refreshed every LEASE_S / 3)."""
REDIS_RETRY_BUDGET_S = 60.0
"""How long a task thread waits for Redis to come back (a restart loading its append-only file)."""


def with_redis_retries(call: Callable[[], T], what: str) -> T:
    """Retry a Redis call with exponential backoff while Redis restarts; the
    last error propagates once REDIS_RETRY_BUDGET_S is spent."""
    deadline = time.monotonic() + REDIS_RETRY_BUDGET_S
    delay = 0.1
    while True:
        try:
            return call()
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError) as error:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("%s: Redis unavailable (%s); retrying in %.1f s", what, error, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _decoded(reply: bytes | str) -> str:
    """A string reply of the worker's client, which does not decode responses (redis-py types
    replies for either setting of decode_responses)."""
    assert isinstance(reply, bytes), "the worker's Redis client does not decode responses"
    return reply.decode()


def finished(backend: Backend, task_id: str) -> bool:
    """Whether the task's result (a SUCCESS, a FAILURE, ...) is stored."""
    meta = with_redis_retries(lambda: backend.get_task_meta(task_id, cache=False), "result lookup")
    return meta.get("status") in states.READY_STATES


class Redeliveries:
    def __init__(self, client: redis.Redis, key_prefix: str) -> None:
        self.client = client
        self.key_prefix = key_prefix

    def take_lease(self, identifier: str, task_id: str) -> str | None:
        """None when this task now holds the lease, else the task id holding it."""
        key = lease_key(identifier, self.key_prefix)

        def take() -> str | None:
            if self.client.set(key, task_id, nx=True, ex=LEASE_S):
                return None
            holder = self.client.get(key)
            return _decoded(holder) if holder is not None else take()

        return with_redis_retries(take, "lease")

    def release_lease(self, identifier: str, task_id: str) -> None:
        """Drop the lease if this task still holds it (a newer request may reuse the identifier)."""
        key = lease_key(identifier, self.key_prefix)
        try:
            holder = with_redis_retries(lambda: self.client.get(key), "lease release")
            if holder is not None and _decoded(holder) == task_id:
                self.client.delete(key)
        except redis.RedisError:
            log.warning("could not release the lease of %r; it expires in %d s", identifier, LEASE_S)

    def refresh_leases(self, holders: dict[str, str]) -> None:
        """Re-set running jobs' leases (identifier -> task id; one pipeline, so a
        Redis that lost them in a crash has them back); a failure is only
        logged: the next refresh retries."""
        if not holders:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for identifier, task_id in holders.items():
                pipe.set(lease_key(identifier, self.key_prefix), task_id, ex=LEASE_S)
            pipe.execute()
        except redis.RedisError:
            log.warning("could not refresh the leases of %d running jobs", len(holders))
