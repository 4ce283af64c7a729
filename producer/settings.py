"""What a producer must agree on with the workers, from the same GENQ_* variables.

A producer reads only the names it shares with the workers (where Redis is,
which queue, which key prefix, the visibility timeout), so a client and the
worker it feeds are configured by one environment. It does not import
worker.settings: producers run without the worker's dependencies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.asyncio import Redis as AsyncRedis

from producer.protocol import DEFAULT_KEY_PREFIX, DEFAULT_QUEUE, PRIORITY_STEPS
from producer.redis_connect import celery_transport_options, connect, connect_async, is_sentinel_url, parse_sentinel_url
from producer.routing import MAX_PREFIX_ROUTES, MAX_TENANT_LANES, prefix_route, route_queue, tenant_queue

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class ClientSettings(BaseSettings):
    """The names every genq process shares (worker, gateway, callback worker,
    client): each reads them from the same GENQ_* variables whatever its own
    prefix, so one environment configures them all alike."""

    model_config = SettingsConfigDict(env_prefix="GENQ_", extra="ignore", populate_by_name=True)

    redis_url: str = Field(default=DEFAULT_REDIS_URL, validation_alias="GENQ_REDIS_URL",
                           description="streams and cancellation; broker and results by default")
    broker_url: str | None = Field(default=None, validation_alias="GENQ_BROKER_URL",
                                   description="overrides redis_url for the Celery broker")
    result_backend: str | None = Field(default=None, validation_alias="GENQ_RESULT_BACKEND",
                                       description="overrides redis_url for Celery results")
    queue: str = Field(default=DEFAULT_QUEUE, min_length=1, validation_alias="GENQ_QUEUE",
                       description="the queue of the model to use")
    key_prefix: str = Field(default=DEFAULT_KEY_PREFIX, validation_alias="GENQ_KEY_PREFIX",
                            description="prefix of every channel / stream / cancel key")
    visibility_timeout_s: int = Field(default=3600, ge=1, validation_alias="GENQ_VISIBILITY_TIMEOUT_S",
                                      description="seconds before an unacknowledged task is redelivered (a Redis "
                                                  "transport option: producers and workers must agree)")
    sentinel_master: str | None = Field(default=None, validation_alias="GENQ_SENTINEL_MASTER",
                                        description="the master's name, for sentinel:// URLs")
    watchdog_after_s: float | None = Field(
        default=None, gt=0, validation_alias="GENQ_WATCHDOG_AFTER_S",
        description="clients resend a request silent this long (producer/watchdog.py); off when unset")
    prefix_routes: int = Field(default=0, ge=0, le=MAX_PREFIX_ROUTES, validation_alias="GENQ_PREFIX_ROUTES",
                               description="opt-in prefix-aware routing over this many queues (producer/routing.py)")
    prefix_route_chars: int = Field(default=256, ge=1, validation_alias="GENQ_PREFIX_ROUTE_CHARS",
                                    description="characters of a request's start that choose its route")
    tenant_lanes: int = Field(default=0, ge=0, le=MAX_TENANT_LANES, validation_alias="GENQ_TENANT_LANES",
                              description="opt-in tenant lanes: a request naming a tenant waits in one of this many "
                                          "lists per queue, which workers take from in turn (producer/routing.py)")

    @model_validator(mode="after")
    def _sentinel_urls_are_usable(self) -> ClientSettings:
        for name, url in (("GENQ_REDIS_URL", self.redis_url), ("GENQ_BROKER_URL", self.broker_url),
                          ("GENQ_RESULT_BACKEND", self.result_backend)):
            if url is None or not is_sentinel_url(url):
                continue
            try:
                parse_sentinel_url(url)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
            if not self.sentinel_master:
                raise ValueError(f"{name} is a Sentinel URL: set GENQ_SENTINEL_MASTER to the master's name")
        return self

    @property
    def broker(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def backend(self) -> str:
        return self.result_backend or self.redis_url

    def queue_for(self, kwargs: Mapping[str, Any], queue: str | None = None) -> str:
        """The queue a request goes to: the model's (`queue`, else the configured one), or its
        prefix route's when routing is on; then its tenant's lane when lanes are on."""
        queue = queue or self.queue
        if self.prefix_routes:
            queue = route_queue(queue, prefix_route(kwargs, self.prefix_routes, self.prefix_route_chars))
        tenant = kwargs.get("tenant")
        return tenant_queue(queue, tenant if isinstance(tenant, str) else None, self.tenant_lanes)

    def redis(self, url: str | None = None, **options: Any) -> redis.Redis:
        """A client for redis_url (or `url`), plain or through Sentinel."""
        return connect(url or self.redis_url, self.sentinel_master, **options)

    def redis_async(self, url: str | None = None, **options: Any) -> AsyncRedis:
        return connect_async(url or self.redis_url, self.sentinel_master, **options)


def celery_base_config(settings: ClientSettings) -> dict[str, Any]:
    """What every genq Celery app (client, GPU worker, callback worker) shares:
    JSON only, and the same Redis transport options — one visibility timeout,
    ten priority levels served lowest number first, the Sentinel master's name
    where the URLs are Sentinel ones — so a task lands where its consumers look
    and is redelivered on the same schedule everywhere."""
    visibility_timeout_s = settings.visibility_timeout_s
    return {
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "broker_transport_options": {
            "visibility_timeout": visibility_timeout_s,
            "priority_steps": PRIORITY_STEPS,
            "queue_order_strategy": "priority",
            **celery_transport_options(settings.broker, settings.sentinel_master),
        },
        "result_backend_transport_options": {
            "visibility_timeout": visibility_timeout_s,
            **celery_transport_options(settings.backend, settings.sentinel_master),
        },
        "broker_connection_retry_on_startup": True,
    }
