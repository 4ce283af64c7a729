"""Admitting a request made with an API key, in ONE Lua script call (atomic in Redis, so gateway
processes never race between a read and a write):

- requests per minute: a sliding 60 s window (a sorted set of the admitted requests' times), so
  at most `rpm` requests pass in any 60 s;
- tokens per minute: a bucket of `tpm` tokens refilled at tpm/60 a second; a request takes its
  prompt tokens plus max_new_tokens (times n) at admission, and settlement (settle.py) gives back
  what the task did not use;
- concurrent tasks: a sorted set of the key's unfinished tasks, each scored by when its slot
  expires (`slot_ttl_s`: the safety net for a task whose end is never reported, a queue purged
  say; a worker killed mid-task is not one, its redelivered task ends and settles);
- for each task, a reservation record (what settlement gives back, and where) and the task's
  owner (its tenant), read by the task API (producer/gateway/access.py).

Tasks queued outside admission, a batch's lines, get a reservation record that holds nothing
(`attribute`): only the name of the key's usage counters, so that their usage counts under the
key that made the batch as well as under its tenant.

Every clock reading is Redis's (TIME), so gateways with skewed clocks agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import redis.asyncio
from redis.typing import EncodableT, FieldT

from producer.tenants.keys import ApiKey
from producer.tenants.names import (
    decoded,
    key_usage,
    requests_window,
    reservation,
    running_tasks,
    task_tenant,
    token_bucket,
)

ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local slot_ms = tonumber(ARGV[4])
local tasks = (#ARGV - 8) / 2
local cost = 0
for i = 1, tasks do cost = cost + tonumber(ARGV[8 + 2 * i]) end
local used, reset_requests, retry = 0, 0, 0
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 60000)
  used = redis.call('ZCARD', KEYS[1])
  if used > 0 then
    reset_requests = tonumber(redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]) + 60000 - now
  end
end
local level = 0
if tpm > 0 then
  level = tpm
  local bucket = redis.call('HMGET', KEYS[2], 'level', 'at')
  if bucket[1] then level = math.min(tpm, tonumber(bucket[1]) + (now - tonumber(bucket[2])) * tpm / 60000) end
end
local refused = ''
if rpm > 0 and used >= rpm then
  refused, retry = 'requests', reset_requests
elseif tpm > 0 and cost > tpm then
  refused = 'request_too_large'
elseif tpm > 0 and level < cost then
  refused, retry = 'tokens', math.ceil((cost - level) * 60000 / tpm)
elseif conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) + tasks > conc then refused = 'concurrent' end
end
if refused == '' then
  if rpm > 0 then
    redis.call('ZADD', KEYS[1], now, ARGV[8])
    redis.call('PEXPIRE', KEYS[1], 60000)
    used = used + 1
    if reset_requests == 0 then reset_requests = 60000 end
  end
  if tpm > 0 then
    level = level - cost
    redis.call('HSET', KEYS[2], 'level', tostring(level), 'at', now)
    redis.call('PEXPIRE', KEYS[2], 120000)
  end
  for i = 1, tasks do
    local record = KEYS[2 + 2 * i]
    redis.call('HSET', record, 'reserved', ARGV[8 + 2 * i], 'tpm', tpm, 'bucket', KEYS[2], 'key_usage', ARGV[7])
    if conc > 0 then
      redis.call('ZADD', KEYS[3], now + slot_ms, ARGV[7 + 2 * i])
      redis.call('HSET', record, 'running', KEYS[3])
    end
    redis.call('PEXPIRE', record, slot_ms)
    redis.call('SET', KEYS[3 + 2 * i], ARGV[6], 'EX', ARGV[5])
  end
  if conc > 0 then redis.call('PEXPIRE', KEYS[3], slot_ms) end
end
local reset_tokens = 0
if tpm > 0 then reset_tokens = math.ceil((tpm - level) * 60000 / tpm) end
return {refused, used, reset_requests, tostring(math.floor(level)), reset_tokens, retry}
"""


