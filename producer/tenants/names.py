"""The Redis keys of tenants, API keys, rate limits and usage: the one copy of their names.

The Lua scripts never build a key name themselves: the gateway writes the names a task's
settlement needs into its reservation record (producer/tenants/settle.py), and every other name
comes in KEYS."""

from __future__ import annotations

DEFAULT_TENANT = "default"
"""The tenant a task without one (sent straight to Celery, or through the admin token without a
`tenant`) counts under."""


def api_key_record(prefix: str, key_id: str) -> str:
    """A hash: the key's record (producer/tenants/keys.py, ApiKey)."""
    return f"{prefix}:apikey:{key_id}"


def api_key_index(prefix: str) -> str:
    """A set of every key id, for `genq keys list`."""
    return f"{prefix}:apikeys"


def requests_window(prefix: str, key_id: str) -> str:
    """A sorted set: one member per request admitted in the last minute, scored by its time (ms)."""
    return f"{prefix}:ratelimit:{key_id}:requests"


def token_bucket(prefix: str, key_id: str) -> str:
    """A hash: the key's tokens-per-minute bucket (level, last refill in ms)."""
    return f"{prefix}:ratelimit:{key_id}:tokens"


def running_tasks(prefix: str, key_id: str) -> str:
    """A sorted set: the key's running tasks, scored by when their slot expires (ms)."""
    return f"{prefix}:ratelimit:{key_id}:running"


def reservation(prefix: str, identifier: str) -> str:
    """A hash: what a task admitted with an API key holds until it ends (settle.py)."""
    return f"{prefix}:tenancy:task:{identifier}"


def task_tenant(prefix: str, identifier: str) -> str:
    """The tenant whose key created the task: only that tenant's keys may read or cancel it."""
    return f"{prefix}:tenancy:owner:{identifier}"


def counted(prefix: str, identifier: str) -> str:
    """Set once a task's usage is counted, so that a resent pipeline never counts it twice."""
    return f"{prefix}:usage:counted:{identifier}"


def tenant_usage(prefix: str, tenant: str) -> str:
    """The stem of a tenant's hourly usage hashes; `hourly(stem, hour)` is one hour's."""
    return f"{prefix}:usage:tenant:{tenant}"


def key_usage(prefix: str, key_id: str) -> str:
    """The stem of an API key's hourly usage hashes."""
    return f"{prefix}:usage:key:{key_id}"


def tenants_used(prefix: str, hour: int) -> str:
    """A set: the tenants with usage in the hour (what an admin's `GET /v1/usage` lists)."""
    return f"{prefix}:usage:tenants:{hour}"


def hourly(stem: str, hour: int) -> str:
    """One hour's hash of a usage stem; the settle script appends ':<hour>' to the key stem alike."""
    return f"{stem}:{hour}"


def decoded(value: bytes | str) -> str:
    """A Redis reply as text (the clients here do not decode replies)."""
    return value.decode() if isinstance(value, bytes) else value
