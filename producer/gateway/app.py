"""The HTTP gateway: webhooks, per-task SSE streams and OpenAI-compatible endpoints in front of
the genq queue. It holds no generation state: every request becomes a `genq.generate` task, and
every stream is read back from Redis (replay stream + live channel) through the async client, so
any number of gateway replicas can serve any task.

Run it with `genq gateway` (uvicorn); `create_app(settings)` is the ASGI application.
"""

from __future__ import annotations

import json
import re
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import aclosing, asynccontextmanager
from functools import partial
from typing import Annotated, Any

import anyio
from fastapi import Depends, FastAPI, Header, Path, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field, HttpUrl, TypeAdapter, ValidationError
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff

from producer.callback_targets import CallbackUrlRefused, check_characters, resolve_target_async
from producer.callbacks import DELIVER_CALLBACK_TASK
from producer.client import (
    AsyncGenerationHandle,
    AsyncGenqClient,
    EventKey,
    GenerationError,
    TextAssembler,
    bounded_redis_async,
    pubsub_options,
)
from producer.gateway import sse
from producer.gateway.access import TaskRecords
from producer.gateway.auth import (
    forget_signature,
    require_gateway_token,
    require_task_access,
    require_webhook_auth,
)
from producer.gateway.batch_api import BatchApi
from producer.gateway.batches import batches_router
from producer.gateway.completions import completions_router
from producer.gateway.constraints import ConstraintChecker
from producer.gateway.errors import CLIENT_CLOSED_REQUEST, ApiError, BodyLimit, ErrorBody, install_handlers
from producer.gateway.files import files_router
from producer.gateway.images import ImageRefused, check_images, image_url_parts, resolve_images
from producer.gateway.logs import redact_access_log
from producer.gateway.metrics import GatewayMetrics, MetricsMiddleware
from producer.gateway.model_limits import check_request
from producer.gateway.model_router import ModelRouter, Target
from producer.gateway.openai_api import (
    STREAM_FAILURES,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    CompletionUsage,
    MissingPromptLogprobs,
    ModelCard,
    ModelList,
    OpenAIFinishReason,
    ScoredPrompt,
    UnsupportedParameter,
    chat_response,
    function_call_delta,
    openai_finish_reason,
    stream_error,
    tool_call_delta,
)
from producer.gateway.openai_api import prompt_logprobs as shape_prompt_logprobs
from producer.gateway.prompt_gate import PromptGate
from producer.gateway.settings import GatewaySettings
from producer.gateway.sse_coalescing import coalesced
from producer.gateway.submission import parse_request, resuming, routed
from producer.gateway.subscriptions import FellBehind, SubscriptionHub
from producer.gateway.tenancy import RateLimitHeaders, Tenancy
from producer.gateway.tokens import tokens_router
from producer.gateway.usage import usage_router
from producer.model_routes import ModelRoute
from producer.protocol import (
    IDENTIFIER_PATTERN,
    GenerationRequest,
    GenerationResult,
    StreamEvent,
    TokenLogprob,
    Usage,
)
from producer.reasoning import ReasoningFormat, ReasoningStream
from producer.routing import route_queue, with_lanes
from producer.signing import task_access_token
from producer.tool_calls import ContentDelta, ToolCallStream, ToolFormat, call_seed

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

    callback_url: HttpUrl | None = Field(default=None, description="http(s) URL that receives the signed outcome")
    model: str | None = Field(default=None, description="a served model or adapter, routed as OpenAI's `model` "
                                                        "(docs/gateway.md, Routing by model); null: the first queue")


