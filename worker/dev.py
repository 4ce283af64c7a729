"""`genq dev`: the whole service on one machine, for a first look.

Redis (GENQ_REDIS_URL if set and reachable, else a private redis-server on a
free port), the tiny model (unless --model), one worker, Flower; then one demo
request streamed to the terminal. Ctrl-C stops everything, children first.
Children run in their own sessions so that the terminal's Ctrl-C reaches only
this process, which then stops them in order.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis
from celery import Celery

from producer.protocol import TASK_NAME, StreamEvent, channel_name

STOP_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 300.0
DEMO_PROMPT = "Once upon a time"


class DevError(RuntimeError):
    """Something the user can fix (no redis-server, bad model directory)."""


def say(message: str) -> None:
    print(f"[genq dev] {message}", file=sys.stderr, flush=True)


class Services:
    """Child processes started by `genq dev`, stopped in reverse order."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.children: list[tuple[str, subprocess.Popen]] = []

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = (self.workdir / f"{name}.log").open("wb")
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        self.children.append((name, process))
        return process

    def check_alive(self) -> None:
        for name, process in self.children:
            if process.poll() is not None:
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise DevError(f"{name} exited with code {process.returncode}; its log ends with:\n{tail}")

    def stop(self) -> None:
        for name, process in reversed(self.children):
            if process.poll() is None:
                say(f"stopping {name} (pid {process.pid})")
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reachable(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except (redis.RedisError, OSError, ValueError):
        return False


def wait_for(condition: Callable[[], object], services: Services, timeout: float, what: str) -> object:
    """Poll a child coming up, failing fast if any child died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        services.check_alive()
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise DevError(f"timed out after {timeout:.0f} s waiting for {what}")


def start_redis(services: Services) -> str:
    configured = os.environ.get("GENQ_REDIS_URL")
    if configured:
        if reachable(configured):
            say(f"using Redis at {configured} (GENQ_REDIS_URL)")
            return configured
        say(f"GENQ_REDIS_URL={configured} is not reachable; starting a private redis-server instead")
    binary = shutil.which("redis-server")
    if binary is None:
        raise DevError(
            "no Redis: GENQ_REDIS_URL is unset or unreachable and redis-server is not on PATH "
            "(install it, e.g. `apt-get install redis-server`, or point GENQ_REDIS_URL at a Redis)"
        )
    port = free_port()
    services.spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--dir", str(services.workdir)])
    url = f"redis://127.0.0.1:{port}/0"
    wait_for(lambda: reachable(url), services, 30, "redis-server")
    say(f"started a private redis-server at {url}")
    return url


def resolve_model(model: str | None) -> Path:
    if model:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise DevError(f"{path} has no config.json; pass a Hugging Face model directory")
        return path
    from engine.tiny_model import make_tiny_model

    path = Path(".models/tiny-llama")
    if not (path / "config.json").is_file():
        say(f"making the tiny random-weight demo model in {path} (its text is noise, not prose)")
        make_tiny_model(path, family="llama", preset="tiny")
    return path


def engine_ready(client: Celery, node: str) -> bool:
    replies = client.control.broadcast("engine_stats", destination=[node], reply=True, timeout=1.0)
    return any(isinstance(r.get(node), dict) and "pages_free" in r[node] for r in replies)


def stream_demo(client: Celery, redis_url: str, queue: str, max_new_tokens: int) -> None:
    """Subscribe first, then send: the documented way to see every event."""
    identifier = f"demo-{int(time.time())}"
    pubsub = redis.Redis.from_url(redis_url).pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(channel_name(identifier))
    client.send_task(TASK_NAME, kwargs={"prompt": DEMO_PROMPT, "max_new_tokens": max_new_tokens,
                                        "ignore_eos": True, "identifier": identifier}, queue=queue)
    say(f"demo request {identifier!r} sent; streaming it:")
    sys.stdout.write(DEMO_PROMPT)
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
            model_dir = resolve_model(model)
            env = {**os.environ, "GENQ_REDIS_URL": redis_url, "FLOWER_UNAUTHENTICATED_API": "true"}
            node = f"genq-dev-{os.getpid()}@localhost"
            worker = services.spawn("worker", [sys.executable, "-m", "worker.cli", "--log-level", "INFO", "worker",
                                               "--model", str(model_dir), "--hostname", node], env)
            port = flower_port or free_port()
            flower = services.spawn("flower", [sys.executable, "-m", "worker.cli", "flower", "--port", str(port)], env)
            client = Celery("genq-dev", broker=redis_url, backend=redis_url)
            say(f"loading the model in the worker (pid {worker.pid}); logs in {workdir}")
            wait_for(lambda: engine_ready(client, node), services, READY_TIMEOUT_S, "the worker's engine")
            stream_demo(client, redis_url, os.environ.get("GENQ_QUEUE", "genq"), max_new_tokens)
            pids = " ".join(f"{name}={process.pid}" for name, process in services.children)
            say(f"Flower: http://127.0.0.1:{port}/ (pid {flower.pid})")
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
