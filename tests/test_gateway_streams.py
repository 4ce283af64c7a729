"""One client must neither exhaust nor bloat the gateway (issue 23, items 2 and 7), against a real
`genq gateway` process on a real Redis; the events come from the worker's own Publisher, so a
test can publish exactly what it needs (a burst of large chunks, a final event) when it needs it.

- Many SSE streams share a few pub/sub connections, one subscription per task, and leave the
  command pool to submissions and health checks.
- Streams are capped per task and per client (429 naming the limit); OpenAI streams count.
- A reader that stops reading falls behind and gets a final `resume` event, or, if it takes
  nothing for the write timeout, is dropped; the gateway's memory comes back after they leave.
- Slow headers and slow bodies (slowloris) are cut off.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import ExitStack, aclosing, closing
from typing import Any

import anyio
import httpx
import psutil
import pytest
import redis

from producer.client import PUBSUB_CLIENT_NAME
from producer.gateway.sse import merged, with_keepalive
from producer.protocol import StreamEvent, channel_name
from tests.gateway_service import MODEL, TOKEN, GatewayProcess, Sse, bearer, service_env
from worker.processes import wait_until
from worker.publisher import Publisher

QUEUE = "genq-streams"
PUBSUB_CONNECTIONS = 2
BIG = "x" * 65536
"""A chunk's text: a burst of these fills a stalled reader's socket buffers (a few MiB on loopback)."""


def gateway_env(redis_url: str, **settings: object) -> dict[str, str]:
    return {**service_env(redis_url), "GENQ_QUEUE": QUEUE, "GENQ_GATEWAY_TOKEN": TOKEN,
            "GENQ_GATEWAY_MODEL_NAME": MODEL,
            **{f"GENQ_GATEWAY_{name.upper()}": str(value) for name, value in settings.items()}}


@pytest.fixture(scope="module")
def roomy(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """Caps above what the tests open, a small per-reader buffer, a write timeout no test reaches."""
    env = gateway_env(redis_url, max_streams_per_task=200, max_streams_per_client=400, stream_buffer_events=64,
                      pubsub_connections=PUBSUB_CONNECTIONS, write_timeout_s=300)
    with GatewayProcess(env, tmp_path_factory.mktemp("roomy") / "gateway.log") as gateway:
        yield gateway


@pytest.fixture(scope="module")
def strict(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """Small caps and one-second timeouts."""
    env = gateway_env(redis_url, max_streams_per_task=3, max_streams_per_client=5, header_timeout_s=1,
                      body_timeout_s=1, write_timeout_s=1)
    with GatewayProcess(env, tmp_path_factory.mktemp("strict") / "gateway.log") as gateway:
        yield gateway


@pytest.fixture(scope="module")
def admin(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


@pytest.fixture(scope="module")
def publisher(redis_url: str) -> Publisher:
    return Publisher(redis.Redis.from_url(redis_url), "genq", stream_maxlen=100_000, stream_ttl_s=600)


def new_task(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:12]}"


def chunk(task: str, seq: int, text: str = "tok") -> StreamEvent:
    return StreamEvent(id=task, seq=seq, attempt=1, event="chunk", text=text)


def started(task: str) -> StreamEvent:
    return StreamEvent(id=task, seq=0, attempt=1, event="started")


def done(task: str, seq: int) -> StreamEvent:
    return StreamEvent(id=task, seq=seq, attempt=1, event="done", text="", finish_reason="stop")


def subscribers(admin: redis.Redis, task: str) -> int:
    return int(dict(admin.pubsub_numsub(channel_name(task, "genq")))[channel_name(task, "genq")])


def gateway_pubsub_connections(admin: redis.Redis, gateway: GatewayProcess) -> int:
    """The gateway process's connections that follow streams (CLIENT LIST, matched by port)."""
    assert gateway.pid is not None
    ports = {conn.laddr.port for conn in psutil.Process(gateway.pid).net_connections("tcp") if conn.raddr}
    return sum(1 for client in admin.client_list() if client["name"] == PUBSUB_CLIENT_NAME
               and int(client["addr"].rsplit(":", 1)[1]) in ports)