class TaskAccepted(BaseModel):
    id: str
    stream_url: str
    result_url: str
    access_token: str | None = Field(default=None, description="this task's read/cancel token (signed deployments)")


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
    webhook signatures, the task records and the workers' model cards, read per queue by the
    model router), the hub every stream's live channel comes through, the open streams' count,
    and a connection to the broker's Redis for the queue depth. Pub/sub has connections of its
    own; the command pools are bounded and wait for a free connection, so streams never take
    what submissions need."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.hub = SubscriptionHub(settings.redis_async(**pubsub_options(AsyncRetry(NoBackoff(), 0))),
                                   connections=settings.pubsub_connections, buffer=settings.stream_buffer_events)
        self.client = AsyncGenqClient(settings.redis_url, broker_url=settings.broker_url,
                                      result_backend=settings.result_backend, queue=settings.fronted_queues[0],
                                      key_prefix=settings.key_prefix, sentinel_master=settings.sentinel_master,
                                      subscriber=self.hub, max_connections=settings.redis_max_connections,
                                      pool_timeout_s=settings.redis_pool_timeout_s)
        self.broker = bounded_redis_async(settings, settings.broker, settings.redis_max_connections,
                                          settings.redis_pool_timeout_s)
        self.records = TaskRecords(self.client, settings.key_prefix, settings.task_record_ttl_s)
        self.tenancy = Tenancy(self.client.redis, settings)
        self.router = ModelRouter(self.client.redis, settings)
        self.streams = sse.StreamSlots(settings.max_streams_per_task, settings.max_streams_per_client,
                                       settings.retry_after_s)
        self.constraints = ConstraintChecker(settings)
        self.started = int(time.time())

    async def close(self) -> None:
        self.constraints.close()
        await self.client.close()
        await self.hub.close()
        await self.broker.aclose()

    async def queue_depth(self, queue: str) -> int:
        """Tasks waiting in the model's queue and, with prefix routing, in all its routes, and with
        tenant lanes, in all their lanes."""
        queues = with_lanes([queue] + [route_queue(queue, route) for route in range(self.settings.prefix_routes)],
                            self.settings.tenant_lanes)
        async with self.broker.pipeline(transaction=False) as pipe:
            for queue in queues:
                for level in PRIORITY_LEVELS:
                    pipe.llen(queue if level == 0 else f"{queue}{KOMBU_PRIORITY_SEPARATOR}{level}")
            return sum(await pipe.execute())

    async def admit(self, queue: str) -> None:
        """Admission control: refuse new work while the model's queue is deeper than the limit, so
        that a burst turns into fast 429s instead of requests that time out after waiting."""
        limit = self.settings.max_queue_depth
        if limit is not None and (depth := await self.queue_depth(queue)) > limit:
            raise ApiError(429, "queue_full", f"{depth} tasks are waiting in queue {queue!r} "
                                              f"(limit {limit}); retry later",
                           headers={"Retry-After": str(self.settings.retry_after_s)})

    async def send(self, request: GenerationRequest, identifier: str, callback_url: str | None, queue: str) -> None:
        """Enqueue with, when asked, the callback signatures: Celery publishes `link` with the
        result and `link_error` with the task id, to the callback queue (see producer.callbacks)."""
        options: dict[str, Any] = {}
        if callback_url is not None:
            common = {"callback_url": callback_url, "identifier": identifier}
            for option, event in (("link", "generation.succeeded"), ("link_error", "generation.failed")):
                options[option] = self.client.celery.signature(
                    DELIVER_CALLBACK_TASK, kwargs={**common, "event": event}, queue=self.settings.callback_queue)
        handle = await self.client.submit(request, identifier=identifier, queue=queue, **options)
        await handle.close()  # nobody follows a webhook's task from here: its reader comes via SSE

    async def status(self, identifier: str) -> TaskStatus:
        """One read of the result backend: the state and the result always agree."""
        snapshot = await self.client.handle(identifier).snapshot()
        return TaskStatus(id=identifier, state=snapshot.state, result=snapshot.result, error=snapshot.error)


async def _gateway_token(request: Request) -> None:
    gateway: Gateway = request.app.state.gateway
    await require_gateway_token(gateway.settings, request, gateway.client.redis)


async def _task_access(request: Request, task_id: Annotated[str, Path(pattern=IDENTIFIER_PATTERN)]) -> str:
    gateway: Gateway = request.app.state.gateway
    await require_task_access(gateway.settings, request, task_id, gateway.records)
    return task_id


