"""Checking a request against the served model's limits at the gateway, before it is queued.

A streamed OpenAI request is answered with HTTP 200 as soon as it is queued; whatever the worker
refuses after that reaches the client only as an error event inside the stream, and SDKs treat a
200 as success. So the gateway checks here what the worker would refuse, from the model card the
workers publish (producer/model_card.py), and answers 400 before anything is queued; for a
non-streamed request this saves a queue round trip. The worker still checks everything, for
producers that bypass the gateway.

Checked, on the OpenAI endpoints and on `POST /v1/tasks`:

- token ids (`input_ids`, `stop_token_ids`, `token_bias` keys, `banned_token_ids`,
  `allowed_token_ids`) inside the vocabulary: `invalid_request` naming the field;
- `messages` only for a model with a chat template;
- prompt tokens + max_new_tokens within max_seq_len: `context_length_exceeded` (OpenAI's code).
  Each image counts the card's tokens_per_image: its placeholder token in the prompt or the rendered
  chat becomes that many (LLaVA's expansion, exact; a family that adds tokens around an image gets
  a lower bound).
  A `prompt` is counted exactly: the workers' own tokenizer (its `tokenizers` JSON) and their
  BOS rule (worker/jobs.py). `input_ids` are counted as given. For `messages` the check renders no
  chat template (only /tokenize does), so it counts a lower bound: the tokens of the system and user contents
  alone, without the first and last pre-tokenizer word of each (those may merge with the
  template's text around them), of the content stripped of surrounding whitespace (templates
  often trim it). Assistant and tool contents are left out: some templates rewrite them (Qwen3
  drops earlier reasoning). A conversation over the limit by this bound is certainly refused.

What remains to the worker, reported as an error event inside a 200 stream: a conversation that
only the chat template's own tokens push over the limit, a template that refuses the
conversation (roles out of order), and a prompt that encodes to no tokens.

The card also names the format the workers' model writes tool calls in (docs/tools.md): the
gateway sends it with a request that has tools and reads a streamed answer's calls in it. With
the card's tokenizer and chat template the gateway answers POST /tokenize and /detokenize
itself (producer/gateway/tokens.py).

Without a card (no worker of this queue has started, or none has refreshed its entry for
CARD_TTL_S) nothing is checked here: the request is queued and the worker decides. Workers that
disagree on the tokenizer (a rolling model change) turn off the prompt count, not the other checks.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import anyio
import redis.asyncio
import tokenizers
from pydantic import ValidationError

from chat_template import ChatTemplate, with_bos
from producer.chat_rendering import render_messages
from producer.gateway.errors import ApiError
from producer.model_card import (
    CHAT_TEMPLATE_JSON,
    ImageSupport,
    WorkerCard,
    card_key,
    chat_template_key,
    tokenizer_key,
)
from producer.model_routes import live_cards
from producer.protocol import GenerationRequest, ProtocolError
from producer.reasoning import ReasoningFormat
from producer.tool_calls import ToolFormat

log = logging.getLogger(__name__)

BOUNDED_ROLES = ("system", "user")
"""Roles whose content chat templates render as it is (at most trimmed)."""


@dataclass(frozen=True)
class PromptTokenizer:
    """The workers' tokenizer and their BOS rule. encode_batch, unlike encode, releases the GIL,
    so a long prompt counted in a thread does not stall the event loop."""

    backend: tokenizers.Tokenizer
    add_bos: bool
    bos_correction: int
    bos_token_id: int | None = None
    """None from workers that do not publish it: then ids are given only where no BOS is added."""

    def prompt_tokens(self, prompt: str, add_bos: bool | None) -> int:
        """Exactly what worker/jobs.py gives a `prompt`."""
        add = self.add_bos if add_bos is None else add_bos
        count = len(self.backend.encode_batch([prompt], add_special_tokens=add)[0].ids)
        return count + (self.bos_correction if add else 0)

    def prompt_ids(self, prompt: str, add_bos: bool | None) -> list[int]:
        """The token ids prompt_tokens counts: what the engine's Tokenizer.encode gives."""
        add = self.add_bos if add_bos is None else add_bos
        ids = self.backend.encode_batch([prompt], add_special_tokens=add)[0].ids
        if not add or self.bos_correction == 0:
            return ids
        if self.bos_correction < 0:
            return ids[1:]
        if self.bos_token_id is None:
            raise ValueError("the workers' model card does not name the BOS token's id (they predate it)")
        return [self.bos_token_id, *ids]

    def rendered_ids(self, text: str) -> list[int]:
        """A rendered chat's token ids, as the engine's Tokenizer.encode_rendered gives them."""
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if self.add_bos and self.bos_token_id is None:
            raise ValueError("the workers' model card does not name the BOS token's id (they predate it)")
        return with_bos(ids, self.add_bos, self.bos_token_id)

    def expand_images(self, ids: list[int], images: ImageSupport) -> list[int]:
        """`ids` with each image placeholder token repeated tokens_per_image times, as LlavaProcessor
        expands `<image>` (the worker puts the image's rows there)."""
        placeholder = self.backend.token_to_id(images.placeholder)
        return [expanded for token in ids
                for expanded in ([token] * images.tokens_per_image if token == placeholder else [token])]

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included (as vLLM's /detokenize gives it)."""
        return self.backend.decode(ids, skip_special_tokens=False)

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's vocabulary entry ("" for an id past the tokenizer's vocabulary that the
        model's embedding still has)."""
        return [self.backend.id_to_token(token) or "" for token in ids]

    def content_tokens_lower_bound(self, contents: list[str]) -> int:
        """Tokens that `contents` certainly take once rendered into a chat template."""
        texts = [text for text in (content.strip() for content in contents) if text]
        total = 0
        for encoding in self.backend.encode_batch(texts, add_special_tokens=False) if texts else ():
            words = encoding.word_ids
            edges = {words[0], words[-1]}
            total += sum(word not in edges for word in words)
        return total


@dataclass(frozen=True)
class ModelLimits:
    """What the live workers of the queue accept together: a request any of them can take passes."""

    vocab_size: int
    max_seq_len: int
    chat_template: bool
    tokenizer: PromptTokenizer | None
    workers: int
    tool_format: ToolFormat | None = None
    """The format the workers write tool calls in; None when they disagree or do not say."""
    reasoning_format: ReasoningFormat | None = None
    """The format the workers' model thinks in; None when they disagree or do not say."""
    chat: ChatTemplate | None = None
    """The workers' chat templates; None when they have none, disagree, or do not publish them."""
    images: ImageSupport | None = None
    """What the workers say about images (the one allowing most); None: their model takes none."""
    cards: tuple[WorkerCard, ...] = ()
    """The live cards these limits were read from (the models and adapters they serve)."""


class CardReader:
    """The model card of the gateway's queue, re-read at most every `refresh_s`; the tokenizer is
    fetched and built once per digest. `client` decodes responses (the gateway's does)."""

    def __init__(self, client: redis.asyncio.Redis, prefix: str, queue: str, refresh_s: float) -> None:
        self.client = client
        self.prefix = prefix
        self.queue = queue
        self.refresh_s = refresh_s
        self.key = card_key(queue, prefix)
        if self.key is None:
            log.warning("queue %r cannot name a model card key: requests are not checked before queueing", queue)
        self._limits: ModelLimits | None = None
        self._read_at = -math.inf
        self._lock = anyio.Lock()
        self._tokenizer: tuple[tuple[str, bool, int, int | None], PromptTokenizer] | None = None
        self._chat: tuple[str, ChatTemplate] | None = None
        self._announced: bool | None = None

    async def current(self) -> ModelLimits | None:
        """The limits, or None when no live worker has published a card."""
        if self.key is None:
            return None
        async with self._lock:
            if time.monotonic() - self._read_at >= self.refresh_s:
                self._limits = await self._read(self.key)
                self._read_at = time.monotonic()
                self._announce(self._limits)
        return self._limits

    async def check(self, request: GenerationRequest, *, status: int, names: Mapping[str, str]) -> int:
        """Raise the ApiError the request deserves under the current limits (none without a card);
        else the prompt's tokens as check_request counts them (0 without a card)."""
        limits = await self.current()
        return 0 if limits is None else await check_request(limits, request, status=status, names=names)

    async def _read(self, key: str) -> ModelLimits | None:
        cards = live_cards(await self.client.hgetall(key), key)
        if not cards:
            return None
        identities = {(c.tokenizer_digest, c.add_bos, c.bos_correction, c.bos_token_id) for c in cards}
        tokenizer = await self._load_tokenizer(identities.pop()) if len(identities) == 1 else None
        templates = {c.chat_template_digest for c in cards}
        digest = templates.pop() if len(templates) == 1 else None
        formats = {c.tool_format for c in cards}
        thinking = {c.reasoning_format for c in cards}
        return ModelLimits(vocab_size=max(c.vocab_size for c in cards), max_seq_len=max(c.max_seq_len for c in cards),
                           chat_template=any(c.chat_template for c in cards), tokenizer=tokenizer, workers=len(cards),
                           tool_format=formats.pop() if len(formats) == 1 else None,
                           reasoning_format=thinking.pop() if len(thinking) == 1 else None,
                           chat=None if digest is None else await self._load_chat(digest),
                           images=max((c.images for c in cards if c.images is not None), default=None,
                                      key=lambda images: images.max_images),
                           cards=tuple(cards))

    async def _load_tokenizer(self, identity: tuple[str, bool, int, int | None]) -> PromptTokenizer | None:
        if self._tokenizer is not None and self._tokenizer[0] == identity:
            return self._tokenizer[1]
        digest, add_bos, correction, bos_token_id = identity
        text = await self._blob(tokenizer_key(digest, self.prefix), digest, "tokenizer")
        if text is None:
            return None
        try:
            backend = await anyio.to_thread.run_sync(tokenizers.Tokenizer.from_str, text)
        except Exception as error:  # noqa: BLE001 - tokenizers raises bare Exception on JSON it cannot load
            log.warning("cannot load the tokenizer %s of the model card (%s); prompts are not counted", digest, error)
            return None
        tokenizer = PromptTokenizer(backend, add_bos, correction, bos_token_id)
        self._tokenizer = (identity, tokenizer)
        return tokenizer

    async def _load_chat(self, digest: str) -> ChatTemplate | None:
        if self._chat is not None and self._chat[0] == digest:
            return self._chat[1]
        text = await self._blob(chat_template_key(digest, self.prefix), digest, "chat template")
        if text is None:
            return None
        try:
            chat = CHAT_TEMPLATE_JSON.validate_json(text)
        except ValidationError:
            log.warning("the chat template %s of the model card is malformed; chats are not tokenized", digest)
            return None
        self._chat = (digest, chat)
        return chat

    async def _blob(self, key: str, digest: str, what: str) -> str | None:
        """The text under `key` if its SHA-256 is `digest`, else None (logged)."""
        text = await self.client.get(key)
        assert not isinstance(text, bytes), "the client decodes responses"
        if text is None or hashlib.sha256(text.encode()).hexdigest() != digest:
            log.warning("the %s %s of the model card is missing or altered; it is not used", what, digest)
            return None
        return text

    def _announce(self, limits: ModelLimits | None) -> None:
        """One INFO line when the card appears or goes away, not one per read."""
        if (limits is not None) == self._announced:
            return
        self._announced = limits is not None
        if limits is None:
            log.info("no model card for queue %r (no live worker has published one): requests are queued without "
                     "checking the model's limits; the worker checks them", self.queue)
        else:
            log.info("checking requests against the model card of queue %r: %d worker(s), max_seq_len %d, "
                     "vocab_size %d%s", self.queue, limits.workers, limits.max_seq_len, limits.vocab_size,
                     "" if limits.tokenizer else ", prompts not counted (no single tokenizer)")


async def check_request(limits: ModelLimits, request: GenerationRequest, *, status: int,
                        names: Mapping[str, str]) -> int:
    """Raise an ApiError (`status` for invalid requests, named with `names`) for a request the
    workers behind `limits` would refuse; else return its prompt's tokens (images included; a
    lower bound where the prompt cannot be counted exactly), which an API key's tokens per
    minute reserve (producer/gateway/tenancy.py)."""
    for field, token in _token_ids(request):
        if not 0 <= token < limits.vocab_size:
            name = names.get(field, field)
            problem = f"{name}: token id {token} is outside the model's vocabulary [0, {limits.vocab_size})"
            raise ApiError(status, "invalid_request", problem, param=name, problems=[problem])
    if request.messages is not None and not limits.chat_template:
        problem = "messages: this model has no chat template; send prompt or input_ids"
        raise ApiError(status, "invalid_request", problem, param="messages", problems=[problem])
    field, prompt_tokens, exact = await _prompt_tokens(limits, request)
    prompt_tokens += image_tokens(limits, request)
    completion = request.max_new_tokens
    if prompt_tokens + completion <= limits.max_seq_len:
        return prompt_tokens
    prompt_name, max_name = names.get(field, field), names.get("max_new_tokens", "max_new_tokens")
    at_least = "" if exact else "at least "
    counted = "" if exact else " (their text alone; the chat template adds more)"
    if limits.images is not None and (images := len(request.image_inputs())):
        counted += f" with its {images} image(s) at {limits.images.tokens_per_image} tokens each"
    raise ApiError(
        status, "context_length_exceeded",
        f"This model's maximum context length is {limits.max_seq_len} tokens, but this request needs "
        f"{at_least}{prompt_tokens + completion}: {at_least}{prompt_tokens} in the {prompt_name}{counted} and "
        f"{completion} for the completion ({max_name}). Shorten the {prompt_name} or lower {max_name}.",
        param=max_name if completion >= limits.max_seq_len else prompt_name)


def _chat_tokens(tokenizer: PromptTokenizer, chat: ChatTemplate, request: GenerationRequest,
                 image_placeholder: str | None) -> int:
    return len(tokenizer.rendered_ids(render_messages(request, chat, image_placeholder)))


def image_tokens(limits: ModelLimits, request: GenerationRequest) -> int:
    """The tokens the request's images add to its text's count: each image's placeholder token
    becomes tokens_per_image tokens (the card's), as the worker expands it (worker/jobs.py)."""
    images = len(request.image_inputs())
    return images * (limits.images.tokens_per_image - 1) if images and limits.images is not None else 0


def _token_ids(request: GenerationRequest) -> Iterator[tuple[str, int]]:
    sampling = request.sampling
    for field, ids in (("input_ids", request.input_ids or ()), ("stop_token_ids", request.stop_token_ids),
                       ("sampling.token_bias", sampling.token_bias),
                       ("sampling.banned_token_ids", sampling.banned_token_ids),
                       ("sampling.allowed_token_ids", sampling.allowed_token_ids)):
        for token in ids:
            yield field, token


async def _prompt_tokens(limits: ModelLimits, request: GenerationRequest) -> tuple[str, int, bool]:
    """(the prompt's field, its tokens or a lower bound of them, whether exact). Without a
    tokenizer a prompt counts as one token: the worker refuses one that encodes to none. A chat
    is rendered as the worker renders it where the card carries the template, else (or when the
    template refuses the chat: the worker reports that) bounded by its contents' tokens."""
    tokenizer = limits.tokenizer
    if request.input_ids is not None:
        return "input_ids", len(request.input_ids), True
    if request.prompt is not None:
        if tokenizer is None:
            return "prompt", 1, False
        count = await anyio.to_thread.run_sync(tokenizer.prompt_tokens, request.prompt, request.add_bos)
        return "prompt", count, True
    if tokenizer is None:
        return "messages", 1, False
    if limits.chat is not None and (tokenizer.bos_token_id is not None or not tokenizer.add_bos):
        placeholder = limits.images.placeholder if limits.images is not None else None
        try:
            count = await anyio.to_thread.run_sync(_chat_tokens, tokenizer, limits.chat, request, placeholder)
            return "messages", count, True
        except (ProtocolError, ValueError):
            pass
    contents = [m.text for m in request.messages or () if m.role in BOUNDED_ROLES]
    bound = await anyio.to_thread.run_sync(tokenizer.content_tokens_lower_bound, contents)
    return "messages", max(1, bound), False
