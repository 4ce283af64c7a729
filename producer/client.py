"""The genq client library: send generation requests, follow their events, get results.

Sync (GenqClient) and asyncio (AsyncGenqClient) flavours share one API::

    with GenqClient() as client:                       # GENQ_REDIS_URL, GENQ_QUEUE, ... or arguments
        handle = client.submit({"prompt": "Once upon a time", "max_new_tokens": 64})
        for text in handle.stream():
            print(text, end="", flush=True)
        result = handle.result()                       # GenerationResult; GenerationError on failure

How nothing is missed (docs/protocol.md, section 5): a handle SUBSCRIBEs to the
request's channel (submit() does it before sending the task), then reads the
replay stream, then takes live messages, de-duplicated by (attempt, seq). The
stream is the source of truth and the channel a low-latency copy of it: a live
event that skips ahead (pub/sub lost something), a dropped connection (the
handle resubscribes by itself) or a silent channel (re-read every few seconds)
all send the reader back to the stream, from the last entry it read. Results
come from the Celery result backend.

Only celery, redis-py and pydantic are imported: no torch, no worker code.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import redis
import redis.asyncio
import redis.asyncio.sentinel
from celery import Celery, states
from celery.exceptions import TimeoutError as CeleryTimeoutError
from pydantic import ValidationError
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from producer.control import request_adapter_load, request_adapter_unload, request_cancel, request_cancel_async
from producer.model_routes import ModelRoute, pick, read_routes
from producer.protocol import (
    STREAM_FIELD,
    TASK_NAME,
    EventType,
    GenerationRequest,
    GenerationResult,
    ProtocolError,
    StreamEvent,
    channel_name,
    control_channel,
    final_key,
    stream_key,
)
from producer.redis_connect import is_sentinel_url
from producer.settings import ClientSettings, celery_base_config
from producer.watchdog import Watchdog

__all__ = [
    "AsyncGenerationHandle",
    "AsyncGenqClient",
    "GenerationError",
    "GenerationHandle",
    "GenqClient",
    "RequestLike",
    "StreamRestarted",
    "Subscriber",
    "Subscription",
    "TextAssembler",
    "make_celery",
]

log = logging.getLogger(__name__)

"""Ten Redis priority levels, 0 served first: the workers' setting (worker/app.py); a producer must
use the same, or kombu files its messages under lists the workers do not read in the same order."""
POLL_INTERVAL_S = 5.0
"""After this long without a live message a reader re-reads the replay stream: it never depends on
pub/sub (at-most-once) to learn that a request ended."""
RECONNECT_WINDOW_S = 30.0
"""How long a reader keeps trying to resubscribe after losing its connection before it gives up."""
CONNECT_TIMEOUT_S = 5.0
REPLAY_PAGE = 256
"""Replay stream entries read at a time: a reader holds at most this many parsed events however
long the stream is (a late reader of an n = 16 request would otherwise hold 40,000 at once)."""
PUBSUB_CLIENT_NAME = "genq-producer-pubsub"
"""CLIENT SETNAME of the connections that follow streams, to tell them apart in CLIENT LIST."""
_RESERVED_OPTIONS = frozenset({"args", "kwargs", "queue", "task_id", "priority", "producer"})

RequestLike = GenerationRequest | Mapping[str, Any]
EventKey = tuple[int, int]
"""(attempt, seq): an event's identity, and the resume point of events(after=...)."""


class GenerationError(RuntimeError):
    """The request failed or was refused by the worker; the message is the worker's own."""

    def __init__(self, message: str, identifier: str) -> None:
        super().__init__(message)
        self.message = message
        self.identifier = identifier


class StreamRestarted(RuntimeError):
    """The task was redelivered (a worker died) and the new attempt's text differs from the text
    already yielded by stream(): that text is void. result() or events() give the new attempt."""

    def __init__(self, identifier: str, attempt: int) -> None:
        super().__init__(f"request {identifier}: attempt {attempt} generated a different text from the start; "
                         "the text streamed so far is void")
        self.identifier = identifier
        self.attempt = attempt


# --- Configuration -------------------------------------------------------------


def _settings(**overrides: Any) -> ClientSettings:
    """Arguments win over GENQ_* variables, which win over the defaults."""
    settings = ClientSettings(**{name: value for name, value in overrides.items() if value is not None})
    control_channel(settings.key_prefix)  # a bad prefix fails here, not at the first request
    return settings


def make_celery(settings: ClientSettings) -> Celery:
    """A Celery app that only sends genq tasks and reads their results (it registers no task).

    JSON only, as on the workers; task-sent events let Flower show queued tasks; the broker
    transport options match worker/app.py so priorities land where the workers look."""
    app = Celery("genq-client", broker=settings.broker, backend=settings.backend, set_as_current=False)
    app.conf.update(
        celery_base_config(settings),
        task_send_sent_event=True,
        task_default_queue=settings.queue,
    )
    return app


def _redis_options() -> dict[str, Any]:
    return {"decode_responses": True, "socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_keepalive": True}


