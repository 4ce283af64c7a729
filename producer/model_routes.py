"""Routing by model (issue 28), as vLLM reads OpenAI's `model`: a name selects a base model or a
LoRA adapter, and the queue whose workers serve it.

Every queue's workers publish their card (producer/model_card.py): the base model they loaded
(`model`) and the adapters they serve (`adapters`). A base model is addressed by its card's
`model`, an adapter by its name (vLLM addresses LoRA modules by their name). Queues are read in
the order the producer lists them and the first claim of a name wins, a base model before an
adapter of the same name within a queue: a name served by two queues always goes to the earlier
one, so every gateway replica and client with the same list routes alike. A queue's entry is the
union of its live workers' cards: a worker that lacks an adapter its pool lists (a load still
under way) refuses the request naming the adapter.

The gateway reads the cards through its cached card readers (producer/gateway/model_router.py);
GenqClient.route reads them with read_routes, once per call."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import redis
from pydantic import ValidationError

from producer.model_card import CARD_TTL_S, CARD_VERSION, WorkerCard, card_key

log = logging.getLogger(__name__)

MAX_NAMED = 16
"""Served names an unknown model's message lists (a deployment may serve hundreds of adapters)."""


@dataclass(frozen=True)
class ModelRoute:
    """Where a model name's requests go: the queue, and the adapter they name (None: the base
    model); `parent` is the base model an adapter is applied to (the name itself for a base model)."""

    name: str
    queue: str
    adapter: str | None
    parent: str


def live_cards(entries: Mapping[bytes | str, bytes | str], key: str, now: float | None = None) -> list[WorkerCard]:
    """The cards of a queue's card hash (HGETALL, decoded) of this version and refreshed within
    CARD_TTL_S; malformed entries are logged and skipped."""
    now = time.time() if now is None else now
    cards = []
    for node, raw in entries.items():
        try:
            card = WorkerCard.model_validate_json(raw)
        except ValidationError:
            log.warning("ignoring the malformed model card entry of %r in %s", node, key)
            continue
        if card.version == CARD_VERSION and now - card.heartbeat_at <= CARD_TTL_S:
            cards.append(card)
    return cards


def model_routes(queues: Sequence[tuple[str, Iterable[WorkerCard]]]) -> dict[str, ModelRoute]:
    """Every name the queues' cards serve → its route; earlier queues win a name two serve."""
    routes: dict[str, ModelRoute] = {}
    for queue, cards in queues:
        cards = sorted(cards, key=lambda card: card.model)
        for card in cards:
            routes.setdefault(card.model, ModelRoute(card.model, queue, None, card.model))
        for card in cards:
            for adapter in card.adapters:
                routes.setdefault(adapter, ModelRoute(adapter, queue, adapter, card.model))
    return routes


class UnknownModel(LookupError):
    """No live worker of the queues serves the model (OpenAI's 404 `model_not_found`)."""

    def __init__(self, model: str, routes: Mapping[str, ModelRoute]) -> None:
        known = ", ".join(repr(name) for name in sorted(routes)[:MAX_NAMED]) or "none (no live worker card)"
        more = f" and {len(routes) - MAX_NAMED} more" if len(routes) > MAX_NAMED else ""
        super().__init__(f"the model {model!r} does not exist; served: {known}{more}")
        self.model = model


def pick(model: str, routes: Mapping[str, ModelRoute]) -> ModelRoute:
    """The route of `model`, or UnknownModel naming what is served."""
    route = routes.get(model)
    if route is None:
        raise UnknownModel(model, routes)
    return route


def read_routes(client: redis.Redis, prefix: str, queues: Sequence[str]) -> dict[str, ModelRoute]:
    """The routes of `queues` from their live cards (`client` decodes responses)."""
    keys = [(queue, card_key(queue, prefix)) for queue in queues]
    return model_routes([(queue, live_cards(cast(dict[bytes | str, bytes | str], client.hgetall(key)), key))
                         for queue, key in keys if key is not None])
