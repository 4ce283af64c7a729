"""The two ways service_overhead.py serves a workload: the engine in this
process, and the whole service (a private redis-server, a real `genq worker`
subprocess, a plain Celery client, one pub/sub subscriber).

Both return throughput_runners.Trace objects (per request: tokens and the
perf_counter time each became available to the caller), so the two paths are
scored by the same code.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from celery.result import AsyncResult
from throughput_runners import Request, Trace

from engine import Generator, Job
from producer.protocol import DEFAULT_KEY_PREFIX, TASK_NAME, channel_name

TERMINAL_EVENTS = frozenset({"done", "error", "cancelled"})
WORKER_CONCURRENCY = 64


@dataclass(frozen=True)
class EngineSettings:
    """Cache and batching settings, given identically to the in-process
    Generator and to the worker's command line, so only the path differs."""

    cache_tokens: int
    page_size: int
    max_batch_size: int
    max_chunk_size: int

    def generator_options(self) -> dict[str, int]:
        return {
            "cache_tokens": self.cache_tokens,
            "page_size": self.page_size,
            "max_batch_size": self.max_batch_size,
            "max_chunk_size": self.max_chunk_size,
        }



# -- the subscriber -------------------------------------------------------------


class EventRecorder:
    """One pub/sub connection subscribed to every request's channel before any
    request is sent (pub/sub keeps nothing); a thread stamps each event with
    perf_counter on arrival, before decoding it, until every request has had
    its final event."""

    def __init__(self, client: redis.Redis, identifiers: Sequence[str], prefix: str = DEFAULT_KEY_PREFIX) -> None:
        self.events: dict[str, list[tuple[float, dict[str, Any]]]] = {i: [] for i in identifiers}
        self.finished = threading.Event()
        self._channels = [channel_name(i, prefix) for i in identifiers]
        self._pubsub = client.pubsub()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="event-recorder", daemon=True)

    def __enter__(self) -> EventRecorder:
        """Returns once Redis has confirmed every subscription."""
        try:
            self._pubsub.subscribe(*self._channels)
            confirmed = 0
            while confirmed < len(self._channels):
                message = self._pubsub.get_message(timeout=10)
                if message is None:
                    raise TimeoutError(f"Redis confirmed {confirmed} of {len(self._channels)} subscriptions")
                confirmed += message["type"] == "subscribe"
        except BaseException:
            self._pubsub.close()
            raise
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._pubsub.close()

    def wait(self, timeout: float) -> None:
        if not self.finished.wait(timeout):
            done = sum(any(e["event"] in TERMINAL_EVENTS for _, e in events) for events in self.events.values())
            raise TimeoutError(f"only {done}/{len(self.events)} requests finished within {timeout:.0f} s")

    def _run(self) -> None:
        unfinished = set(self.events)
        while unfinished and not self._stop.is_set():
            message = self._pubsub.get_message(timeout=0.2)
            if message is None or message["type"] != "message":
                continue
            now = time.perf_counter()
            event = json.loads(message["data"])
            self.events[event["id"]].append((now, event))
            if event["event"] in TERMINAL_EVENTS:
                unfinished.discard(event["id"])
        if not unfinished:
            self.finished.set()

    def trace(self, identifiers: Sequence[str], start: float) -> Trace:
        """Tokens and their arrival times from the chunk events (which carry
        token_ids: the requests ask for them); end = the last final event."""
        tokens: list[list[int]] = []
        times: list[list[float]] = []
        for identifier in identifiers:
            chunks = [(t, e.get("token_ids") or []) for t, e in self.events[identifier] if e["event"] == "chunk"]
            tokens.append([token for _, ids in chunks for token in ids])
            times.append([t for t, ids in chunks for _ in ids])
        end = max(t for events in self.events.values() for t, e in events if e["event"] in TERMINAL_EVENTS)
        texts = ["".join(e.get("text", "") for _, e in self.events[i] if e["event"] == "chunk") for i in identifiers]
        return Trace(start, end, tokens, times, texts=texts)


# -- the two paths --------------------------------------------------------------


def task_kwargs(request: Request, identifier: str) -> dict[str, Any]:
    """The wire request: the prompt as input_ids, greedy, EOS ignored, token
    ids in the chunk events so that every token yields a chunk."""
    return {
        "input_ids": request.prompt,
        "max_new_tokens": request.max_new_tokens,
        "ignore_eos": True,
        "sampling": {"temperature": 0},
        "identifier": identifier,
        "stream": {"include_token_ids": True},
    }


def run_service(
    client: Celery, redis_client: redis.Redis, requests: Sequence[Request], queue: str, name: str, timeout: float
) -> tuple[Trace, list[dict[str, Any]]]:
    """Subscribe to every channel, then send every task at once; the trace
    comes from the stream events, the results from the result backend."""
    identifiers = [f"{name}-{i}" for i in range(len(requests))]
    with EventRecorder(redis_client, identifiers) as recorder:
        start = time.perf_counter()
        handles = [client.send_task(TASK_NAME, kwargs=task_kwargs(r, i), queue=queue)
                   for r, i in zip(requests, identifiers)]
        submitted = time.perf_counter()
        recorder.wait(timeout)
    results = [handle.get(timeout=timeout) for handle in handles]
    collected = time.perf_counter()
    trace = recorder.trace(identifiers, start)
    trace.details.update(submit_s=round(submitted - start, 4), results_collected_s=round(collected - start, 4))
    return trace, results


def service_singles(
    client: Celery, redis_client: redis.Redis, requests: Sequence[Request], queue: str, name: str, timeout: float
) -> list[float]:
    """One request at a time: seconds from send_task to its first chunk's arrival."""
    latencies = []
    for i, request in enumerate(requests):
        identifier = f"{name}-{i}"
        with EventRecorder(redis_client, [identifier]) as recorder:
            start = time.perf_counter()
            handle: AsyncResult = client.send_task(TASK_NAME, kwargs=task_kwargs(request, identifier), queue=queue)
            recorder.wait(timeout)
        handle.get(timeout=timeout)
        first = next(t for t, e in recorder.events[identifier] if e["event"] == "chunk")
        latencies.append(first - start)
    return latencies


def engine_singles(gen: Generator, requests: Sequence[Request]) -> list[float]:
    """One request at a time: seconds from enqueue to the iterate() that returns its first token."""
    latencies = []
    for i, request in enumerate(requests):
        start = time.perf_counter()
        gen.enqueue(Job(request.prompt, request.max_new_tokens, stop_conditions=[], identifier=i))
        first = None
        while gen.num_remaining_jobs():
            results = gen.iterate()
            if first is None and any(r["token_ids"] for r in results):
                first = time.perf_counter() - start
        if first is None:
            raise RuntimeError(f"single request {i} produced no token")
        latencies.append(first)
    return latencies


def install_sigterm_as_interrupt() -> None:
    """Python's default SIGTERM ends the process without running finally
    blocks; raise KeyboardInterrupt instead so the worker and redis-server stop."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)

