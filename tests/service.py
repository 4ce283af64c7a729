"""Helpers for service tests: plain Celery/Redis clients and stream readers
(the worker process itself is worker.processes.WorkerProcess)."""

from __future__ import annotations

import json
import time
from typing import Any

import redis
from celery import Celery
from kombu import Connection

from producer.protocol import STREAM_FIELD, StreamEvent, stream_key


def plain_client(redis_url: str) -> Celery:
    """A Celery client that knows nothing of genq: what a backend team would write."""
    return Celery("client", broker=redis_url, backend=redis_url)


def replay(client: redis.Redis, identifier: str, prefix: str = "genq") -> list[StreamEvent]:
    return [StreamEvent.from_json(fields[STREAM_FIELD.encode()])
            for _, fields in client.xrange(stream_key(identifier, prefix))]


def chunk_text(events: list[StreamEvent]) -> str:
    return "".join(e.text for e in events if e.event == "chunk")


def decode_event(message: dict[str, Any]) -> StreamEvent:
    return StreamEvent.model_validate(json.loads(message["data"]))


def next_event(pubsub: redis.client.PubSub, timeout: float = 30) -> StreamEvent:
    """The next stream event on a subscribed channel (subscribe acknowledgements skipped)."""
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        message = pubsub.get_message(timeout=remaining)
        if message is not None and message["type"] == "message":
            return decode_event(message)
    raise TimeoutError(f"no stream event within {timeout:.0f} s")


class RawPublisher:
    """Publishes hand-made task messages (any body bytes, any headers), as a
    buggy or hostile producer in another language could: no Celery involved."""

    def __init__(self, redis_url: str) -> None:
        self.connection = Connection(redis_url)
        self.producer = self.connection.Producer()

    def publish(self, queue: str, body: Any, headers: dict[str, Any] | None, content_type: str = "application/json",
                content_encoding: str = "utf-8") -> None:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.producer.publish(payload, routing_key=queue, headers=headers, content_type=content_type,
                              content_encoding=content_encoding)

    def close(self) -> None:
        self.connection.release()
