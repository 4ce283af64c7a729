"""The HTTP gateway: webhooks, per-task SSE streams and OpenAI-compatible endpoints in front of
the genq queue. It holds no generation state: every request becomes a `genq.generate` task, and
every stream is read back from Redis (replay stream + live channel) through the async client, so
any number of gateway replicas can serve any task.

Run it with `genq gateway` (uvicorn); `create_app(settings)` is the ASGI application.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import anyio
from fastapi import Depends, FastAPI, Header, Path, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field, HttpUrl, TypeAdapter, ValidationError

from producer.callback_targets import CallbackUrlRefused, resolve_target_async
from producer.callbacks import DELIVER_CALLBACK_TASK
from producer.client import AsyncGenerationHandle, AsyncGenqClient, GenerationError, StreamRestarted, TextAssembler
from producer.gateway import sse
from producer.gateway.access import TaskRecords
from producer.gateway.auth import (
    forget_signature,
    require_gateway_token,
    require_task_access,
    require_webhook_auth,
)
from producer.gateway.constraints import constraint_problem
from producer.gateway.errors import CLIENT_CLOSED_REQUEST, ApiError, BodyLimit, ErrorBody, install_handlers
from producer.gateway.logs import redact_access_log
from producer.gateway.metrics import GatewayMetrics, MetricsMiddleware
from producer.gateway.model_limits import OPENAI_NAMES, CardReader
from producer.gateway.openai_api import (
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionUsage,
    ModelCard,
    ModelList,
    UnsupportedParameter,
    chat_response,
    completion_response,
    openai_finish_reason,
)
from producer.gateway.settings import GatewaySettings
from producer.protocol import (
    IDENTIFIER_PATTERN,
    MAX_SEED,
    GenerationRequest,
    GenerationResult,
    ProtocolError,
    StreamEvent,
    TokenLogprob,
    Usage,
)
from producer.routing import route_queue
from producer.signing import task_access_token

PRIORITY_LEVELS = range(10)
KOMBU_PRIORITY_SEPARATOR = "\x06\x16"
"""kombu's Redis transport keeps one list per priority level: the queue's own name for level 0,
f"{queue}\\x06\\x16{level}" for the others (kombu/transport/redis.py, Channel._q_for_pri).
Summing every level 0-9 counts a queue whatever priority_steps its producers use."""

_CALLBACK_URL = TypeAdapter(HttpUrl)
_LAST_EVENT_ID = "Last-Event-ID"
_LAST_EVENT_ID_RE = re.compile(r"([0-9]{1,9})-([0-9]{1,18})")
"""ASCII digits only (str.isdigit also takes '²', which int() refuses) and bounded, since the
numbers go into Redis stream positions."""
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody} for status in (400, 401, 404, 409, 413, 422, 429)}


class WebhookTask(GenerationRequest):
    """The body of `POST /v1/tasks`: a generation request plus where to deliver its outcome."""

    callback_url: HttpUrl | None = Field(None, description="http(s) URL that receives the signed outcome")


class TaskAccepted(BaseModel):
    id: str
    stream_url: str
    result_url: str
    access_token: str | None = Field(None, description="this task's read/cancel token (signed deployments)")


class TaskStatus(BaseModel):
    id: str
    state: str = Field(description="Celery's: PENDING (queued or unknown), STARTED, SUCCESS, FAILURE, ...")
    result: GenerationResult | None = None
    error: str | None = None


class CancelAccepted(BaseModel):
    id: str
    cancel_requested: bool = True


class Gateway:
    """What the handlers share: the settings, the async client (whose Redis also keeps the seen
    webhook signatures, the task records and the workers' model card) and a connection to the
    broker's Redis for the queue depth."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.client = AsyncGenqClient(settings.redis_url, broker_url=settings.broker_url,
                                      result_backend=settings.result_backend, queue=settings.queue,
                                      key_prefix=settings.key_prefix, sentinel_master=settings.sentinel_master)
        self.broker = self.client.settings.redis_async(self.client.settings.broker)
        self.records = TaskRecords(self.client, settings.key_prefix, settings.task_record_ttl_s)
        self.limits = CardReader(self.client.redis, settings.key_prefix, settings.queue, settings.card_refresh_s)
        self.started = int(time.time())

    async def close(self) -> None:
        await self.client.close()
        await self.broker.aclose()

    async def queue_depth(self) -> int:
        """Tasks waiting in the model's queue and, with prefix routing, in all its routes."""
        queues = [self.settings.queue] + [route_queue(self.settings.queue, route)
                                          for route in range(self.settings.prefix_routes)]
        async with self.broker.pipeline(transaction=False) as pipe:
            for queue in queues:
                for level in PRIORITY_LEVELS:
                    pipe.llen(queue if level == 0 else f"{queue}{KOMBU_PRIORITY_SEPARATOR}{level}")
            return sum(await pipe.execute())

    async def admit(self) -> None:
        """Admission control: refuse new work while the queue is deeper than the limit, so that a
        burst turns into fast 429s instead of requests that time out after waiting."""
        limit = self.settings.max_queue_depth
        if limit is not None and (depth := await self.queue_depth()) > limit:
            raise ApiError(429, "queue_full", f"{depth} tasks are waiting in queue {self.settings.queue!r} "
                                              f"(limit {limit}); retry later",
                           headers={"Retry-After": str(self.settings.retry_after_s)})

    async def send(self, request: GenerationRequest, identifier: str, callback_url: str | None) -> None:
        """Enqueue with, when asked, the callback signatures: Celery publishes `link` with the
        result and `link_error` with the task id, to the callback queue (see producer.callbacks)."""
        options: dict[str, Any] = {}
        if callback_url is not None:
            common = {"callback_url": callback_url, "identifier": identifier}
            for option, event in (("link", "generation.succeeded"), ("link_error", "generation.failed")):
                options[option] = self.client.celery.signature(
                    DELIVER_CALLBACK_TASK, kwargs={**common, "event": event}, queue=self.settings.callback_queue)
        handle = await self.client.submit(request, identifier=identifier, **options)
        await handle.close()  # nobody follows a webhook's task from here: its reader comes via SSE

    async def status(self, identifier: str) -> TaskStatus:
        handle = self.client.handle(identifier)
        try:
            result = await handle.result(timeout=0)
        except GenerationError as error:
            return TaskStatus(id=identifier, state=await handle.state(), error=error.message)
        except TimeoutError:
            return TaskStatus(id=identifier, state=await handle.state())
        return TaskStatus(id=identifier, state="SUCCESS", result=result)


