"""What the gateway tests share: a real `genq worker`, `genq gateway` and `genq callback-worker`
as subprocesses on one test Redis, a local webhook receiver, and small HTTP helpers (SSE reader,
signed webhook POST). Test modules import the fixtures they use."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

import httpx
import openai
import pytest
import redis
from celery import Celery

from producer.client import GenqClient
from producer.protocol import DEFAULT_KEY_PREFIX
from producer.signing import signed_headers
from producer.tenants.keys import KeyStore
from tests.service import plain_client
from worker.processes import ChildProcess, WorkerProcess, free_port, genq_command, wait_until

QUEUE = "genq-gateway"
CALLBACK_QUEUE = "genq-gateway-callbacks"
TOKEN = "test-token"
SECRET = "test-webhook-secret"
MODEL = "genq"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def celery_client(redis_url: str) -> Celery:
    return plain_client(redis_url)


@contextmanager
def running_worker(model_dir: Path, redis_url: str, celery_client: Celery, log_dir: Path, queue: str = QUEUE,
                   name: str = "gateway-worker", **options: Any) -> Iterator[WorkerProcess]:
    """A `genq worker` on `queue`, its engine up; options override its engine and Celery settings."""
    with WorkerProcess(model_dir, redis_url, queue, name, log_dir / "worker.log",
                       {"cache_tokens": 16384, "page_size": 16, "concurrency": 16, **options}) as process:
        process.wait_ready(celery_client)
        yield process


@pytest.fixture(scope="module")
def module_worker(model_dir: Path, redis_url: str, celery_client: Celery,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., WorkerProcess]]:
    """start(queue, name, **options): a worker of the tiny model on a module's queue (running_worker),
    stopped when the module's tests are done."""
    with ExitStack() as workers:

        def start(queue: str, name: str, **options: Any) -> WorkerProcess:
            log_dir = tmp_path_factory.mktemp(name)
            return workers.enter_context(running_worker(model_dir, redis_url, celery_client, log_dir, queue, name,
                                                        **options))

        yield start


