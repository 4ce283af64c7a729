"""Resends requests that the broker lost.

kombu's Redis transport pops a task message (BRPOP) and records it as
unacknowledged in a second command. A worker killed, or a connection dropped
by a Redis restart, between the two loses the message for good; so does a
Redis killed -9 before its append-only file holds the unacknowledged record.
No worker runs such a message, and no visibility timeout brings it back
(issue 17, case 5). Only the producer knows the request exists, so it watches.

A request is alive while it shows progress: a new event on its stream, a
change of its stored state, or its lease (`lease_key`, held and refreshed
every few seconds by the worker generating it, lapsing seconds after that
worker dies). A request that shows none of these for `after_s` seconds is
sent again under the same task id; one whose result is final is forgotten.
A stored STARTED state or old stream events are not proof of life on their
own: they are what a request lost mid-run leaves behind.

Resending is idempotent by identifier: a worker skips a task whose result is
stored and defers one whose lease another worker holds (worker/redelivery.py),
so a resend of a request that was only slow (queued behind a backlog) costs a
queue slot, never a second generation. Choose `after_s` above the usual
queue wait to keep such resends rare.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery, states

from producer.protocol import DEFAULT_KEY_PREFIX, TASK_NAME, lease_key, stream_key

log = logging.getLogger(__name__)

MAX_RESENDS = 3
"""A request still silent after this many resends is given up on (and logged)."""
Progress = tuple[bytes | None, str | None]
"""What changes while a request advances: its stream's last entry id and its stored state."""


@dataclass
class Tracked:
    identifier: str
    kwargs: dict[str, Any]
    queue: str
    quiet_since: float
    progress: Progress = (None, None)
    resends: int = 0


class Watchdog:
    """Tracks sent requests until their result is final; `check()` resends the
    ones that showed no progress for `after_s` seconds (at most MAX_RESENDS
    times each). Call check() from a loop of your own, or start() a thread
    that calls it (GenqClient does with GENQ_WATCHDOG_AFTER_S). Thread-safe."""

    def __init__(self, app: Celery, client: redis.Redis, after_s: float, key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        self.app = app
        self.client = client
        self.after_s = after_s
        self.key_prefix = key_prefix
        self.tracked: dict[str, Tracked] = {}
        self.resent = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def track(self, task_id: str, kwargs: dict[str, Any], queue: str) -> None:
        identifier = kwargs.get("identifier") or task_id
        with self._lock:
            self.tracked[task_id] = Tracked(identifier, kwargs, queue, time.monotonic())

    def start(self) -> None:
        """Check every third of after_s (1 to 10 s) on a daemon thread."""
        if self._thread is not None:
            return
        interval = min(10.0, max(1.0, self.after_s / 3))
        self._thread = threading.Thread(target=self._run, args=(interval,), name="genq-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self, interval_s: float) -> None:
        while not self._stopped.wait(interval_s):
            try:
                self.check()
            except redis.RedisError as error:
                log.warning("watchdog: Redis unavailable (%s); checking again in %.0f s", error, interval_s)

    def check(self) -> list[str]:
        """Forget finished requests; resend the ones quiet for `after_s`; return the resent task ids."""
        with self._lock:
            now = time.monotonic()
            due = [(task_id, t) for task_id, t in self.tracked.items() if now - t.quiet_since >= self.after_s]
            if not due:
                return []
            pipe = self.client.pipeline(transaction=False)
            for task_id, tracked in due:
                pipe.xrevrange(stream_key(tracked.identifier, self.key_prefix), count=1)
                pipe.get(self.app.backend.get_key_for_task(task_id))
                pipe.exists(lease_key(tracked.identifier, self.key_prefix))
            replies = pipe.execute()
            resent: list[str] = []
            for n, (task_id, tracked) in enumerate(due):
                last_entry, meta, leased = replies[3 * n: 3 * n + 3]
                status = json.loads(meta)["status"] if meta is not None else None
                progress = (last_entry[0][0] if last_entry else None, status)
                if status in states.READY_STATES:
                    del self.tracked[task_id]
                elif leased or progress != tracked.progress:
                    tracked.progress = progress
                    tracked.quiet_since = now
                elif tracked.resends >= MAX_RESENDS:
                    log.error("request %s is still silent after %d resends; giving up on it", task_id, tracked.resends)
                    del self.tracked[task_id]
                else:
                    log.warning("request %s showed no progress for %.0f s; sending it again", task_id,
                                now - tracked.quiet_since)
                    self.app.send_task(TASK_NAME, kwargs=tracked.kwargs, task_id=task_id, queue=tracked.queue)
                    tracked.quiet_since = now
                    tracked.resends += 1
                    resent.append(task_id)
            self.resent += len(resent)
            return resent