AccessibleTaskId = Annotated[str, Depends(_task_access)]
"""A task id from the path that the caller may read and cancel."""


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    gateway = Gateway(settings)

    batch_api = BatchApi(gateway, chat_generation)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with batch_api.running():
            yield
        await gateway.close()

    app = FastAPI(title="genq gateway", version="1", lifespan=lifespan,
                  description="Webhooks, SSE streams and OpenAI-compatible endpoints for the genq queue.")
    app.state.gateway = gateway
    redact_access_log()
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, larger=batch_api.upload_limits)
    metrics = GatewayMetrics()
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(RateLimitHeaders)
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
            return await _accept(gateway, request, body)
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
        task_id: AccessibleTaskId, request: Request,
        last_event_id: Annotated[str | None, Header(alias=_LAST_EVENT_ID)] = None,
    ) -> StreamingResponse:
        """The task's events as Server-Sent Events: `id: <attempt>-<seq>`, `event: <type>`, `data:
        <StreamEvent JSON>`; first what the replay stream holds, then live, each once; the stream
        ends after the final event. Reconnect with `Last-Event-ID` to get only what follows. A
        reader that falls behind gets a last `event: resume` and should reconnect so. 429 past
        the open streams' caps per task and per client."""
        after = _parse_last_event_id(last_event_id)
        events = gateway.client.handle(task_id).events(timeout=settings.stream_idle_timeout_s, after=after)
        give_back = gateway.streams.take(task_id, sse.client_identity(request))
        return sse.EventStream(_task_sse(events, after, settings.keepalive_s), give_back)

    @app.get("/healthz", include_in_schema=False)
    async def health() -> dict[str, bool]:
        return {"redis": bool(await gateway.client.redis.ping())}

    # --- OpenAI-compatible endpoints ---------------------------------------------------

    @app.get("/v1/models", response_model=ModelList, dependencies=[Depends(_gateway_token)],
             responses=ERROR_RESPONSES)
    async def list_models() -> ModelList:
        """Every base model and adapter the live cards of the fronted queues serve (adapters with
        their base model as `parent`, as vLLM lists LoRA modules)."""
        routes = await gateway.router.routes()
        return ModelList(data=[_model_card(route, gateway.started) for route in routes.values()])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, dependencies=[Depends(_gateway_token)],
             responses=ERROR_RESPONSES)
    async def get_model(model: str) -> ModelCard:
        return _model_card((await gateway.router.resolve(model)).route, gateway.started)

    app.include_router(completions_router(_gateway_token, ERROR_RESPONSES))

    @app.post("/v1/chat/completions", response_model=ChatCompletion, dependencies=[Depends(_gateway_token)],
              responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        """OpenAI's chat completions; the worker renders the messages with the model's chat template."""
        return await _chat(gateway, request, body)

    app.include_router(files_router(batch_api, _gateway_token, ERROR_RESPONSES))
    app.include_router(batches_router(batch_api, _gateway_token, ERROR_RESPONSES,
                                      partial(_callback_url, allow_private=settings.callback_allow_private_hosts)))
    app.include_router(tokens_router(gateway.router, partial(parse_request, gateway.constraints, status=400),
                                     settings),
                       dependencies=[Depends(_gateway_token)])
    app.include_router(usage_router(gateway.client.redis, settings), dependencies=[Depends(_gateway_token)])

    # FastAPI's documented way to customise the schema is to replace the method.
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


async def _accept(gateway: Gateway, request: Request, body: bytes) -> TaskAccepted:
    """The webhook after authentication: validate, admit, claim the identifier, enqueue."""
    settings = gateway.settings
    payload = _json_object(body)
    callback_url = await _callback_url(payload.pop("callback_url", None), settings.callback_allow_private_hosts)
    if callback_url is not None and settings.webhook_secret is None:
        raise ApiError(422, "invalid_request", "callback_url: callbacks are signed with GENQ_WEBHOOK_SECRET, "
                                               "which this gateway does not have", param="callback_url")
    model = payload.pop("model", None)
    target = gateway.router.default if model is None else await gateway.router.resolve(_model_name(model))
    if target.route.adapter is not None:
        if payload.get("adapter") is not None:
            raise ApiError(422, "invalid_request", "adapter: give either `model` (an adapter's name) or `adapter`",
                           param="adapter")
        payload["adapter"] = target.route.adapter
    generation = await parse_request(gateway.constraints, payload, status=422)
    prompt_tokens = await target.cards.check(generation, status=422, names={})
    if generation.image_inputs():
        limits = await target.cards.current()
        try:
            await check_images(generation, None if limits is None else limits.images, limits is not None)
        except ImageRefused as error:
            raise ApiError(422, "invalid_image", str(error), param=error.param) from None
    await gateway.admit(target.route.queue)
    identifier = generation.identifier or str(uuid.uuid4())
    nonce = await gateway.records.claim(identifier)  # first: admission's reservation is named by the identifier
    try:
        generation, = await gateway.tenancy.admit(request, [generation.model_copy(update={"identifier": identifier})],
                                                  [prompt_tokens])
    except BaseException:
        with anyio.CancelScope(shield=True):
            await gateway.records.release(identifier, nonce)
        raise
    try:
        await gateway.send(generation, identifier, callback_url, target.route.queue)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await gateway.records.release(identifier, nonce)
            await gateway.tenancy.release(request, [identifier])
        raise
    access = (task_access_token(settings.webhook_secret.get_secret_value(), identifier, nonce)
              if settings.webhook_secret is not None else None)
    return TaskAccepted(id=identifier, stream_url=f"/v1/tasks/{identifier}/events",
                        result_url=f"/v1/tasks/{identifier}", access_token=access)


def _model_name(value: Any) -> str:
    if not isinstance(value, str):
        raise ApiError(422, "invalid_request", f"model: must be a string, got {_preview(value)}", param="model")
    return value


def _model_card(route: ModelRoute, created: int) -> ModelCard:
    return ModelCard(id=route.name, created=created, parent=None if route.adapter is None else route.parent)


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
        if isinstance(value, str):
            check_characters(value)  # before parsing, which would drop a CR or LF unseen
        try:
            url = str(_CALLBACK_URL.validate_python(value))
        except ValidationError:
            raise ApiError(422, "invalid_request", f"callback_url: must be an http(s) URL, got {_preview(value)}",
                           param="callback_url", problems=["callback_url: must be an http(s) URL"]) from None
        await resolve_target_async(url, allow_private=allow_private)
    except CallbackUrlRefused as refused:
        problem = f"callback_url: {refused}"
        raise ApiError(422, "invalid_request", problem, param="callback_url", problems=[problem]) from None
    return url


def _preview(value: Any, limit: int = 80) -> str:
    text = ascii(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parse_last_event_id(value: str | None) -> tuple[int, int] | None:
    if not value:
        return None
    match = _LAST_EVENT_ID_RE.fullmatch(value)
    if match is None:
        raise ApiError(400, "invalid_last_event_id", f"{_LAST_EVENT_ID} must be '<attempt>-<seq>' as in this "
                                                     f"stream's `id:` lines (at most 9 and 18 digits), "
                                                     f"got {_preview(value)}", param=_LAST_EVENT_ID)
    return int(match[1]), int(match[2])


def _event_id(key: EventKey | None) -> str | None:
    return None if key is None else f"{key[0]}-{key[1]}"


async def _task_sse(events: AsyncGenerator[StreamEvent, None], after: EventKey | None, keepalive_s: float
                    ) -> AsyncGenerator[str, None]:
    try:
        async with aclosing(sse.with_keepalive(events, keepalive_s)) as items:
            async for event in items:
                if event is None:
                    yield sse.KEEPALIVE
                    continue
                after = (event.attempt, event.seq)
                yield sse.message(event.to_json(), event=event.event, id=_event_id(after))
    except TimeoutError as error:
        yield sse.message(json.dumps({"error": str(error)}), event="timeout")
    except FellBehind as behind:
        yield sse.resume(_event_id(after), str(behind))


async def chat_generation(gateway: Gateway, body: ChatCompletionRequest, identifier: str
                          ) -> tuple[GenerationRequest, Target, int]:
    """A chat completion request as the genq request it runs as, checked against the model's card,
    where it goes, and its prompt's token count (0 without a card): the one translation of
    `/v1/chat/completions` (the batch lines' too)."""
    settings = gateway.settings
    target = await gateway.router.resolve(body.model)
    limits = await target.cards.current()
    try:
        body.check_params(settings.ignore_unknown_params)
        images = await resolve_images(image_url_parts(body.messages), None if limits is None else limits.images,
                                      limits is not None, allow_private=settings.image_url_allow_private_hosts,
                                      fetch_timeout_s=settings.image_fetch_timeout_s)
        fields = body.to_request_fields(settings.ignore_unknown_params, images)
    except UnsupportedParameter as error:
        raise ApiError(400, error.code, str(error), param=error.param) from None
    except ImageRefused as error:
        raise ApiError(400, "invalid_image", str(error), param=error.param) from None
    names = body.param_names()
    fields = routed(fields, target)
    if fields.get("tools") is not None and limits is not None and limits.tool_format is not None:
        # The worker then forces and reads calls in the format this gateway reads the stream in.
        fields["tool_format"] = limits.tool_format
    if limits is not None and limits.reasoning_format is not None:
        fields["reasoning_format"] = limits.reasoning_format  # so too for the thought
    generation = await parse_request(gateway.constraints, {**fields, "identifier": identifier}, status=400,
                                     names=names)
    # Before anything is queued: a streamed request is answered 200 as soon as it is.
    prompt_tokens = 0 if limits is None else await check_request(limits, generation, status=400, names=names)
    return generation, target, prompt_tokens


async def _chat(gateway: Gateway, request: Request, body: ChatCompletionRequest) -> Any:
    settings = gateway.settings
    identifier = f"chatcmpl-{uuid.uuid4().hex}"
    generation, target, prompt_tokens = await chat_generation(gateway, body, identifier)
    await gateway.admit(target.route.queue)
    generation, = await gateway.tenancy.admit(request, [generation], [prompt_tokens])
    if body.stream:
        give_back = gateway.streams.take(identifier, sse.client_identity(request))
        try:
            handle = await gateway.client.submit(generation, identifier=identifier, queue=target.route.queue)
        except BaseException:
            give_back()
            with anyio.CancelScope(shield=True):
                await gateway.tenancy.release(request, [identifier])
            raise
        reads_calls = generation.tools is not None and generation.tool_choice != "none"
        chunks = _chat_stream(gateway, handle, body.n_choices, body.model, include_usage=body.include_usage,
                              tool_format=(generation.tool_format or "hermes") if reads_calls else None,
                              reasoning_format=generation.reasoning_format, legacy_functions=body.legacy_functions,
                              prompt_logprobs=body.prompt_logprobs,
                              coalesce_s=body.coalesce_s(settings.stream_coalesce_ms))
        return sse.EventStream(chunks, give_back)
    try:
        handle = await gateway.client.submit(generation, identifier=identifier, queue=target.route.queue)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await gateway.tenancy.release(request, [identifier])
        raise
    try:
        result = await sse.unless_disconnected(request, handle.result(timeout=settings.result_timeout_s))
    except GenerationError as error:
        # Nearly always the request's fault (a token outside the vocabulary, a prompt longer than the
        # context): 400, so that SDKs do not retry it; the message is the worker's.
        raise ApiError(400, "generation_failed", error.message) from None
    except TimeoutError:
        await gateway.client.cancel(identifier)
        raise ApiError(504, "timeout", f"no result within {settings.result_timeout_s:.0f} s; cancelled") from None
    if result is None:  # the client went away: nobody will read the answer
        await gateway.client.cancel(identifier)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    try:
        return chat_response(identifier, body.model, result, body.prompt_logprobs, body.legacy_functions)
    except MissingPromptLogprobs as missing:
        raise ApiError(502, "missing_prompt_logprobs", str(missing)) from None


async def _chat_stream(gateway: Gateway, handle: AsyncGenerationHandle, n: int, model: str, *,
                       include_usage: bool, tool_format: ToolFormat | None = None,
                       reasoning_format: ReasoningFormat | None = None, legacy_functions: bool = False,
                       prompt_logprobs: int | None = None, coalesce_s: float = 0.0) -> AsyncGenerator[str, None]:
    """OpenAI's streaming format of chat completions (completions': producer/gateway/completions.py):
    `data: <chunk>` per piece of text, a finish chunk, a usage chunk when asked, then `data: [DONE]`.
    With a tool_format (a chat with tools) each choice's text goes through a ToolCallStream:
    content as `delta.content`, calls as `delta.tool_calls`, with
    the ids the worker's result gives them (the same parser, format and seed), so the assembled
    stream equals the non-streamed answer; the format is the model card's (hermes, the generic
    tool prompt's, when no worker has published a card). With a reasoning_format (a chat with a
    thinking model, also the card's) a ReasoningStream splits the thought off first: it goes out as
    `delta.reasoning_content`; a call answers legacy `functions` as `delta.function_call`. It also
    splits only the text after the thought reaches the tool-call parser. With n > 1
    the task's chunk events carry their sample's index and become one choice per chunk (as OpenAI
    sends them): chat's role chunk for each index first, each index's text as it comes, then,
    from the final event, a finish chunk per index (after any text of that sample no chunk
    carried) and one usage chunk for all. A client that
    disconnects before the end cancels the task; an error ends the stream with an error chunk. If
    a worker dies mid-generation, the redelivered attempt continues each sample's text where it
    stopped (a TextAssembler per index). With prompt_logprobs (vLLM's, `alternatives` each) the
    first chunk carries them at its top level: the role chunks wait for the chunk event that
    brings them, and a PromptGate holds the text back until then. `coalesce_s`: each choice's
    chunk events merged, one at most this often (producer/gateway/sse_coalescing.py)."""
    created = int(time.time())

    def chunk(index: int, text: str | None, finish_reason: OpenAIFinishReason | None = None, *, role: bool = False,
              logprobs: list[TokenLogprob] | None = None, tool_call: dict[str, Any] | None = None,
              reasoning: str | None = None, scored: ScoredPrompt | None = None) -> str:
        delta = ChatDelta(role="assistant" if role else None, content=text, reasoning_content=reasoning,
                          tool_calls=None if tool_call is None or legacy_functions else [tool_call],
                          function_call=tool_call if legacy_functions else None)
        body = ChatCompletionChunk(id=handle.id, created=created, model=model, choices=[
            ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason,
                            logprobs=ChatLogprobs.from_tokens(logprobs))],
            prompt_logprobs=None if scored is None or prompt_logprobs is None
            else shape_prompt_logprobs(scored, prompt_logprobs))
        return sse.message(body.model_dump_json())

    def roles(scored: ScoredPrompt | None) -> Iterator[str]:
        """Each index's role chunk; the first carries the prompt's log-probabilities when asked."""
        for index in range(n):
            yield chunk(index, "", role=True, scored=scored if index == 0 else None)

    def usage_chunk(usage: Usage) -> str:
        totals = CompletionUsage.from_usage(usage)
        body = ChatCompletionChunk(id=handle.id, created=created, model=model, choices=[], usage=totals)
        return sse.message(body.model_dump_json())

    def pieces(index: int, text: str, logprobs: list[TokenLogprob] | None = None, final: bool = False
               ) -> Iterator[str]:
        """The chunks of a piece of choice `index`'s text (the logprobs ride on the first); through
        the choice's reasoning splitter and tool-call parser when there are, which `final` flushes."""
        if thinkers is not None:
            reasoning, text = thinkers[index].feed(text)
            if final:
                more_reasoning, more_text = thinkers[index].finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
            if reasoning:
                yield chunk(index, None, logprobs=logprobs, reasoning=reasoning)
                logprobs = None
        if parsers is None:
            if text or logprobs:
                yield chunk(index, text, logprobs=logprobs)
            return
        deltas = parsers[index].feed(text) + (parsers[index].finish() if final else [])
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                yield chunk(index, delta.text, logprobs=logprobs)
            else:
                call = function_call_delta(delta) if legacy_functions else tool_call_delta(delta)
                yield chunk(index, None, logprobs=logprobs, tool_call=call)
            logprobs = None
        if logprobs:
            yield chunk(index, None, logprobs=logprobs)

    finished = False
    assemblers = [TextAssembler(handle.id, index) for index in range(n)]
    parsers = None if tool_format is None else [
        ToolCallStream(tool_format, call_seed(handle.id, index)) for index in range(n)]
    thinkers = None if reasoning_format in (None, "none") else [
        ReasoningStream(reasoning_format) for _ in range(n)]

    def answer(event: StreamEvent) -> Iterator[str]:
        """The chunks of one of the task's events."""
        if event.event in ("chunk", "error"):  # feeding an error event raises GenerationError
            index = event.index or 0
            yield from pieces(index, assemblers[index].feed(event), event.logprobs)
        elif event.is_terminal:
            reasons = {choice.index: choice.finish_reason for choice in event.choices or ()}
            for index, assembler in enumerate(assemblers):
                yield from pieces(index, assembler.feed(event), final=True)
                reason = openai_finish_reason(reasons.get(index, event.finish_reason or "stop"),
                                              legacy_functions)
                yield chunk(index, None, reason)
            if include_usage and event.usage is not None:
                yield usage_chunk(event.usage)
            yield "data: [DONE]\n\n"

    gate = PromptGate(waiting=prompt_logprobs is not None)
    try:
        if not gate.waiting:
            for role in roles(None):
                yield role
        events = coalesced(resuming(handle, gateway.settings.stream_idle_timeout_s), coalesce_s)
        async with aclosing(sse.with_keepalive(events, gateway.settings.keepalive_s)) as items:
            async for item in items:
                if item is None:
                    yield sse.KEEPALIVE
                    continue
                if item.is_terminal:
                    finished = True  # the task ended (done, cancelled, or failed)
                scored, ready = gate.feed(item)
                if scored is not None:
                    for role in roles(scored):
                        yield role
                for passed in ready:
                    for piece in answer(passed):
                        yield piece
    except STREAM_FAILURES as failure:
        finished = finished or isinstance(failure, GenerationError)  # a failed task has ended
        yield stream_error(failure)
    finally:
        # The client left (the server cancels this generator), or the stream broke: stop the GPU work.
        if not finished:
            with anyio.CancelScope(shield=True):
                await gateway.client.cancel(handle.id)
