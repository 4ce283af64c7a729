"""Publishing this worker's model card (producer/model_card.py): its vocabulary, its context
length, its tokenizer, its chat templates and the formats its model writes tool calls and
thoughts in, so that the gateway can refuse what this worker would refuse before a streamed
request has been answered with HTTP 200, read streamed tool calls and thoughts as the worker
reads them, and answer POST /tokenize as this worker would encode the request.

The worker publishes once its engine is ready, rewrites its entry every 5 s from the control
listener's thread, with its job leases (so a Redis that restarted empty has it back within
seconds), and removes it when it stops."""

from __future__ import annotations

import hashlib
import logging
import time

import redis

from engine import Generator
from producer.chat_rendering import model_reasoning_format, model_tool_format
from producer.model_card import (
    CARD_TTL_S,
    CHAT_TEMPLATE_JSON,
    WorkerCard,
    card_key,
    chat_template_key,
    tokenizer_key,
)
from worker.images import image_support

log = logging.getLogger(__name__)


def describe(generator: Generator, model: str) -> tuple[WorkerCard, str, str | None]:
    """The card of `generator` (its heartbeat not yet set), its tokenizer's JSON and its chat
    template's JSON (None without a chat template)."""
    tokenizer = generator.tokenizer
    tokenizer_json = tokenizer.backend.to_str()
    chat = tokenizer.chat
    template_json = CHAT_TEMPLATE_JSON.dump_json(chat).decode() if chat.template else None
    # What tokenizer.encode does on top of the backend's own special tokens (engine/tokenizer.py):
    # the same for every text, so one probe measures it.
    probe = "a"
    correction = len(tokenizer.encode(probe)) - len(tokenizer.backend.encode(probe, add_special_tokens=True).ids)
    card = WorkerCard(model=model, vocab_size=generator.model.config.vocab_size, max_seq_len=generator.max_seq_len,
                      add_bos=tokenizer.add_bos_token, bos_correction=correction,
                      chat_template=bool(tokenizer.chat_template),
                      tool_format=model_tool_format(chat), reasoning_format=model_reasoning_format(chat),
                      tokenizer_digest=_digest(tokenizer_json), bos_token_id=tokenizer.bos_token_id,
                      chat_template_digest=None if template_json is None else _digest(template_json),
                      images=image_support(generator), adapters=generator.adapters.names(),
                      heartbeat_at=0.0)
    return card, tokenizer_json, template_json


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class CardPublisher:
    """Keeps this worker's entry in `{prefix}:card:{queue}`, the tokenizer key and the chat
    template key alive. Redis errors are logged, never raised: the card only lets producers fail
    early (and answer /tokenize without a worker)."""

    def __init__(self, client: redis.Redis, prefix: str, queue: str, node: str, card: WorkerCard,
                 tokenizer_json: str, chat_template_json: str | None) -> None:
        self.client = client
        self.node = node
        self.card = card
        self.card_key = card_key(queue, prefix)
        if self.card_key is None:
            log.warning("queue %r cannot name a model card key: no card is published (the gateway will not check "
                        "requests before queueing)", queue)
        self.blobs = {tokenizer_key(card.tokenizer_digest, prefix): tokenizer_json}
        if card.chat_template_digest is not None and chat_template_json is not None:
            self.blobs[chat_template_key(card.chat_template_digest, prefix)] = chat_template_json

    def set_adapters(self, names: list[str]) -> None:
        """Publish the card again at once with these LoRA adapters (sorted), so that a load or
        unload shows up without waiting for the next heartbeat."""
        self.card = self.card.model_copy(update={"adapters": sorted(names)})
        self.heartbeat()

    def heartbeat(self) -> None:
        """Write this worker's entry with the current time; the tokenizer and chat template JSON
        only when Redis does not hold them (first start, or a Redis that lost them)."""
        if self.card_key is None:
            return
        entry = self.card.model_copy(update={"heartbeat_at": time.time()}).model_dump_json()
        try:
            # What the entry names first: a reader that finds the entry finds its tokenizer and template.
            for key, text in self.blobs.items():
                if not self.client.expire(key, CARD_TTL_S):
                    self.client.set(key, text, ex=CARD_TTL_S)
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(self.card_key, self.node, entry)
            pipe.expire(self.card_key, CARD_TTL_S)
            pipe.execute()
        except redis.RedisError:
            log.warning("could not publish the model card to %s", self.card_key)

    def withdraw(self) -> None:
        """Remove this worker's entry: a stopped worker no longer widens what the gateway accepts."""
        if self.card_key is None:
            return
        try:
            self.client.hdel(self.card_key, self.node)
        except redis.RedisError:
            log.warning("could not remove the model card entry of %s (it expires in %d s)", self.node, CARD_TTL_S)