@dataclass(frozen=True, slots=True)
class Verdict:
    """The script's answer: `refused` names the limit that refused ('' when admitted); the rest
    feeds the x-ratelimit-* headers."""

    key: ApiKey
    refused: str
    requests_used: int
    reset_requests_ms: int
    tokens_left: int
    reset_tokens_ms: int
    retry_ms: int

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers of the key's limits that are set."""
        limits, headers = self.key.limits, {}
        if limits.rpm is not None:
            headers.update({"x-ratelimit-limit-requests": str(limits.rpm),
                            "x-ratelimit-remaining-requests": str(max(0, limits.rpm - self.requests_used)),
                            "x-ratelimit-reset-requests": duration(self.reset_requests_ms)})
        if limits.tpm is not None:
            headers.update({"x-ratelimit-limit-tokens": str(limits.tpm),
                            "x-ratelimit-remaining-tokens": str(max(0, self.tokens_left)),
                            "x-ratelimit-reset-tokens": duration(self.reset_tokens_ms)})
        return headers


def duration(ms: int) -> str:
    """OpenAI's spelling of a reset time: '20ms', '1s', '6m0s'."""
    if ms < 1000:
        return f"{max(0, ms)}ms"
    seconds = math.ceil(ms / 1000)
    return f"{seconds}s" if seconds < 60 else f"{seconds // 60}m{seconds % 60}s"


class Admission:
    """The gateway's side: one registered script (EVALSHA, loaded again if Redis forgot it)."""

    def __init__(self, client: redis.asyncio.Redis, prefix: str, slot_ttl_s: int, owner_ttl_s: int) -> None:
        self.client = client
        self.prefix = prefix
        self.slot_ttl_s = slot_ttl_s
        self.owner_ttl_s = owner_ttl_s
        self._admit = client.register_script(ADMIT)

    async def admit(self, key: ApiKey, tasks: list[tuple[str, int]], request: str | None = None) -> Verdict:
        """Admit one request of `tasks` (identifier, tokens to reserve), or say which limit refuses it.
        `request` names the request in the requests window (default: its first task's id); a
        request that queues no task itself (a batch's creation) names itself and takes one request
        of the rpm limit, no tokens and no slot."""
        p, limits = self.prefix, key.limits
        keys = [requests_window(p, key.id), token_bucket(p, key.id), running_tasks(p, key.id)]
        args: list[str | int] = [limits.rpm or 0, limits.tpm or 0, limits.concurrent or 0, self.slot_ttl_s * 1000,
                                 self.owner_ttl_s, key.tenant, key_usage(p, key.id), request or tasks[0][0]]
        for identifier, tokens in tasks:
            keys += [reservation(p, identifier), task_tenant(p, identifier)]
            args += [identifier, tokens]
        refused, used, reset_requests, left, reset_tokens, retry = await self._admit(keys=keys, args=args)
        return Verdict(key, decoded(refused), int(used),
                       int(reset_requests), int(left), int(reset_tokens), int(retry))

    async def attribute(self, key_id: str, identifiers: list[str], until_unix_s: int) -> None:
        """Count the usage of tasks queued without admission (a batch's lines) under the key: each
        gets a reservation record of no tokens and no slot whose `key_usage` settlement reads
        (settle.py), kept until `until_unix_s`; written before the tasks are queued, and again
        harmlessly when a task is sent again."""
        p = self.prefix
        record: dict[FieldT, EncodableT] = {"reserved": 0, "tpm": 0, "bucket": token_bucket(p, key_id),
                                              "key_usage": key_usage(p, key_id)}
        async with self.client.pipeline(transaction=False) as pipe:
            for identifier in identifiers:
                pipe.hset(reservation(p, identifier), mapping=record)
                pipe.expireat(reservation(p, identifier), until_unix_s)
            await pipe.execute()
