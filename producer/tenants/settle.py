"""Settling a task that ended: its usage counted once, per tenant and per API key, in hourly Redis
hashes, and what its admission reserved given back (its concurrency slot; the tokens it did not
use), in ONE script call. The worker runs it in the pipeline that carries the task's final event
(worker/publisher.py), so the counts are the final event's own usage; a gateway runs it for a task
it admitted but could not enqueue.

Each usage hash (`names.hourly(stem, hour)`) holds prompt_tokens, completion_tokens,
cached_tokens and requests, and expires `retention_s` plus an hour after its first count: at least
`retention_s` after its last, since every count of an hour's hash falls within that hour. Its
expiry (and that of the hour's set of tenants) is set once, as the hash (the set member) is
created, instead of again at every count: two commands a settled task (issue 30). A marker key makes
the count happen once per task identifier even when Redis applied a pipeline whose reply was lost
and the worker sends it again. Only tasks that end with a result count (done, length, cancelled,
expired); a failed task counts no usage and keeps the tokens it reserved (no refund), but frees
its slot.

SETTLE reads the names of the key's bucket, running set and usage stem from the reservation
record, where the gateway wrote them (keys a script does not receive in KEYS): genq's Redis is
one server (or a Sentinel-managed primary), never a Cluster."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from producer.protocol import Usage
from producer.tenants.names import DEFAULT_TENANT, counted, hourly, reservation, tenant_usage, tenants_used

HOUR_S = 3600
DEFAULT_USAGE_RETENTION_S = 90 * 86400
"""How long an hour's usage hash lives at least after its last count (the worker's GENQ_USAGE_RETENTION_S)."""


class Refund(Enum):
    """What the task's reserved tokens become at settlement."""

    NONE = "0"  # a failed task: the reservation stays charged
    UNUSED = "1"  # the reservation minus the usage's prompt and completion tokens (can be negative)
    ALL = "2"  # never enqueued


SETTLE = """
local fields = redis.call('HGETALL', KEYS[1])
local held = {}
for i = 1, #fields, 2 do held[fields[i]] = fields[i + 1] end
local prompt, completion, cached = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local counted = 0
if ARGV[3] == '1' and redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[9]) then
  local hashes = {KEYS[3]}
  if held.key_usage then hashes[2] = held.key_usage .. ':' .. ARGV[7] end
  for _, hash in ipairs(hashes) do
    redis.call('HINCRBY', hash, 'prompt_tokens', prompt)
    redis.call('HINCRBY', hash, 'completion_tokens', completion)
    redis.call('HINCRBY', hash, 'cached_tokens', cached)
    if redis.call('HINCRBY', hash, 'requests', 1) == 1 then redis.call('EXPIRE', hash, ARGV[8]) end
  end
  if redis.call('SADD', KEYS[4], ARGV[2]) == 1 then redis.call('EXPIRE', KEYS[4], ARGV[8]) end
  counted = 1
end
if held.reserved then
  if held.running then redis.call('ZREM', held.running, ARGV[1]) end
  local tpm = tonumber(held.tpm)
  if tpm > 0 and ARGV[10] ~= '0' then
    local refund = tonumber(held.reserved)
    if ARGV[10] == '1' then refund = refund - prompt - completion end
    local bucket = redis.call('HMGET', held.bucket, 'level', 'at')
    if bucket[1] then
      local t = redis.call('TIME')
      local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
      local level = tonumber(bucket[1]) + (now - tonumber(bucket[2])) * tpm / 60000 + refund
      redis.call('HSET', held.bucket, 'level', tostring(math.min(tpm, level)), 'at', now)
      redis.call('PEXPIRE', held.bucket, 120000)
    end
  end
  redis.call('DEL', KEYS[1])
end
return counted
"""


@dataclass(frozen=True, slots=True)
class Settlement:
    """One ended task's call of SETTLE: `usage` None counts nothing."""

    identifier: str
    tenant: str | None
    usage: Usage | None
    refund: Refund

    def keys(self, prefix: str, hour: int) -> list[str]:
        return [reservation(prefix, self.identifier), counted(prefix, self.identifier),
                hourly(tenant_usage(prefix, self.tenant_name), hour), tenants_used(prefix, hour)]

    def args(self, hour: int, retention_s: int, marker_ttl_s: int) -> list[str | int]:
        usage = self.usage or Usage()
        return [self.identifier, self.tenant_name, "1" if self.usage is not None else "0", usage.prompt_tokens,
                usage.completion_tokens, usage.cached_tokens, hour, retention_s + HOUR_S, marker_ttl_s,
                self.refund.value]

    @property
    def tenant_name(self) -> str:
        return self.tenant or DEFAULT_TENANT


def hour_of(unix_s: float) -> int:
    """The unix time at which the hour holding `unix_s` begins (the usage hashes' hour)."""
    return int(unix_s) // HOUR_S * HOUR_S
