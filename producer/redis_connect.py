"""Reaching Redis from one URL, directly or through Redis Sentinel.

Every genq process names Redis by URL (GENQ_REDIS_URL, GENQ_BROKER_URL,
GENQ_RESULT_BACKEND). Besides redis://, rediss:// and unix:// URLs, a URL may
list Sentinels the way kombu and Celery's result backend spell it:

    sentinel://[:password@]host1:26379[/db];sentinel://host2:26379;...

with the monitored master's name in GENQ_SENTINEL_MASTER. kombu (broker) and
Celery (results) resolve such URLs themselves given `master_name` in their
transport options (`celery_transport_options`); the streams, cancel keys and
leases go through redis-py's Sentinel client built here, which asks the
Sentinels for the current master on every reconnect, so a failover is
followed like a restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.retry
import redis.sentinel
from redis.backoff import ExponentialWithJitterBackoff

SENTINEL_SCHEME = "sentinel"
#: A command on a connection that a Redis restart closed is retried on a new one (redis-py 8 does not
#: retry by default); five tries with backoff up to 1 s ride out a restart without waiting long when
#: Redis is really down (callers then see the ConnectionError and decide).
RETRIES = 5
RETRY_ON = [redis.ConnectionError, redis.TimeoutError]


@dataclass(frozen=True)
class SentinelTarget:
    hosts: list[tuple[str, int]]
    db: int
    password: str | None


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() == SENTINEL_SCHEME


def parse_sentinel_url(url: str) -> SentinelTarget:
    """Split kombu's `sentinel://h1:p1;sentinel://h2:p2/db` form; ValueError naming the part that is wrong."""
    hosts: list[tuple[str, int]] = []
    db = 0
    password: str | None = None
    for part in url.split(";"):
        parsed = urlsplit(part.strip())
        if parsed.scheme.lower() != SENTINEL_SCHEME or not parsed.hostname:
            raise ValueError(f"{part!r}: each ';'-separated part of a Sentinel URL must be sentinel://host:port")
        try:
            port = parsed.port or 26379
        except ValueError:
            raise ValueError(f"{part!r}: the port must be a number from 1 to 65535") from None
        hosts.append((parsed.hostname, port))
        if parsed.password and password is None:
            password = unquote(parsed.password)
        path = parsed.path.strip("/")
        if path:
            if not path.isdigit():
                raise ValueError(f"{part!r}: the database must be a number, got {path!r}")
            db = int(path)
    return SentinelTarget(hosts, db, password)


def _master_name(url: str, master_name: str | None) -> str:
    if not master_name:
        raise ValueError(f"{url!r} is a Sentinel URL: set GENQ_SENTINEL_MASTER to the name of the master to use")
    return master_name


def _backoff() -> ExponentialWithJitterBackoff:
    return ExponentialWithJitterBackoff(base=0.05, cap=1.0)


def connect(url: str, master_name: str | None = None, **options: Any) -> redis.Redis:
    """A redis-py client for a plain or Sentinel URL (options as for redis.Redis),
    retrying a command that meets a closed connection."""
    options.setdefault("retry", redis.retry.Retry(_backoff(), RETRIES))
    options.setdefault("retry_on_error", RETRY_ON)
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **options)
    target = parse_sentinel_url(url)
    sentinel = redis.sentinel.Sentinel(target.hosts, socket_timeout=options.get("socket_connect_timeout"))
    return sentinel.master_for(_master_name(url, master_name), db=target.db, password=target.password, **options)


def connect_async(url: str, master_name: str | None = None, **options: Any) -> redis.asyncio.Redis:
    """connect() for asyncio."""
    options.setdefault("retry", redis.asyncio.retry.Retry(_backoff(), RETRIES))
    options.setdefault("retry_on_error", RETRY_ON)
    if not is_sentinel_url(url):
        return redis.asyncio.Redis.from_url(url, **options)
    target = parse_sentinel_url(url)
    sentinel = redis.asyncio.sentinel.Sentinel(target.hosts, socket_timeout=options.get("socket_connect_timeout"))
    return sentinel.master_for(_master_name(url, master_name), db=target.db, password=target.password, **options)


def celery_transport_options(url: str, master_name: str | None) -> dict[str, Any]:
    """What kombu and Celery's Sentinel backend need beyond the URL."""
    return {"master_name": _master_name(url, master_name)} if is_sentinel_url(url) else {}
