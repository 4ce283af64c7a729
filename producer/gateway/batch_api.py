"""What the Files and Batches routers share: the file store, the batch records and this
process's batch driver, built from the gateway's settings and Redis; and who the caller is to
them (`owner_of`: an API key's tenant, or the admin). Files live in GENQ_GATEWAY_FILES_DIR or the
bucket GENQ_GATEWAY_FILES_S3_BUCKET names; with neither both APIs answer 503 and no driver runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import TYPE_CHECKING

from fastapi import Request

from producer.batches.blobs import Blobs, DirectoryBlobs
from producer.batches.driver import BatchDriver
from producer.batches.input_file import InputLimits
from producer.batches.owners import ADMIN, Owner
from producer.batches.records import BatchRecords
from producer.batches.storage import FileStore
from producer.client import CONNECT_TIMEOUT_S
from producer.gateway.auth import caller_of
from producer.gateway.batch_runner import ChatTranslation, GatewayLineRunner
from producer.gateway.errors import ApiError
from producer.gateway.settings import GatewaySettings
from producer.watchdog import Watchdog

if TYPE_CHECKING:
    from producer.gateway.app import Gateway

MULTIPART_OVERHEAD_BYTES = 64 * 1024
"""What an upload's body may hold besides the file: the multipart boundaries, headers and `purpose`."""


def owner_of(request: Request) -> Owner:
    """The caller as the Files and Batch APIs see it: an API key's tenant, max_priority and id (its
    own files and batches only), or the admin (every one)."""
    key = caller_of(request).key
    return ADMIN if key is None else Owner(key.tenant, key.limits.max_priority, key.id)


class BatchApi:
    def __init__(self, gateway: Gateway, chat: ChatTranslation) -> None:
        settings = gateway.settings
        self.settings = settings
        self.tenancy = gateway.tenancy
        self.limits = InputLimits(settings.file_max_bytes, settings.batch_max_lines, settings.batch_max_line_bytes)
        self.records = BatchRecords(gateway.client.redis, settings.key_prefix, settings.file_retention_s)
        blobs = _blobs(settings)
        self._store = None if blobs is None else FileStore(
            gateway.client.redis, settings.key_prefix, blobs, settings.file_retention_s)
        self.watchdog: Watchdog | None = None
        self.driver: BatchDriver | None = None
        if self._store is not None:
            self.watchdog = Watchdog(gateway.client.celery, settings.redis(socket_connect_timeout=CONNECT_TIMEOUT_S),
                                     settings.batch_resend_after_s, settings.key_prefix)
            self.driver = BatchDriver(self.records, self._store, GatewayLineRunner(gateway, chat, self.watchdog),
                                      self.limits, max_in_flight=settings.batch_max_in_flight,
                                      poll_s=settings.batch_poll_s, lease_s=settings.batch_lease_s)

    def ensure_enabled(self) -> None:
        """503 when this gateway has nowhere to keep files."""
        if self._store is None:
            raise ApiError(503, "files_unavailable", "the Files and Batches APIs need GENQ_GATEWAY_FILES_DIR or "
                                                     "GENQ_GATEWAY_FILES_S3_BUCKET, which this gateway does not have")

    @property
    def store(self) -> FileStore:
        self.ensure_enabled()
        assert self._store is not None
        return self._store

    @property
    def upload_limits(self) -> dict[str, tuple[int, str]]:
        """BodyLimit's own limit for uploads: the largest input file plus its multipart envelope."""
        return {"/v1/files": (self.settings.file_max_bytes + MULTIPART_OVERHEAD_BYTES,
                              "GENQ_GATEWAY_FILE_MAX_BYTES")}

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """This process's batch driver and its watchdog, for the application's lifetime."""
        if self.driver is None or self.watchdog is None:
            yield
            return
        watchdog = self.watchdog
        watchdog.start()
        task = asyncio.create_task(self.driver.run(), name="batch-driver")
        try:
            yield
        finally:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            await asyncio.to_thread(watchdog.stop)
            watchdog.client.close()


def _blobs(settings: GatewaySettings) -> Blobs | None:
    """Where files' bytes live: the bucket, the directory, or nowhere (the APIs answer 503)."""
    if settings.files_s3_bucket is not None:
        from producer.batches.s3_blobs import connect  # boto3: only where a bucket is configured

        return connect(settings.files_s3_bucket, settings.files_s3_prefix, settings.files_s3_endpoint_url,
                       settings.files_s3_region)
    return None if settings.files_dir is None else DirectoryBlobs(settings.files_dir)
