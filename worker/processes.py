"""Starting and stopping genq's processes on one machine: a free port, a
private redis-server, a `genq worker`, and polling until one is up.

`genq dev`, the tests and the benchmarks all start these processes; they use
this one copy so that the flags (persistence, bind address, node names) and
the readiness checks cannot drift apart between them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self

import redis
from celery import Celery
from kombu.exceptions import OperationalError

from worker.metrics import STATS_PREFIX

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


def genq_command(*args: str) -> list[str]:
    """`genq ...` as this interpreter runs it (no console script needed)."""
    return [sys.executable, "-m", "worker.cli", "--log-level", "INFO", *args]


@dataclass
class ChildProcess:
    """A command in its own session (so a terminal's Ctrl-C reaches only the
    parent, which stops its children in order), its output in `log_path`."""

    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    process: subprocess.Popen | None = None

    def start(self) -> Self:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.args, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        return self

    def start_until(self, ready: Callable[[], bool], timeout: float, what: str) -> Self:
        """Start it and wait for `ready` (which may raise to fail fast); stopped again if it never is."""
        ChildProcess.start(self)
        try:
            wait_until(ready, timeout, what)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}; its log ends with:\n"
                               f"{self.log_tail()}")

    def serves_health(self, url: str) -> bool:
        """Whether this process, an HTTP server (the gateway), answers `url`/healthz; raises if it died."""
        self.check_alive()
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait()

    def wait(self, timeout: float = 60) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, then SIGKILL if it has not exited within the timeout."""
        if not self.running():
            return
        self.signal(signal.SIGTERM)
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisServer(ChildProcess):
    """A private redis-server on a free port. With persistence="aof" (the
    default, as in docker-compose) it keeps an fsync-every-second append-only
    file in workdir, so a restart (graceful or kill -9) keeps queued tasks and
    results, and restart() brings it back on the same port. `replica_of`
    makes it a replica of the server on that port (the Sentinel tests)."""

    def __init__(self, workdir: Path, persistence: Persistence = "aof", replica_of: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (e.g. `apt-get install redis-server`)")
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        durable = ["--appendonly", "yes", "--appendfsync", "everysec"] if persistence == "aof" else [
            "--appendonly", "no"]
        replica = ["--replicaof", "127.0.0.1", str(replica_of)] if replica_of else []
        super().__init__("redis-server", [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                          *durable, *replica, "--dir", str(workdir.resolve())], workdir / "redis.log")

    @property
    def version(self) -> str:
        banner = subprocess.run([self.args[0], "--version"], capture_output=True, text=True, check=True).stdout
        return banner.split("v=", 1)[-1].split()[0]  # "Redis server v=7.0.15 sha=..." -> "7.0.15"

    def start(self, timeout: float = 20.0) -> Self:
        """Start it and wait for PING."""
        self.workdir.mkdir(parents=True, exist_ok=True)

        def up() -> bool:
            self.check_alive()
            return reachable(self.url)

        return self.start_until(up, timeout, "redis-server to answer PING")

    def restart(self, graceful: bool = True) -> None:
        """Graceful (SIGTERM: redis-server flushes its append-only file and exits), or a crash
        (SIGKILL: nothing flushed beyond what the append-only file already holds)."""
        self.stop() if graceful else self.kill()
        self.start()


class FlowerProcess(ChildProcess):
    """`genq flower` on a free port with its /api open (FLOWER_UNAUTHENTICATED_API)."""

    def __init__(self, redis_url: str, log_path: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        super().__init__("flower", genq_command("flower", "--port", str(self.port), "--redis-url", redis_url),
                         log_path, {**os.environ, "FLOWER_UNAUTHENTICATED_API": "true"})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def engine_stats(self, nodes: list[str]) -> dict[str, dict[str, str]] | None:
        """Each node's engine lines (worker.metrics.readable_stats) as Flower's /api/workers shows
        them; None until it shows them all, the engines loaded."""
        try:
            with urllib.request.urlopen(f"{self.url}api/workers?refresh=1", timeout=10) as reply:
                workers = json.load(reply)
        except OSError:
            return None
        engines = {node: {name: value for name, value in workers.get(node, {}).get("stats", {}).items()
                          if name.startswith(STATS_PREFIX)} for node in nodes}
        return engines if all(f"{STATS_PREFIX}jobs" in e for e in engines.values()) else None


class WorkerProcess(ChildProcess):
    """`genq worker ...`: a worker exactly as deployed. GENQ_* variables are
    removed from its environment (unless `inherit_settings`) so only the
    options given here (and the defaults) apply; `options` are worker
    command-line options (a list: the option repeated, as --lora A=DIR --lora B=DIR)."""

    def __init__(self, model: Path, redis_url: str, queue: str, name: str, log_path: Path,
                 options: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                 inherit_settings: bool = False) -> None:
        self.model = model
        self.redis_url = redis_url
        self.queue = queue
        self.options = options or {}
        args = genq_command("worker", "--model", str(model), "--redis-url", redis_url, "--queue", queue,
                            "--hostname", f"{name}@genq")
        for option, value in self.options.items():
            flag = f"--{option.replace('_', '-')}"
            if isinstance(value, list):  # a repeatable option: given once per item
                args += [part for item in value for part in (flag, str(item))]
            else:
                args += [flag] if value is True else [flag, str(value)]  # True: a flag without a value
        inherited = {k: v for k, v in os.environ.items() if inherit_settings or not k.startswith("GENQ_")}
        super().__init__(name, args, log_path, {**inherited, "PYTHONUNBUFFERED": "1", **(env or {})})

    @property
    def node(self) -> str:
        return f"{self.name}@genq"

    def wait_ready(self, client: Celery, timeout: float = 120) -> dict[str, Any]:
        """Until the engine answers `engine_stats`: the model is loaded and the loop runs."""

        def engine_up() -> dict[str, Any] | None:
            self.check_alive()
            return self.engine_stats(client, timeout=0.5)

        return wait_until(engine_up, timeout, f"worker {self.node} to load its engine")

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
