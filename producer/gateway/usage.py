"""GET /v1/usage: the hourly usage counters the workers keep (producer/tenants/settle.py), per
tenant or per API key. The admin (gateway token) may ask for any tenant or key, or every tenant;
an API key sees its own tenant and that tenant's keys (another's: 404)."""

from __future__ import annotations

import time
from typing import Annotated

import redis.asyncio
from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from producer.gateway.auth import caller_of
from producer.gateway.errors import ApiError
from producer.gateway.settings import GatewaySettings
from producer.protocol import IDENTIFIER_PATTERN
from producer.tenants.names import api_key_record, decoded, hourly, key_usage, tenant_usage, tenants_used
from producer.tenants.settle import HOUR_S, hour_of

COUNTS = ("prompt_tokens", "completion_tokens", "cached_tokens", "requests")


class UsageCounts(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = Field(default=0, description="prompt tokens served from the prefix cache (a part of "
                                                      "prompt_tokens)")
    requests: int = Field(default=0, description="tasks that ended with a result (one per prompt and request)")


class UsageRow(UsageCounts):
    tenant: str
    key: str | None = Field(default=None, description="the API key's id, when asked per key")
    hour: int = Field(description="unix time the hour begins")


class UsageReport(BaseModel):
    object: str = "usage"
    start: int = Field(description="unix time of the first hour counted")
    end: int = Field(description="unix time of the end of the last hour counted")
    data: list[UsageRow] = Field(description="one row per tenant (or key) and hour with any usage, in time order")
    totals: UsageCounts


def usage_router(client: redis.asyncio.Redis, settings: GatewaySettings) -> APIRouter:
    router = APIRouter()
    prefix = settings.key_prefix

    @router.get("/v1/usage", response_model=UsageReport)
    async def usage(request: Request,
                    tenant: Annotated[str | None, Query(pattern=IDENTIFIER_PATTERN)] = None,
                    key: Annotated[str | None, Query(pattern=r"^[0-9a-f]{16}$", description="an API key id")] = None,
                    start: Annotated[int | None, Query(ge=0, description="unix time; default end - 24 h")] = None,
                    end: Annotated[int | None, Query(ge=0, description="unix time; default now")] = None,
                    ) -> UsageReport:
        """Prompt, completion and cached tokens and requests per hour from `start` to `end` (whole
        hours), of one tenant, one API key (`key`: its id), or, for the admin, every tenant."""
        caller = caller_of(request).key
        last = hour_of(time.time() if end is None else end)
        first = hour_of(last - 23 * HOUR_S if start is None else start)  # default: the last 24 hours
        hours = list(range(first, last + 1, HOUR_S))
        if not hours:
            raise ApiError(400, "invalid_request", f"start: must not lie after end ({start} > {end})", param="start")
        if len(hours) > settings.usage_max_hours:
            raise ApiError(400, "invalid_request", f"start: the range spans {len(hours)} hours, more than "
                                                   f"GENQ_GATEWAY_USAGE_MAX_HOURS={settings.usage_max_hours}",
                           param="start")
        if caller is not None:
            if tenant not in (None, caller.tenant):
                raise ApiError(404, "tenant_not_found", f"tenant: {tenant!r} is not this API key's tenant",
                               param="tenant")
            tenant = caller.tenant
        if key is not None:
            stored = await client.hget(api_key_record(prefix, key), "tenant")
            owner = None if stored is None else decoded(stored)
            if owner is None or tenant not in (None, owner):
                whose = "" if tenant is None else f" of tenant {tenant!r}"
                raise ApiError(404, "key_not_found", f"key: no API key {key!r}{whose}", param="key")
            rows: list[tuple[str, str | None, int, str]] = [
                (owner, key, hour, hourly(key_usage(prefix, key), hour)) for hour in hours]
        else:
            rows = []
            for hour in hours:
                names = [tenant] if tenant is not None else sorted(
                    decoded(n) for n in await client.smembers(tenants_used(prefix, hour)))
                rows += [(name, None, hour, hourly(tenant_usage(prefix, name), hour)) for name in names]
        async with client.pipeline(transaction=False) as pipe:
            for *_, redis_key in rows:
                pipe.hmget(redis_key, COUNTS)
            values = await pipe.execute()
        data = [UsageRow(tenant=name, key=key_id, hour=hour, **{c: int(v or 0) for c, v in zip(COUNTS, counts)})
                for (name, key_id, hour, _), counts in zip(rows, values) if any(counts)]
        totals = UsageCounts(**{c: sum(getattr(row, c) for row in data) for c in COUNTS})
        return UsageReport(start=first, end=last + HOUR_S, data=data, totals=totals)

    return router
