"""The gateway's routing by model (issue 28): OpenAI's `model` → the queue (worker pool) that
serves it and the adapter the request names, from the cards of every queue the gateway fronts
(GENQ_GATEWAY_QUEUES), each read through its CardReader with the cards' caching.

The rules are producer/model_routes.py's (earlier queues win a name two serve). On top of them,
GENQ_GATEWAY_MODEL_NAME ("genq") keeps naming the first queue's base model, as it did when a
gateway fronted one queue: it answers before any worker has published a card, and wins over a
card's name that equals it. Any other name that no live card serves is OpenAI's 404
`model_not_found`."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio

from producer.gateway.errors import ApiError
from producer.gateway.model_limits import CardReader
from producer.gateway.settings import GatewaySettings
from producer.model_routes import ModelRoute, UnknownModel, model_routes, pick


@dataclass(frozen=True)
class Target:
    """A resolved `model`: its route, and the card reader of its queue (the limits it is checked
    against before queueing)."""

    route: ModelRoute
    cards: CardReader


class ModelRouter:
    def __init__(self, client: redis.asyncio.Redis, settings: GatewaySettings) -> None:
        self.alias = settings.model_name
        self.queues = settings.fronted_queues
        self.readers = {queue: CardReader(client, settings.key_prefix, queue, settings.card_refresh_s)
                        for queue in self.queues}
        self.default = Target(ModelRoute(self.alias, self.queues[0], None, self.alias), self.readers[self.queues[0]])

    async def routes(self) -> dict[str, ModelRoute]:
        """Every name the live cards serve → its route, the alias first."""
        read = [(queue, await reader.current()) for queue, reader in self.readers.items()]
        served = model_routes([(queue, () if limits is None else limits.cards) for queue, limits in read])
        return {self.alias: self.default.route, **{name: route for name, route in served.items() if name != self.alias}}

    async def resolve(self, model: str) -> Target:
        """The target of `model`, or the 404 OpenAI answers for a model it does not serve."""
        if model == self.alias:
            return self.default
        try:
            route = pick(model, await self.routes())
        except UnknownModel as unknown:
            raise ApiError(404, "model_not_found", str(unknown), param="model",
                           kind="invalid_request_error") from None
        return Target(route, self.readers[route.queue])
