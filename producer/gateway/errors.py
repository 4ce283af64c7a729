"""Every error the gateway answers is one JSON shape, OpenAI's, so that OpenAI clients raise
their usual exceptions and webhook senders parse one format:

    {"error": {"message": "...", "type": "invalid_request_error", "code": "...", "param": null,
               "problems": ["field.path: problem", ...]}}     # problems: validation errors only
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import redis
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from kombu.exceptions import OperationalError
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a request whose client left before the answer; logged, never received."""
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/files", "/v1/batches", "/tokenize",
                "/detokenize")
"""OpenAI (and vLLM, for /tokenize) answers invalid requests with 400; the native endpoints use
422, as FastAPI does."""
REDIS_RETRY_AFTER_S = 2

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None
    param: str | None = None
    problems: list[str] | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class ApiError(Exception):
    """An answer other than success, raised anywhere in a handler."""

    def __init__(self, status: int, code: str, message: str, *, param: str | None = None,
                 problems: list[str] | None = None, headers: Mapping[str, str] | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.param, self.problems, self.headers = param, problems, headers
        self.kind = kind or _TYPES.get(status, "server_error")
        """The body's `type`: the status's, unless OpenAI answers otherwise (model_not_found)."""

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.kind, code=self.code,
                             param=self.param, problems=self.problems)
        return ErrorBody(error=detail).model_dump(exclude_none=True)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(status: int, errors: Sequence[Any]) -> ApiError:
    """pydantic's validation errors as one ApiError: every problem, the first one's field as param."""
    problems = [f"{_location(e['loc'])}: {e['msg']}" for e in errors]
    first = errors[0]["loc"] if errors else ()
    return ApiError(status, "invalid_request", "\n".join(problems), param=_location(first) if first else None,
                    problems=problems)


def validation_status(path: str) -> int:
    return 400 if path.startswith(OPENAI_PATHS) else 422


def _location(loc: tuple[Any, ...]) -> str:
    parts = [str(part) for part in loc if part != "body"]
    return ".".join(parts) or "body"


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return invalid_request(validation_status(request.url.path), error.errors()).response()

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, error: ClientDisconnect) -> Response:
        # The client left while its body was being read (or the server refused the rest of it):
        # nobody reads an answer, and it is not the gateway's error to log with a traceback.
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(redis.RedisError)
    @app.exception_handler(OperationalError)
    async def _broker_down(request: Request, error: Exception) -> JSONResponse:
        # Redis is unreachable (restarting, failing over) even after the clients' own retries:
        # the caller may retry, which SDKs do on 503 with Retry-After.
        log.warning("%s %s: Redis unavailable: %s", request.method, request.url.path, error)
        return ApiError(503, "redis_unavailable", f"the queue is unavailable right now ({type(error).__name__}); "
                        "retry shortly", headers={"Retry-After": str(REDIS_RETRY_AFTER_S)}).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own 400 is a body it could not parse (not JSON, too deep, a too long number).
        code = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed",
                413: "body_too_large"}.get(error.status_code, "http_error")
        return ApiError(error.status_code, code, str(error.detail), headers=error.headers).response()


class BodyLimit:
    """413 for a request body over `max_bytes`, as a JSON error: at once when Content-Length says
    so, else when the bytes read pass the limit (a chunked body has no Content-Length). `larger`
    gives paths a limit of their own (a file upload's), with the setting a refusal names."""

    def __init__(self, app: ASGIApp, max_bytes: int, larger: Mapping[str, tuple[int, str]] | None = None) -> None:
        self.app = app
        self.default = (max_bytes, "GENQ_GATEWAY_MAX_BODY_BYTES")
        self.larger = dict(larger or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes, setting = self.larger.get(scope["path"], self.default)
        message = f"the request body exceeds {max_bytes} bytes ({setting})"
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await ApiError(413, "body_too_large", message).response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message_ = await receive()
            received += len(message_.get("body", b""))
            if received > max_bytes:
                # Raised inside a handler's body read; FastAPI lets an HTTPException through as it is.
                raise HTTPException(413, message)
            return message_

        await self.app(scope, counting_receive, send)
