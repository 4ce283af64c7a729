"""The tenants that used the most tokens lately, from the hourly usage counters: the worker gives
them the `tenant` labels of its usage metrics first (worker/metrics.py, TenantLabels), so the
labels go to the top tenants rather than to whichever came first after a restart."""

from __future__ import annotations

import time
from collections import Counter

import redis

from producer.tenants.names import decoded, hourly, tenant_usage, tenants_used
from producer.tenants.settle import HOUR_S, hour_of

TOKEN_FIELDS = ("prompt_tokens", "completion_tokens")


def top_tenants(client: redis.Redis, prefix: str, limit: int, hours: int) -> list[str]:
    """At most `limit` tenants, most prompt + completion tokens first, over the last `hours` hours."""
    last = hour_of(time.time())
    spans = [last - i * HOUR_S for i in range(hours)]
    pipe = client.pipeline(transaction=False)
    for hour in spans:
        pipe.smembers(tenants_used(prefix, hour))
    members = pipe.execute()
    rows = [(hour, decoded(name)) for hour, names in zip(spans, members) for name in names]
    for hour, tenant in rows:
        pipe.hmget(hourly(tenant_usage(prefix, tenant), hour), TOKEN_FIELDS)
    tokens: Counter[str] = Counter()
    for (_, tenant), counts in zip(rows, pipe.execute()):
        tokens[tenant] += sum(int(count or 0) for count in counts)
    return [tenant for tenant, _ in tokens.most_common(limit)]
