"""Server-Sent Events plumbing: message framing, keep-alives while a stream is idle, and
noticing that the HTTP client went away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")

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


async def with_keepalive(items: AsyncIterator[T], interval_s: float) -> AsyncIterator[T | None]:
    """Yield the items of `items`, and None whenever none arrived for `interval_s`. The pending
    read is kept across keep-alives (cancelling it would lose an item)."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()  # the source generator ends with the CancelledError thrown into it


async def merged(sources: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of several async iterators as (index of the source, item), as they arrive (each
    source's own order kept; items ready together in source order), until every source is
    exhausted. A source's exception ends the merge. One read per source is pending at a time; the
    pending reads are cancelled when the merge ends (the source generators end with the
    CancelledError thrown into them), as in with_keepalive.

    asyncio tasks rather than an anyio task group: a task group must not stay open across the
    yields of an async generator, and Starlette leaves a response's generator suspended at a yield
    when its client goes away, to be closed later from another task."""
    pending: dict[asyncio.Future[T], int] = {}
    try:
        for index, source in enumerate(sources):
            pending[asyncio.ensure_future(anext(source))] = index
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):
                index = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                yield index, item
                pending[asyncio.ensure_future(anext(sources[index]))] = index
    finally:
        for future in pending:
            future.cancel()


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
