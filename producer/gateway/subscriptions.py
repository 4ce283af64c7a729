"""Every SSE reader of one gateway process over a few pub/sub connections.

A reader used to hold a pub/sub connection of its own, so 100 streams of one task took every
connection redis-py's pool had. Here a channel is SUBSCRIBEd once, on one of `connections`
connections (chosen by the channel's hash), however many readers follow it; each message is
fanned out in-process to every reader's bounded buffer, and the last reader to leave
UNSUBSCRIBEs. The handles' replay-then-live logic (producer/client.py) is unchanged: a
`HubSubscription` is what they read instead of a PubSub.

- A reader whose buffer holds `buffer` messages when the next arrives has fallen behind: its
  buffer is dropped and its next read raises FellBehind (the gateway ends the SSE stream with a
  `resume` event).
- A lost connection (a Redis restart) fails every reader on it with redis.ConnectionError: each
  subscribes again, on a new connection, and re-reads the replay stream, as it did with a
  connection of its own.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections import Counter, deque
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio
from redis.asyncio.client import PubSub

from producer.client import CONNECT_TIMEOUT_S

log = logging.getLogger(__name__)

Message = Mapping[str, Any]


class FellBehind(RuntimeError):
    """A reader let more live messages wait than its buffer holds; they were dropped (the replay
    stream still has them)."""


@dataclass(eq=False)
class _Reader:
    """One reader's bounded buffer of live messages; `ready` is set while it has something to
    read (a message, or the failure that ends it)."""

    channel: str
    capacity: int
    queue: deque[Message] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    failure: Exception | None = None

    def deliver(self, message: Message) -> None:
        if self.failure is not None:
            return
        if len(self.queue) >= self.capacity:
            log.info("a reader of %s fell behind: %d live events were waiting for it; dropped them",
                     self.channel, self.capacity)
            self.fail(FellBehind(f"more than {self.capacity} live events waited for this reader"))
            return
        self.queue.append(message)
        self.ready.set()

    def fail(self, error: Exception) -> None:
        if self.failure is None:
            self.failure = error
            self.queue.clear()
            self.ready.set()


@dataclass(eq=False)
class _Channel:
    readers: set[_Reader]
    confirmed: asyncio.Future[None]


class HubSubscription:
    """What a handle reads: its reader's messages (producer.client.Subscription)."""

    def __init__(self, shard: _Shard, reader: _Reader) -> None:
        self._shard = shard
        self._reader = reader

    async def get_message(self, *, timeout: float | None) -> Message | None:
        reader = self._reader
        if not reader.queue and reader.failure is None:
            reader.ready.clear()
            try:
                async with asyncio.timeout(timeout):
                    await reader.ready.wait()
            except TimeoutError:
                return None
        if reader.queue:
            return reader.queue.popleft()
        assert reader.failure is not None
        raise reader.failure

    async def aclose(self) -> None:
        """No I/O here (it runs in cancelled tasks): the UNSUBSCRIBE, if due, runs in the background."""
        self._shard.leave(self._reader)


