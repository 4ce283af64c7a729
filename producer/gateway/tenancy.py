"""The API key side of queueing work: a key's requests become its tenant's (the body's `tenant`
replaced, a priority better than the key's `max_priority` clamped to it), are admitted within its
limits in one Redis script call (producer/tenants/admission.py) or refused with 429, and carry
OpenAI's x-ratelimit-* headers, on success too. Admin requests (the gateway token) pass unchanged."""

from __future__ import annotations

import math

import redis.asyncio
from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.gateway.auth import caller_of
from producer.gateway.errors import ApiError
from producer.gateway.settings import GatewaySettings
from producer.protocol import GenerationRequest
from producer.tenants.admission import Admission, Verdict
from producer.tenants.settle import SETTLE, Refund, Settlement

_HEADERS_STATE = "ratelimit_headers"


class Tenancy:
    def __init__(self, client: redis.asyncio.Redis, settings: GatewaySettings) -> None:
        self.prefix = settings.key_prefix
        self.retry_after_s = settings.retry_after_s
        self.admission = Admission(client, settings.key_prefix, settings.key_slot_ttl_s, settings.task_record_ttl_s)
        self._settle = client.register_script(SETTLE)

    async def admit(self, request: Request, generations: list[GenerationRequest], prompt_tokens: list[int]
                    ) -> list[GenerationRequest]:
        """The requests as they run (an API key's tenant and priority), once admitted; ApiError 429
        naming the limit otherwise. Every generation has its identifier."""
        key = caller_of(request).key
        if key is None:
            return generations
        generations = [as_tenant(generation, key.tenant, key.limits.max_priority) for generation in generations]
        tasks = []
        for generation, prompt in zip(generations, prompt_tokens, strict=True):
            assert generation.identifier is not None
            tasks.append((generation.identifier, prompt + generation.n * generation.max_new_tokens))
        verdict = await self.admission.admit(key, tasks)
        if verdict.refused:
            raise _refusal(verdict, sum(tokens for _, tokens in tasks), self.retry_after_s)
        request.state.ratelimit_headers = verdict.headers()
        return generations

    async def admit_request(self, request: Request, identifier: str) -> None:
        """A request that queues no task itself (a batch's creation: its lines are throttled by
        GENQ_GATEWAY_BATCH_MAX_IN_FLIGHT instead): one request of the key's rpm, no tokens, no
        slot; ApiError 429 past the limit."""
        key = caller_of(request).key
        if key is None:
            return
        verdict = await self.admission.admit(key, [], identifier)
        if verdict.refused:
            raise _refusal(verdict, 0, self.retry_after_s)
        request.state.ratelimit_headers = verdict.headers()

    async def attribute(self, key_id: str, identifiers: list[str], deadline: int) -> None:
        """Count a batch's lines, queued without admission, under the key that made the batch (its
        tenant counts them anyway), until their deadline and a slot's TTL after it."""
        await self.admission.attribute(key_id, identifiers, deadline + self.admission.slot_ttl_s)

    async def release(self, request: Request, identifiers: list[str]) -> None:
        """Give back what admission reserved for tasks that were never enqueued."""
        if caller_of(request).key is None:
            return
        for identifier in identifiers:
            # Without usage nothing is counted: the hour and the counters' lifetimes go unused.
            settlement = Settlement(identifier, None, None, Refund.ALL)
            await self._settle(keys=settlement.keys(self.prefix, 0), args=settlement.args(0, 1, 1))


def as_tenant(generation: GenerationRequest, tenant: str, max_priority: int | None) -> GenerationRequest:
    """The request as a key of `tenant` runs it: its tenant, and a priority better (lower) than
    the key's `max_priority`, or none, clamped to it (a key's requests and its batches' lines)."""
    priority = generation.priority
    if max_priority is not None and (priority is None or priority < max_priority):
        priority = max_priority
    return generation.model_copy(update={"tenant": tenant, "priority": priority})


_MESSAGES = {
    "requests": "requests per minute: this API key's limit of {rpm} requests in any 60 s is reached",
    "tokens": "tokens per minute: this request reserves {cost} tokens (prompt + n * max_tokens) and this API "
              "key has {left} of its {tpm} per minute left",
    "request_too_large": "tokens per minute: this request reserves {cost} tokens (prompt + n * max_tokens), more "
                         "than this API key's whole limit of {tpm} per minute; lower max_tokens or n",
    "concurrent": "concurrent tasks: this API key's {concurrent} tasks at once are running or queued",
}


def _refusal(verdict: Verdict, cost: int, retry_after_s: int) -> ApiError:
    limits = verdict.key.limits
    message = _MESSAGES[verdict.refused].format(rpm=limits.rpm, tpm=limits.tpm, concurrent=limits.concurrent,
                                                cost=cost, left=max(0, verdict.tokens_left))
    retry = math.ceil(verdict.retry_ms / 1000) if verdict.retry_ms > 0 else retry_after_s
    return ApiError(429, "rate_limit_exceeded", message,
                    headers={**verdict.headers(), "Retry-After": str(max(1, retry))})


class RateLimitHeaders:
    """Adds the x-ratelimit-* headers admission left in the request's state to its response
    (streamed ones too: their headers go out after the handler returned)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = scope.get("state", {}).get(_HEADERS_STATE)
                if headers:
                    message = {**message, "headers": [*message.get("headers", []),
                                                      *((k.encode(), v.encode()) for k, v in headers.items())]}
            await send(message)

        await self.app(scope, receive, with_headers)
