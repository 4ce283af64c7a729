"""A Celery consumer that no message can stop.

Celery's task handler raises on a malformed message (a body that is not
`[args, kwargs, embed]`, a missing `id` header, an unhashable task name):
the worker then dies (`Unrecoverable error`), or kombu takes the exception
for a lost connection and redelivers the same message for ever. This
consumer checks every `genq.generate` message first (worker.intake) and
refuses a bad one: a log line, a stored failure and an `error` event naming
the field when an id can be read, and the message acknowledged so it never
comes back. Anything Celery's own handler still raises on is refused the
same way; only connection errors go on to kombu's reconnect logic. An
acknowledgement through a connection that Redis restarts closed is logged,
not raised (Celery would stop the worker).

Task events (for Flower) go out in batches: Celery buffers them and flushes the buffer on the
next turn of its event loop, waking the loop for each, so nearly every event was its own PUBLISH
(about 2.4 a request, issue 30). This consumer flushes at most every EVENT_FLUSH_S instead
(Celery still flushes at once when 24 are waiting), and once more as it shuts down, before Celery
closes its event dispatcher with the buffer unsent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis
from celery.worker.consumer import Consumer
from vine import promise

from producer.protocol import TASK_NAME, ProtocolError
from worker.intake import Refusal, check_message
from worker.publisher import Publisher
from worker.tasks import publish_error

log = logging.getLogger(__name__)

EVENT_FLUSH_S = 0.1
"""How long a task event may wait for others to share its PUBLISH: what Flower's view lags by."""


class GuardedConsumer(Consumer):
    """Celery's Consumer with every task message checked before it is handled."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._publisher: Publisher | None = None
        self._flush_due = 0.0

    def create_task_handler(self, promise: type = promise) -> Callable[[Any], None]:
        handle = super().create_task_handler(promise)

        def on_task_received(message: Any) -> None:
            try:
                headers = message.headers if isinstance(message.headers, Mapping) else {}
                if headers.get("task") == TASK_NAME:
                    refusal = check_message(message)
                    if refusal is not None:
                        self.refuse(message, refusal)
                        return
                handle(message)
            except self.connection_errors:
                raise
            except Exception as error:
                log.exception("refusing a message Celery could not handle")
                self.refuse(message, Refusal(f"message: {type(error).__name__}: {error}", None, None))

        return on_task_received

    def on_send_event_buffered(self) -> None:
        """A task event waits in Celery's buffer: unless a flush is already due, flush it EVENT_FLUSH_S
        later with whatever joins it (the timer is set on the loop's own thread, which then wakes for
        it). A flush counts as due until its time has passed, so one lost with the loop's timers on a
        reconnect delays events until the next one, never for good."""
        now = time.monotonic()
        if self.hub and now >= self._flush_due:
            self._flush_due = now + EVENT_FLUSH_S
            self.hub.call_soon(self._flush_later)

    def _flush_later(self) -> None:
        self.hub.call_later(EVENT_FLUSH_S, self._flush_buffered_events)

    def _flush_buffered_events(self) -> None:
        # Not due any more before the buffer is read: an event appended during the flush sets the next.
        self._flush_due = 0.0
        self._flush_events()

    def shutdown(self) -> None:
        self._flush_events()
        super().shutdown()

    def call_soon_ack(self, p: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Acknowledge without letting a dead connection stop the worker: after a
        Redis restart, a task that finished on the old connection acknowledges
        through a channel whose connection is gone, and kombu raises
        AttributeError, which Celery takes for an unrecoverable error. The
        message then stays unacknowledged; kombu redelivers it, and the worker
        skips it because its result is stored (worker/redelivery.py)."""

        def ack_safely(*call_args: Any, **call_kwargs: Any) -> Any:
            try:
                return p(*call_args, **call_kwargs)
            except self.connection_errors:
                raise
            except Exception:  # noqa: BLE001 - an acknowledgement must never stop the consumer
                log.warning("could not acknowledge a message on a closed connection; it will be redelivered and "
                            "skipped (its result is stored)", exc_info=True)
                return None

        return super().call_soon_ack(ack_safely, *args, **kwargs)

    def on_connection_error_after_connected(self, exc: BaseException) -> None:
        """Closing the broken connection makes kombu restore its unacknowledged
        messages through a transport already torn down (AttributeError), which
        Celery takes for an unrecoverable error: reconnect anyway; what was not
        restored comes back after the visibility timeout."""
        try:
            super().on_connection_error_after_connected(exc)
        except AttributeError:
            log.warning("closing the lost broker connection failed inside kombu; reconnecting anyway", exc_info=True)

    def refuse(self, message: Any, refusal: Refusal) -> None:
        """Log; store the task's failure and publish its `error` event where an id can be read, so a
        producer waiting on either learns why at once instead of timing out; then acknowledge (never
        requeue)."""
        log.warning("refused a task message (task id %r, identifier %r): %s", refusal.task_id, refusal.identifier,
                    refusal.reason)
        if self._publisher is None:
            settings = self.app.genq_settings
            self._publisher = Publisher(settings.redis(), settings.key_prefix, settings.stream_maxlen,
                                        settings.stream_ttl_s)
        try:
            # The stream first, as for every task: a result never precedes its stream's final event.
            if refusal.identifier is not None:
                publish_error(self._publisher, refusal.identifier, refusal.reason)
            if refusal.task_id is not None:
                self.app.backend.mark_as_failure(refusal.task_id, ProtocolError(refusal.reason),
                                                 call_errbacks=False)
        except (redis.RedisError, OSError):
            log.exception("could not report the refusal of task %r", refusal.task_id)
        if not message.acknowledged:
            message.reject_log_error(log, self.connection_errors, requeue=False)
