"""Publishing this worker's model card (producer/model_card.py): its vocabulary, its context
length and its tokenizer, so that the gateway can refuse what this worker would refuse before a
streamed request has been answered with HTTP 200.

The worker publishes once its engine is ready, rewrites its entry every 5 s from the control
listener's thread, with its job leases (so a Redis that restarted empty has it back within
seconds), and removes it when it stops."""

from __future__ import annotations

import hashlib
import logging
import time

import redis

from engine import Generator
from producer.model_card import CARD_TTL_S, WorkerCard, card_key, tokenizer_key

log = logging.getLogger(__name__)


def describe(generator: Generator, model: str) -> tuple[WorkerCard, str]:
    """The card of `generator` (its heartbeat not yet set) and its tokenizer's JSON."""
    tokenizer = generator.tokenizer
    tokenizer_json = tokenizer.backend.to_str()
    # What tokenizer.encode does on top of the backend's own special tokens (engine/tokenizer.py):
    # the same for every text, so one probe measures it.
    probe = "a"
    correction = len(tokenizer.encode(probe)) - len(tokenizer.backend.encode(probe, add_special_tokens=True).ids)
    card = WorkerCard(model=model, vocab_size=generator.model.config.vocab_size, max_seq_len=generator.max_seq_len,
                      add_bos=tokenizer.add_bos_token, bos_correction=correction,
                      chat_template=bool(tokenizer.chat_template),
                      tokenizer_digest=hashlib.sha256(tokenizer_json.encode()).hexdigest(), heartbeat_at=0.0)
    return card, tokenizer_json


class CardPublisher:
    """Keeps this worker's entry in `{prefix}:card:{queue}` and the tokenizer key alive. Redis
    errors are logged, never raised: the card only lets producers fail early."""

    def __init__(self, client: redis.Redis, prefix: str, queue: str, node: str, card: WorkerCard,
                 tokenizer_json: str) -> None:
        self.client = client
        self.node = node
        self.card = card
        self.tokenizer_json = tokenizer_json
        self.card_key = card_key(queue, prefix)
        if self.card_key is None:
            log.warning("queue %r cannot name a model card key: no card is published (the gateway will not check "
                        "requests before queueing)", queue)
        self.tokenizer_key = tokenizer_key(card.tokenizer_digest, prefix)

    def heartbeat(self) -> None:
        """Write this worker's entry with the current time; the tokenizer JSON only when Redis
        does not hold it (first start, or a Redis that lost it)."""
        if self.card_key is None:
            return
        entry = self.card.model_copy(update={"heartbeat_at": time.time()}).model_dump_json()
        try:
            # The tokenizer first: a reader that finds the entry finds its tokenizer.
            if not self.client.expire(self.tokenizer_key, CARD_TTL_S):
                self.client.set(self.tokenizer_key, self.tokenizer_json, ex=CARD_TTL_S)
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
