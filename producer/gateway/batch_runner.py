"""The gateway's side of driving a batch (producer/batches/driver.py's LineRunner): a line's body
translated by the endpoint's own translation (app.chat_generation, completions'
completion_generations) into the genq request it runs as, at the batch priority with the
completion window as its deadline, and as the batch owner's tenant (tenancy.as_tenant: the tenant
set, the priority clamped to the key's max_priority), its usage counted under the owner's key too
(tenancy.attribute); a task's outcome read back as the endpoint would have
answered it; the end of a batch posted to the webhook its metadata names (`genq_webhook_url`),
through the callback worker (producer/callbacks.py)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from celery import states
from pydantic import BaseModel, ValidationError

from producer.batches.driver import LineAnswer
from producer.batches.input_file import BatchLine
from producer.batches.owners import Owner
from producer.batches.records import Batch
from producer.callbacks import DELIVER_CALLBACK_TASK
from producer.gateway.completions import completion_generations
from producer.gateway.errors import ApiError, invalid_request
from producer.gateway.model_router import Target
from producer.gateway.openai_api import ChatCompletionRequest, CompletionRequest, chat_response, completion_response
from producer.gateway.tenancy import as_tenant
from producer.protocol import GenerationRequest, GenerationResult
from producer.watchdog import Watchdog

if TYPE_CHECKING:
    from producer.gateway.app import Gateway

WEBHOOK_METADATA_KEY = "genq_webhook_url"
"""The batch metadata key whose value, an http(s) URL, receives the batch object when the batch ends."""

ModelT = TypeVar("ModelT", bound=BaseModel)
ChatTranslation = Callable[["Gateway", ChatCompletionRequest, str], Awaitable[tuple[GenerationRequest, Target, int]]]


class GatewayLineRunner:
    """`watchdog` watches every line this process queued, or found queued when it took a batch
    over, and sends a line the broker lost again (producer/watchdog.py)."""

    def __init__(self, gateway: Gateway, chat: ChatTranslation, watchdog: Watchdog) -> None:
        self.gateway = gateway
        self.chat = chat
        self.watchdog = watchdog

    async def send(self, batch: Batch, owner: Owner, lines: list[tuple[BatchLine, str]]
                   ) -> list[tuple[BatchLine, LineAnswer]]:
        prepared, refused = await self._prepare(batch, owner, lines)
        if owner.key_id is not None:
            identifiers = [g.identifier for generations in prepared.values() for g in generations if g.identifier]
            await self.gateway.tenancy.attribute(owner.key_id, identifiers, batch.expires_at)
        for queue, generations in prepared.items():
            for handle in await self.gateway.client.submit_many(generations, queue=queue):
                await handle.close()
        self._track(prepared)
        return refused

    async def watch(self, batch: Batch, owner: Owner, lines: list[tuple[BatchLine, str]]) -> None:
        prepared, _ = await self._prepare(batch, owner, lines)
        self._track(prepared)

    async def _prepare(self, batch: Batch, owner: Owner, lines: list[tuple[BatchLine, str]]
                       ) -> tuple[dict[str, list[GenerationRequest]], list[tuple[BatchLine, LineAnswer]]]:
        """Each line's request by queue, at the batch priority, within the window and as the
        owner's tenant; and the lines refused, answered as their endpoint would answer them."""
        refused: list[tuple[BatchLine, LineAnswer]] = []
        by_queue: dict[str, list[GenerationRequest]] = defaultdict(list)
        for line, identifier in lines:
            try:
                generation, target = await self._translate(line, identifier)
            except ApiError as error:
                refused.append((line, LineAnswer("error", error.status, error.body())))
                continue
            update: dict[str, Any] = {"priority": self.gateway.settings.batch_priority}
            if generation.timeout_s is None:
                update["deadline"] = min(generation.deadline or batch.expires_at, batch.expires_at)
            generation = generation.model_copy(update=update)
            if owner.tenant is not None:
                generation = as_tenant(generation, owner.tenant, owner.max_priority)
            by_queue[target.route.queue].append(generation)
        return by_queue, refused

    def _track(self, prepared: dict[str, list[GenerationRequest]]) -> None:
        for queue, generations in prepared.items():
            for generation in generations:
                assert generation.identifier is not None
                kwargs = generation.to_kwargs()
                self.watchdog.track(generation.identifier, kwargs, self.gateway.settings.queue_for(kwargs, queue))

    async def answer(self, batch: Batch, line: BatchLine, identifier: str) -> LineAnswer | None:
        snapshot = await self.gateway.client.handle(identifier).snapshot()
        if snapshot.state not in states.READY_STATES:
            return None
        result = snapshot.result
        reason = "cancelled" if snapshot.state == states.REVOKED else result.finish_reason if result else None
        if reason == "deadline" or (reason == "cancelled" and time.time() >= batch.expires_at):
            return LineAnswer("error", error={"code": "batch_expired",
                                              "message": "the batch's completion window ended during this request"})
        if reason == "cancelled":
            return LineAnswer("error", error={"code": "batch_cancelled",
                                              "message": "the batch was cancelled before this request finished"})
        if result is None:
            # Nearly always the request's fault, answered 400 as the endpoint answers it.
            failed = ApiError(400, "generation_failed", snapshot.error or "the generation failed")
            return LineAnswer("error", failed.status, failed.body())
        try:
            return LineAnswer("output", 200, await self._response(line, identifier, result))
        except ApiError as error:
            return LineAnswer("error", error.status, error.body())

    async def cancel(self, identifier: str) -> None:
        await self.gateway.client.cancel(identifier)

    async def notify(self, batch: Batch) -> None:
        url = (batch.metadata or {}).get(WEBHOOK_METADATA_KEY)
        if url is None or self.gateway.settings.webhook_secret is None:
            return
        # The task id is the delivery id the receiver sees: the same if a crash sends it again.
        await asyncio.to_thread(
            self.gateway.client.celery.send_task, DELIVER_CALLBACK_TASK, args=(batch.model_dump(mode="json"),),
            kwargs={"callback_url": url, "identifier": batch.id, "event": f"batch.{batch.status}"},
            queue=self.gateway.settings.callback_queue, task_id=f"{batch.id}-webhook")

    async def _translate(self, line: BatchLine, identifier: str) -> tuple[GenerationRequest, Target]:
        if line.body.get("stream"):
            raise ApiError(400, "invalid_request", "stream: a batch request is answered whole; leave stream out",
                           param="stream")
        if line.url == "/v1/chat/completions":
            generation, target, _ = await self.chat(self.gateway, _parsed(ChatCompletionRequest, line.body),
                                                    identifier)
            return generation, target
        checked, _, target = await completion_generations(
            self.gateway, _parsed(CompletionRequest, line.body), identifier)
        if len(checked) != 1:
            raise ApiError(400, "invalid_request", f"prompt: a batch request holds one prompt, got "
                                                   f"{len(checked)}; give each its own line", param="prompt")
        return checked[0][0], target

    async def _response(self, line: BatchLine, identifier: str, result: GenerationResult) -> dict[str, Any]:
        """The body the endpoint would have answered the line with."""
        answer: BaseModel
        if line.url == "/v1/chat/completions":
            chat = _parsed(ChatCompletionRequest, line.body)
            answer = chat_response(identifier, chat.model, result, chat.prompt_logprobs, chat.legacy_functions)
        else:
            completion = _parsed(CompletionRequest, line.body)
            _, echo, _ = await completion_generations(self.gateway, completion, identifier)
            answer = completion_response(identifier, completion.model, [result], echo)
        body: dict[str, Any] = json.loads(answer.model_dump_json())
        return body


def _parsed(model: type[ModelT], body: dict[str, Any]) -> ModelT:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise invalid_request(400, error.errors()) from None
