"""/v1/batches: OpenAI's Batch API. Creating a batch checks its input file against the endpoint
(every line's url), records it (producer/batches/records.py) and leaves the rest to the batch
drivers (producer/batches/driver.py): each line runs as an ordinary `genq.generate` task at the
batch priority, with the completion window as its deadline. A batch whose metadata names
`genq_webhook_url` has its final Batch object posted there, signed, when it ends. A batch
belongs to the tenant of the API key that made it (the admin's to no tenant) and its lines run as
that tenant's; a key sees and cancels only its tenant's batches and makes them only from its
tenant's files; another's is 404, as an unknown id is."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Depends, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from producer.batches.input_file import BatchLine, InputRefused, parse_lines
from producer.batches.owners import Owner
from producer.batches.records import BATCH_ID_PATTERN, Batch
from producer.gateway.batch_api import BatchApi, owner_of
from producer.gateway.batch_runner import WEBHOOK_METADATA_KEY
from producer.gateway.errors import ApiError

BatchId = Annotated[str, Path(pattern=BATCH_ID_PATTERN)]
COMPLETION_WINDOWS = {"24h": 24 * 3600}
"""OpenAI's one completion window, in seconds: the batch's expires_at and each line's deadline."""
MAX_BATCH_PAGE = 100
"""OpenAI's largest `limit` of a batch listing."""
MAX_BATCH_METADATA_KEYS = 16
MAX_BATCH_METADATA_KEY_CHARS = 64
MAX_BATCH_METADATA_VALUE_CHARS = 512
"""OpenAI's bounds of a batch's metadata."""

CallbackCheck = Callable[[Any], Awaitable[str | None]]


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(max_length=128)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: dict[Annotated[str, Field(max_length=MAX_BATCH_METADATA_KEY_CHARS)],
                   Annotated[str, Field(max_length=MAX_BATCH_METADATA_VALUE_CHARS)]] | None = Field(
        default=None, max_length=MAX_BATCH_METADATA_KEYS)


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


def batches_router(api: BatchApi, gateway_token: Any, error_responses: Mapping[int | str, dict[str, Any]],
                   callback_url: CallbackCheck) -> APIRouter:
    """callback_url: the gateway's check of a callback URL (normalized, or a 422 naming it)."""
    router = APIRouter(dependencies=[Depends(gateway_token)], responses=dict(error_responses))

    @router.post("/v1/batches", response_model=Batch)
    async def create(body: CreateBatch, request: Request) -> Batch:
        """Create a batch of the input file's requests; it runs as soon as a driver steps it."""
        store, owner = api.store, owner_of(request)
        metadata = dict(body.metadata) if body.metadata is not None else None
        if metadata is not None and WEBHOOK_METADATA_KEY in metadata:
            if api.settings.webhook_secret is None:
                raise ApiError(400, "invalid_request", f"metadata.{WEBHOOK_METADATA_KEY}: webhooks are signed with "
                                                       "GENQ_WEBHOOK_SECRET, which this gateway does not have",
                               param=f"metadata.{WEBHOOK_METADATA_KEY}")
            try:
                url = await callback_url(metadata[WEBHOOK_METADATA_KEY])
            except ApiError as refused:
                message = refused.message.replace("callback_url", f"metadata.{WEBHOOK_METADATA_KEY}", 1)
                raise ApiError(400, refused.code, message,
                               param=f"metadata.{WEBHOOK_METADATA_KEY}") from None
            assert url is not None
            metadata[WEBHOOK_METADATA_KEY] = url
        file = await store.get(body.input_file_id, owner)
        if file is None or (data := await store.read(body.input_file_id, owner)) is None:
            raise ApiError(404, "file_not_found", f"input_file_id: no file {body.input_file_id!r} (never uploaded, "
                                                  "deleted, or past its expires_at)", param="input_file_id")
        if file.purpose != "batch":
            raise ApiError(400, "invalid_request", f"input_file_id: {body.input_file_id!r} is a batch's "
                                                   f"{file.purpose} file, not a batch input file",
                           param="input_file_id")
        try:
            lines = await anyio.to_thread.run_sync(parse_lines, data, api.limits)
        except InputRefused as refused:
            raise ApiError(400, "invalid_file", f"input_file_id: {refused}", param="input_file_id") from None
        _check_endpoint(lines, body.endpoint)
        await api.tenancy.admit_request(request, f"batch-create-{uuid.uuid4().hex}")
        return await api.records.create(body.endpoint, body.input_file_id, body.completion_window,
                                        COMPLETION_WINDOWS[body.completion_window], metadata, len(lines), owner)

    @router.get("/v1/batches/{batch_id}", response_model=Batch)
    async def retrieve(batch_id: BatchId, request: Request) -> Batch:
        return await _batch(api, batch_id, owner_of(request))

    @router.get("/v1/batches", response_model=BatchList)
    async def list_batches(request: Request, after: str | None = None,
                           limit: Annotated[int, Query(ge=1, le=MAX_BATCH_PAGE)] = 20) -> BatchList:
        """The caller's batches newest first; `after` a batch id pages on."""
        api.ensure_enabled()
        batches, more = await api.records.page(after, limit, owner_of(request))
        return BatchList(data=batches, first_id=batches[0].id if batches else None,
                         last_id=batches[-1].id if batches else None, has_more=more)

    @router.post("/v1/batches/{batch_id}/cancel", response_model=Batch)
    async def cancel(batch_id: BatchId, request: Request) -> Batch:
        """Stop queueing the batch's lines and cancel those queued or running; the batch is
        `cancelling` until they have ended, then `cancelled`, with the answers it has."""
        owner = owner_of(request)
        batch = await _batch(api, batch_id, owner)
        if batch.status not in ("cancelling", "cancelled") and not await api.records.transition(
                batch_id, "cancelling", "validating", "in_progress"):
            raise ApiError(409, "batch_not_cancellable", f"batch {batch_id} is {batch.status}: only a validating or "
                                                         "in_progress batch can be cancelled")
        return await _batch(api, batch_id, owner)

    return router


async def _batch(api: BatchApi, batch_id: str, viewer: Owner) -> Batch:
    api.ensure_enabled()
    batch = await api.records.get(batch_id, viewer)
    if batch is None:
        raise ApiError(404, "batch_not_found", f"no batch {batch_id!r} (never created, or past its retention)",
                       param="batch_id")
    return batch


def _check_endpoint(lines: list[BatchLine], endpoint: str) -> None:
    for line in lines:
        if line.url != endpoint:
            raise ApiError(400, "invalid_file", f"input_file_id: line {line.index + 1}: url {line.url} differs from "
                                                f"the batch's endpoint {endpoint}; a batch calls one endpoint",
                           param="input_file_id")