def pubsub_options(retry: Retry | AsyncRetry) -> dict[str, Any]:
    """redis-py would silently reconnect and resubscribe a pub/sub connection, losing whatever was
    published meanwhile without telling anyone. With retries off the error reaches the reader,
    which resubscribes AND re-reads the replay stream."""
    return {**_redis_options(), "retry": retry, "client_name": PUBSUB_CLIENT_NAME}


class _BlockingSentinelPool(redis.asyncio.sentinel.SentinelConnectionPool, redis.asyncio.BlockingConnectionPool):
    """The Sentinel master's pool, waiting for a free connection as BlockingConnectionPool does."""


def bounded_redis_async(settings: ClientSettings, url: str, max_connections: int, timeout_s: float,
                        **options: Any) -> redis.asyncio.Redis:
    """An asyncio client (as ClientSettings.redis_async makes) whose pool holds at most
    `max_connections`: a command waits up to `timeout_s` for a free one (then ConnectionError)
    instead of failing at once with MaxConnectionsError, as redis-py's default pool does."""
    if is_sentinel_url(url):
        return settings.redis_async(url, connection_pool_class=_BlockingSentinelPool,
                                    max_connections=max_connections, timeout=timeout_s, **options)
    pool = settings.redis_async(url, **options).connection_pool  # the URL's and genq's connection options
    return redis.asyncio.Redis.from_pool(redis.asyncio.BlockingConnectionPool(
        max_connections=max_connections, timeout=timeout_s, connection_class=pool.connection_class,
        **pool.connection_kwargs))


class Subscription(Protocol):
    """A live channel subscription as an async handle reads it (redis-py's PubSub is one). A lost
    connection raises redis.ConnectionError or redis.TimeoutError from get_message: the handle
    then subscribes again and re-reads the replay stream."""

    async def get_message(self, *, timeout: float | None) -> Mapping[str, Any] | None: ...

    async def aclose(self) -> None: ...


class Subscriber(Protocol):
    """Where an AsyncGenqClient's handles get their subscriptions: by default a pub/sub connection
    per reader; the gateway multiplexes every reader over a few (producer.gateway.subscriptions)."""

    async def subscribe(self, channel: str) -> Subscription:
        """Subscribed, and confirmed by Redis: nothing published from now on is missed."""
        ...


# --- Requests --------------------------------------------------------------------


@dataclass(frozen=True)
class _Prepared:
    """A validated request, ready for send_task."""

    identifier: str
    kwargs: dict[str, Any]
    priority: int | None
    options: dict[str, Any] = field(default_factory=dict)


def _prepare(request: RequestLike, identifier: str | None, options: Mapping[str, Any]) -> _Prepared:
    """Validate before sending: a bad request is refused here with the worker's own wording."""
    if isinstance(request, GenerationRequest):
        payload = request.to_kwargs()
    elif isinstance(request, Mapping):
        payload = dict(request)
    else:
        raise ProtocolError([f"request: must be a GenerationRequest or a mapping, got {type(request).__name__}"])
    given = payload.get("identifier")
    if given is not None and identifier is not None and given != identifier:
        raise ProtocolError([f"identifier: given twice with different values: {given!r} in the request, "
                             f"{identifier!r} as an argument"])
    if given is None:
        payload["identifier"] = identifier if identifier is not None else uuid.uuid4().hex
    reserved = sorted(_RESERVED_OPTIONS & options.keys())
    if reserved:
        raise TypeError(f"send_task options set by the client itself: {', '.join(reserved)}")
    validated = GenerationRequest.parse_payload(payload)
    return _Prepared(payload["identifier"], validated.to_kwargs(), validated.priority, dict(options))


def _prepare_many(requests: Iterable[RequestLike]) -> list[_Prepared]:
    """Every request is validated before any is sent, so a bad one sends none."""
    prepared = [_prepare(request, None, {}) for request in requests]
    counts = Counter(item.identifier for item in prepared)
    duplicates = sorted(identifier for identifier, count in counts.items() if count > 1)
    if duplicates:
        raise ProtocolError([f"identifier: used by more than one request: {', '.join(duplicates)}"])
    return prepared


def _send(app: Celery, queue: str, prepared: _Prepared, producer: Any = None, watchdog: Watchdog | None = None
          ) -> None:
    # The Celery priority orders the broker queue; the field tells the worker (docs/protocol.md, 7).
    app.send_task(TASK_NAME, kwargs=prepared.kwargs, queue=queue, task_id=prepared.identifier,
                  priority=prepared.priority, producer=producer, **prepared.options)
    if watchdog is not None:
        watchdog.track(prepared.identifier, prepared.kwargs, queue)


def _send_many(app: Celery, settings: ClientSettings, prepared: list[_Prepared], watchdog: Watchdog | None,
               queue: str | None = None) -> None:
    """All messages over one broker connection, to `queue` (the client's by default)."""
    with app.producer_or_acquire() as producer:
        for item in prepared:
            _send(app, settings.queue_for(item.kwargs, queue), item, producer, watchdog)


class _Client:
    """What both clients set up alike: settings, queue, key prefix, Celery app and watchdog."""

    def __init__(self, **overrides: str | None) -> None:
        self.settings = _settings(**overrides)
        self.queue = self.settings.queue
        self.key_prefix = self.settings.key_prefix
        self.celery = make_celery(self.settings)
        self.watchdog = _make_watchdog(self.settings, self.celery)


