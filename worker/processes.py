"""Starting and stopping genq's processes on one machine: a free port, a
private redis-server, a `genq worker`, and polling until one is up.

`genq dev`, the tests and the benchmarks all start these processes; they use
this one copy so that the flags (persistence, bind address, node names) and
the readiness checks cannot drift apart between them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, Self

import redis
from celery import Celery
from kombu.exceptions import OperationalError

ROOT = Path(__file__).resolve().parent.parent
STOP_TIMEOUT_S = 60.0
Persistence = Literal["aof", "none"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll a condition that has no event to wait on (a process coming up);
    the condition may raise to fail fast (a child died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def reachable(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except (redis.RedisError, OSError, ValueError):
        return False


def stop_process(process: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, then SIGKILL if it has not exited within the timeout."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class RedisServer:
    """A private redis-server on a free port. With persistence="aof" (the
    default, as in docker-compose) it keeps an fsync-every-second append-only
    file in workdir, so a restart (graceful or kill -9) keeps queued tasks and
    results, and restart() brings it back on the same port. `replica_of`
    makes it a replica of the server on that port (the Sentinel tests)."""

    def __init__(self, workdir: Path, persistence: Persistence = "aof", port: int | None = None,
                 replica_of: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (e.g. `apt-get install redis-server`)")
        self.binary = binary
        self.workdir = workdir
        self.persistence = persistence
        self.replica_of = replica_of
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    @property
    def version(self) -> str:
        banner = subprocess.run([self.binary, "--version"], capture_output=True, text=True, check=True).stdout
        return banner.split("v=", 1)[-1].split()[0]  # "Redis server v=7.0.15 sha=..." -> "7.0.15"

    def args(self) -> list[str]:
        durable = ["--appendonly", "yes", "--appendfsync", "everysec"] if self.persistence == "aof" else [
            "--appendonly", "no"]
        replica = ["--replicaof", "127.0.0.1", str(self.replica_of)] if self.replica_of else []
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *durable, *replica,
                "--dir", str(self.workdir)]

    def start(self, timeout: float = 20.0) -> Self:
        """Start it in its own session (a terminal's Ctrl-C reaches only the parent) and wait for PING."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = (self.workdir / "redis.log").open("ab")
        self.process = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        process = self.process

        def up() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {process.returncode} (port {self.port})")
            return reachable(self.url)

        try:
            wait_until(up, timeout, "redis-server to answer PING")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Graceful: SIGTERM (redis-server flushes its append-only file and exits)."""
        if self.process is not None:
            stop_process(self.process, 20)

    def kill(self) -> None:
        """A crash: SIGKILL, nothing flushed beyond what AOF already wrote."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restart(self, graceful: bool = True) -> None:
        self.stop() if graceful else self.kill()
        self.start()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class WorkerProcess:
    """`python -m worker.cli worker ...`: a worker exactly as deployed. GENQ_*
    variables are removed from its environment so only the options given here
    (and the defaults) apply; `options` are worker command-line options."""

    model: Path
    redis_url: str
    queue: str
    name: str
    log_path: Path
    options: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    _log: IO[bytes] | None = None

    @property
    def node(self) -> str:
        return f"{self.name}@genq"

    def start(self) -> Self:
        args = [sys.executable, "-m", "worker.cli", "--log-level", "INFO", "worker", "--model", str(self.model),
                "--redis-url", self.redis_url, "--queue", self.queue, "--hostname", self.node]
        for option, value in self.options.items():
            args += [f"--{option.replace('_', '-')}", str(value)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
        env.update(PYTHONUNBUFFERED="1", **self.env)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in wait()
        self.process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        return self

    def wait_ready(self, client: Celery, timeout: float = 120) -> dict[str, Any]:
        """Until the engine answers `engine_stats`: the model is loaded and the loop runs."""

        def engine_up() -> dict[str, Any] | None:
            self.check_alive()
            return self.engine_stats(client, timeout=0.5)

        return wait_until(engine_up, timeout, f"worker {self.node} to load its engine")

    def check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"worker {self.node} exited with {self.process.returncode}:\n{self.log_tail()}")

    def engine_stats(self, client: Celery, timeout: float = 2.0) -> dict[str, Any] | None:
        """The worker's `engine_stats` control reply; None until its engine is up."""
        replies = client.control.broadcast("engine_stats", destination=[self.node], reply=True, timeout=timeout)
        reply = next((r[self.node] for r in replies if self.node in r), None)
        return reply if isinstance(reply, dict) and "pages_free" in reply else None

    def ping(self, client: Celery, timeout: float = 2.0) -> bool:
        """Whether the worker answers `celery inspect ping` (its consumer is
        serving); False also when this client cannot reach Redis right now."""
        try:
            replies = client.control.broadcast("ping", destination=[self.node], reply=True, timeout=timeout, limit=1)
        except (redis.RedisError, OperationalError, OSError):
            return False
        return any(self.node in reply for reply in replies)

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait()

    def wait(self, timeout: float = 60) -> int:
        assert self.process is not None
        code = self.process.wait(timeout)
        if self._log is not None:
            self._log.close()
        return code

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        if self.process is not None and self.process.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        elif self._log is not None:
            self._log.close()

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