def rss(gateway: GatewayProcess) -> int:
    assert gateway.pid is not None
    return psutil.Process(gateway.pid).memory_info().rss


def events_url(gateway: GatewayProcess, task: str) -> str:
    return f"{gateway.url}/v1/tasks/{task}/events"


def stalled_reader(gateway: GatewayProcess, task: str) -> socket.socket:
    """A raw connection that asks for the task's events and then reads nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1])))
    sock.sendall(f"GET /v1/tasks/{task}/events HTTP/1.1\r\nHost: gateway\r\n"
                 f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
    return sock


def read_until_closed_or(sock: socket.socket, end: bytes, timeout: float = 30) -> bytes:
    """Everything the server sends until `end` or until it closes the connection."""
    sock.settimeout(timeout)
    data = bytearray()
    try:
        while end not in data[-len(end) - 65536:]:
            received = sock.recv(1 << 20)
            if not received:
                break
            data += received
    except ConnectionResetError:
        pass
    return bytes(data)


def drop_lines(gateway: GatewayProcess, task: str) -> int:
    return gateway.log().count(f"a reader of {channel_name(task, 'genq')} fell behind")


class Reader(threading.Thread):
    """A well-behaved SSE reader in a thread: every message until the stream ends."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.messages: list[Sse] = []
        self.progress = threading.Condition()
        self.opened = threading.Event()

    def run(self) -> None:
        with httpx.stream("GET", self.url, headers=bearer(), timeout=60) as response:
            assert response.status_code == 200
            self.opened.set()
            fields: dict[str, str] = {}
            for line in response.iter_lines():
                if line and not line.startswith(":"):
                    name, _, value = line.partition(": ")
                    fields[name] = value
                elif not line and "data" in fields:
                    with self.progress:
                        self.messages.append(Sse(fields.get("id"), fields.get("event"), fields["data"]))
                        self.progress.notify_all()
                    fields = {}

    def wait_for(self, count: int) -> None:
        with self.progress:
            assert self.progress.wait_for(lambda: len(self.messages) >= count, 30), self.messages[-1:]


# --- (a) many streams, few connections -----------------------------------------------------


def test_150_streams_of_one_task_use_one_subscription_and_leave_room_for_other_requests(
    roomy: GatewayProcess, admin: redis.Redis, publisher: Publisher
):
    task = new_task("many")
    url = events_url(roomy, task)
    published = [started(task)] + [chunk(task, seq, f"t{seq}") for seq in range(1, 20)] + [done(task, 20)]

    async def follow_all() -> list[list[str]]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:

            async def follow(ready: asyncio.Event) -> list[str]:
                async with http.stream("GET", url, headers=bearer()) as response:
                    assert response.status_code == 200, await response.aread()
                    ids: list[str] = []
                    async for line in response.aiter_lines():
                        if line.startswith("id: "):
                            ids.append(line.removeprefix("id: "))
                            ready.set()
                    return ids

            ready = [asyncio.Event() for _ in range(150)]
            readers = [asyncio.create_task(follow(event)) for event in ready]
            publisher.publish(published[:1])
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in ready)), 60)
            # 150 streams are open (more than redis-py's default pool of 100): everything else still works.
            assert subscribers(admin, task) == 1
            assert 1 <= gateway_pubsub_connections(admin, roomy) <= PUBSUB_CONNECTIONS
            async with httpx.AsyncClient(timeout=30) as other:
                accepted = await other.post(f"{roomy.url}/v1/tasks", headers=bearer(),
                                            json={"prompt": "still room", "max_new_tokens": 2})
                assert accepted.status_code == 202, accepted.text
                assert (await other.get(f"{roomy.url}/healthz")).status_code == 200
                assert (await other.get(f"{roomy.url}/v1/tasks/{accepted.json()['id']}",
                                        headers=bearer())).status_code == 200
            publisher.publish(published[1:])
            return await asyncio.wait_for(asyncio.gather(*readers), 60)

    streams = asyncio.run(follow_all())
    expected = [f"1-{event.seq}" for event in published]
    assert all(ids == expected for ids in streams), [ids for ids in streams if ids != expected][:1]
    wait_until(lambda: subscribers(admin, task) == 0, 30, "the last reader to unsubscribe")


