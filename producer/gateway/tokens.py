"""POST /tokenize and POST /detokenize in vLLM's shapes, answered by the gateway itself from the
model card (producer/model_card.py): the workers' tokenizer, BOS rule and chat templates. No task
is queued, so they answer while every worker is busy, and a chat is rendered with the one copy
the worker renders it with (producer/chat_rendering.py), so `count` is the prompt_tokens the
worker would report for the same request. A chat's image_url parts are checked and fetched as the
chat endpoint does (producer/gateway/images.py) and each image's placeholder token counts
tokens_per_image times (the card's), as the worker expands it; its unknown keys are refused as the
chat endpoint refuses them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from producer.chat_rendering import render_messages
from producer.gateway.errors import ApiError, ErrorBody
from producer.gateway.images import ImageRefused, image_url_parts, resolve_images
from producer.gateway.model_limits import CardReader, ModelLimits, PromptTokenizer
from producer.gateway.model_router import ModelRouter
from producer.gateway.openai_api import TOOL_SHAPE, ChatMessageParam, UnsupportedParameter, refuse_unknown, unknown_keys
from producer.gateway.settings import GatewaySettings
from producer.model_card import CARD_TTL_S
from producer.protocol import GenerationRequest, ProtocolError

CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")
"""Fields that shape a chat's rendering: refused beside a prompt."""
RETRY_AFTER_S = 5
"""A worker publishes its card as soon as its engine is up, and refreshes it every 5 s."""
RESPONSES: dict[int | str, dict[str, Any]] = {status: {"model": ErrorBody} for status in (400, 401, 404, 503)}

RequestParser = Callable[[dict[str, Any]], Awaitable[GenerationRequest]]
"""The gateway's parse of protocol fields (app.py's): a ProtocolError becomes a 400 naming the field."""


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest (`prompt`) and TokenizeChatRequest (`messages`) in one."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, description="if given, a served model or adapter: its queue's card answers")
    prompt: str | None = Field(default=None, description="a text, encoded as a completions prompt is")
    messages: list[ChatMessageParam] | None = Field(default=None, description="a chat, rendered as the worker does")
    add_special_tokens: bool | None = Field(
        default=None, description="a prompt: BOS as the model adds it (default true; false: none). Messages: "
                                  "encode the rendered chat as a prompt, on top of what the template wrote "
                                  "(default false: BOS only where the model wants one and the template left it out)")
    add_generation_prompt: bool | None = Field(default=None, description="messages only (default true)")
    continue_final_message: bool | None = Field(default=None, description="messages only (default false)")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="messages only")
    tools: list[dict[str, Any]] | None = Field(default=None, description="messages only: OpenAI's tool entries")
    return_token_strs: bool = Field(default=False, description="also each token's vocabulary entry")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int = Field(description="the longest sequence a worker serves (the card's max_seq_len)")
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, description="if given, a served model or adapter: its queue's card answers")
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokens_router(models: ModelRouter, parse: RequestParser, settings: GatewaySettings) -> APIRouter:
    """The two endpoints, reading the card of the queue `model` routes to (the first queue's
    without one; an adapter tokenizes as its base model); `settings`: the unknown-key and
    image-fetch settings the chat endpoint uses too."""
    router = APIRouter()

    @router.post("/tokenize", response_model=TokenizeResponse, responses=RESPONSES)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: a prompt's or a chat's token ids, as the worker encodes the same request."""
        limits, tokenizer = await _card(await _cards(models, body.model))
        if body.prompt is not None and body.messages is None:
            given = [name for name in CHAT_ONLY if getattr(body, name) is not None]
            if given:
                raise ApiError(400, "invalid_request", f"{given[0]}: only with messages (a chat), not with a prompt",
                               param=given[0])
            add_bos = None if body.add_special_tokens in (None, True) else False
            ids = await _encode(tokenizer.prompt_ids, body.prompt, add_bos)
        elif body.messages is not None and body.prompt is None:
            request = await parse(await _chat_fields(body, limits, settings))
            text = await anyio.to_thread.run_sync(_render, limits, request)
            if body.add_special_tokens:
                ids = await _encode(tokenizer.prompt_ids, text, None)
            else:
                ids = await _encode(tokenizer.rendered_ids, text)
            if limits.images is not None and request.image_inputs():
                ids = tokenizer.expand_images(ids, limits.images)
        else:
            raise ApiError(400, "invalid_request", "prompt|messages: give exactly one of prompt and messages",
                           param="prompt")
        strs = await anyio.to_thread.run_sync(tokenizer.token_strs, ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=limits.max_seq_len, tokens=ids, token_strs=strs)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's /detokenize: the text of token ids, special tokens included."""
        limits, tokenizer = await _card(await _cards(models, body.model))
        for index, token in enumerate(body.tokens):
            if not 0 <= token < limits.vocab_size:
                vocabulary = f"[0, {limits.vocab_size})"
                problem = f"tokens[{index}]: token id {token} is outside the model's vocabulary {vocabulary}"
                raise ApiError(400, "invalid_request", problem, param=f"tokens[{index}]", problems=[problem])
        return DetokenizeResponse(prompt=await anyio.to_thread.run_sync(tokenizer.decode, body.tokens))

    return router