def _make_watchdog(settings: ClientSettings, app: Celery) -> Watchdog | None:
    """The resend loop of GENQ_WATCHDOG_AFTER_S (producer/watchdog.py), on its own sync connection."""
    if settings.watchdog_after_s is None:
        return None
    watchdog = Watchdog(app, settings.redis(socket_connect_timeout=CONNECT_TIMEOUT_S), settings.watchdog_after_s,
                        settings.key_prefix)
    watchdog.start()
    return watchdog


# --- Results -----------------------------------------------------------------------


def _failure_message(error: object) -> str:
    """The worker's message: Celery rebuilds the stored exception with it as its only argument."""
    return str(error) or type(error).__name__


def _outcome(identifier: str, state: str, value: object) -> GenerationResult:
    if state == "SUCCESS":
        assert isinstance(value, Mapping), "a genq.generate task returns its result as a dict"
        return GenerationResult.from_dict(value)
    if state == "FAILURE":
        raise GenerationError(_failure_message(value), identifier)
    raise GenerationError(f"the task ended in state {state}", identifier)


@dataclass(frozen=True)
class TaskSnapshot:
    state: str
    result: GenerationResult | None = None
    error: str | None = None


def _snapshot(app: Celery, identifier: str) -> TaskSnapshot:
    meta = app.backend.get_task_meta(identifier)
    state = meta["status"]
    if state not in states.READY_STATES:
        return TaskSnapshot(state)
    try:
        return TaskSnapshot(state, result=_outcome(identifier, state, meta["result"]))
    except GenerationError as error:
        return TaskSnapshot(state, error=error.message)


def _fetch_outcome(app: Celery, identifier: str, timeout: float | None) -> GenerationResult:
    """Wait for the task's outcome in the result backend; timeout <= 0 looks once.

    The AsyncResult is made here, in the calling thread: Celery's backend object is per thread
    and a Redis backend's result consumer must not be shared between threads."""
    async_result = app.AsyncResult(identifier)
    if timeout is not None and timeout <= 0:
        ready = async_result.ready()
    else:
        try:
            async_result.get(timeout=timeout, propagate=False, disable_sync_subtasks=False)
            ready = True
        except CeleryTimeoutError:
            ready = False
    if not ready:
        raise TimeoutError(f"request {identifier}: no result within {timeout} s (state {async_result.state})")
    return _outcome(identifier, async_result.state, async_result.result)


def _final_event_from_backend(app: Celery, identifier: str) -> StreamEvent | None:
    """The outcome of a finished request as its final event, for when its replay stream has
    expired (docs/protocol.md, section 5): the result backend keeps outcomes longer."""
    async_result = app.AsyncResult(identifier)
    if not async_result.ready():
        return None
    try:
        result = _outcome(identifier, async_result.state, async_result.result)
    except GenerationError as error:
        return StreamEvent(id=identifier, seq=0, attempt=1, event="error", finish_reason="error",
                           error=error.message)
    kind: EventType = "cancelled" if result.finish_reason == "cancelled" else "done"
    return StreamEvent(id=identifier, seq=0, attempt=result.attempt, event=kind, text=result.text,
                       finish_reason=result.finish_reason, usage=result.usage, timings=result.timings)


# --- Putting the replay stream and the live channel together ----------------------


def _decode(data: str, source: str) -> StreamEvent | None:
    try:
        return StreamEvent.from_json(data)
    except ValidationError as error:
        log.warning("ignoring a malformed event from the %s: %s", source, error)
        return None


def _replay_start(last_entry_id: str | None) -> str:
    """XRANGE's start: everything, or everything after the last entry read (exclusive range)."""
    return "-" if last_entry_id is None else f"({last_entry_id}"


StreamEntries = list[tuple[str, Mapping[str, str]]]


def _entries(reply: object) -> StreamEntries:
    """XRANGE's reply: (entry id, fields) pairs of strings, the handles' clients decoding
    responses (redis-py types replies for either setting of decode_responses)."""
    return cast(StreamEntries, reply)


def _from_entries(entries: StreamEntries) -> list[StreamEvent]:
    events = (_decode(fields.get(STREAM_FIELD, ""), "replay stream") for _, fields in entries)
    return [event for event in events if event is not None]


