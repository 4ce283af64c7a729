"""Big but valid requests through a real `genq worker` (issue 23, items 8 and 9): a
request with n samples streams more events than GENQ_STREAM_MAXLEN and a late
reader still rebuilds every sample's text; a batch of requests with 20
alternatives per token finishes without pausing another request's stream, and
each result's logprobs are stored once in Redis."""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from producer.control import request_cancel
from producer.protocol import TASK_NAME, GenerationResult, StreamEvent, channel_name, final_key, stream_key
from tests.pauses import Pause, run_queue_wait_s, schedstat_path
from tests.service import decode_event, replay
from worker.loop import LOOP_THREAD_NAME, PUBLISHER_THREAD_NAME
from worker.processes import WorkerProcess, wait_until

QUEUE = "genq-big"
STREAM_MAXLEN = 10  # the setting's least: an n = 4 request of 64 tokens streams 258 events
BATCH = 8
BATCH_TOKENS = 128
MAX_GAP_S = 0.1
ANY_ROUND_MAX_GAP_S = 0.2
ROUNDS = 3
_ids = itertools.count()


@pytest.fixture(scope="module")
def worker(tiny_model_factory: Callable[..., Path], redis_url: str, client: Celery,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    model = tiny_model_factory("llama", max_position_embeddings=1024)
    options = {"cache_tokens": 16384, "page_size": 16, "concurrency": 16, "stream_maxlen": STREAM_MAXLEN}
    with WorkerProcess(model, redis_url, QUEUE, "big", tmp_path_factory.mktemp("big") / "worker.log",
                       options) as process:
        process.wait_ready(client)
        yield process


def send(client: Celery, identifier: str, **request: Any) -> Any:
    return client.send_task(TASK_NAME, queue=QUEUE, task_id=identifier,
                            kwargs={"prompt": f"big {identifier}", "ignore_eos": True, "identifier": identifier,
                                    **request})


def test_a_late_reader_rebuilds_every_sample_of_a_request_longer_than_the_stream_maxlen(
        worker: WorkerProcess, client: Celery, redis_client: redis.Redis):
    result = GenerationResult.from_dict(send(client, "many-samples", n=4, max_new_tokens=64,
                                             stream={"include_token_ids": True}).get(timeout=120))
    events = replay(redis_client, "many-samples")  # read after the end: the latest a reader can come
    assert len(events) == 1 + 4 * 64 + 1 > STREAM_MAXLEN
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[0].event == "started" and events[-1].event == "done"
    assert result.choices is not None and len(result.choices) == 4
    for choice in result.choices:
        chunks = [e for e in events if e.event == "chunk" and e.index == choice.index]
        assert "".join(e.text for e in chunks) == choice.text
        assert [t for e in chunks for t in e.token_ids or []] == choice.token_ids
        assert len(choice.token_ids or []) == 64


def path_schedstats(worker: WorkerProcess, redis_client: redis.Redis) -> list[Path]:
    """The schedstats of the threads a chunk passes through before the recorder's: the worker's
    engine loop thread, the thread that publishes its steps' events and the Redis server's main
    thread. The kernel knows the worker's by their names; a thread started by one (torch's
    intra-op threads, by the loop) inherits its name, so each is the first (lowest id) so named."""
    names = (LOOP_THREAD_NAME, PUBLISHER_THREAD_NAME)
    tasks = Path(f"/proc/{worker.pid}/task")
    first: dict[str, int] = {}
    for task in sorted(tasks.iterdir(), key=lambda task: int(task.name), reverse=True):
        first[(task / "comm").read_text().strip()] = int(task.name)
    server = int(redis_client.info("server")["process_id"])
    return [*(schedstat_path(worker.pid, first[name]) for name in names), schedstat_path(server, server)]


class ChannelRecorder:
    """Every event on the given channels with the time it arrived, from a thread of its own (the
    test's thread reads nothing big meanwhile, so arrival times are the worker's), and how long
    the threads each chunk passes through had waited for a CPU so far: the `schedstats` threads
    (path_schedstats) and this recorder's."""

    def __init__(self, client: redis.Redis, identifiers: list[str], schedstats: list[Path]) -> None:
        self.schedstats = schedstats
        self.pubsub = client.pubsub()
        self.pubsub.subscribe(*[channel_name(i) for i in identifiers])
        self.arrivals: list[tuple[float, float, StreamEvent]] = []
        self.finals: set[str] = set()
        self.changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        schedstats = [*self.schedstats, schedstat_path()]
        while not self._stop.is_set():
            message = self.pubsub.get_message(timeout=0.05)
            if message is None or message["type"] != "message":
                continue
            at, waited = time.monotonic(), sum(map(run_queue_wait_s, schedstats))
            event = decode_event(message)
            with self.changed:
                self.arrivals.append((at, waited, event))
                if event.is_terminal:
                    self.finals.add(event.id)
                self.changed.notify_all()

    def wait(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        with self.changed:
            assert self.changed.wait_for(condition, timeout), f"timed out waiting for {what}"

    def chunk_times(self, identifier: str) -> list[tuple[float, float]]:
        """(arrival time, the path's run-queue waits so far) of each of the request's chunks."""
        with self.changed:
            return [(at, waited) for at, waited, event in self.arrivals
                    if event.id == identifier and event.event == "chunk"]

    def final_time(self, identifier: str) -> float:
        with self.changed:
            return next(at for at, _, event in self.arrivals if event.id == identifier and event.is_terminal)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pubsub.close()


def longest_pause_while_a_batch_finishes(client: Celery, redis_client: redis.Redis, schedstats: list[Path]
                                         ) -> Pause:
    """The canary's longest gap between chunks, less the time the threads on its path waited
    for a CPU meanwhile (ChannelRecorder, tests/pauses.py), from 1 s before the first of the
    batch's final events (but not before this thread has sent the batch: sending holds this
    process's GIL, which the recorder needs to take each arrival's time) until five chunks
    after the last of its results was stored (the storing threads run then too)."""
    run = next(_ids)
    canary = f"canary-{run}"
    batch = [f"top20-{run}-{i}" for i in range(BATCH)]
    recorder = ChannelRecorder(redis_client, [canary, *batch], schedstats)
    try:
        send(client, canary, max_new_tokens=900)
        recorder.wait(lambda: len(recorder.chunk_times(canary)) >= 10, 60, "the canary to stream")
        for identifier in batch:
            send(client, identifier, max_new_tokens=BATCH_TOKENS, logprobs=True, top_logprobs=20,
                 stream={"enabled": False})
        sent = time.monotonic()
        recorder.wait(lambda: recorder.finals >= set(batch), 120, "the batch to finish")
        wait_until(lambda: all(redis_client.exists(f"celery-task-meta-{i}") for i in batch), 60,
                   "the batch's results to be stored")
        stored = time.monotonic()
        recorder.wait(lambda: sum(at > stored for at, _ in recorder.chunk_times(canary)) >= 5, 60,
                      "the canary to go on")
        assert canary not in recorder.finals, "the canary ended before the batch did"
        start = max(sent, min(recorder.final_time(identifier) for identifier in batch) - 1.0)
        chunks = [chunk for chunk in recorder.chunk_times(canary) if chunk[0] >= start]
    finally:
        request_cancel(redis_client, canary)
        recorder.wait(lambda: canary in recorder.finals, 60, "the canary to end")
        recorder.close()
    result = GenerationResult.from_dict(client.AsyncResult(batch[0]).get(timeout=60))
    assert result.logprobs is not None and len(result.logprobs) == BATCH_TOKENS
    assert all(len(lp.top_logprobs) == 20 for lp in result.logprobs)
    assert len(chunks) >= 10
    return max((Pause(at - before, waited - waited_before)
                for (before, waited_before), (at, waited) in itertools.pairwise(chunks)), key=lambda p: p.engine_s)


def test_a_batch_with_20_alternatives_a_token_finishes_without_pausing_another_stream(
        worker: WorkerProcess, client: Celery, redis_client: redis.Redis):
    """The canary streams a chunk per engine step; when the batch ends, the worker builds 8
    results of 128 tokens with 20 alternatives each (21,504 logprobs) and encodes each twice
    (its final record, then Celery's result). Built on the engine loop, as at first, that paused
    the canary for 0.3 to 0.6 s here.

    The statistic: each round's longest gap between two chunks, less only the time the threads
    the chunks pass through (the worker's loop and publishing threads, the Redis server's, the
    recorder's) were runnable but the kernel ran something else: the run-queue wait the kernel
    counts per thread (tests/pauses.py; test_grammar_isolation.py takes the loop's off the same
    way). Everything else counts: the loop's work, its waits for the GIL and for other threads,
    Redis's and the publisher's work. The median of 3 rounds must stay under the issue's bound
    and every round under twice it: a pause the worker causes whenever a batch finishes (as the
    build on the loop did, every round) fails, and so does one of the 0.3 s it caused, while one
    round that other jobs on this machine disturbed beyond what the run-queue waits show (1 of
    24 rounds here: 140 ms, at a load average of 5.7) does not.

    The gaps taken whole (the statistic before: the least of up to 5 rounds) read 102 to 215 ms
    on this 2-core machine shared with other jobs: logging every step inside the worker showed
    the loop stepping every 3 to 5 ms through most of those gaps while the Redis server's main
    thread waited 67 to 212 ms for a CPU (the recorder's, up to 240 ms), and the rounds that
    paused most had their gap right after this thread sent the batch (its sends hold this
    process's GIL). As measured now: 6 to 73 ms in 23 of 24 rounds, with this machine's load
    average at 5 to 6; with the results' pacing (worker/pacing.py) taken out, 9 to 58 ms over 9
    rounds: 8 results are too few for their GIL holds to show here as the canary sees them
    (tests/test_pacing.py shows them)."""
    schedstats = path_schedstats(worker, redis_client)
    pauses = [longest_pause_while_a_batch_finishes(client, redis_client, schedstats) for _ in range(ROUNDS)]
    shown = ", ".join(map(str, pauses))
    assert statistics.median(p.engine_s for p in pauses) < MAX_GAP_S, f"the canary paused {shown}"
    assert max(p.engine_s for p in pauses) < ANY_ROUND_MAX_GAP_S, f"the canary paused {shown}"


def holders_of(client: redis.Redis, identifier: str, needle: bytes) -> dict[str, int]:
    """Each Redis key named after the request that holds `needle`, with its MEMORY USAGE."""
    found = {}
    for key in client.scan_iter(match=f"*{identifier}*", count=1000):
        kind = client.type(key)
        if kind == b"string":
            held = needle in (client.get(key) or b"")
        elif kind == b"stream":
            held = any(needle in value for _, fields in client.xrange(key) for value in fields.values())
        else:
            held = False
        if held:
            found[key.decode()] = client.memory_usage(key) or 0
    return found


@pytest.mark.parametrize("streamed", [False, True])
def test_a_result_s_logprobs_are_stored_once(worker: WorkerProcess, client: Celery, redis_client: redis.Redis,
                                             streamed: bool):
    """The result backend holds the result; the final record that covers a worker dying before
    Celery stored it is deleted once it did, and the final event leaves the logprobs out (a
    streamed request's chunks carry each token's, as they come)."""
    identifier = f"stored-once-{streamed}-{next(_ids)}"
    result = GenerationResult.from_dict(send(client, identifier, max_new_tokens=64, logprobs=True, top_logprobs=20,
                                             stream={"enabled": streamed}).get(timeout=120))
    assert result.logprobs is not None and len(result.logprobs) == 64
    wait_until(lambda: not redis_client.exists(final_key(identifier, "genq")), 30,
               "the final record to be deleted once the result was stored")
    meta = f"celery-task-meta-{identifier}"
    holders = holders_of(redis_client, identifier, b'"top_logprobs"')
    events = replay(redis_client, identifier)
    assert events[-1].event == "done" and events[-1].logprobs is None
    if not streamed:
        assert holders == {meta: redis_client.memory_usage(meta)}
        assert (redis_client.memory_usage(stream_key(identifier)) or 0) < holders[meta] / 20
    else:
        # The chunks are the stream, not a stored result; together they are the result's logprobs.
        assert set(holders) == {meta, stream_key(identifier)}
        assert [lp for e in events if e.event == "chunk" for lp in e.logprobs or []] == result.logprobs
