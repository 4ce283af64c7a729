"""Cancelling a request from any process: a cancel key with an expiry (seen by
a worker that has not started the request yet) plus a control message (seen
at once by the worker generating it)."""

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
