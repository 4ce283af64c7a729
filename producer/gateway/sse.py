"""Server-Sent Events plumbing: message framing, keep-alives while a stream is idle, noticing
that the HTTP client went away, and how many streams a task and a client may hold open."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Generic, TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from producer.gateway.errors import ApiError

T = TypeVar("T")


class Idle:
    """What Lookahead.next returns when no item came in time (a type of its own: an item may be None)."""


IDLE = Idle()

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    # nginx and similar proxies buffer responses unless told not to; a token stream must not wait.
    "X-Accel-Buffering": "no",
}
KEEPALIVE = ": keep-alive\n\n"
"""A comment line: EventSource and OpenAI's SDK ignore it, but a dead connection fails to take it,
which is how an idle stream learns that its client left."""


def message(data: str, *, event: str | None = None, id: str | None = None) -> str:
    """One SSE message. `data` must be one line (compact JSON is)."""
    head = (f"id: {id}\n" if id is not None else "") + (f"event: {event}\n" if event is not None else "")
    return f"{head}data: {data}\n\n"


def resume(last_event_id: str | None, reason: str) -> str:
    """The last message of a stream whose reader fell behind: reconnect with `Last-Event-ID:
    <last_event_id>` (what EventSource does by itself) to read on from the replay stream. It has
    no `id:`, so the client's last event id stays the last event's."""
    return message(json.dumps({"error": f"{reason}; reconnect with Last-Event-ID to resume from the replay stream",
                               "last_event_id": last_event_id}), event="resume")


def client_identity(request: Request) -> str:
    """Who a stream counts against: the credential it came with (a digest of the Authorization
    header or access_token parameter), from its address. Holders of one task's access token are
    also bounded per task; holders of the gateway token are told apart by address."""
    credential = request.headers.get("authorization") or request.query_params.get("access_token") or ""
    digest = hashlib.sha256(credential.encode()).hexdigest()[:16] if credential else "anonymous"
    return f"{digest}@{request.client.host if request.client else 'unknown'}"


class StreamSlots:
    """The SSE streams open in this process, per task and per client, with their caps."""

    def __init__(self, per_task: int, per_client: int, retry_after_s: int) -> None:
        self.per_task, self.per_client, self.retry_after_s = per_task, per_client, retry_after_s
        self.tasks: Counter[str] = Counter()
        self.clients: Counter[str] = Counter()

    def take(self, task_id: str, client: str) -> Callable[[], None]:
        """A slot for one more stream, or 429 naming the cap; call the result (once or more) to give it back."""
        if self.tasks[task_id] >= self.per_task:
            self._refuse(f"{self.per_task} SSE streams of task {task_id} are open on this gateway "
                         f"(GENQ_GATEWAY_MAX_STREAMS_PER_TASK={self.per_task})")
        if self.clients[client] >= self.per_client:
            self._refuse(f"this client holds {self.per_client} open SSE streams on this gateway "
                         f"(GENQ_GATEWAY_MAX_STREAMS_PER_CLIENT={self.per_client})")
        self.tasks[task_id] += 1
        self.clients[client] += 1
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                for counter, key in ((self.tasks, task_id), (self.clients, client)):
                    counter[key] -= 1
                    if counter[key] <= 0:
                        del counter[key]

        return give_back

    def _refuse(self, reason: str) -> None:
        raise ApiError(429, "too_many_streams", f"{reason}; close one, or retry later",
                       headers={"Retry-After": str(self.retry_after_s)})


class EventStream(StreamingResponse):
    """An SSE response that, however it ends, closes its generator and gives its stream slot back.
    Starlette stops iterating a stream whose client left but leaves the generator suspended:
    its subscription would live on (and a task go on reading events) until the idle timeout."""

    def __init__(self, content: AsyncGenerator[str, None], give_back: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._content = content
        self._give_back = give_back

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._give_back()
            with anyio.CancelScope(shield=True):
                await self._content.aclose()


async def _read_next(items: AsyncGenerator[T, None], scope: anyio.CancelScope) -> T:
    """The next item of `items`, under `scope`: cancelling the scope cancels the read again on
    every turn of the loop until it ends. A plain Task.cancel() is delivered once and can be
    lost: Python 3.11's asyncio.wait_for, which redis-py's socket writes go through, returns the
    write's result and drops a cancellation that arrives as the write completes; the read would
    then go on, subscribed, for as long as its stream could last."""
    with scope:
        return await anext(items)
    raise asyncio.CancelledError  # reached only when the scope was cancelled (it caught that)


class Lookahead(Generic[T]):
    """One read of `items` kept pending across waits that time out (cancelling it would lose an
    item), for a stream that must also act on a clock: keep-alives, coalescing deadlines."""

    def __init__(self, items: AsyncGenerator[T, None]) -> None:
        self._items = items
        self._pending: asyncio.Future[T] | None = None
        self._scope = anyio.CancelScope()

    async def next(self, timeout_s: float | None) -> T | Idle:
        """The next item, or IDLE when none arrived within `timeout_s` (None: wait for it); raises
        StopAsyncIteration at the end, and what `items` raised."""
        if self._pending is None and timeout_s is None:
            return await anext(self._items)  # nothing to keep across a timeout: read in this task
        if self._pending is None:
            self._scope = anyio.CancelScope()
            self._pending = asyncio.ensure_future(_read_next(self._items, self._scope))
        done, _ = await asyncio.wait({self._pending}, timeout=timeout_s)
        if not done:
            return IDLE
        finished, self._pending = self._pending, None
        return finished.result()

    async def aclose(self) -> None:
        """Give up the pending read and close `items`. Shielded: when a stream's client leaves,
        Starlette cancels its task group, and anyio cancels every await in there again; the first
        await would end this cleanup, and a read that had just finished would leave `items`
        suspended at a yield, subscribed."""
        with anyio.CancelScope(shield=True):
            pending, self._pending = self._pending, None
            if pending is not None:
                self._scope.cancel()  # the source generator ends with the CancelledError thrown into it
                await asyncio.wait({pending})
                if not pending.cancelled():
                    pending.exception()  # retrieved: a read that failed as it was given up is not news
            await self._items.aclose()


async def with_keepalive(items: AsyncGenerator[T, None], interval_s: float) -> AsyncGenerator[T | None, None]:
    """Yield the items of `items`, and None whenever none arrived for `interval_s`. Closing this
    closes `items`."""
    reader = Lookahead(items)
    try:
        while True:
            try:
                item = await reader.next(interval_s)
            except StopAsyncIteration:
                return
            yield None if isinstance(item, Idle) else item
    finally:
        await reader.aclose()


async def _numbered(source: AsyncGenerator[T, None]) -> AsyncGenerator[tuple[int, T], None]:
    try:
        async for item in source:
            yield 0, item
    finally:
        with anyio.CancelScope(shield=True):  # as in Lookahead.aclose
            await source.aclose()


def merged(sources: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """The items of all `sources` as they come, each with its source's position; ends when they
    all have. Each read is cancelled as with_keepalive's is. Closing this closes every source. One
    source is read in the reader's task: no read of its own per item (a task and a wait per token
    of the usual one-prompt stream)."""
    return _numbered(sources[0]) if len(sources) == 1 else _merged(sources)


async def _merged(sources: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    scopes: dict[int, anyio.CancelScope] = {}
    pending: dict[asyncio.Future[T], int] = {}

    def read(position: int) -> None:
        scopes[position] = anyio.CancelScope()
        pending[asyncio.ensure_future(_read_next(sources[position], scopes[position]))] = position

    try:
        for position in range(len(sources)):
            read(position)
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                position = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                read(position)
                yield position, item
    finally:
        with anyio.CancelScope(shield=True):  # as in with_keepalive
            for position in pending.values():
                scopes[position].cancel()
            if pending:
                await asyncio.wait(pending)
            for future in pending:
                if not future.cancelled():
                    future.exception()
            for source in sources:
                await source.aclose()


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has closed the connection (the request body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, or give up on it and return None when the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        return None
    finally:
        for future in (task, watcher):
            future.cancel()