class _Follower:
    """The de-duplicating, ordering state of one reader (no I/O: the sync and async handles share it).

    cursor is the (attempt, seq) of the last event handed out. Replay events are taken as they
    come (a gap in the stream cannot be filled from anywhere); a live event that is not the next
    one is a sign that pub/sub lost something, and the caller re-reads the stream first."""

    def __init__(self, after: EventKey | None) -> None:
        self.cursor = after
        self.last_entry_id: str | None = None
        self.finished = False

    def _is_old(self, event: StreamEvent) -> bool:
        return self.cursor is not None and (event.attempt, event.seq) <= self.cursor

    def skips_ahead(self, event: StreamEvent) -> bool:
        """Whether a live event leaves a hole after the cursor (a new attempt starts at seq 0)."""
        if self._is_old(event):
            return False
        if self.cursor is None:
            return event.seq != 0
        attempt, seq = self.cursor
        return not ((event.attempt == attempt and event.seq == seq + 1) or (event.attempt > attempt and event.seq == 0))

    def take(self, event: StreamEvent, newest_attempt: int = 0) -> bool:
        """Whether the event is new; if so it becomes the cursor. The request is finished at a final
        event of the newest attempt known, new or already seen (a resume right after the end)."""
        if self.finished:
            return False
        fresh = not self._is_old(event)
        if fresh:
            self.cursor = (event.attempt, event.seq)
        if event.is_terminal and event.attempt >= max(newest_attempt, self.cursor[0] if self.cursor else 0):
            self.finished = True
        return fresh

    def replayed(self, events: list[StreamEvent], last_entry_id: str | None, newest_attempt: int = 0
                 ) -> list[StreamEvent]:
        """The new events among replayed ones. A final event followed by a newer attempt in the same
        read (or in the stream, `newest_attempt`, when it is read page by page) does not end the
        request (an identifier reused, or a requeue racing the reader)."""
        if last_entry_id is not None:
            self.last_entry_id = last_entry_id
        newest = max((event.attempt for event in events), default=newest_attempt)
        return [event for event in events if self.take(event, max(newest, newest_attempt))]


def _replay_page(follower: _Follower, entries: StreamEntries, newest: StreamEntries | None) -> list[StreamEvent]:
    """The new events of one page of the replay stream; `newest`: the stream's last entry, read
    when the page is not the last one."""
    newest_attempt = max((event.attempt for event in _from_entries(newest or [])), default=0)
    return follower.replayed(_from_entries(entries), entries[-1][0] if entries else None, newest_attempt)


def _more_pages(follower: _Follower, entries: StreamEntries) -> bool:
    return len(entries) == REPLAY_PAGE and not follower.finished


def _live_event(message: Mapping[str, Any] | None) -> StreamEvent | None:
    if message is None or message.get("type") != "message":
        return None
    return _decode(message["data"], "channel")


def _wait_for(idle_since: float, timeout: float | None, identifier: str) -> float:
    """How long the next read may block: the poll interval, bounded by the idle timeout left."""
    if timeout is None:
        return POLL_INTERVAL_S
    remaining = timeout - (time.monotonic() - idle_since)
    if remaining <= 0:
        raise TimeoutError(f"request {identifier}: no event within {timeout} s")
    return min(POLL_INTERVAL_S, remaining)


class TextAssembler:
    """Turns events into the text to show, once, for stream() and the CLI.

    When a task is redelivered its new attempt generates from the start. For a greedy or seeded
    request the new attempt regenerates the same text: the part already shown is checked and
    withheld, and the stream continues where it was. If the new attempt differs, feed() raises
    StreamRestarted; reset() then makes the new attempt's text so far the shown text.

    With n > 1 an assembler follows one sample, `index`: its chunks, and its choice in the final
    event (the other samples' chunks add nothing)."""

    def __init__(self, identifier: str, index: int = 0) -> None:
        self.identifier = identifier
        self.index = index
        self._shown: list[str] = []
        self._shown_len = 0
        self._attempt = 0
        self._attempt_parts: list[str] = []
        self._attempt_len = 0

    def feed(self, event: StreamEvent) -> str:
        """The text this event adds to what was shown; raises GenerationError on an error event."""
        if event.event == "error":
            raise GenerationError(event.error or "the generation failed", self.identifier)
        if event.attempt != self._attempt:
            self._attempt, self._attempt_parts, self._attempt_len = event.attempt, [], 0
        if event.event == "chunk":
            if (event.index or 0) != self.index:
                return ""
            new = event.text
        elif event.is_terminal:
            new = self._whole_text(event)[self._attempt_len:]  # what no chunk carried (stream disabled)
        else:
            return ""
        start = self._attempt_len
        self._attempt_parts.append(new)
        self._attempt_len += len(new)
        overlap = min(len(new), self._shown_len - start)
        if overlap > 0:
            if new[:overlap] != self._shown_text()[start:start + overlap]:
                raise StreamRestarted(self.identifier, event.attempt)
            new = new[overlap:]
        if new:
            self._shown.append(new)
            self._shown_len += len(new)
        return new

    def _whole_text(self, final: StreamEvent) -> str:
        """The sample's whole text in a final event: its choice's, or (n = 1, or a request cancelled
        before it started) the event's own text for sample 0."""
        for choice in final.choices or ():
            if choice.index == self.index:
                return choice.text
        return final.text if self.index == 0 else ""

    def reset(self) -> str:
        """After StreamRestarted: the current attempt's text so far, now counted as shown."""
        text = "".join(self._attempt_parts)
        self._shown, self._shown_len = [text], len(text)
        return text

    def _shown_text(self) -> str:
        if len(self._shown) > 1:
            self._shown = ["".join(self._shown)]
        return self._shown[0] if self._shown else ""


# --- Sync client ---------------------------------------------------------------------


