"""The gateway's SSE coalescing (producer/gateway/sse_coalescing.py) on hand-fed events: what a
merged chunk carries and when it goes out. Each test feeds the events one by one through a queue
and reads what comes out, so "at once" means before the next event exists.
tests/test_gateway_sse_coalescing.py runs the same through a real gateway and worker."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

import pytest

from producer.gateway.sse_coalescing import coalesced
from producer.protocol import StreamEvent, TokenLogprob

LONG_S = 3600.0
"""An interval no test waits out: only the first chunk, the final event or an error lets text out."""

_END = object()


def in_loop(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """The test run to its end in a fresh event loop."""

    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())

    return run


class Feed:
    """A task's events, put one at a time; `events()` is the source coalesced() reads."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.seq = 0
        self.closed = False

    def put(self, event: str = "chunk", text: str = "", **fields: Any) -> StreamEvent:
        item = StreamEvent(id="r1", seq=self.seq, attempt=fields.pop("attempt", 1), event=event, text=text,
                           **fields)
        self.seq += 1
        self.queue.put_nowait(item)
        return item

    def chunk(self, text: str, token: int, **fields: Any) -> StreamEvent:
        logprob = TokenLogprob(token_id=token, token=text, logprob=-0.5)
        return self.put("chunk", text, token_ids=[token], logprobs=[logprob], **fields)

    def fail(self, error: Exception) -> None:
        self.queue.put_nowait(error)

    def end(self) -> None:
        self.queue.put_nowait(_END)

    async def events(self) -> AsyncGenerator[StreamEvent, None]:
        try:
            while (item := await self.queue.get()) is not _END:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.closed = True


async def taken(stream: AsyncGenerator[StreamEvent, None]) -> list[StreamEvent]:
    return [event async for event in stream]


@in_loop
async def test_the_first_chunk_goes_out_before_the_second_exists_and_the_rest_merge_until_the_end():
    feed = Feed()
    stream = coalesced(feed.events(), LONG_S)
    feed.put("started")
    assert (await anext(stream)).event == "started"
    feed.chunk("Hel", 7)
    first = await anext(stream)  # nothing else is queued: it was not held back for a second chunk
    assert (first.text, first.token_ids) == ("Hel", [7])
    for text, token in (("lo", 8), ("", 9), (" you", 10)):
        feed.chunk(text, token)
    final = feed.put("done", "Hello you", finish_reason="length")
    feed.end()
    merged, last = await taken(stream)
    assert (merged.text, merged.token_ids, merged.seq) == ("lo you", [8, 9, 10], 4)
    assert merged.logprobs is not None and [lp.token for lp in merged.logprobs] == ["lo", "", " you"]
    assert last == final  # the final event unchanged
    assert feed.closed


@in_loop
async def test_a_held_chunk_goes_out_by_itself_once_the_interval_passed():
    feed = Feed()
    stream = coalesced(feed.events(), 0.001)
    feed.chunk("a", 1)
    assert (await anext(stream)).text == "a"
    feed.chunk("b", 2)
    feed.chunk("c", 3)
    late = await anext(stream)  # no further event comes: the clock lets them out
    assert (late.text, late.token_ids) == ("bc", [2, 3])
    await stream.aclose()
    assert feed.closed


@in_loop
async def test_a_deadline_s_final_event_comes_after_what_waited():
    feed = Feed()
    stream = coalesced(feed.events(), LONG_S)
    feed.put("started")
    for i, text in enumerate(("x", "y", "z")):
        feed.chunk(text, i)
    feed.put("done", "xyz", finish_reason="deadline")
    feed.end()
    events = await taken(stream)
    assert [(e.event, e.text) for e in events] == [("started", ""), ("chunk", "x"), ("chunk", "yz"), ("done", "xyz")]
    assert events[-1].finish_reason == "deadline"


@in_loop
async def test_cancellation_and_a_broken_stream_let_out_what_waited_first():
    feed = Feed()
    stream = coalesced(feed.events(), LONG_S)
    feed.chunk("a", 1)
    feed.chunk("b", 2)
    feed.put("cancelled", "ab", finish_reason="cancelled")
    assert [e.text for e in [await anext(stream), await anext(stream), await anext(stream)]] == ["a", "b", "ab"]
    feed.put("started", attempt=2)
    feed.chunk("c", 3, attempt=2)  # a new attempt's first chunk: at once
    feed.chunk("d", 4, attempt=2)
    feed.fail(TimeoutError("no event within 1 s"))
    assert [(e.event, e.attempt) for e in [await anext(stream), await anext(stream)]] == [("started", 2),
                                                                                          ("chunk", 2)]
    assert (await anext(stream)).text == "d"
    with pytest.raises(TimeoutError, match="no event"):
        await anext(stream)
    assert feed.closed


@in_loop
async def test_each_choice_merges_on_its_own_and_the_prompt_s_logprobs_go_out_at_once():
    feed = Feed()
    stream = coalesced(feed.events(), LONG_S)
    feed.chunk("a0", 1, index=0)
    feed.chunk("b0", 2, index=1)
    assert [(e.index, e.text) for e in [await anext(stream), await anext(stream)]] == [(0, "a0"), (1, "b0")]
    feed.chunk("a1", 3, index=0)
    feed.chunk("b1", 4, index=1)
    feed.chunk("a2", 5, index=0)
    scored = TokenLogprob(token_id=2, token="x", logprob=-1.0)
    feed.put("chunk", "", index=0, prompt_token_ids=[1, 2], prompt_logprobs=[None, scored])
    out = [await anext(stream) for _ in range(3)]
    assert [(e.index, e.text, e.token_ids) for e in out] == [(0, "a1a2", [3, 5]), (1, "b1", [4]), (0, "", None)]
    assert out[2].prompt_logprobs is not None
    await stream.aclose()
    assert feed.closed


@in_loop
async def test_an_interval_of_zero_is_the_events_themselves():
    feed = Feed()
    source = feed.events()
    assert coalesced(source, 0) is source
