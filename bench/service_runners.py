"""The two ways service_overhead.py serves a workload: the engine in this
process, and the whole service (a private redis-server, a real `genq worker`
subprocess, a plain Celery client, one pub/sub subscriber).

Both return throughput_runners.Trace objects (per request: tokens and the
perf_counter time each became available to the caller), so the two paths are
scored by the same code.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.result import AsyncResult

from bench_common import progress
from engine import Generator, Job
from producer.protocol import DEFAULT_KEY_PREFIX, TASK_NAME, channel_name
from throughput_runners import Request, Trace

ROOT = Path(__file__).resolve().parent.parent
TERMINAL_EVENTS = frozenset({"done", "error", "cancelled"})
STOP_TIMEOUT_S = 30.0
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

    def worker_args(self) -> list[str]:
        return [arg for name, value in self.generator_options().items()
                for arg in (f"--{name.replace('_', '-')}", str(value))]


def wait_until(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll a condition that has no event to wait on (a process coming up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop_process(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within the timeout."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        progress(f"pid {process.pid} ignored SIGTERM for {timeout:.0f} s: killing it")
        process.kill()
        process.wait()


# -- the processes ------------------------------------------------------------


class RedisServer:
    """A private redis-server on a free port, without persistence. Children run
    in their own session, so a Ctrl-C reaches only the benchmark, which then
    stops them in order (worker first) from its finally blocks."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("error: redis-server is not installed (apt-get install redis-server); "
                             "the service benchmark starts its own private one")
        banner = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
        self.version = banner.split("v=", 1)[-1].split()[0]  # "Redis server v=7.0.15 sha=..." -> "7.0.15"
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def __enter__(self) -> RedisServer:
        client = redis.Redis(port=self.port)

        def ping() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode} (port {self.port})")
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        try:
            wait_until(ping, 20, "redis-server to answer PING")
        except BaseException:
            self.stop()
            raise
        finally:
            client.close()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        _stop_process(self.process, 10)


class WorkerProcess:
    """`python -m worker.cli worker ...`: the service exactly as deployed, with
    GENQ_* variables removed from its environment so that only the options
    given here (and the defaults) apply."""

    def __init__(self, model: Path, redis_url: str, queue: str, engine: EngineSettings, threads: int,
                 log_path: Path) -> None:
        self.node = f"bench-{queue}@genq-bench"
        self.log_path = log_path
        args = [sys.executable, "-m", "worker.cli", "--log-level", "INFO", "worker", "--model", str(model),
                "--redis-url", redis_url, "--queue", queue, "--concurrency", str(WORKER_CONCURRENCY),
                "--hostname", self.node, "--shutdown-grace", "0", *engine.worker_args()]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
        # torch sizes its thread pool from OMP_NUM_THREADS: the same thread count as the in-process engine.
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self, client: Celery, timeout: float) -> dict[str, Any]:
        """Until the engine answers `engine_stats`: the model is loaded and the loop runs."""

        def engine_up() -> dict[str, Any] | None:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited with {self.process.returncode}:\n{self.log_tail()}")
            return self.engine_stats(client, timeout=0.5)

        return wait_until(engine_up, timeout, f"worker {self.node} to load its engine")

    def engine_stats(self, client: Celery, timeout: float = 5.0) -> dict[str, Any] | None:
        """The worker's `engine_stats` control reply; None until its engine is up."""
        replies = client.control.broadcast("engine_stats", destination=[self.node], reply=True, timeout=timeout)
        reply = next((r[self.node] for r in replies if self.node in r), None)
        return reply if isinstance(reply, dict) and "pages_free" in reply else None

    def stop(self) -> None:
        try:
            _stop_process(self.process, STOP_TIMEOUT_S)
        finally:
            self._log.close()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


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

