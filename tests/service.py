"""Helpers for service tests: real worker processes and plain Celery/Redis clients."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from producer.protocol import STREAM_FIELD, StreamEvent, stream_key
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent


def plain_client(redis_url: str) -> Celery:
    """A Celery client that knows nothing of genq: what a backend team would write."""
    return Celery("client", broker=redis_url, backend=redis_url)


@dataclass
class WorkerProcess:
    model: Path
    redis_url: str
    queue: str
    name: str
    log_path: Path
    options: dict[str, Any] = field(default_factory=dict)
    process: subprocess.Popen | None = None

    @property
    def node(self) -> str:
        return f"{self.name}@genq-test"

    def start(self) -> WorkerProcess:
        args = [sys.executable, "-m", "worker.cli", "--log-level", "INFO", "worker", "--model", str(self.model),
                "--redis-url", self.redis_url, "--queue", self.queue, "--hostname", self.node]
        for option, value in self.options.items():
            args += [f"--{option.replace('_', '-')}", str(value)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self.log_file, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, client: Celery, timeout: float = 120) -> dict[str, Any]:
        def engine_up() -> dict[str, Any] | None:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"worker exited with {self.process.returncode}:\n{self.log_tail()}")
            return self.engine_stats(client, timeout=0.5)

        return wait_until(engine_up, timeout, f"worker {self.node} to load its engine")  # type: ignore[return-value]

    def engine_stats(self, client: Celery, timeout: float = 2.0) -> dict[str, Any] | None:
        """The worker's `engine_stats` inspect reply; None until its engine is up."""
        replies = client.control.broadcast("engine_stats", destination=[self.node], reply=True, timeout=timeout)
        reply = next((r[self.node] for r in replies if self.node in r), None)
        return reply if isinstance(reply, dict) and "pages_free" in reply else None

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait()

    def wait(self, timeout: float = 60) -> int:
        assert self.process is not None
        code = self.process.wait(timeout)
        self.log_file.close()
        return code

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def replay(client: redis.Redis, identifier: str, prefix: str = "genq") -> list[StreamEvent]:
    return [StreamEvent.from_json(fields[STREAM_FIELD.encode()])
            for _, fields in client.xrange(stream_key(identifier, prefix))]


def chunk_text(events: list[StreamEvent]) -> str:
    return "".join(e.text for e in events if e.event == "chunk")


def decode_event(message: dict[str, Any]) -> StreamEvent:
    return StreamEvent.model_validate(json.loads(message["data"]))


def next_event(pubsub: redis.client.PubSub, timeout: float = 30) -> StreamEvent:
    """The next stream event on a subscribed channel (subscribe acknowledgements skipped)."""
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        message = pubsub.get_message(timeout=remaining)
        if message is not None and message["type"] == "message":
            return decode_event(message)
    raise TimeoutError(f"no stream event within {timeout:.0f} s")