def _gateway_token(request: Request) -> None:
    require_gateway_token(request.app.state.gateway.settings, request)


async def _task_access(request: Request, task_id: Annotated[str, Path(pattern=IDENTIFIER_PATTERN)]) -> str:
    gateway: Gateway = request.app.state.gateway
    await require_task_access(gateway.settings, request, task_id, gateway.records)
    return task_id


AccessibleTaskId = Annotated[str, Depends(_task_access)]
"""A task id from the path that the caller may read and cancel."""


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    gateway = Gateway(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await gateway.close()

    app = FastAPI(title="genq gateway", version="1", lifespan=lifespan,
                  description="Webhooks, SSE streams and OpenAI-compatible endpoints for the genq queue.")
    app.state.gateway = gateway
    redact_access_log()
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    metrics = GatewayMetrics()
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_api_route("/metrics", metrics.endpoint, methods=["GET"], include_in_schema=False)
    install_handlers(app)

    # --- native endpoints ---------------------------------------------------------------

    @app.post("/v1/tasks", status_code=202, response_model=TaskAccepted, responses=ERROR_RESPONSES,
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/WebhookTask"}}}}})
    async def create_task(request: Request) -> TaskAccepted:
        """Enqueue a generation. Authenticated by the bearer token or by an HMAC signature: headers
        `X-Genq-Timestamp: <unix s>` and `X-Genq-Signature: sha256=<hex HMAC-SHA256(secret,
        "<timestamp>." + raw body)>`. The body is a genq request (docs/protocol.md) plus an
        optional `callback_url` that receives the outcome, signed the same way."""
        body = await request.body()
        seen_signature = await require_webhook_auth(settings, request, body, gateway.client.redis)
        try:
            return await _accept(gateway, body)
        except BaseException:
            if seen_signature is not None:  # refused: the sender may retry the same signed bytes
                with anyio.CancelScope(shield=True):
                    await forget_signature(gateway.client.redis, seen_signature)
            raise

    @app.get("/v1/tasks/{task_id}", response_model=TaskStatus, responses=ERROR_RESPONSES)
    async def get_task(task_id: AccessibleTaskId) -> TaskStatus:
        """The task's Celery state, with its result on SUCCESS or its error on FAILURE."""
        return await gateway.status(task_id)

    @app.delete("/v1/tasks/{task_id}", status_code=202, response_model=CancelAccepted, responses=ERROR_RESPONSES)
    async def cancel_task(task_id: AccessibleTaskId) -> CancelAccepted:
        """Cancel the task, queued or running; its stream ends with a `cancelled` event."""
        await gateway.client.cancel(task_id)
        return CancelAccepted(id=task_id)

    @app.get("/v1/tasks/{task_id}/events", responses={**ERROR_RESPONSES, 200: {
        "content": {"text/event-stream": {}}, "description": "one SSE message per stream event"}})
    async def task_events(
        task_id: AccessibleTaskId,
        last_event_id: Annotated[str | None, Header(alias=_LAST_EVENT_ID)] = None,
    ) -> StreamingResponse:
        """The task's events as Server-Sent Events: `id: <attempt>-<seq>`, `event: <type>`, `data:
        <StreamEvent JSON>`; first what the replay stream holds, then live, each once; the stream
        ends after the final event. Reconnect with `Last-Event-ID` to get only what follows."""
        after = _parse_last_event_id(last_event_id)
        events = gateway.client.handle(task_id).events(timeout=settings.stream_idle_timeout_s, after=after)
        return StreamingResponse(_task_sse(events, settings.keepalive_s), media_type="text/event-stream",
                                 headers=sse.SSE_HEADERS)

    @app.get("/healthz", include_in_schema=False)
    async def health() -> dict[str, bool]:
        return {"redis": bool(await gateway.client.redis.ping())}

    # --- OpenAI-compatible endpoints ---------------------------------------------------

    @app.get("/v1/models", response_model=ModelList, dependencies=[Depends(_gateway_token)],
             responses=ERROR_RESPONSES)
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=settings.model_name, created=gateway.started)])

    @app.get("/v1/models/{model}", response_model=ModelCard, dependencies=[Depends(_gateway_token)],
             responses=ERROR_RESPONSES)
    async def get_model(model: str) -> ModelCard:
        _check_model(settings, model)
        return ModelCard(id=settings.model_name, created=gateway.started)

    @app.post("/v1/completions", response_model=Completion, dependencies=[Depends(_gateway_token)],
              responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}})
    async def completions(body: CompletionRequest, request: Request) -> Any:
        """OpenAI's text completions, streamed (`stream: true`) or not."""
        return await _openai(gateway, request, body, chat=False)

    @app.post("/v1/chat/completions", response_model=ChatCompletion, dependencies=[Depends(_gateway_token)],
              responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        """OpenAI's chat completions; the worker renders the messages with the model's chat template."""
        return await _openai(gateway, request, body, chat=True)

    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


# --- helpers -------------------------------------------------------------------------------


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, plus the webhook body: that handler reads the raw bytes (the signature
    covers them), so FastAPI cannot see its model."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        body = WebhookTask.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(body.pop("$defs", {}))
        components["WebhookTask"] = body
        app.openapi_schema = schema
    return app.openapi_schema


async def _accept(gateway: Gateway, body: bytes) -> TaskAccepted:
    """The webhook after authentication: validate, admit, claim the identifier, enqueue."""
    settings = gateway.settings
    payload = _json_object(body)
    callback_url = await _callback_url(payload.pop("callback_url", None), settings.callback_allow_private_hosts)
    if callback_url is not None and settings.webhook_secret is None:
        raise ApiError(422, "invalid_request", "callback_url: callbacks are signed with GENQ_WEBHOOK_SECRET, "
                                               "which this gateway does not have", param="callback_url")
    generation = _parse(payload, status=422)
    await gateway.limits.check(generation, status=422, names={})
    await gateway.admit()
    identifier = generation.identifier or str(uuid.uuid4())
    nonce = await gateway.records.claim(identifier)
    try:
        await gateway.send(generation, identifier, callback_url)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await gateway.records.release(identifier, nonce)
        raise
    access = (task_access_token(settings.webhook_secret.get_secret_value(), identifier, nonce)
              if settings.webhook_secret is not None else None)
    return TaskAccepted(id=identifier, stream_url=f"/v1/tasks/{identifier}/events",
                        result_url=f"/v1/tasks/{identifier}", access_token=access)


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(422, "invalid_json", f"the body is not JSON: {error}"[:300]) from None
    except ValueError:  # valid JSON, but an integer longer than Python converts (sys.get_int_max_str_digits)
        raise ApiError(422, "invalid_json", f"the body holds a number of more than {sys.get_int_max_str_digits()} "
                                            "digits") from None
    except RecursionError:
        raise ApiError(422, "invalid_json", "the body is nested too deeply") from None
    if not isinstance(payload, dict):
        raise ApiError(422, "invalid_request", "the body must be a JSON object of request fields")
    return payload


async def _callback_url(value: Any, allow_private: bool) -> str | None:
    """The normalized callback URL (IP spellings become dotted quads), checked against the
    address policy of producer.callback_targets."""
    if value is None:
        return None
    try:
        url = str(_CALLBACK_URL.validate_python(value))
    except ValidationError:
        raise ApiError(422, "invalid_request", f"callback_url: must be an http(s) URL, got {_preview(value)}",
                       param="callback_url", problems=["callback_url: must be an http(s) URL"]) from None
    try:
        await resolve_target_async(url, allow_private=allow_private)
    except CallbackUrlRefused as refused:
        problem = f"callback_url: {refused}"
        raise ApiError(422, "invalid_request", problem, param="callback_url", problems=[problem]) from None
    return url


def _preview(value: Any, limit: int = 80) -> str:
    text = ascii(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parse(fields: dict[str, Any], *, status: int) -> GenerationRequest:
    try:
        request = GenerationRequest.parse_payload(fields)
    except ProtocolError as error:
        param = error.problems[0].split(":", 1)[0] if error.problems else None
        raise ApiError(status, "invalid_request", str(error), param=param, problems=error.problems) from None
    problem = constraint_problem(request.constraint) if request.constraint is not None else None
    if problem is not None:
        raise ApiError(status, "invalid_constraint", problem, param="constraint", problems=[problem])
    return request


def _parse_last_event_id(value: str | None) -> tuple[int, int] | None:
    if not value:
        return None
    match = _LAST_EVENT_ID_RE.fullmatch(value)
    if match is None:
        raise ApiError(400, "invalid_last_event_id", f"{_LAST_EVENT_ID} must be '<attempt>-<seq>' as in this "
                                                     f"stream's `id:` lines (at most 9 and 18 digits), "
                                                     f"got {_preview(value)}", param=_LAST_EVENT_ID)
    return int(match[1]), int(match[2])


def _check_model(settings: GatewaySettings, model: str) -> None:
    if model != settings.model_name:
        raise ApiError(404, "model_not_found", f"the model {model!r} does not exist; this gateway serves "
                                               f"{settings.model_name!r}", param="model")


async def _task_sse(events: AsyncIterator[StreamEvent], keepalive_s: float) -> AsyncIterator[str]:
    try:
        async for event in sse.with_keepalive(events, keepalive_s):
            if event is None:
                yield sse.KEEPALIVE
                continue
            yield sse.message(event.to_json(), event=event.event, id=f"{event.attempt}-{event.seq}")
    except TimeoutError as error:
        yield sse.message(json.dumps({"error": str(error)}), event="timeout")


async def _openai(gateway: Gateway, request: Request, body: CompletionRequest | ChatCompletionRequest,
                  *, chat: bool) -> Any:
    settings = gateway.settings
    _check_model(settings, body.model)
    try:
        fields = body.to_request_fields()
    except UnsupportedParameter as error:
        raise ApiError(400, error.code, str(error), param=error.param) from None
    identifier = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    generation = _parse({**fields, "identifier": identifier}, status=400)
    # Before anything is queued: a streamed request is answered 200 as soon as it is.
    await gateway.limits.check(generation, status=400, names=OPENAI_NAMES)
    await gateway.admit()
    if body.n_choices == 1:
        handles = [await gateway.client.submit(generation, identifier=identifier)]
    else:
        handles = await gateway.client.submit_many(_children(generation, body.n_choices))
    if body.stream:
        chunks = _openai_stream(gateway, identifier, handles, body.model, chat=chat,
                                include_usage=body.include_usage)
        return StreamingResponse(chunks, media_type="text/event-stream", headers=sse.SSE_HEADERS)
    try:
        results = await sse.unless_disconnected(request, _results(handles, settings.result_timeout_s))
    except GenerationError as error:
        # Nearly always the request's fault (a token outside the vocabulary, a prompt longer than the
        # context): 400, so that SDKs do not retry it; the message is the worker's.
        await _cancel(gateway, [handle for handle in handles if handle.id != error.identifier])
        raise ApiError(400, "generation_failed", error.message) from None
    except TimeoutError:
        await _cancel(gateway, handles)
        raise ApiError(504, "timeout", f"no result within {settings.result_timeout_s:.0f} s; cancelled") from None
    if results is None:  # the client went away: nobody will read the answer
        await _cancel(gateway, handles)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return (chat_response if chat else completion_response)(identifier, body.model, results)


def _children(generation: GenerationRequest, n: int) -> list[dict[str, Any]]:
    """OpenAI's n > 1 as vLLM v1 does it (parallel sampling): n child requests `<id>-0` ...
    `<id>-<n-1>` with the parent's prompt and settings, seeds seed + i (wrapped into the protocol's
    range, as engine.Job.samples does) or, without a seed, each its own random one. Sent together
    (submit_many) to one queue (with prefix routing, the prompt's route), they usually reach one
    worker, which computes the prompt once: the engine shares its pages between jobs admitted
    together (prefix cache). Children that land on different workers (several consume one queue,
    a redelivery) each compute the prompt."""
    kwargs = generation.to_kwargs()
    sampling = kwargs.get("sampling", {})
    seed = generation.sampling.seed
    children = []
    for i in range(n):
        child = {**kwargs, "identifier": f"{generation.identifier}-{i}"}
        if seed is not None:
            child["sampling"] = {**sampling, "seed": (seed + i) % (MAX_SEED + 1)}
        children.append(child)
    return children


async def _results(handles: list[AsyncGenerationHandle], timeout: float) -> list[GenerationResult]:
    """Every handle's result, in order; the first failure (GenerationError, TimeoutError) is raised
    as soon as it happens, and the waits still running are dropped."""
    if len(handles) == 1:
        return [await handles[0].result(timeout=timeout)]
    waits = [asyncio.ensure_future(handle.result(timeout=timeout)) for handle in handles]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
        for wait in waits:
            if wait.done() and (failure := wait.exception()) is not None:
                raise failure
        return [wait.result() for wait in waits]
    finally:
        for wait in waits:
            wait.cancel()


async def _cancel(gateway: Gateway, handles: list[AsyncGenerationHandle]) -> None:
    for handle in handles:
        await gateway.client.cancel(handle.id)


async def _openai_stream(gateway: Gateway, identifier: str, handles: list[AsyncGenerationHandle], model: str, *,
                         chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """OpenAI's streaming format: `data: <chunk>` per piece of text, a last chunk with the
    finish_reason, a usage chunk when asked, then `data: [DONE]`. With n > 1 the children's events
    are merged as they come, one choice per chunk (as OpenAI sends them): chat's role chunk for
    each index first, each index's text and its own finish chunk, then one usage chunk for all
    (CompletionUsage.from_usage) once every child has finished. A client that disconnects before
    the end cancels every unfinished child, and so does an error of any child (the stream ends
    with that error). If a worker dies mid-generation, the redelivered attempt continues the text
    where it stopped (a TextAssembler per child)."""
    created = int(time.time())
    n = len(handles)
    offsets = [0] * n  # of each choice's text so far (the legacy logprobs' text_offset)

    def chunk(index: int, text: str | None, finish_reason: str | None = None, *, role: bool = False,
              logprobs: list[TokenLogprob] | None = None) -> str:
        if chat:
            delta = ChatDelta(role="assistant" if role else None, content=text)
            body: BaseModel = ChatCompletionChunk(id=identifier, created=created, model=model, choices=[
                ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason,
                                logprobs=ChatLogprobs.from_tokens(logprobs))])
        else:
            body = Completion(id=identifier, created=created, model=model, choices=[
                CompletionChoice(index=index, text=text or "", finish_reason=finish_reason,
                                 logprobs=CompletionLogprobs.from_tokens(logprobs, offsets[index]))])
        return sse.message(body.model_dump_json())

    def usage_chunk(usages: list[Usage]) -> str:
        totals = CompletionUsage.from_usage(usages)
        body: BaseModel = (ChatCompletionChunk(id=identifier, created=created, model=model, choices=[],
                                               usage=totals)
                           if chat else Completion(id=identifier, created=created, model=model, choices=[],
                                                   usage=totals))
        return sse.message(body.model_dump_json())

    def error(code: str, message: str) -> str:
        return sse.message(json.dumps({"error": {"message": message, "type": "server_error", "code": code}}))

    usages: dict[int, Usage | None] = {}  # of the children that finished (an error finishes one too)
    assemblers = [TextAssembler(handle.id) for handle in handles]
    try:
        if chat:
            for index in range(n):
                yield chunk(index, "", role=True)
        timeout = gateway.settings.stream_idle_timeout_s
        events = sse.merged([handle.events(timeout=timeout) for handle in handles])
        async for item in sse.with_keepalive(events, gateway.settings.keepalive_s):
            if item is None:
                yield sse.KEEPALIVE
                continue
            index, event = item
            text = assemblers[index].feed(event)
            logprobs = event.logprobs if event.event == "chunk" else None
            if text or logprobs:
                yield chunk(index, text, logprobs=logprobs)
                offsets[index] += len(text or "")
            if event.is_terminal:
                usages[index] = event.usage
                yield chunk(index, None if chat else "", openai_finish_reason(event.finish_reason or "stop"))
                if len(usages) == n:
                    totals = [usages[i] for i in range(n)]
                    if include_usage and all(usage is not None for usage in totals):
                        yield usage_chunk(totals)  # type: ignore[arg-type]
                    yield "data: [DONE]\n\n"
    except GenerationError as failure:
        usages.update({i: None for i, handle in enumerate(handles) if handle.id == failure.identifier})
        yield error("generation_failed", failure.message)
    except StreamRestarted as restarted:
        yield error("stream_restarted", str(restarted))
    except TimeoutError as timeout:
        yield error("timeout", str(timeout))
    finally:
        # The client left (the server cancels this generator), or the stream broke: stop the GPU work.
        unfinished = [handle for i, handle in enumerate(handles) if i not in usages]
        if unfinished:
            with anyio.CancelScope(shield=True):
                await _cancel(gateway, unfinished)