class GenerationHandle:
    """One request, by identifier: its events, text, result and cancellation.

    A handle from submit() holds a subscription made before the task was sent; the first
    events()/stream() call takes it over, and result() or close() releases it. Without one
    (handle(), submit_many()) events() subscribes first and then replays, which misses nothing
    either. Iterating the same handle twice, or from two threads, is fine: each iteration
    has its own subscription and starts from the beginning (or `after`)."""

    def __init__(self, client: GenqClient, identifier: str, pubsub: redis.client.PubSub | None = None,
                 *, submitted: bool = False) -> None:
        self.id = identifier
        self._client = client
        self._pubsub = pubsub
        self._fresh = submitted  # just sent: its stream cannot have expired yet

    def events(self, timeout: float | None = None, after: EventKey | None = None) -> Iterator[StreamEvent]:
        """Every event once, in order, until the final event (done, error, cancelled) of the newest
        attempt. `after` is the (attempt, seq) of the last event already seen: resume after it.

        A redelivered request's events come too, with a higher `attempt` and seq from 0 again:
        its text starts over (see TextAssembler). timeout: seconds without any event before
        TimeoutError (None: wait as long as it takes; an unknown identifier waits forever)."""
        follower = _Follower(after)
        pubsub, self._pubsub = self._pubsub, None
        check_backend, self._fresh = not self._fresh, False
        if pubsub is None:
            pubsub = self._client._subscribe(self.id)
        try:
            yield from self._replay(follower, check_backend)
            idle_since = time.monotonic()
            while not follower.finished:
                try:
                    message = pubsub.get_message(timeout=_wait_for(idle_since, timeout, self.id))
                except (redis.ConnectionError, redis.TimeoutError):
                    log.info("request %s: lost the channel connection, resubscribing", self.id)
                    pubsub.close()
                    pubsub = self._client._resubscribe(self.id)
                    message = None
                for event in self._next_events(follower, message):
                    yield event
                    idle_since = time.monotonic()
        finally:
            pubsub.close()

    def _next_events(self, follower: _Follower, message: Mapping[str, Any] | None) -> Iterator[StreamEvent]:
        """What a live message (or its absence: silence, a reconnect) adds, in order."""
        event = _live_event(message)
        if event is None or follower.skips_ahead(event):
            yield from self._replay(follower)
        if event is not None and follower.take(event):
            yield event

    def _replay(self, follower: _Follower, check_backend: bool = False) -> Iterator[StreamEvent]:
        """The new events in the replay stream, a page at a time; check_backend: if it is empty, ask
        the result backend whether the request finished long ago (its stream expired)."""
        key = stream_key(self.id, self._client.key_prefix)
        redis_ = self._client.redis
        entries = _entries(redis_.xrange(key, min=_replay_start(follower.last_entry_id), count=REPLAY_PAGE))
        if check_backend and not entries:
            final = _final_event_from_backend(self._client.celery, self.id)
            if final is not None:
                # The worker writes the stream before the result: re-read, in case it just finished.
                entries = _entries(redis_.xrange(key, count=REPLAY_PAGE))
                if not entries:
                    yield from follower.replayed([final], None)
                    return
        newest = _entries(redis_.xrevrange(key, count=1)) if len(entries) == REPLAY_PAGE else None
        yield from _replay_page(follower, entries, newest)
        while _more_pages(follower, entries):
            entries = _entries(redis_.xrange(key, min=_replay_start(follower.last_entry_id), count=REPLAY_PAGE))
            yield from _replay_page(follower, entries, newest)

    def stream(self, timeout: float | None = None) -> Iterator[str]:
        """The generated text, piece by piece as it arrives; concatenated, the final text.

        Raises GenerationError if the generation fails, StreamRestarted if a redelivered attempt
        generates a different text (a greedy or seeded request regenerates the same one and the
        stream simply continues). A cancelled request ends with the text generated so far.
        A request with n > 1 streams sample 0 (events() has every sample's chunks, result() their
        texts)."""
        assembler = TextAssembler(self.id)
        for event in self.events(timeout):
            text = assembler.feed(event)
            if text:
                yield text

    def result(self, timeout: float | None = None) -> GenerationResult:
        """The outcome from the result backend: a GenerationResult (a cancelled request's too, with
        finish_reason "cancelled"); GenerationError with the worker's message if it failed;
        TimeoutError if not finished within timeout (<= 0: look once, don't wait)."""
        self.close()
        return _fetch_outcome(self._client.celery, self.id, timeout)

    def cancel(self) -> None:
        self._client.cancel(self.id)

    @property
    def state(self) -> str:
        """The Celery task state: PENDING (queued, or unknown), STARTED, SUCCESS, FAILURE."""
        return self._client.celery.AsyncResult(self.id).state

    def close(self) -> None:
        """Release the subscription submit() made, if events() has not taken it over."""
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            pubsub.close()

    def __enter__(self) -> GenerationHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GenerationHandle({self.id!r})"


