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
"""

from __future__ import annotations

import logging
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


class GuardedConsumer(Consumer):
    """Celery's Consumer with every task message checked before it is handled."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._publisher: Publisher | None = None

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
