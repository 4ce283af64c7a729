"""What a producer must agree on with the workers, from the same GENQ_* variables.

A producer reads only the names it shares with the workers (where Redis is,
which queue, which key prefix, the visibility timeout), so a client and the
worker it feeds are configured by one environment. It does not import
worker.settings: producers run without the worker's dependencies.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from producer.protocol import DEFAULT_KEY_PREFIX, DEFAULT_QUEUE, PRIORITY_STEPS

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class ClientSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GENQ_", extra="ignore")

    redis_url: str = Field(DEFAULT_REDIS_URL, description="streams and cancellation; broker and results by default")
    broker_url: str | None = Field(None, description="overrides redis_url for the Celery broker")
    result_backend: str | None = Field(None, description="overrides redis_url for Celery results")
    queue: str = Field(DEFAULT_QUEUE, min_length=1, description="the queue of the model to use")
    key_prefix: str = Field(DEFAULT_KEY_PREFIX, description="prefix of every channel / stream / cancel key")
    visibility_timeout_s: int = Field(3600, ge=1, description="must match the workers' (Redis transport option)")

    @property
    def broker(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def backend(self) -> str:
        return self.result_backend or self.redis_url


def celery_base_config(visibility_timeout_s: int) -> dict[str, Any]:
    """What every genq Celery app (client, GPU worker, callback worker) shares:
    JSON only, and the same Redis transport options — one visibility timeout,
    ten priority levels served lowest number first — so a task lands where its
    consumers look and is redelivered on the same schedule everywhere."""
    return {
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "broker_transport_options": {
            "visibility_timeout": visibility_timeout_s,
            "priority_steps": PRIORITY_STEPS,
            "queue_order_strategy": "priority",
        },
        "result_backend_transport_options": {"visibility_timeout": visibility_timeout_s},
        "broker_connection_retry_on_startup": True,
    }