async def _cards(models: ModelRouter, model: str | None) -> CardReader:
    return (models.default if model is None else await models.resolve(model)).cards


async def _card(cards: CardReader) -> tuple[ModelLimits, PromptTokenizer]:
    """The card and its tokenizer, or a 503 saying why there is none."""
    limits = await cards.current()
    if limits is None:
        raise ApiError(503, "model_card_unavailable",
                       f"no worker has published its model card yet (none of queue {cards.queue!r} has started, or "
                       f"none has refreshed it within {CARD_TTL_S} s): tokenizing needs the workers' tokenizer; "
                       "retry once a worker is up", headers={"Retry-After": str(RETRY_AFTER_S)})
    if limits.tokenizer is None:
        raise ApiError(503, "tokenizer_unavailable",
                       "the workers' model card names no single tokenizer that this gateway could load (workers of "
                       "different tokenizers serve the queue, or its key is missing); retry shortly",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    return limits, limits.tokenizer


async def _chat_fields(body: TokenizeRequest, limits: ModelLimits, settings: GatewaySettings) -> dict[str, Any]:
    """The protocol fields of the chat request whose prompt /tokenize encodes: unknown keys in its
    messages, their parts and its tools refused, its images fetched and checked, as POST
    /v1/chat/completions does."""
    messages = body.messages or []
    try:
        unknown = [key for index, message in enumerate(messages) for key in message.unknown_keys(f"messages[{index}]")]
        unknown += [key for index, tool in enumerate(body.tools or ()) if tool.get("type", "function") == "function"
                    for key in unknown_keys(tool, TOOL_SHAPE, f"tools[{index}]")]  # the protocol refuses the rest
        refuse_unknown(unknown, settings.ignore_unknown_params)
        images = await resolve_images(image_url_parts(messages), limits.images, True,
                                      allow_private=settings.image_url_allow_private_hosts,
                                      fetch_timeout_s=settings.image_fetch_timeout_s)
        by_message: dict[int, dict[int, dict[str, Any]]] = {}
        for (message_index, part), image in images.items():
            by_message.setdefault(message_index, {})[part] = image
        fields: dict[str, Any] = {"messages": [message.fields(index, by_message.get(index))
                                               for index, message in enumerate(messages)], "max_new_tokens": 1}
    except UnsupportedParameter as error:
        raise ApiError(400, error.code, str(error), param=error.param) from None
    except ImageRefused as error:
        raise ApiError(400, "invalid_image", str(error), param=error.param) from None
    for name in CHAT_ONLY:
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    return fields


def _render(limits: ModelLimits, request: GenerationRequest) -> str:
    """The chat's prompt text, as the worker renders it (on a worker thread: templates are Python)."""
    if not limits.chat_template:
        raise ApiError(400, "invalid_request", "messages: this model has no chat template; send prompt",
                       param="messages")
    if limits.chat is None:
        raise ApiError(503, "chat_template_unavailable",
                       "the workers' model card carries no chat template this gateway can render (the workers "
                       "predate publishing it, or workers with different templates serve the queue)",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    try:
        return render_messages(request, limits.chat, limits.images.placeholder if limits.images is not None else None)
    except ProtocolError as error:
        problem = error.problems[0]
        raise ApiError(400, "invalid_request", problem, param=problem.split(":", 1)[0], problems=error.problems) \
            from None
    except ValueError as error:
        raise ApiError(400, "invalid_request", f"messages: {error}", param="messages") from None


async def _encode(encode: Callable[..., list[int]], *args: Any) -> list[int]:
    """`encode(*args)` off the event loop; a card too old to say what BOS to add is a 503."""
    try:
        return await anyio.to_thread.run_sync(encode, *args)
    except ValueError as error:
        raise ApiError(503, "tokenizer_unavailable", str(error), headers={"Retry-After": str(RETRY_AFTER_S)}) \
            from None