@pytest.fixture(scope="module")
def worker(module_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker(QUEUE, "gateway-worker")


def service_env(redis_url: str) -> dict[str, str]:
    """The environment every gateway-side process of the tests shares. The webhook receiver of
    the tests listens on 127.0.0.1, which callbacks refuse by default: these processes run with
    the documented opt-out for trusted deployments (test_gateway_security shows the default)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "GENQ_REDIS_URL": redis_url, "GENQ_QUEUE": QUEUE,
            "GENQ_WEBHOOK_SECRET": SECRET, "GENQ_CALLBACK_QUEUE": CALLBACK_QUEUE,
            "GENQ_CALLBACK_ALLOW_PRIVATE_HOSTS": "true"}


@pytest.fixture(scope="module")
def callback_worker(redis_url: str, celery_client: Celery,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChildProcess]:
    env = {**service_env(redis_url), "GENQ_CALLBACK_BACKOFF_S": "1", "GENQ_CALLBACK_MAX_RETRIES": "4"}
    log = tmp_path_factory.mktemp("callbacks") / "callbacks.log"
    node = f"genq-callbacks@{socket.gethostname()}"  # the name the compose healthcheck pings
    with ChildProcess("callback worker", genq_command("callback-worker"), log, env) as process:
        wait_until(lambda: process.check_alive() or celery_client.control.ping(destination=[node], timeout=0.5), 60,
                   "the callback worker to answer ping")
        yield process


class GatewayProcess(ChildProcess):
    """`genq gateway` on a free port, its stdout and stderr (uvicorn's logs) in `log_path`."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        # INFO: uvicorn's access log on, as an operator who wants one runs it.
        super().__init__("gateway", genq_command("gateway", "--port", str(port)), log_path, env)

    def start(self) -> Self:
        return self.start_until(lambda: self.serves_health(self.url), 30, "the gateway to answer /healthz")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def module_gateway(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., GatewayProcess]]:
    """start(queue, name, **env): `genq gateway` in front of a module's queue, with the tests' token and
    model name (env: further GENQ_* variables), stopped when the module's tests are done."""
    with ExitStack() as gateways:

        def start(queue: str, name: str, **env: str) -> GatewayProcess:
            variables = {**service_env(redis_url), "GENQ_QUEUE": queue, "GENQ_GATEWAY_TOKEN": TOKEN,
                         "GENQ_GATEWAY_MODEL_NAME": MODEL, **env}
            return gateways.enter_context(GatewayProcess(variables, tmp_path_factory.mktemp(name) / "gateway.log"))

        yield start


@pytest.fixture(scope="module")
def gateway_process(worker: WorkerProcess, module_gateway: Callable[..., GatewayProcess]) -> GatewayProcess:
    return module_gateway(QUEUE, "gateway")


@pytest.fixture(scope="module")
def gateway(gateway_process: GatewayProcess) -> str:
    """The base URL of the module's gateway."""
    return gateway_process.url


@pytest.fixture(scope="module")
def genq(redis_url: str) -> Iterator[GenqClient]:
    with GenqClient(redis_url, queue=QUEUE) as client:
        yield client


@pytest.fixture(scope="module")
def oai(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=TOKEN, max_retries=0, timeout=120)


# --- helpers --------------------------------------------------------------------------


@dataclass
class Sse:
    id: str | None
    event: str | None
    data: str


def read_sse(response: httpx.Response, limit: int | None = None) -> list[Sse]:
    """SSE messages of a streamed response, up to `limit` of them (comments skipped)."""
    messages: list[Sse] = []
    fields: dict[str, str] = {}
    for line in response.iter_lines():
        if line.startswith(":"):
            continue
        if line:
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")
            continue
        if "data" in fields:
            messages.append(Sse(fields.get("id"), fields.get("event"), fields["data"]))
            if limit is not None and len(messages) >= limit:
                break
        fields = {}
    return messages


def close_once_two_choices_stream(stream: Any) -> str:
    """Read an OpenAI completions stream until choices 0 and 1 have each streamed two chunks of
    text, then close it, as a client that goes away; the stream's id."""
    seen: Counter[int] = Counter()
    for chunk in stream:
        for choice in chunk.choices:
            seen[choice.index] += bool(choice.text)
        if min(seen[0], seen[1]) >= 2:
            break
    stream.close()
    return chunk.id


def signed_post(base: str, body: dict[str, Any], *, timestamp: int | None = None,
                secret: str = SECRET) -> tuple[httpx.Response, bytes, dict[str, str]]:
    raw = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **signed_headers(secret, raw, timestamp)}
    return httpx.post(f"{base}/v1/tasks", content=raw, headers=headers, timeout=30), raw, headers


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@dataclass
class Receiver:
    """A local webhook receiver that fails the first `failures` calls of each path with a 500."""

    failures: int
    calls: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    lock: threading.Condition = field(default_factory=threading.Condition)

    def handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.lock:
                    receiver.calls.append((self.path, dict(self.headers), body))
                    tries = sum(path == self.path for path, _, _ in receiver.calls)
                    receiver.lock.notify_all()
                self.send_response(500 if tries <= receiver.failures else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler

    def wait(self, path: str, calls: int, timeout: float = 60) -> list[tuple[dict[str, str], bytes]]:
        with self.lock:
            done = self.lock.wait_for(lambda: sum(p == path for p, _, _ in self.calls) >= calls, timeout)
            assert done, f"{path}: {sum(p == path for p, _, _ in self.calls)} calls, expected {calls}"
            return [(headers, body) for p, headers, body in self.calls if p == path]


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    state = Receiver(failures=2)
    server = ThreadingHTTPServer(("127.0.0.1", 0), state.handler())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def store(redis_client: redis.Redis) -> KeyStore:
    """API keys made as `genq keys create` makes them."""
    return KeyStore(redis_client, DEFAULT_KEY_PREFIX)


def sdk(gateway: str, key: str) -> openai.OpenAI:
    """The openai SDK calling `gateway` with an API key, without retries."""
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=120)
