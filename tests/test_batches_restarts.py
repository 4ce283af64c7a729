"""A batch through a Redis crash (kill -9, append-only file on) and a graceful Redis restart, and
through a worker killed mid-batch: it completes with every line answered once. The test owns its
redis-server, worker and gateway: it restarts and kills them."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import redis

from tests.gateway_service import MODEL, TOKEN, GatewayProcess, service_env
from tests.service import plain_client
from worker.processes import RedisServer, WorkerProcess, wait_until

QUEUE = "genq-batch-restarts"
OPTIONS = {"cache_tokens": 8192, "page_size": 16, "concurrency": 8, "visibility_timeout": 10}
LINES = 16


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as running:
        yield running


def start_worker(model: Path, server: RedisServer, log: Path) -> WorkerProcess:
    """A worker, once its engine answers; a control reply cut by a Redis restart just before is asked again."""
    process = WorkerProcess(model, server.url, QUEUE, "batch-restarts", log, OPTIONS).start()
    client = plain_client(server.url)

    def ready() -> bool:
        process.check_alive()
        try:
            return process.engine_stats(client, timeout=0.5) is not None
        except redis.ConnectionError:
            return False

    wait_until(ready, 120, "the worker to load its engine")
    return process


def counts(client: openai.OpenAI, batch_id: str) -> int:
    """Lines answered so far; 0 while Redis is away (the gateway answers 503)."""
    try:
        return client.batches.retrieve(batch_id).request_counts.completed
    except openai.APIStatusError:
        return 0


def test_a_batch_completes_through_redis_restarts_and_a_killed_worker_with_every_line_once(
        tiny_model_factory: Callable[..., Path], server: RedisServer, tmp_path: Path):
    model = tiny_model_factory("llama", max_position_embeddings=1024)
    worker = start_worker(model, server, tmp_path / "worker.log")
    env = {**service_env(server.url), "GENQ_QUEUE": QUEUE, "GENQ_GATEWAY_TOKEN": TOKEN,
           "GENQ_GATEWAY_MODEL_NAME": MODEL, "GENQ_GATEWAY_FILES_DIR": str(tmp_path / "files"),
           "GENQ_GATEWAY_BATCH_POLL_S": "0.2", "GENQ_GATEWAY_BATCH_LEASE_S": "2",
           "GENQ_GATEWAY_BATCH_MAX_IN_FLIGHT": "4", "GENQ_GATEWAY_BATCH_RESEND_AFTER_S": "5"}
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": f"restart {i}", "max_tokens": 60, "ignore_eos": True}}
             for i in range(LINES)]
    try:
        with GatewayProcess(env, tmp_path / "gateway.log") as gateway:
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=TOKEN, max_retries=0, timeout=60)
            content = "".join(json.dumps(line) + "\n" for line in lines).encode()
            input_file = client.files.create(file=("restarts.jsonl", content), purpose="batch")
            batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/completions",
                                          completion_window="24h")
            wait_until(lambda: counts(client, batch.id) >= 2, 60, "two lines answered")
            server.restart(graceful=False)
            wait_until(lambda: counts(client, batch.id) >= 6, 90, "six lines answered after a Redis crash")
            server.restart(graceful=True)
            wait_until(lambda: counts(client, batch.id) >= 8, 90, "eight lines answered after a graceful restart")
            worker.signal(signal.SIGKILL)  # mid-line: its reserved lines come back after the visibility timeout
            worker.wait()
            worker = start_worker(model, server, tmp_path / "worker-2.log")
            deadline = time.monotonic() + 180
            while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
                assert time.monotonic() < deadline, f"still {done.status}: {done.request_counts}"
                time.sleep(0.2)
            assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", LINES, 0)
            assert done.output_file_id is not None
            answers = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
            gateway.check_alive()
    finally:
        worker.stop()
    assert sorted(answer["custom_id"] for answer in answers) == sorted(line["custom_id"] for line in lines)
    for answer in answers:
        assert answer["response"]["body"]["usage"]["completion_tokens"] == 60
