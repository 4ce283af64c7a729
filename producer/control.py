"""Cancelling a request from any process: a cancel key with an expiry (seen by
a worker that has not started the request yet) plus a control message (seen
at once by the worker generating it). Loading and unloading a LoRA adapter on
the workers of a queue: a control message alone (at most once, like every
control message: a worker that is not subscribed then never sees it)."""

from __future__ import annotations

import redis
import redis.asyncio

from producer.protocol import (
    CANCEL_KEY_TTL_S,
    CANCEL_KEY_VALUE,
    DEFAULT_KEY_PREFIX,
    cancel_key,
    cancel_message,
    control_channel,
    load_adapter_message,
    unload_adapter_message,
)


def request_cancel(client: redis.Redis, identifier: str, prefix: str = DEFAULT_KEY_PREFIX) -> None:
    pipe = client.pipeline(transaction=True)
    pipe.set(cancel_key(identifier, prefix), CANCEL_KEY_VALUE, ex=CANCEL_KEY_TTL_S)
    pipe.publish(control_channel(prefix), cancel_message(identifier))
    pipe.execute()


async def request_cancel_async(client: redis.asyncio.Redis, identifier: str, prefix: str = DEFAULT_KEY_PREFIX) -> None:
    """request_cancel for asyncio callers (the gateway): the same two commands, in one transaction."""
    async with client.pipeline(transaction=True) as pipe:
        pipe.set(cancel_key(identifier, prefix), CANCEL_KEY_VALUE, ex=CANCEL_KEY_TTL_S)
        pipe.publish(control_channel(prefix), cancel_message(identifier))
        await pipe.execute()


def request_adapter_load(client: redis.Redis, queue: str, name: str, path: str,
                         prefix: str = DEFAULT_KEY_PREFIX) -> int:
    """Ask the workers of `queue` to load the PEFT adapter directory `path` (a path on the workers'
    machines) under `name`; ProtocolError if invalid. Returns how many processes the message reached
    (every worker and gateway on the prefix listens; the model cards show which loaded it)."""
    return int(client.publish(control_channel(prefix), load_adapter_message(queue, name, path)))


def request_adapter_unload(client: redis.Redis, queue: str, name: str, prefix: str = DEFAULT_KEY_PREFIX) -> int:
    """Ask the workers of `queue` to unload adapter `name`: requests naming it are refused from then
    on, those already admitted finish."""
    return int(client.publish(control_channel(prefix), unload_adapter_message(queue, name)))
