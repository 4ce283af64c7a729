"""Files of the Files API: their bytes in a `Blobs` (blobs.py: a directory, GENQ_GATEWAY_FILES_DIR,
or an S3-compatible bucket, GENQ_GATEWAY_FILES_S3_BUCKET), their metadata (OpenAI's File object and
its owner, producer/batches/owners.py) in Redis, and nothing else there. Every file is listed in
one sorted set, and a tenant's also in the tenant's own (which expires with its newest file), so
that a key's listing reads only its tenant's files. A file's metadata key expires at the file's
`expires_at`; a sorted set by expiry lets `sweep` delete the bytes of expired files, and a read
of an expired file finds nothing. The per-line answers of a running batch live in the same
store (`parts/<batch id>/<line>.json`) until the batch's output files are written."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, cast

import anyio
import redis.asyncio
from pydantic import BaseModel

from producer.batches.blobs import Blobs
from producer.batches.owners import Owner, page_start

FILE_ID_PATTERN = r"^file-[A-Za-z0-9_-]{1,80}$"
FilePurpose = Literal["batch", "batch_output"]


class FileObject(BaseModel):
    """OpenAI's File object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["processed"] = "processed"
    status_details: str | None = None


class StoredFile(BaseModel):
    """A file's metadata as Redis keeps it: the File object and the tenant that owns it (None: the admin)."""

    owner: str | None
    file: FileObject


class FileStore:
    def __init__(self, redis_: redis.asyncio.Redis, key_prefix: str, blobs: Blobs, retention_s: int) -> None:
        self.redis = redis_
        self.prefix = key_prefix
        self.blobs = blobs
        self.retention_s = retention_s

    def _meta_key(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}"

    @property
    def _listing(self) -> str:
        return f"{self.prefix}:files"

    @property
    def _expiry(self) -> str:
        return f"{self.prefix}:files:expiry"

    @staticmethod
    def blob_name(file_id: str) -> str:
        """Where the file's bytes are in the blobs."""
        return f"{file_id}.jsonl"

    async def create(self, content: bytes, filename: str, purpose: FilePurpose, owner: Owner,
                     file_id: str | None = None) -> FileObject:
        """Store `content` as a new file of `owner` (or again under `file_id`, the same bytes: idempotent)."""
        now = int(time.time())
        file = FileObject(id=file_id or f"file-{uuid.uuid4().hex}", bytes=len(content), created_at=now,
                          expires_at=now + self.retention_s, filename=filename, purpose=purpose)
        await anyio.to_thread.run_sync(self.blobs.put, self.blob_name(file.id), content)
        stored = StoredFile(owner=owner.tenant, file=file)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self._meta_key(file.id), stored.model_dump_json(), exat=file.expires_at)
            pipe.zadd(self._listing, {file.id: time.time()})  # finer than created_at: the listing's order
            if owner.tenant is not None:  # a tenant's listing lives as long as its newest file
                pipe.zadd(owner.listing(self._listing), {file.id: time.time()})
                pipe.expireat(owner.listing(self._listing), file.expires_at)
            pipe.zadd(self._expiry, {file.id: file.expires_at})
            await pipe.execute()
        return file

    async def _stored(self, file_id: str, viewer: Owner) -> StoredFile | None:
        """The file's metadata, None if it does not exist, has expired, or is not `viewer`'s to see."""
        raw = await self.redis.get(self._meta_key(file_id))
        stored = None if raw is None else StoredFile.model_validate_json(raw)
        return stored if stored is not None and viewer.sees(stored.owner) else None

    async def get(self, file_id: str, viewer: Owner) -> FileObject | None:
        stored = await self._stored(file_id, viewer)
        return None if stored is None else stored.file

    async def read(self, file_id: str, viewer: Owner) -> bytes | None:
        """The file's bytes, None if `get` finds no file."""
        if await self.get(file_id, viewer) is None:
            return None
        return await anyio.to_thread.run_sync(self.blobs.get, self.blob_name(file_id))

    async def page(self, after: str | None, limit: int, purpose: str | None, viewer: Owner
                   ) -> tuple[list[FileObject], bool]:
        """The files `viewer` sees, newest first, those after the file `after`, at most `limit`; and
        whether more follow."""
        listing = viewer.listing(self._listing)
        start = await page_start(self.redis, listing, after)
        files: list[FileObject] = []
        while len(files) <= limit:
            ids = cast(list[str], await self.redis.zrevrange(listing, start, start + 2 * limit))
            if not ids:
                break
            start += len(ids)
            for file_id, raw in zip(ids, await self.redis.mget([self._meta_key(i) for i in ids]), strict=True):
                if raw is None:  # expired: dropped from the listing (its bytes are sweep's)
                    start -= await self.redis.zrem(listing, file_id)
                    continue
                file = StoredFile.model_validate_json(raw).file
                if purpose is None or file.purpose == purpose:
                    files.append(file)
        return files[:limit], len(files) > limit

    async def delete(self, file_id: str, viewer: Owner) -> bool:
        """Delete the file if `viewer` sees it; whether it did."""
        stored = await self._stored(file_id, viewer)
        return stored is not None and await self._remove(file_id, Owner(stored.owner).listing(self._listing))

    async def _remove(self, file_id: str, *listings: str) -> bool:
        """Remove the file's metadata, listing entries and bytes; whether its metadata was there
        (two deletes at once: one says so)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._meta_key(file_id))
            for listing in {self._listing, *listings}:
                pipe.zrem(listing, file_id)
            pipe.zrem(self._expiry, file_id)
            existed, *_ = await pipe.execute()
        await anyio.to_thread.run_sync(self.blobs.delete, self.blob_name(file_id))
        return bool(existed)

    async def sweep(self) -> int:
        """Delete the files whose retention has passed; how many."""
        expired = cast(list[str], await self.redis.zrangebyscore(self._expiry, 0, int(time.time())))
        for file_id in expired:
            await self._remove(file_id)
        return len(expired)

    # --- a running batch's per-line answers ------------------------------------------------

    @staticmethod
    def _parts(batch_id: str) -> str:
        return f"parts/{batch_id}/"

    async def write_part(self, batch_id: str, index: int, kind: Literal["output", "error"],
                         line: dict[str, Any]) -> None:
        data = json.dumps({"kind": kind, "line": line}, separators=(",", ":")).encode()
        await anyio.to_thread.run_sync(self.blobs.put, f"{self._parts(batch_id)}{index}.json", data)

    async def read_parts(self, batch_id: str, count: int) -> list[tuple[str, dict[str, Any]]]:
        """The answers of lines 0..count-1 that have one, in line order."""
        def read() -> list[tuple[str, dict[str, Any]]]:
            folder = self._parts(batch_id)
            names = {int(stem): name for name in self.blobs.names(folder)
                     if (stem := name.removeprefix(folder).removesuffix(".json")).isdigit()}
            found = self.blobs.get_many([names[index] for index in sorted(names) if index < count])
            return [(part["kind"], part["line"]) for part in map(json.loads, found.values())]
        return await anyio.to_thread.run_sync(read)

    async def drop_parts(self, batch_id: str) -> None:
        await anyio.to_thread.run_sync(self.blobs.delete_folder, self._parts(batch_id))
