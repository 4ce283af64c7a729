"""Batch records in Redis: OpenAI's Batch object and a batch's progress, kept so that any gateway
can take over driving it. Per batch, a hash `{prefix}:batch:{id}` (the fixed fields as one JSON
value, the status and its timestamps, the counts, `sent`: how many lines have been queued, the
owner's tenant, max_priority and key id when an API key made it, producer/batches/owners.py) and a
hash `{prefix}:batch:{id}:done` (line index -> "completed" or "failed"), whose HSETNX counts each
line once however often its answer is collected. Every batch is listed in one sorted set, and
a tenant's also in the tenant's own. Status changes are compare-and-set scripts, so a
cancel never overwrites a batch that has just completed."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, cast

import redis.asyncio
from pydantic import BaseModel, Field
from redis.typing import EncodableT, FieldT

from producer.batches.owners import Owner, page_start

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]
TERMINAL: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
LineOutcome = Literal["completed", "failed"]
BATCH_ID_PATTERN = r"^batch_[0-9a-f]{32}$"

_TRANSITION = """
local status = redis.call('HGET', KEYS[1], 'status')
for i = 3, #ARGV do
  if status == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[1] .. '_at', ARGV[2])
    return 1
  end
end
return 0
"""
_MARK_DONE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
  return 1
end
return 0
"""
_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_TIMESTAMPS = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class Batch(BaseModel):
    """OpenAI's Batch object."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


class BatchRecords:
    def __init__(self, redis_: redis.asyncio.Redis, key_prefix: str, retention_s: int) -> None:
        self.redis = redis_
        """A client that decodes responses (the gateway's)."""
        self.prefix = key_prefix
        self.retention_s = retention_s
        self._transition = redis_.register_script(_TRANSITION)
        self._mark_done = redis_.register_script(_MARK_DONE)
        self._lease = redis_.register_script(_LEASE)

    def _key(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

    def _done_key(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:done"

    @property
    def _listing(self) -> str:
        return f"{self.prefix}:batches"

    @property
    def active_key(self) -> str:
        return f"{self.prefix}:batches:active"

    async def create(self, endpoint: str, input_file_id: str, completion_window: str, window_s: int,
                     metadata: dict[str, str] | None, total: int, owner: Owner) -> Batch:
        now = int(time.time())
        batch = Batch(id=f"batch_{uuid.uuid4().hex}", endpoint=endpoint, input_file_id=input_file_id,
                      completion_window=completion_window, status="validating", created_at=now,
                      expires_at=now + window_s, metadata=metadata, request_counts=RequestCounts(total=total))
        fixed = batch.model_dump(include={"id", "endpoint", "input_file_id", "completion_window", "created_at",
                                          "expires_at", "metadata"})
        owned: dict[FieldT, EncodableT] = {
            name: value for name, value in (("owner", owner.tenant), ("max_priority", owner.max_priority),
                                            ("key", owner.key_id)) if value is not None}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._key(batch.id), mapping={"fixed": json.dumps(fixed), "status": "validating",
                                                    "total": total, "sent": 0, "completed": 0, "failed": 0, **owned})
            pipe.zadd(self._listing, {batch.id: time.time()})
            if owner.tenant is not None:  # lives as long as its newest batch's window and retention
                pipe.zadd(owner.listing(self._listing), {batch.id: time.time()})
                pipe.expire(owner.listing(self._listing), window_s + self.retention_s)
            pipe.sadd(self.active_key, batch.id)
            await pipe.execute()
        return batch

    async def get(self, batch_id: str, viewer: Owner) -> Batch | None:
        """The batch, None if it does not exist (or has expired) or is not `viewer`'s to see."""
        found = await self.owned(batch_id)
        return None if found is None or not viewer.sees(found[1].tenant) else found[0]

    async def owned(self, batch_id: str) -> tuple[Batch, Owner] | None:
        """The batch and its owner, whoever that is."""
        fields = cast(dict[str, str], await self.redis.hgetall(self._key(batch_id)))
        if "fixed" not in fields:
            return None
        values: dict[str, Any] = json.loads(fields["fixed"])
        values["status"] = fields["status"]
        values["request_counts"] = RequestCounts(total=int(fields["total"]), completed=int(fields["completed"]),
                                                 failed=int(fields["failed"]))
        for name in _TIMESTAMPS:
            if f"{name}_at" in fields:
                values[f"{name}_at"] = int(float(fields[f"{name}_at"]))
        for name in ("output_file_id", "error_file_id"):
            values[name] = fields.get(name)
        if "errors" in fields:
            values["errors"] = BatchErrors.model_validate_json(fields["errors"])
        max_priority = fields.get("max_priority")
        return Batch.model_validate(values), Owner(fields.get("owner"), None if max_priority is None
                                                   else int(max_priority), fields.get("key"))

    async def page(self, after: str | None, limit: int, viewer: Owner) -> tuple[list[Batch], bool]:
        """The batches `viewer` sees, newest first, those after batch `after`, at most `limit`; and
        whether more follow."""
        listing = viewer.listing(self._listing)
        start = await page_start(self.redis, listing, after)
        ids = cast(list[str], await self.redis.zrevrange(listing, start, start + limit))
        batches = []
        for batch_id in ids[:limit]:
            if (batch := await self.get(batch_id, viewer)) is not None:
                batches.append(batch)
            else:  # its record has expired with its files
                await self.redis.zrem(listing, batch_id)
        return batches, len(ids) > limit

    async def transition(self, batch_id: str, status: BatchStatus, *allowed: BatchStatus) -> bool:
        """Set `status` (and its timestamp) if the batch is in one of `allowed`."""
        return bool(await self._transition(keys=[self._key(batch_id)], args=[status, int(time.time()), *allowed]))

    async def progress(self, batch_id: str) -> tuple[int, dict[int, LineOutcome]]:
        """How many lines have been queued, and the outcome of each line that has ended."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hget(self._key(batch_id), "sent")
            pipe.hgetall(self._done_key(batch_id))
            sent, done = await pipe.execute()
        outcomes = cast(dict[str, LineOutcome], done)
        return int(cast(str | None, sent) or 0), {int(k): v for k, v in outcomes.items()}

    async def set_sent(self, batch_id: str, sent: int) -> None:
        await self.redis.hset(self._key(batch_id), "sent", sent)

    async def mark_done(self, batch_id: str, index: int, outcome: LineOutcome) -> None:
        await self._mark_done(keys=[self._done_key(batch_id), self._key(batch_id)], args=[index, outcome])

    async def fail(self, batch_id: str, errors: list[BatchError]) -> None:
        await self.redis.hset(self._key(batch_id), "errors", BatchErrors(data=errors).model_dump_json())
        await self.transition(batch_id, "failed", "validating", "in_progress")

    async def finish(self, batch_id: str, status: BatchStatus, output_file_id: str | None,
                     error_file_id: str | None, *allowed: BatchStatus) -> bool:
        """The batch's end: its files and final status, if it is still in one of `allowed` (a
        cancel may have come in between: then it stays active for the next step); the record
        then lives as long as its files."""
        for name, value in (("output_file_id", output_file_id), ("error_file_id", error_file_id)):
            if value is not None:
                await self.redis.hset(self._key(batch_id), name, value)
        if not await self.transition(batch_id, status, *allowed):
            return False
        await self.retire(batch_id)
        return True

    async def retire(self, batch_id: str) -> None:
        """An ended batch: no longer driven; its record and progress expire with its files."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.srem(self.active_key, batch_id)
            pipe.expire(self._key(batch_id), self.retention_s)
            pipe.expire(self._done_key(batch_id), self.retention_s)
            await pipe.execute()

    async def active(self) -> list[str]:
        return sorted(cast(set[str], await self.redis.smembers(self.active_key)))

    async def lease(self, batch_id: str, owner: str, lease_s: float) -> bool:
        """Take or renew the right to drive the batch for `lease_s`; False while another holds it."""
        key = f"{self._key(batch_id)}:lease"
        return bool(await self._lease(keys=[key], args=[owner, int(lease_s * 1000)]))