# --- (b) caps ---------------------------------------------------------------------------------


def test_streams_past_the_per_task_and_per_client_caps_get_a_429_naming_the_limit(
    strict: GatewayProcess, admin: redis.Redis
):
    first, second = new_task("capped"), new_task("capped")
    queued = admin.llen(QUEUE)
    with httpx.Client(timeout=30) as http, ExitStack() as open_streams:

        def open_stream(task: str, client: httpx.Client = http) -> httpx.Response:
            response = open_streams.enter_context(client.stream("GET", events_url(strict, task), headers=bearer()))
            if response.status_code != 200:
                response.read()
            return response

        assert [open_stream(first).status_code for _ in range(3)] == [200, 200, 200]
        refused = open_stream(first)
        assert refused.status_code == 429 and refused.headers["Retry-After"]
        assert refused.json()["error"]["code"] == "too_many_streams"
        assert "GENQ_GATEWAY_MAX_STREAMS_PER_TASK=3" in refused.json()["error"]["message"]

        assert [open_stream(second).status_code for _ in range(2)] == [200, 200]
        refused = open_stream(new_task("capped"))
        assert refused.status_code == 429
        assert "GENQ_GATEWAY_MAX_STREAMS_PER_CLIENT=5" in refused.json()["error"]["message"]
        # An OpenAI stream counts too, and is refused before anything is queued.
        completion = http.post(f"{strict.url}/v1/completions", headers=bearer(),
                               json={"model": MODEL, "prompt": "one more", "max_tokens": 2, "stream": True})
        assert completion.status_code == 429, completion.text
        assert "GENQ_GATEWAY_MAX_STREAMS_PER_CLIENT=5" in completion.json()["error"]["message"]
        assert admin.llen(QUEUE) == queued
        # Another client (the same token from another address) has its own budget.
        with httpx.Client(timeout=30, transport=httpx.HTTPTransport(local_address="127.0.0.2")) as elsewhere:
            assert open_stream(second, elsewhere).status_code == 200


def test_a_closed_stream_gives_its_slot_back(strict: GatewayProcess):
    """Streams closed as soon as they open, in rounds: each round's task must have all of its
    slots back (a stream whose first read went on after its client left kept its slot for good;
    rounds of 3 hit that within about 15 rounds)."""
    with httpx.Client(timeout=30) as http:
        for _ in range(40):
            task = new_task("slot")
            with ExitStack() as open_streams:
                for _ in range(3):
                    assert open_streams.enter_context(http.stream("GET", events_url(strict, task),
                                                                  headers=bearer())).status_code == 200

            def reopened(task: str = task) -> bool:
                with http.stream("GET", events_url(strict, task), headers=bearer()) as response:
                    return response.status_code == 200

            wait_until(reopened, 30, "a slot to be given back when its stream closed")


def test_a_task_that_fails_after_the_200_ends_its_openai_stream_with_an_error_chunk(
        roomy: GatewayProcess, publisher: Publisher):
    """The worker's error event becomes OpenAI's error object in the stream (code generation_failed,
    the worker's message), and the stream ends there."""
    chat = {"model": MODEL, "stream": True, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{roomy.url}/v1/chat/completions", headers=bearer(),
                                                     json=chat) as response:
        assert response.status_code == 200
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        task = json.loads(next(lines)[len("data: "):])["id"]  # the role chunk names the task
        publisher.publish([StreamEvent(id=task, seq=0, attempt=1, event="error", error="the worker broke",
                                       finish_reason="error")])
        rest = [line[len("data: "):] for line in lines]
    assert [json.loads(data)["error"] for data in rest] == [
        {"message": "the worker broke", "type": "server_error", "code": "generation_failed"}]