class GenqClient(_Client):
    """Sends `genq.generate` tasks and follows them. Thread-safe: share one per process.

    Arguments left out come from GENQ_REDIS_URL, GENQ_BROKER_URL, GENQ_RESULT_BACKEND,
    GENQ_QUEUE, GENQ_KEY_PREFIX, GENQ_SENTINEL_MASTER and GENQ_VISIBILITY_TIMEOUT_S, as on
    the workers. Any of the URLs may be a Sentinel URL (producer/redis_connect.py). With
    GENQ_WATCHDOG_AFTER_S set, a thread resends requests the broker lost (producer/watchdog.py)."""

    def __init__(self, redis_url: str | None = None, *, broker_url: str | None = None,
                 result_backend: str | None = None, queue: str | None = None, key_prefix: str | None = None,
                 sentinel_master: str | None = None) -> None:
        super().__init__(redis_url=redis_url, broker_url=broker_url, result_backend=result_backend, queue=queue,
                         key_prefix=key_prefix, sentinel_master=sentinel_master)
        self.redis = self.settings.redis(**_redis_options())
        self._pubsub_redis = self.settings.redis(**pubsub_options(Retry(NoBackoff(), 0)))

    def submit(self, request: RequestLike, *, identifier: str | None = None, queue: str | None = None,
               **options: Any) -> GenerationHandle:
        """Validate (ProtocolError if invalid), subscribe to the request's channel, send the task.

        The identifier is the request's, else `identifier`, else a new UUID; it is also the Celery
        task id. `queue` is the model's queue (route(model).queue; default the client's queue).
        `options` go to Celery's send_task (link, link_error, headers, ...)."""
        prepared = _prepare(request, identifier, options)
        pubsub = self._subscribe(prepared.identifier)
        try:
            _send(self.celery, self.settings.queue_for(prepared.kwargs, queue), prepared, None, self.watchdog)
        except BaseException:
            pubsub.close()
            raise
        return GenerationHandle(self, prepared.identifier, pubsub, submitted=True)

    def submit_many(self, requests: Iterable[RequestLike], *, queue: str | None = None) -> list[GenerationHandle]:
        """Bulk submit over one broker connection, to `queue` as submit; all are validated before
        any is sent. The handles subscribe when iterated (the replay stream covers what came before)."""
        prepared = _prepare_many(requests)
        _send_many(self.celery, self.settings, prepared, self.watchdog, queue)
        return [GenerationHandle(self, item.identifier, submitted=True) for item in prepared]

    def route(self, model: str, queues: Sequence[str] | None = None) -> ModelRoute:
        """Where `model` (a base model or an adapter, as the gateway's OpenAI `model`) is served,
        read from the live cards of `queues` (default: the client's queue), earlier queues first:
        submit(request with `adapter` = route.adapter, queue=route.queue). UnknownModel if none."""
        return pick(model, read_routes(self.redis, self.key_prefix, queues or [self.queue]))

    def handle(self, identifier: str) -> GenerationHandle:
        """Attach to a request sent by anyone: its events from the start, its result, cancel."""
        channel_name(identifier, self.key_prefix)  # ProtocolError for an unusable identifier
        return GenerationHandle(self, identifier)

    def cancel(self, identifier: str) -> None:
        """Cancel a queued or running request (a no-op for a finished or unknown one)."""
        request_cancel(self.redis, identifier, self.key_prefix)

    def load_adapter(self, name: str, path: str, queue: str | None = None) -> None:
        """Ask the workers of `queue` (default: the client's) to load the PEFT adapter directory `path`,
        a path on the workers' machines, under `name`; requests then name it in `adapter`. Fire and
        forget: the workers' model cards list it once loaded (a refused one is logged by the worker)."""
        request_adapter_load(self.redis, queue or self.settings.queue, name, path, self.key_prefix)

    def unload_adapter(self, name: str, queue: str | None = None) -> None:
        """Ask the workers of `queue` to unload adapter `name`: later requests naming it fail clearly,
        those already admitted finish with it."""
        request_adapter_unload(self.redis, queue or self.settings.queue, name, self.key_prefix)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self._pubsub_redis.close()
        self.redis.close()
        self.celery.close()

    def __enter__(self) -> GenqClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _subscribe(self, identifier: str) -> redis.client.PubSub:
        """SUBSCRIBE and wait for Redis to confirm it: only then is nothing published missed."""
        channel = channel_name(identifier, self.key_prefix)
        pubsub = self._pubsub_redis.pubsub()
        try:
            pubsub.subscribe(channel)
            deadline = time.monotonic() + CONNECT_TIMEOUT_S
            while (message := pubsub.get_message(timeout=max(0.0, deadline - time.monotonic()))) is None:
                if time.monotonic() >= deadline:
                    raise redis.TimeoutError(f"no SUBSCRIBE confirmation for {channel} in {CONNECT_TIMEOUT_S} s")
            if message["type"] != "subscribe":
                raise redis.ResponseError(f"unexpected reply to SUBSCRIBE {channel}: {message!r}")
        except BaseException:
            pubsub.close()
            raise
        return pubsub

    def _resubscribe(self, identifier: str) -> redis.client.PubSub:
        """Subscribe again after a lost connection, with backoff, for up to RECONNECT_WINDOW_S."""
        give_up = time.monotonic() + RECONNECT_WINDOW_S
        delay = 0.05
        while True:
            try:
                return self._subscribe(identifier)
            except (redis.ConnectionError, redis.TimeoutError):
                if time.monotonic() + delay > give_up:
                    raise
                time.sleep(delay)
                delay = min(2 * delay, 2.0)


