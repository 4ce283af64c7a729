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

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from celery import states
from celery.backends.base import Backend

from producer.protocol import attempt_key, cancel_key, final_key, lease_key

log = logging.getLogger(__name__)
T = TypeVar("T")

LEASE_S = 15
"""How long a running job's lease lasts without a refresh (refreshed every LEASE_S / 3)."""
REDIS_RETRY_BUDGET_S = 60.0
"""How long a task thread waits for Redis to come back (a restart loading its append-only file)."""

# The delivery's Redis checks in one round trip (they were four: the final record's GET, the lease's
# SET NX and its holder's GET, and begin_attempt's MULTI), in the order decide() took them: a
# published final answers the delivery; else the lease, and only with it, unless the identifier is
# generating on this worker under another task (ARGV[4] = '1'), the attempt's INCR, its expiry and
# the cancel check. KEYS: final, lease, attempt, cancel; ARGV: task id, lease s, attempt ttl s, active.
CLAIM = """
local final = redis.call('GET', KEYS[1])
if final then return {'final', final} end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'EX', ARGV[2]) then
  if ARGV[4] == '1' then return {'active'} end
  local attempt = redis.call('INCR', KEYS[3])
  redis.call('EXPIRE', KEYS[3], ARGV[3])
  return {'run', attempt, redis.call('EXISTS', KEYS[4])}
end
return {'held', redis.call('GET', KEYS[2])}
"""
# Drop a lease only while this task holds it, in one round trip (a GET and a DEL before).
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class Claim:
    """What claim() found: the task's published result (`final`), else the lease's other holder
    (`holder`), else the lease taken while the identifier generates here (`active`), else the lease
    is this task's and its attempt begun (`attempt`, `cancel_requested`)."""

    final: dict[str, Any] | None = None
    holder: str | None = None
    active: bool = False
    attempt: int = 0
    cancel_requested: bool = False


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


def finished(backend: Backend, task_id: str) -> bool:
    """Whether the task's result (a SUCCESS, a FAILURE, ...) is stored."""
    meta = with_redis_retries(lambda: backend.get_task_meta(task_id, cache=False), "result lookup")
    return meta.get("status") in states.READY_STATES


class Redeliveries:
    def __init__(self, client: redis.Redis, key_prefix: str, attempt_ttl_s: int) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.attempt_ttl_s = attempt_ttl_s
        self._claim = client.register_script(CLAIM)
        self._release = client.register_script(RELEASE)

    def claim(self, identifier: str, task_id: str, active: Callable[[], bool]) -> Claim:
        """The task's published result, or the lease's holder, or the lease taken and, unless
        `active()` (the identifier generates on this worker), the request's next attempt begun (its
        counter expiring with the stream, as begin_attempt's)."""
        prefix = self.key_prefix
        keys = [final_key(task_id, prefix), lease_key(identifier, prefix), attempt_key(identifier, prefix),
                cancel_key(identifier, prefix)]
        outcome, *values = with_redis_retries(
            lambda: self._claim(keys=keys, args=[task_id, LEASE_S, self.attempt_ttl_s, int(active())]), "claim")
        if outcome == b"final":
            return Claim(final=json.loads(values[0]))
        if outcome == b"held":
            return Claim(holder=values[0].decode())
        if outcome == b"active":
            return Claim(active=True)
        return Claim(attempt=int(values[0]), cancel_requested=bool(values[1]))

    def release_lease(self, identifier: str, task_id: str) -> None:
        """Drop the lease if this task still holds it (a newer request may reuse the identifier)."""
        key = lease_key(identifier, self.key_prefix)
        try:
            with_redis_retries(lambda: self._release(keys=[key], args=[task_id]), "lease release")
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