# --- (c) stalled readers -----------------------------------------------------------------------


def test_stalled_readers_fall_behind_get_a_resume_event_and_leave_no_memory_behind(
    roomy: GatewayProcess, admin: redis.Redis, publisher: Publisher
):
    task = new_task("stalled")
    baseline = rss(roomy)
    normal = Reader(events_url(roomy, task))
    normal.start()
    assert normal.opened.wait(30)
    stalled = [stalled_reader(roomy, task) for _ in range(20)]
    try:
        publisher.publish([started(task)])
        wait_until(lambda: subscribers(admin, task) == 1 and roomy.log().count("GET /v1/tasks/" + task) >= 21, 30,
                   "every reader to be served")
        seq = 0
        # In step with the normal reader, until a few MiB have filled the stalled readers' socket
        # buffers and their own buffers (64 events) overflowed.
        while drop_lines(roomy, task) < len(stalled) and seq < 400:
            seq += 1
            publisher.publish([chunk(task, seq, BIG)])
            normal.wait_for(seq + 1)
        wait_until(lambda: drop_lines(roomy, task) >= len(stalled), 60, "the stalled readers to fall behind")
        publisher.publish([done(task, seq + 1)])
        normal.join(60)
        assert [m.id for m in normal.messages] == [f"1-{n}" for n in range(seq + 2)]
        assert normal.messages[-1].event == "done" and all(json.loads(m.data)["text"] == BIG
                                                          for m in normal.messages[1:-1])
        for sock in stalled:
            received = read_until_closed_or(sock, b"\r\n0\r\n\r\n")
            # The last message, alone in the last chunk and without an id: line.
            before, resume_message, after = received.rpartition(b"event: resume\ndata: ")
            assert resume_message and before.endswith(b"\r\n"), received[-300:]
            data, _, rest = after.partition(b"\n")
            assert rest == b"\n\r\n0\r\n\r\n"
            resume = json.loads(data)
            assert resume["last_event_id"].startswith("1-") and "Last-Event-ID" in resume["error"]
    finally:
        for sock in stalled:
            sock.close()
    wait_until(lambda: subscribers(admin, task) == 0, 30, "every reader to leave")
    grown = rss(roomy) - baseline
    assert grown < 32 * 2**20, f"the gateway kept {grown / 2**20:.0f} MiB after its stalled readers left"


def test_a_reader_that_takes_nothing_for_the_write_timeout_is_dropped(
    strict: GatewayProcess, admin: redis.Redis, publisher: Publisher
):
    task = new_task("write-timeout")
    sock = stalled_reader(strict, task)
    port = sock.getsockname()[1]
    with closing(sock):
        wait_until(lambda: subscribers(admin, task) == 1, 30, "the reader to subscribe")
        publisher.publish([started(task)])
        closed = f"closing the connection of 127.0.0.1:{port}: it took nothing of the response"
        seq, deadline = 0, time.monotonic() + 60  # fill the socket buffers until the write blocks past the timeout
        while closed not in strict.log() and time.monotonic() < deadline:
            seq += 1
            publisher.publish([chunk(task, seq, BIG)])
            time.sleep(0.02)
        assert closed in strict.log()
        received = read_until_closed_or(sock, b"\r\n0\r\n\r\n")
        assert b"event: resume" not in received and not received.endswith(b"\r\n0\r\n\r\n")
    wait_until(lambda: subscribers(admin, task) == 0, 30, "the dropped reader to unsubscribe")