# --- asyncio client ----------------------------------------------------------------


class AsyncGenerationHandle:
    """GenerationHandle for asyncio: the same methods, awaited; state() is a coroutine method.

    Pub/sub and streams go through redis.asyncio; only Celery's blocking calls run in a thread."""

    def __init__(self, client: AsyncGenqClient, identifier: str,
                 subscription: Subscription | None = None, *, submitted: bool = False) -> None:
        self.id = identifier
        self._client = client
        self._subscription = subscription
        self._fresh = submitted  # just sent: its stream cannot have expired yet
        self._finished = False

    async def events(self, timeout: float | None = None, after: EventKey | None = None
                     ) -> AsyncGenerator[StreamEvent, None]:
        """See GenerationHandle.events."""
        follower = _Follower(after)
        subscription, self._subscription = self._subscription, None
        check_backend, self._fresh = not self._fresh, False
        if subscription is None:
            subscription = await self._client._subscribe(self.id)
        try:
            async for event in self._replay(follower, check_backend):
                yield event
            idle_since = time.monotonic()
            while not follower.finished:
                try:
                    message = await subscription.get_message(timeout=_wait_for(idle_since, timeout, self.id))
                except (redis.ConnectionError, redis.TimeoutError):
                    log.info("request %s: lost the channel connection, resubscribing", self.id)
                    await subscription.aclose()
                    subscription = await self._client._resubscribe(self.id)
                    message = None
                async for event in self._next_events(follower, message):
                    yield event
                    idle_since = time.monotonic()
            self._finished = True
        finally:
            await subscription.aclose()

    async def _next_events(self, follower: _Follower, message: Mapping[str, Any] | None
                           ) -> AsyncIterator[StreamEvent]:
        event = _live_event(message)
        if event is None or follower.skips_ahead(event):
            async for fresh in self._replay(follower):
                yield fresh
        if event is not None and follower.take(event):
            yield event

    async def _replay(self, follower: _Follower, check_backend: bool = False) -> AsyncIterator[StreamEvent]:
        """See GenerationHandle._replay."""
        key = stream_key(self.id, self._client.key_prefix)
        redis_ = self._client.redis
        entries = _entries(await redis_.xrange(key, min=_replay_start(follower.last_entry_id), count=REPLAY_PAGE))
        if check_backend and not entries:
            final = await asyncio.to_thread(_final_event_from_backend, self._client.celery, self.id)
            if final is not None:
                entries = _entries(await redis_.xrange(key, count=REPLAY_PAGE))
                if not entries:
                    for event in follower.replayed([final], None):
                        yield event
                    return
        newest = _entries(await redis_.xrevrange(key, count=1)) if len(entries) == REPLAY_PAGE else None
        for event in _replay_page(follower, entries, newest):
            yield event
        while _more_pages(follower, entries):
            entries = _entries(await redis_.xrange(key, min=_replay_start(follower.last_entry_id),
                                                   count=REPLAY_PAGE))
            for event in _replay_page(follower, entries, newest):
                yield event

    async def stream(self, timeout: float | None = None) -> AsyncIterator[str]:
        """See GenerationHandle.stream."""
        assembler = TextAssembler(self.id)
        async for event in self.events(timeout):
            text = assembler.feed(event)
            if text:
                yield text

    async def result(self, timeout: float | None = None) -> GenerationResult:
        """See GenerationHandle.result. Waits for the final event on the channel first, so that a
        thread blocks on the result backend only for the moment the result takes to arrive."""
        deadline = None if timeout is None else time.monotonic() + timeout
        look_only = timeout is not None and timeout <= 0
        if look_only or not (self._fresh or self._finished):
            # A look without waiting, or a handle attached to a request that may have ended long
            # ago: the backend answers at once, without replaying the stream.
            try:
                return await asyncio.to_thread(_fetch_outcome, self._client.celery, self.id, 0)
            except TimeoutError:
                if look_only:
                    raise
        if not self._finished:
            try:
                async with asyncio.timeout(None if deadline is None else deadline - time.monotonic()):
                    async for _ in self.events():
                        pass
            except TimeoutError:
                raise TimeoutError(f"request {self.id}: no result within {timeout} s") from None
        remaining = None if deadline is None else max(0.001, deadline - time.monotonic())
        return await asyncio.to_thread(_fetch_outcome, self._client.celery, self.id, remaining)

    async def cancel(self) -> None:
        await self._client.cancel(self.id)

    async def state(self) -> str:
        """The Celery task state (see GenerationHandle.state)."""
        return await asyncio.to_thread(lambda: self._client.celery.AsyncResult(self.id).state)

    async def snapshot(self) -> TaskSnapshot:
        """The task state with its result or error, from one read of the result backend, so that
        the two always agree (a state read after a separate result read can be newer). Between the
        final event and Celery storing the result, the worker's final record answers: a read
        right after the stream's last event already sees SUCCESS and the result."""
        snapshot = await asyncio.to_thread(_snapshot, self._client.celery, self.id)
        if snapshot.state in states.READY_STATES:
            return snapshot
        final = await self._client.redis.get(final_key(self.id, self._client.key_prefix))
        if final is None:
            return snapshot
        return TaskSnapshot(states.SUCCESS, result=GenerationResult.from_dict(json.loads(final)))

    async def close(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            await subscription.aclose()

    async def __aenter__(self) -> AsyncGenerationHandle:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncGenerationHandle({self.id!r})"


class _PubSubPerReader:
    """The default Subscriber: each subscription is a pub/sub connection of its own."""

    def __init__(self, pubsub_redis: redis.asyncio.Redis) -> None:
        self.redis = pubsub_redis

    async def subscribe(self, channel: str) -> Subscription:
        """See GenqClient._subscribe."""
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(channel)
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                while (message := await pubsub.get_message(timeout=CONNECT_TIMEOUT_S)) is None:
                    pass
            if message["type"] != "subscribe":
                raise redis.ResponseError(f"unexpected reply to SUBSCRIBE {channel}: {message!r}")
        except TimeoutError:
            await pubsub.aclose()
            raise redis.TimeoutError(f"no SUBSCRIBE confirmation for {channel} in {CONNECT_TIMEOUT_S} s") from None
        except BaseException:
            await pubsub.aclose()
            raise
        return pubsub


class AsyncGenqClient(_Client):
    """GenqClient for asyncio (the gateway): the same methods, awaited; handle() needs no I/O.
    Celery's send_task runs in a thread (asyncio.to_thread); everything else is redis.asyncio.

    `subscriber` replaces the pub/sub connection per reader (the gateway multiplexes its readers);
    `max_connections` bounds the command connection pool, a command waiting up to
    `pool_timeout_s` for a free connection (bounded_redis_async)."""

    def __init__(self, redis_url: str | None = None, *, broker_url: str | None = None,
                 result_backend: str | None = None, queue: str | None = None, key_prefix: str | None = None,
                 sentinel_master: str | None = None, subscriber: Subscriber | None = None,
                 max_connections: int | None = None, pool_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        super().__init__(redis_url=redis_url, broker_url=broker_url, result_backend=result_backend, queue=queue,
                         key_prefix=key_prefix, sentinel_master=sentinel_master)
        self.redis = (self.settings.redis_async(**_redis_options()) if max_connections is None else
                      bounded_redis_async(self.settings, self.settings.redis_url, max_connections, pool_timeout_s,
                                          **_redis_options()))
        self._own_subscriber: _PubSubPerReader | None = None
        if subscriber is None:
            subscriber = self._own_subscriber = _PubSubPerReader(
                self.settings.redis_async(**pubsub_options(AsyncRetry(NoBackoff(), 0))))
        self._subscriber = subscriber

    async def submit(self, request: RequestLike, *, identifier: str | None = None, queue: str | None = None,
                     **options: Any) -> AsyncGenerationHandle:
        """See GenqClient.submit."""
        prepared = _prepare(request, identifier, options)
        subscription = await self._subscribe(prepared.identifier)
        try:
            await asyncio.to_thread(_send, self.celery, self.settings.queue_for(prepared.kwargs, queue), prepared, None,
                                    self.watchdog)
        except BaseException:
            await subscription.aclose()
            raise
        return AsyncGenerationHandle(self, prepared.identifier, subscription, submitted=True)

    async def submit_many(self, requests: Iterable[RequestLike], *,
                          queue: str | None = None) -> list[AsyncGenerationHandle]:
        """See GenqClient.submit_many."""
        prepared = _prepare_many(requests)
        await asyncio.to_thread(_send_many, self.celery, self.settings, prepared, self.watchdog, queue)
        return [AsyncGenerationHandle(self, item.identifier, submitted=True) for item in prepared]

    def handle(self, identifier: str) -> AsyncGenerationHandle:
        """See GenqClient.handle."""
        channel_name(identifier, self.key_prefix)
        return AsyncGenerationHandle(self, identifier)

    async def cancel(self, identifier: str) -> None:
        """See GenqClient.cancel."""
        await request_cancel_async(self.redis, identifier, self.key_prefix)

    async def close(self) -> None:
        if self.watchdog is not None:
            await asyncio.to_thread(self.watchdog.stop)
        if self._own_subscriber is not None:
            await self._own_subscriber.redis.aclose()
        await self.redis.aclose()
        await asyncio.to_thread(self.celery.close)

    async def __aenter__(self) -> AsyncGenqClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _subscribe(self, identifier: str) -> Subscription:
        """See GenqClient._subscribe."""
        return await self._subscriber.subscribe(channel_name(identifier, self.key_prefix))

    async def _resubscribe(self, identifier: str) -> Subscription:
        """See GenqClient._resubscribe."""
        give_up = time.monotonic() + RECONNECT_WINDOW_S
        delay = 0.05
        while True:
            try:
                return await self._subscribe(identifier)
            except (redis.ConnectionError, redis.TimeoutError):
                if time.monotonic() + delay > give_up:
                    raise
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)
