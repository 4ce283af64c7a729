"""A worker on a Redis that restarts (kill -9 and graceful, append-only file
on) keeps serving and runs nothing twice; a request lost by the broker is sent
again by the producer's watchdog; a Redis without persistence is warned about
(issue 17, cases 3, 4, 5, 7); the gateway and the client reconnect too
(issue 14). Each test owns its redis-server: they restart it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from celery import states

from producer.client import GenqClient
from producer.protocol import TASK_NAME, StreamEvent
from producer.watchdog import Watchdog
from tests.gateway_service import MODEL, TOKEN, GatewayProcess, bearer, service_env
from tests.service import plain_client, replay
from worker.bootsteps import EXIT_MODEL_UNUSABLE
from worker.processes import RedisServer, WorkerProcess, wait_until
from worker.publisher import Publisher

QUEUE = "genq-restarts"
OPTIONS = {"cache_tokens": 8192, "page_size": 16, "concurrency": 32, "visibility_timeout": 30}


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", max_position_embeddings=1024)


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as running:
        yield running


@pytest.fixture()
def worker(model: Path, server: RedisServer, tmp_path: Path) -> Iterator[WorkerProcess]:
    process = WorkerProcess(model, server.url, QUEUE, "restarts", tmp_path / "worker.log", OPTIONS)
    process.start().wait_ready(plain_client(server.url))
    yield process
    process.stop()


def finals(events: list[StreamEvent]) -> list[StreamEvent]:
    return [e for e in events if e.is_terminal]


def test_the_worker_carries_on_through_a_redis_crash_and_a_graceful_restart(
    worker: WorkerProcess, server: RedisServer
):
    client = plain_client(server.url)
    handles = [client.send_task(TASK_NAME, kwargs={"prompt": f"restart {i}", "max_new_tokens": 120,
                                                   "ignore_eos": True, "identifier": f"restart-{i}"},
                                task_id=f"restart-{i}", queue=QUEUE) for i in range(12)]
    wait_until(lambda: (worker.engine_stats(client) or {}).get("generated_tokens", 0) >= 24, 60, "generation")
    server.restart(graceful=False)
    wait_until(lambda: worker.ping(client), 60, "the worker to answer ping after a Redis crash")
    server.restart(graceful=True)
    wait_until(lambda: worker.ping(client), 60, "the worker to answer ping after a graceful Redis restart")
    results = [handle.get(timeout=180) for handle in handles]
    worker.check_alive()
    assert all(r["usage"]["completion_tokens"] == 120 for r in results)
    check = redis.Redis.from_url(server.url)
    for i in range(12):
        events = replay(check, f"restart-{i}")
        assert len(finals(events)) == 1 and events[-1].is_terminal, [e.event for e in events]
    log = worker.log_path.read_text()
    assert "Connection to broker lost" in log  # the restarts did reach the worker


def test_the_gateway_and_the_client_carry_on_through_a_redis_crash_and_a_graceful_restart(
    worker: WorkerProcess, server: RedisServer, tmp_path: Path
):
    env = {**service_env(server.url), "GENQ_QUEUE": QUEUE, "GENQ_GATEWAY_TOKEN": TOKEN,
           "GENQ_GATEWAY_MODEL_NAME": MODEL}
    gateway = GatewayProcess(env, tmp_path / "gateway.log").start()
    oai = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    try:
        with GenqClient(server.url, queue=QUEUE) as client:
            for round_, graceful in enumerate([None, False, True]):
                if graceful is not None:
                    server.restart(graceful=graceful)
                # The same client and gateway, on connections the restart cut.
                request = {"prompt": f"client {round_}", "max_new_tokens": 8, "ignore_eos": True}
                result = client.submit(request).result(timeout=120)
                assert result.usage.completion_tokens == 8
                completion = oai.completions.create(model=MODEL, prompt=f"gateway {round_}", max_tokens=8,
                                                    extra_body={"ignore_eos": True})
                assert completion.usage.completion_tokens == 8
                gateway.check_alive()
            # While Redis is down: a 503 the caller may retry, in the gateway's one error shape, never a 500.
            server.stop()
            down = httpx.post(f"{gateway.url}/v1/completions", headers=bearer(), timeout=60,
                              json={"model": MODEL, "prompt": "down", "max_tokens": 2})
            assert down.status_code == 503 and down.headers["Retry-After"], down.text
            assert down.json()["error"]["code"] == "redis_unavailable"
            server.start()
            assert oai.completions.create(model=MODEL, prompt="back", max_tokens=2).choices[0].finish_reason
            gateway.check_alive()
    finally:
        gateway.stop()
    worker.check_alive()


@pytest.mark.parametrize("fails", [False, True], ids=["succeeded", "failed"])
def test_a_task_whose_result_is_stored_is_not_run_again(worker: WorkerProcess, server: RedisServer, fails: bool):
    """Celery keeps a stored SUCCESS from being overwritten, not a FAILURE: a failed task
    delivered again (as when its acknowledgement is lost to a Redis restart) must not run again
    and publish a second final event either (the chaos run's hostile mix found it)."""
    client = plain_client(server.url)
    identifier = "failed-once" if fails else "once"
    # 30,000 tokens are valid in the protocol and past the model's context: the worker refuses it.
    kwargs = {"prompt": "only once", "max_new_tokens": 30_000 if fails else 8, "identifier": identifier}
    first = client.send_task(TASK_NAME, kwargs=kwargs, task_id=identifier, queue=QUEUE)
    first.get(timeout=60, propagate=False)
    assert first.state == (states.FAILURE if fails else states.SUCCESS)
    client.send_task(TASK_NAME, kwargs=kwargs, task_id=identifier, queue=QUEUE)
    wait_until(lambda: f"task {identifier} delivered again after its result was stored" in
               worker.log_path.read_text(), 60, "the worker to skip the second delivery")
    check = redis.Redis.from_url(server.url)
    events = replay(check, identifier)
    assert [(e.attempt, e.event) for e in finals(events)] == [(1, "error" if fails else "done")]
    assert check.get(f"genq:attempt:{identifier}") == b"1"
    assert client.AsyncResult(identifier).state == first.state


def test_the_watchdog_resends_lost_and_abandoned_requests_and_leaves_running_ones_alone(
    worker: WorkerProcess, server: RedisServer
):
    client = plain_client(server.url)
    check = redis.Redis.from_url(server.url)
    watchdog = Watchdog(client, check, after_s=0)
    # Lost: tracked as sent, but its message never reached Redis (as when a pop is lost).
    lost = {"prompt": "lost", "max_new_tokens": 8, "identifier": "lost-1"}
    watchdog.track("lost-1", lost, QUEUE)
    # Abandoned: what a worker killed mid-run leaves when Redis then loses the unacknowledged
    # message: a STARTED state, no lease, no new events.
    ghost = {"prompt": "ghost", "max_new_tokens": 8, "identifier": "ghost-1"}
    client.backend.store_result("ghost-1", {"pid": 0, "hostname": "gone"}, states.STARTED)
    watchdog.track("ghost-1", ghost, QUEUE)
    # Running: a long generation whose worker holds its lease.
    running = {"prompt": "running", "max_new_tokens": 400, "ignore_eos": True, "identifier": "running-1"}
    handle = client.send_task(TASK_NAME, kwargs=running, task_id="running-1", queue=QUEUE)
    watchdog.track("running-1", running, QUEUE)
    wait_until(lambda: len(replay(check, "running-1")) >= 2, 60, "running-1 to stream")
    assert watchdog.check() == ["lost-1"]  # the ghost's STARTED state counts as progress once
    second = watchdog.check()  # (lost-1 may go again: after_s is 0 and its resend may still be queued)
    assert "ghost-1" in second and "running-1" not in second
    assert handle.get(timeout=120)["usage"]["completion_tokens"] == 400
    for task_id in ("lost-1", "ghost-1"):
        assert client.AsyncResult(task_id).get(timeout=60)["id"] == task_id
    watchdog.check()
    assert watchdog.tracked == {}
    assert [e.attempt for e in finals(replay(check, "running-1"))] == [1]


def test_the_worker_warns_at_start_when_redis_has_no_persistence(model: Path, tmp_path: Path):
    with RedisServer(tmp_path / "volatile", persistence="none") as volatile:
        process = WorkerProcess(model, volatile.url, QUEUE, "volatile", tmp_path / "volatile.log", OPTIONS)
        process.start().wait_ready(plain_client(volatile.url))
        process.stop()
    assert "REDIS HAS NO PERSISTENCE" in process.log_path.read_text()


def test_the_worker_on_a_durable_redis_does_not_warn(worker: WorkerProcess):
    assert "REDIS HAS NO PERSISTENCE" not in worker.log_path.read_text()


@pytest.mark.parametrize("damage", ["empty-config", "truncated-gguf"])
def test_a_worker_that_cannot_load_its_model_says_why_in_one_line_and_exits_non_zero(
    damage: str, server: RedisServer, smollm2_gguf: Path, tmp_path: Path
):
    if damage == "empty-config":
        broken = tmp_path / "broken-model"
        broken.mkdir()
        (broken / "config.json").write_text("{}")
    else:
        broken = tmp_path / "broken.gguf"
        with smollm2_gguf.open("rb") as whole:
            broken.write_bytes(whole.read(5_000_000))
    process = WorkerProcess(broken, server.url, QUEUE, "broken", tmp_path / "broken.log", OPTIONS)
    assert process.start().wait(120) == EXIT_MODEL_UNUSABLE
    log = process.log_path.read_text()
    assert "CRITICAL worker.bootsteps: cannot load the model:" in log and "Traceback" not in log, log
    if damage == "truncated-gguf":
        assert f"{broken} is truncated or corrupt" in log



def test_a_client_with_a_watchdog_resends_what_the_broker_lost(
    worker: WorkerProcess, server: RedisServer, monkeypatch: pytest.MonkeyPatch
):
    celery = plain_client(server.url)
    check = redis.Redis.from_url(server.url)
    # A queue the worker does not consume yet, so the message surely waits there to be lost
    # (stopping a consumer can race a pop already in flight).
    lost_queue = f"{QUEUE}-lost"
    monkeypatch.setenv("GENQ_WATCHDOG_AFTER_S", "1")
    with GenqClient(server.url, queue=lost_queue) as client:
        handle = client.submit({"prompt": "lost in the broker", "max_new_tokens": 8, "identifier": "dropped-1"})
        assert check.delete(lost_queue) == 1  # the message is gone, as when a pop is lost
        replies = celery.control.add_consumer(lost_queue, destination=[worker.node], reply=True, timeout=30,
                                              limit=1)
        assert any(worker.node in reply for reply in replies), replies
        result = handle.result(timeout=60)
        assert result.usage.completion_tokens == 8 and client.watchdog is not None
        assert client.watchdog.resent == 1


def test_a_publish_resent_after_a_dropped_reply_adds_each_event_once(server: RedisServer):
    """The chaos run's duplicate: Redis applied a step's pipeline, died before replying, and the
    publisher resent it. The replay stream must still hold each event once, and the next step's
    events must still be added after it."""
    publisher = Publisher(redis.Redis.from_url(server.url), "genq", stream_maxlen=1000, stream_ttl_s=60)
    first = [StreamEvent(id="r", seq=0, attempt=1, event="started"),
             StreamEvent(id="r", seq=1, attempt=1, event="chunk", text="a")]
    publisher.publish(first)
    publisher.publish(first)
    publisher.publish([StreamEvent(id="r", seq=2, attempt=1, event="done", text="a", finish_reason="stop")])
    publisher.publish([StreamEvent(id="r", seq=0, attempt=2, event="started")])
    events = replay(redis.Redis.from_url(server.url), "r")
    assert [(e.attempt, e.seq) for e in events] == [(1, 0), (1, 1), (1, 2), (2, 0)]