SOURCES: dict[str, tuple[Callable[[AsyncGenerator[int, None]], AsyncGenerator[Any, None]], Any]] = {
    "alone": (lambda source: source, 1),
    "one merged source": (lambda source: merged([source]), (0, 1)),
}
"""How a stream reads its source (a one-prompt completions stream: merged over one), and what
its first item then is."""


@pytest.mark.parametrize("reading", SOURCES)
def test_a_stream_cancelled_as_its_read_finishes_closes_its_source(reading: str):
    """Starlette cancels a stream's task group when its client leaves (a dropped stalled reader),
    and anyio cancels every later await in that group again. If the read of the next event had
    just finished, the source (the task's events and their subscription) is suspended at a yield:
    with_keepalive's cleanup must still close it, not stop at its first await."""
    wrap, first = SOURCES[reading]
    closed: list[bool] = []

    async def stream() -> None:
        async with anyio.create_task_group() as group:

            async def source() -> AsyncGenerator[int, None]:
                try:
                    yield 1
                    group.cancel_scope.cancel()  # the client leaves while this read finishes
                    yield 2
                finally:
                    closed.append(True)

            async with aclosing(with_keepalive(wrap(source()), 60)) as items:
                assert await anext(items) == first
                try:
                    await anext(items)
                finally:
                    assert closed, "the source was left open"

    asyncio.run(stream())


@pytest.mark.parametrize("reading", SOURCES)
def test_a_read_that_drops_a_cancellation_is_cancelled_again_when_its_stream_closes(reading: str):
    """Python 3.11's asyncio.wait_for (redis-py's socket writes use it) returns the inner
    result and drops a cancellation that arrives as the inner work completes: the gateway saw
    a task's first replay read go on after its client left, wait for live events, and hold its
    stream's slot for good. Closing the stream must cancel the read until it ends."""
    closed: list[bool] = []

    async def stream() -> None:
        async def source() -> AsyncGenerator[int, None]:
            try:
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    pass  # what asyncio.wait_for does when the inner work had just finished
                await asyncio.sleep(60)  # the next await: cancelled only by a second cancellation
                yield 1
            finally:
                closed.append(True)

        items = with_keepalive(SOURCES[reading][0](source()), 0.01)
        assert await anext(items) is None  # a keep-alive: the read is pending
        async with asyncio.timeout(10):
            await items.aclose()
        assert closed, "the source was left open"

    asyncio.run(stream())


# --- (d) slow requests -------------------------------------------------------------------------


def test_connections_sending_their_headers_slowly_are_closed_after_the_header_timeout(strict: GatewayProcess):
    address = ("127.0.0.1", int(strict.url.rsplit(":", 1)[1]))
    slow = [socket.create_connection(address) for _ in range(30)]
    begun = time.monotonic()
    try:
        for sock in slow:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n")
        dribbler = slow[0]
        dribbler.setblocking(False)
        answer = b""
        while time.monotonic() - begun < 15:  # a header byte every 50 ms, as slowloris sends them
            try:
                dribbler.sendall(b"X")
                answer += dribbler.recv(4096)
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                break
            if answer:
                break
            time.sleep(0.05)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"GENQ_GATEWAY_HEADER_TIMEOUT_S" in answer
        for sock in slow[1:]:
            assert read_until_closed_or(sock, b"\r\n\r\nX", timeout=15).startswith(b"HTTP/1.1 408")
        assert time.monotonic() - begun < 15  # the timeout is 1 s: all 30 are gone well before this
    finally:
        for sock in slow:
            sock.close()
    assert httpx.get(f"{strict.url}/healthz", timeout=10).status_code == 200


def test_a_request_body_sent_too_slowly_is_cut_off(strict: GatewayProcess):
    with closing(socket.create_connection(("127.0.0.1", int(strict.url.rsplit(":", 1)[1])))) as sock:
        sock.sendall(f"POST /v1/tasks HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {TOKEN}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":".encode())
        assert read_until_closed_or(sock, b"\r\n\r\nX", timeout=15) == b""
    assert "its request body took longer than 1 s" in strict.log()

