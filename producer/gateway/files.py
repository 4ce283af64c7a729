"""/v1/files: OpenAI's Files API for batch input and output files (producer/batches/storage.py
keeps them). An upload is `multipart/form-data` with `file` and `purpose` ("batch"); its lines are
checked as a batch input file at once (producer/batches/input_file.py), a refusal naming the line
and the limit. A file belongs to the tenant of the API key that uploaded it (the admin's to no
tenant): a key sees, reads and deletes only its tenant's; another's is 404 `file_not_found`, as an
unknown id is. The multipart body is read with the standard library's email parser."""

from __future__ import annotations

from collections.abc import Mapping
from email.parser import BytesParser
from email.policy import HTTP
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel

from producer.batches.input_file import InputRefused, parse_lines
from producer.batches.storage import FILE_ID_PATTERN, FileObject
from producer.gateway.batch_api import BatchApi, owner_of
from producer.gateway.errors import ApiError

FileId = Annotated[str, Path(pattern=FILE_ID_PATTERN)]
MAX_FILE_PAGE = 10_000
"""OpenAI's largest `limit` of a file listing."""


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


def files_router(api: BatchApi, gateway_token: Any, error_responses: Mapping[int | str, dict[str, Any]]
                 ) -> APIRouter:
    router = APIRouter(dependencies=[Depends(gateway_token)], responses=dict(error_responses))

    @router.post("/v1/files", response_model=FileObject)
    async def upload(request: Request) -> FileObject:
        """Upload a batch input file: multipart `file` and `purpose` ("batch")."""
        store = api.store
        fields = await anyio.to_thread.run_sync(_form, request.headers.get("content-type", ""), await request.body())
        purpose = fields.get("purpose", (None, b""))[1].decode(errors="replace")
        if purpose != "batch":
            raise ApiError(400, "invalid_request", f"purpose: this gateway stores batch input files only: 'batch', "
                                                   f"got {purpose[:40]!r}", param="purpose")
        if "file" not in fields:
            raise ApiError(400, "invalid_request", "file: missing (a multipart part named 'file')", param="file")
        filename, content = fields["file"]
        try:
            await anyio.to_thread.run_sync(parse_lines, content, api.limits)
        except InputRefused as refused:
            raise ApiError(400, "invalid_file", f"file: {refused}", param="file") from None
        return await store.create(content, (filename or "upload.jsonl")[:256], "batch", owner_of(request))

    @router.get("/v1/files", response_model=FileList)
    async def list_files(request: Request, after: str | None = None,
                         limit: Annotated[int, Query(ge=1, le=MAX_FILE_PAGE)] = MAX_FILE_PAGE,
                         purpose: str | None = None) -> FileList:
        """The caller's files newest first; `after` a file id pages on."""
        files, more = await api.store.page(after, limit, purpose, owner_of(request))
        return FileList(data=files, first_id=files[0].id if files else None,
                        last_id=files[-1].id if files else None, has_more=more)

    @router.get("/v1/files/{file_id}", response_model=FileObject)
    async def retrieve(file_id: FileId, request: Request) -> FileObject:
        file = await api.store.get(file_id, owner_of(request))
        if file is None:
            raise _no_file(file_id)
        return file

    @router.get("/v1/files/{file_id}/content", response_class=Response,
                responses={200: {"content": {"application/jsonl": {}}}})
    async def content(file_id: FileId, request: Request) -> Response:
        data = await api.store.read(file_id, owner_of(request))
        if data is None:
            raise _no_file(file_id)
        return Response(data, media_type="application/jsonl")

    @router.delete("/v1/files/{file_id}", response_model=FileDeleted)
    async def delete(file_id: FileId, request: Request) -> FileDeleted:
        if not await api.store.delete(file_id, owner_of(request)):
            raise _no_file(file_id)
        return FileDeleted(id=file_id, deleted=True)

    return router


def _no_file(file_id: str) -> ApiError:
    return ApiError(404, "file_not_found", f"no file {file_id!r} (never uploaded, deleted, or past its expires_at)",
                    param="file_id")


def _form(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """The parts of a multipart/form-data body by name: (filename, bytes)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise ApiError(400, "invalid_request", "an upload is multipart/form-data with parts 'file' and 'purpose'")
    message = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode("latin-1")
                                                  + b"\r\n\r\n" + body)
    if not message.is_multipart():
        raise ApiError(400, "invalid_request", "the multipart body could not be read (boundary missing or wrong)")
    parts: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if isinstance(name, str) and isinstance(payload, bytes):
            parts[name] = (part.get_filename(), payload)
    return parts