class _Shard:
    """One pub/sub connection, its channels and the task that reads it."""

    def __init__(self, pubsub_redis: redis.asyncio.Redis, buffer: int) -> None:
        self._redis = pubsub_redis
        self._buffer = buffer
        self._pubsub: PubSub | None = None
        self._listener: asyncio.Task[None] | None = None
        self._channels: dict[str, _Channel] = {}
        self._unconfirmed: Counter[str] = Counter()
        """SUBSCRIBEs sent per channel whose reply has not come: a channel is confirmed by the
        reply to its latest SUBSCRIBE, not by a late one to an earlier (since left) subscription."""
        self._lock = asyncio.Lock()  # orders SUBSCRIBE / UNSUBSCRIBE on the connection
        self._background: set[asyncio.Task[None]] = set()

    async def subscribe(self, channel: str) -> HubSubscription:
        reader = _Reader(channel, self._buffer)
        entry = self._channels.get(channel)
        try:
            if entry is None:
                entry = self._channels[channel] = _Channel({reader}, asyncio.get_running_loop().create_future())
                entry.confirmed.add_done_callback(_retrieve)
                await self._send_subscribe(channel, entry)
            else:
                entry.readers.add(reader)
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await asyncio.shield(entry.confirmed)
        except TimeoutError:
            self.leave(reader)
            raise redis.TimeoutError(f"no SUBSCRIBE confirmation for {channel} in {CONNECT_TIMEOUT_S} s") from None
        except BaseException:
            self.leave(reader)
            raise
        return HubSubscription(self, reader)

    def leave(self, reader: _Reader) -> None:
        entry = self._channels.get(reader.channel)
        if entry is None or reader not in entry.readers:
            return
        entry.readers.discard(reader)
        if not entry.readers:
            del self._channels[reader.channel]
            self._spawn(self._unsubscribe(reader.channel))

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self._lost(redis.ConnectionError("the gateway is shutting down"))

    async def _send_subscribe(self, channel: str, entry: _Channel) -> None:
        async with self._lock:
            if self._channels.get(channel) is not entry:
                return  # its readers left while this waited for the lock
            if self._pubsub is None:
                self._pubsub = self._redis.pubsub()
            pubsub = self._pubsub
            self._unconfirmed[channel] += 1
            try:
                await pubsub.subscribe(channel)  # connects, the first time
            except Exception as error:
                await self._lost(error, pubsub)
                raise
            if self._listener is None:
                self._listener = asyncio.create_task(self._listen(pubsub))

    async def _unsubscribe(self, channel: str) -> None:
        async with self._lock:
            pubsub = self._pubsub
            if channel in self._channels or pubsub is None:
                return  # a reader came back meanwhile, or the connection is gone (and with it the subscription)
            try:
                await pubsub.unsubscribe(channel)
            except Exception as error:
                await self._lost(error, pubsub)

    async def _listen(self, pubsub: PubSub) -> None:
        """Hand each message to its channel's readers, until the connection fails."""
        try:
            while True:
                message = await pubsub.get_message(timeout=None)
                if message is not None:
                    self._dispatch(message)
        except Exception as error:
            await self._lost(error, pubsub)

    def _dispatch(self, message: Message) -> None:
        channel = message["channel"]
        entry = self._channels.get(channel)
        if message["type"] == "subscribe":
            self._unconfirmed[channel] -= 1
            if self._unconfirmed[channel] <= 0:
                del self._unconfirmed[channel]
                if entry is not None and not entry.confirmed.done():
                    entry.confirmed.set_result(None)
        elif message["type"] == "message" and entry is not None:
            for reader in entry.readers:
                reader.deliver(message)

    async def _lost(self, error: BaseException, pubsub: PubSub | None = None) -> None:
        """The connection failed (or the hub closes): every reader on it learns it, and the next
        subscription opens a new connection. `pubsub`: the connection that failed, if known (a
        failure of one already replaced changes nothing)."""
        if pubsub is not None and pubsub is not self._pubsub:
            return
        if self._channels:
            log.info("lost a pub/sub connection (%s): the readers of %d channels resubscribe", error,
                     len(self._channels))
        pubsub, self._pubsub = self._pubsub, None
        listener, self._listener = self._listener, None
        channels, self._channels = self._channels, {}
        self._unconfirmed.clear()
        failure = redis.ConnectionError(f"lost the pub/sub connection: {error}")
        for entry in channels.values():
            if not entry.confirmed.done():
                entry.confirmed.set_exception(failure)
            for reader in entry.readers:
                reader.fail(failure)
        if listener is not None and listener is not asyncio.current_task():
            listener.cancel()
        if pubsub is not None:
            await pubsub.aclose()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _retrieve(future: asyncio.Future[None]) -> None:
    """A confirmation nobody awaits any more (its readers left) must not log 'never retrieved'."""
    if not future.cancelled():
        future.exception()


class SubscriptionHub:
    """producer.client.Subscriber for the gateway: `connections` pub/sub connections shared by
    every reader, each reader buffering at most `buffer` live messages."""

    def __init__(self, pubsub_redis: redis.asyncio.Redis, *, connections: int, buffer: int) -> None:
        self._redis = pubsub_redis
        self._shards = [_Shard(pubsub_redis, buffer) for _ in range(connections)]

    async def subscribe(self, channel: str) -> HubSubscription:
        """Subscribed and confirmed. One retry on a new connection: after a Redis restart the
        connection may fail only when this SUBSCRIBE is sent on it."""
        shard = self._shards[zlib.crc32(channel.encode()) % len(self._shards)]
        try:
            return await shard.subscribe(channel)
        except redis.ConnectionError:
            return await shard.subscribe(channel)

    async def close(self) -> None:
        for shard in self._shards:
            await shard.close()
        await self._redis.aclose()
