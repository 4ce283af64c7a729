"""SSE coalescing (issue 30): a stream's chunk events merged and written at most every so many
milliseconds per choice, instead of one OpenAI chunk (built, encoded, written) per wire event.

Worker-side coalescing (worker/coalescing.py) cuts what crosses Redis; this cuts what the
gateway does per event it reads: at GPU rates the per-chunk path (the OpenAI chunk's model,
its JSON, the SSE write) is most of the gateway's CPU. The rules are the worker's: a choice's
first chunk goes out at once (time to first token is unchanged), later ones once the interval
has passed since its last; texts, token ids and logprobs are concatenated in order, so the
stream's text is the same; the chunk carrying the prompt's log-probabilities, `started`, and the
final event go out at once, after whatever waits. A stream that breaks gets what waits before
its error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from producer.gateway.sse import Idle, Lookahead
from producer.protocol import StreamEvent, TokenLogprob


@dataclass(slots=True)
class _Held:
    """A choice's chunks since its last one went out, merged in order."""

    first: StreamEvent
    last_seq: int
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def of(cls, event: StreamEvent) -> _Held:
        held = cls(event, event.seq)
        held.add(event)
        return held

    def add(self, event: StreamEvent) -> None:
        self.last_seq = event.seq
        if event.text:
            self.texts.append(event.text)
        if event.token_ids:  # copied on the first: the event's lists are not ours to extend
            if self.token_ids is None:
                self.token_ids = list(event.token_ids)
            else:
                self.token_ids.extend(event.token_ids)
        if event.logprobs:
            if self.logprobs is None:
                self.logprobs = list(event.logprobs)
            else:
                self.logprobs.extend(event.logprobs)

    def event(self) -> StreamEvent:
        return self.first.model_copy(update={"seq": self.last_seq, "text": "".join(self.texts),
                                             "token_ids": self.token_ids, "logprobs": self.logprobs})


def _mergeable(event: StreamEvent) -> bool:
    return event.event == "chunk" and event.prompt_logprobs is None


def coalesced(events: AsyncGenerator[StreamEvent, None], interval_s: float) -> AsyncGenerator[StreamEvent, None]:
    """`events` with each choice's chunks merged, one at most every `interval_s` per choice (0:
    `events` itself). Closing this closes `events`."""
    return events if interval_s <= 0 else _coalesced(events, interval_s)


async def _coalesced(events: AsyncGenerator[StreamEvent, None], interval_s: float
                     ) -> AsyncGenerator[StreamEvent, None]:
    loop = asyncio.get_running_loop()
    reader = Lookahead(events)
    held: dict[int, _Held] = {}
    last_sent: dict[int, float] = {}
    try:
        while True:
            deadline = min((last_sent[index] + interval_s for index in held), default=None)
            try:
                event = await reader.next(None if deadline is None else max(0.0, deadline - loop.time()))
            except StopAsyncIteration:
                break
            except Exception:
                for pending in held.values():
                    yield pending.event()
                held.clear()
                raise
            now = loop.time()
            if isinstance(event, Idle):
                for index in [index for index in held if now - last_sent[index] >= interval_s]:
                    yield held.pop(index).event()
                    last_sent[index] = now
                continue
            index = event.index or 0
            if _mergeable(event):
                merging = held.get(index)
                if merging is None:
                    held[index] = _Held.of(event)
                else:
                    merging.add(event)
                if now - last_sent.get(index, -interval_s) >= interval_s:
                    yield held.pop(index).event()
                    last_sent[index] = now
                continue
            for pending in held.values():
                yield pending.event()
            held.clear()
            yield event
            if event.event == "chunk":
                last_sent[index] = now
            elif event.event == "started" or event.is_terminal:
                last_sent.clear()  # a new attempt's first chunk goes out at once
        for pending in held.values():
            yield pending.event()
    finally:
        await reader.aclose()
