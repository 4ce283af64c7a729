"""The OpenAI Batch API end to end: the `openai` SDK's own calls (files.create, batches.create,
batches.retrieve polled, files.content, batches.cancel) against a real gateway, a real worker of
the tiny model and a real callback worker, on the session's Redis."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from fastapi.testclient import TestClient
from openai.types import Batch

from producer.client import GenqClient
from producer.gateway import GatewaySettings, create_app
from producer.signing import verify
from tests.gateway_service import MODEL, QUEUE, SECRET, TOKEN, GatewayProcess, Receiver, bearer, service_env
from worker.processes import WorkerProcess

MAX_LINES = 200
MAX_LINE_BYTES = 4096


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batch-files")


def batch_env(files_dir: Path, **more: str) -> dict[str, str]:
    return {"GENQ_GATEWAY_FILES_DIR": str(files_dir), "GENQ_GATEWAY_BATCH_MAX_LINES": str(MAX_LINES),
            "GENQ_GATEWAY_BATCH_MAX_LINE_BYTES": str(MAX_LINE_BYTES), "GENQ_GATEWAY_BATCH_POLL_S": "0.2",
            "GENQ_GATEWAY_BATCH_LEASE_S": "2", "GENQ_GATEWAY_BATCH_MAX_IN_FLIGHT": "4", **more}


@pytest.fixture(scope="module")
def gateway(worker: WorkerProcess, module_gateway: Callable[..., GatewayProcess], files_dir: Path) -> str:
    return module_gateway(QUEUE, "batch-gateway", **batch_env(files_dir)).url


@pytest.fixture(scope="module")
def oai(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=TOKEN, max_retries=0, timeout=60)


def chat_line(custom_id: str, text: str, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                     "temperature": 0, **body}}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


ENDED = frozenset({"completed", "failed", "expired", "cancelled"})
"""OpenAI's final batch statuses."""


def wait_for(oai: openai.OpenAI, batch_id: str, statuses: set[str] | frozenset[str], timeout: float = 180) -> Batch:
    """Poll batches.retrieve, as a client of the Batch API does, until the batch reaches a status."""
    deadline = time.monotonic() + timeout
    while True:
        batch = oai.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)


def output_lines(oai: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(line) for line in oai.files.content(file_id).text.splitlines()]


def attempts(genq: GenqClient, batch_id: str, count: int) -> list[int]:
    """The attempt each line's task ended on: 1 when no line ran twice."""
    return [genq.handle(f"{batch_id}-{index}").result(timeout=5).attempt for index in range(count)]


# --- files ---------------------------------------------------------------------------------


def test_files_create_retrieve_list_content_delete(oai: openai.OpenAI):
    content = jsonl([chat_line("a", "hello"), chat_line("b", "world")])
    created = oai.files.create(file=("requests.jsonl", content), purpose="batch")
    assert (created.object, created.purpose, created.bytes, created.filename) == (
        "file", "batch", len(content), "requests.jsonl")
    assert created.expires_at is not None and created.expires_at > created.created_at
    assert oai.files.retrieve(created.id) == created
    assert created.id in [file.id for file in oai.files.list()]
    assert oai.files.content(created.id).content == content
    deleted = oai.files.delete(created.id)
    assert (deleted.id, deleted.deleted) == (created.id, True)
    with pytest.raises(openai.NotFoundError):
        oai.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        oai.files.content(created.id)


@pytest.mark.parametrize(("content", "expected"), [
    (jsonl([chat_line("a", "x"), chat_line("a", "y")]), "line 2: custom_id 'a' is already used on line 1"),
    (jsonl([chat_line("a", "x")]) + b"{not json\n", "line 2: not JSON"),
    (jsonl([chat_line("a", "x"), {**chat_line("b", "y"), "url": "/v1/embeddings"}]), "line 2: url must be one of"),
    (jsonl([{**chat_line("a", "x"), "method": "GET"}]), "line 1: method must be 'POST'"),
    (jsonl([{**chat_line("a", "x"), "extra": 1}]), "line 1: unknown keys 'extra'"),
    (jsonl([chat_line(f"c{i}", "x") for i in range(MAX_LINES + 1)]),
     f"{MAX_LINES + 1} lines, more than GENQ_GATEWAY_BATCH_MAX_LINES ({MAX_LINES})"),
    (jsonl([chat_line("a", "x"), chat_line("b", "y" * MAX_LINE_BYTES)]),
     f"line 2: {len(json.dumps(chat_line('b', 'y' * MAX_LINE_BYTES)))} bytes, more than "
     f"GENQ_GATEWAY_BATCH_MAX_LINE_BYTES ({MAX_LINE_BYTES})"),
    (b"", "the file is empty"),
], ids=["duplicate-id", "not-json", "url", "method", "unknown-key", "too-many-lines", "long-line", "empty"])
def test_an_invalid_input_file_is_refused_naming_the_line_and_the_limit(oai: openai.OpenAI, content: bytes,
                                                                         expected: str):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.files.create(file=("bad.jsonl", content), purpose="batch")
    assert expected in refused.value.body["message"]  # type: ignore[index]
    assert refused.value.body["param"] == "file"  # type: ignore[index]


def test_an_upload_for_another_purpose_is_refused_naming_purpose(oai: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.files.create(file=("a.jsonl", jsonl([chat_line("a", "x")])), purpose="fine-tune")
    assert refused.value.body["param"] == "purpose"  # type: ignore[index]


# --- batches -------------------------------------------------------------------------------


def test_a_batch_of_twenty_chat_lines_answers_every_line_exactly_once_and_calls_its_webhook(
        oai: openai.OpenAI, genq: GenqClient, callback_worker: Any, receiver: tuple[Receiver, str]):
    state, url = receiver
    lines = [chat_line(f"req-{i}", f"question {i}") for i in range(20)]
    input_file = oai.files.create(file=("twenty.jsonl", jsonl(lines)), purpose="batch")
    batch = oai.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions",
                               completion_window="24h", metadata={"genq_webhook_url": f"{url}/batch-done"})
    assert (batch.status, batch.request_counts.total, batch.input_file_id) == ("validating", 20, input_file.id)
    done = wait_for(oai, batch.id, ENDED)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (20, 20, 0)
    assert done.error_file_id is None and done.in_progress_at and done.finalizing_at and done.completed_at
    answers = output_lines(oai, done.output_file_id)
    assert sorted(answer["custom_id"] for answer in answers) == sorted(line["custom_id"] for line in lines)
    for answer in answers:
        index = int(answer["custom_id"].removeprefix("req-"))
        assert answer["error"] is None and answer["response"]["status_code"] == 200
        assert answer["response"]["request_id"] == f"{batch.id}-{index}"
        body = answer["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] <= 4
    assert attempts(genq, batch.id, 20) == [1] * 20
    (headers, raw), *_ = state.wait("/batch-done", 3)[-1:]  # two 500s, then delivered
    assert verify(SECRET, raw, headers["X-Genq-Timestamp"], headers["X-Genq-Signature"], window_s=300)
    assert (headers["X-Genq-Event"], headers["X-Genq-Delivery"]) == ("batch.completed", f"{batch.id}-webhook")
    delivered = json.loads(raw)
    assert (delivered["id"], delivered["event"]) == (batch.id, "batch.completed")
    assert delivered["batch"]["status"] == "completed"
    assert delivered["batch"]["output_file_id"] == done.output_file_id
    assert oai.batches.retrieve(batch.id).id in [b.id for b in oai.batches.list(limit=100)]


def test_a_completions_batch_answers_good_lines_and_puts_refused_ones_in_the_error_file(oai: openai.OpenAI):
    def line(custom_id: str, **body: Any) -> dict[str, Any]:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                "body": {"model": MODEL, "max_tokens": 3, "temperature": 0, **body}}

    lines = [line("good", prompt="once upon"), line("two-prompts", prompt=["a", "b"]),
             line("bad-max", prompt="x", max_tokens=0)]
    input_file = oai.files.create(file=("completions.jsonl", jsonl(lines)), purpose="batch")
    batch = oai.batches.create(input_file_id=input_file.id, endpoint="/v1/completions", completion_window="24h")
    done = wait_for(oai, batch.id, ENDED)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 1, 2)
    [good] = output_lines(oai, done.output_file_id)
    assert good["custom_id"] == "good" and good["response"]["body"]["object"] == "text_completion"
    errors = {answer["custom_id"]: answer["response"] for answer in output_lines(oai, done.error_file_id)}
    assert errors["two-prompts"]["status_code"] == 400
    assert errors["two-prompts"]["body"]["error"]["param"] == "prompt"
    assert errors["bad-max"]["status_code"] == 400
    assert errors["bad-max"]["body"]["error"]["param"] == "max_tokens"


def test_cancel_stops_a_batch_with_only_the_lines_it_answered(oai: openai.OpenAI):
    lines = [chat_line(f"long-{i}", "tell me everything", max_tokens=600, ignore_eos=True) for i in range(20)]
    input_file = oai.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    batch = oai.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    wait_for(oai, batch.id, {"in_progress"}, timeout=30)
    cancelling = oai.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_for(oai, batch.id, {"cancelled"}, timeout=120)
    assert done.cancelling_at is not None and done.cancelled_at is not None
    counts = done.request_counts
    assert counts.total == 20 and counts.completed + counts.failed < 20  # at most 4 lines were ever queued
    errors = output_lines(oai, done.error_file_id) if done.error_file_id else []
    assert all(answer["error"]["code"] == "batch_cancelled" for answer in errors)
    assert len(errors) == counts.failed


def test_a_completed_batch_cannot_be_cancelled(oai: openai.OpenAI):
    input_file = oai.files.create(file=("one.jsonl", jsonl([chat_line("one", "hi")])), purpose="batch")
    batch = oai.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    wait_for(oai, batch.id, {"completed"})
    with pytest.raises(openai.ConflictError) as refused:
        oai.batches.cancel(batch.id)
    assert refused.value.code == "batch_not_cancellable"
    assert oai.batches.retrieve(batch.id).status == "completed"


@pytest.mark.parametrize(("create", "status", "param", "expected"), [
    ({"endpoint": "/v1/completions"}, 400, "input_file_id", "line 1: url /v1/chat/completions differs from the "
                                                            "batch's endpoint /v1/completions"),
    ({"input_file_id": "file-doesnotexist"}, 404, "input_file_id", "no file 'file-doesnotexist'"),
    ({"completion_window": "1h"}, 400, "completion_window", "completion_window"),
    ({"metadata": {"genq_webhook_url": "ftp://example.com/x"}}, 400, "metadata.genq_webhook_url",
     "metadata.genq_webhook_url: must be an http(s) URL"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata", "metadata"),
], ids=["endpoint-mismatch", "unknown-file", "window", "webhook-url", "metadata-keys"])
def test_an_invalid_batch_is_refused_naming_the_field(oai: openai.OpenAI, gateway: str, create: dict[str, Any],
                                                      status: int, param: str, expected: str):
    input_file = oai.files.create(file=("ok.jsonl", jsonl([chat_line("a", "x")])), purpose="batch")
    body = {"input_file_id": input_file.id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
            **create}
    response = httpx.post(f"{gateway}/v1/batches", json=body, headers=bearer(), timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and expected in error["message"]


def test_a_batch_survives_its_gateway_being_killed_with_no_line_run_twice(
        worker: WorkerProcess, genq: GenqClient, redis_url: str, files_dir: Path,
        tmp_path_factory: pytest.TempPathFactory):
    env = {**service_env(redis_url), "GENQ_GATEWAY_TOKEN": TOKEN, "GENQ_GATEWAY_MODEL_NAME": MODEL,
           **batch_env(files_dir)}
    lines = [chat_line(f"r-{i}", f"restart {i}", max_tokens=24, ignore_eos=True) for i in range(20)]
    first = GatewayProcess(env, tmp_path_factory.mktemp("first") / "gateway.log").start()
    try:
        client = openai.OpenAI(base_url=f"{first.url}/v1", api_key=TOKEN, max_retries=0, timeout=60)
        input_file = client.files.create(file=("restart.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < 2:
            assert time.monotonic() < deadline, "no line answered within 60 s"
            time.sleep(0.1)
    finally:
        first.kill()
        first.wait()
    with GatewayProcess(env, tmp_path_factory.mktemp("second") / "gateway.log") as second:
        client = openai.OpenAI(base_url=f"{second.url}/v1", api_key=TOKEN, max_retries=0, timeout=60)
        done = wait_for(client, batch.id, ENDED)
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 20, 0)
        answers = output_lines(client, done.output_file_id)
    assert sorted(answer["custom_id"] for answer in answers) == sorted(line["custom_id"] for line in lines)
    assert attempts(genq, batch.id, 20) == [1] * 20


def test_an_upload_past_the_file_limit_is_413_and_without_a_files_directory_the_apis_answer_503(
        worker: WorkerProcess, module_gateway: Callable[..., GatewayProcess]):
    url = module_gateway(QUEUE, "no-files-gateway", GENQ_GATEWAY_FILE_MAX_BYTES="2048").url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=30)
    big = jsonl([chat_line(f"id-{i}", "x" * 100) for i in range(500)])  # past 2048 + MULTIPART_OVERHEAD_BYTES
    with pytest.raises(openai.APIStatusError) as refused:
        client.files.create(file=("big.jsonl", big), purpose="batch")
    assert refused.value.status_code == 413
    assert "GENQ_GATEWAY_FILE_MAX_BYTES" in refused.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.APIStatusError) as unavailable:
        client.files.create(file=("small.jsonl", jsonl([chat_line("a", "x")])), purpose="batch")
    assert unavailable.value.status_code == 503
    assert "GENQ_GATEWAY_FILES_DIR" in unavailable.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.APIStatusError) as listing:
        client.batches.list()
    assert listing.value.status_code == 503


def test_batch_lines_are_queued_at_the_batch_priority_with_the_window_as_deadline_and_the_line_ids(
        redis_url: str, tmp_path: Path):
    """On a queue no worker consumes, the messages a batch's driver sends are read back from the
    broker: kombu's list of priority 9, at most GENQ_GATEWAY_BATCH_MAX_IN_FLIGHT of them."""
    queue = f"genq-unconsumed-{uuid.uuid4().hex[:8]}"
    settings = GatewaySettings(token=TOKEN, redis_url=redis_url, queue=queue, key_prefix=f"p{uuid.uuid4().hex[:8]}",
                               files_dir=tmp_path, batch_poll_s=0.1, batch_max_in_flight=3)
    broker = redis.Redis.from_url(redis_url)
    lowest = f"{queue}\x06\x169"
    try:
        with TestClient(create_app(settings)) as client:
            upload = client.post("/v1/files", headers=bearer(), data={"purpose": "batch"},
                                 files={"file": ("five.jsonl", jsonl([chat_line(f"p{i}", "x") for i in range(5)]))})
            assert upload.status_code == 200, upload.text
            created = client.post("/v1/batches", headers=bearer(), json={
                "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
            batch = created.json()
            deadline = time.monotonic() + 30
            while broker.llen(lowest) < 3:
                assert time.monotonic() < deadline, "the batch's first lines were not queued within 30 s"
                time.sleep(0.05)
            messages = [json.loads(raw) for raw in broker.lrange(lowest, 0, -1)]
            assert client.post(f"/v1/batches/{batch['id']}/cancel", headers=bearer()).json()["status"] == "cancelling"
        assert broker.llen(queue) == 0  # nothing at the default (interactive) priority
        assert sorted(message["headers"]["id"] for message in messages) == [f"{batch['id']}-{i}" for i in range(3)]
        for message in messages:
            assert message["properties"]["priority"] == 9
            _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
            assert (kwargs["priority"], kwargs["deadline"]) == (9, batch["expires_at"])
            assert batch["expires_at"] - batch["created_at"] == 24 * 3600
    finally:
        broker.delete(queue, *(f"{queue}\x06\x16{level}" for level in range(1, 10)))


def test_a_batch_past_its_window_expires_with_its_unanswered_lines_in_the_error_file(
        oai: openai.OpenAI, redis_url: str):
    """The window's end, brought forward in the batch's record (the one 24 h window is too long
    to wait for): the driver cancels the lines in flight and answers the rest batch_expired."""
    lines = [chat_line(f"late-{i}", "go on", max_tokens=600, ignore_eos=True) for i in range(10)]
    input_file = oai.files.create(file=("late.jsonl", jsonl(lines)), purpose="batch")
    batch = oai.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    wait_for(oai, batch.id, {"in_progress"}, timeout=30)
    record = redis.Redis.from_url(redis_url, decode_responses=True)
    fixed = json.loads(record.hget(f"genq:batch:{batch.id}", "fixed"))  # type: ignore[arg-type]
    record.hset(f"genq:batch:{batch.id}", "fixed", json.dumps({**fixed, "expires_at": int(time.time())}))
    done = wait_for(oai, batch.id, {"expired", "completed"}, timeout=120)
    assert done.status == "expired" and done.expired_at is not None
    assert done.request_counts.completed + done.request_counts.failed == 10
    errors = output_lines(oai, done.error_file_id)
    assert len(errors) == done.request_counts.failed >= 6  # at most 4 lines were queued before the end
    assert {answer["error"]["code"] for answer in errors} == {"batch_expired"}
    answered = [answer["custom_id"] for answer in errors]
    if done.output_file_id is not None:
        answered += [answer["custom_id"] for answer in output_lines(oai, done.output_file_id)]
    assert sorted(answered) == sorted(line["custom_id"] for line in lines)


BESIDE_BATCH_BOUND = 3
"""How much slower an interactive chat may be answered beside a running 200-line batch than on the
idle deployment (the slowest of INTERACTIVE_CHATS each, measured in the same test). Batch lines run
at the batch priority, so a chat is taken from the broker ahead of the queued lines and prefilled
in an engine step of its own ahead of the running ones (docs/engine.md, Fair share); what it still
shares is the step in progress and its decode steps beside the lines' rows, on a 2-core machine
whose load alone moves the slowest of a few answers by 2x or more (docs/benchmarks.md, Fair
share under a flood). The order itself is checked in tests/test_fair_share.py."""
INTERACTIVE_CHATS = 8


def chat_seconds(oai: openai.OpenAI, text: str) -> float:
    """An interactive 2-token chat, from the SDK's call to its answer."""
    started = time.perf_counter()
    answer = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2,
                                         extra_body={"ignore_eos": True})
    assert answer.usage is not None and answer.usage.completion_tokens == 2
    return time.perf_counter() - started


def test_a_200_line_batch_answers_every_line_once_while_interactive_requests_keep_their_latency(
        oai: openai.OpenAI, genq: GenqClient):
    chat_seconds(oai, "warm up")
    idle = [chat_seconds(oai, f"idle {i}") for i in range(INTERACTIVE_CHATS)]
    lines = [chat_line(f"bulk-{i}", f"item {i}", max_tokens=8, ignore_eos=True) for i in range(200)]
    input_file = oai.files.create(file=("bulk.jsonl", jsonl(lines)), purpose="batch")
    batch = oai.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    wait_for(oai, batch.id, {"in_progress"}, timeout=30)
    deadline = time.monotonic() + 60
    while oai.batches.retrieve(batch.id).request_counts.completed == 0:  # the lines are running
        assert time.monotonic() < deadline, "no line of the batch was answered in 60 s"
        time.sleep(0.05)
    beside = [chat_seconds(oai, f"now {i}") for i in range(INTERACTIVE_CHATS)]
    progress = oai.batches.retrieve(batch.id)
    assert progress.status == "in_progress", "the batch ended before the last interactive chat"
    assert max(beside) <= BESIDE_BATCH_BOUND * max(idle), (
        f"slowest chat {max(beside) * 1000:.0f} ms beside the batch ({progress.request_counts}), "
        f"{max(idle) * 1000:.0f} ms idle; beside {[round(t * 1000) for t in beside]} ms, "
        f"idle {[round(t * 1000) for t in idle]} ms")
    done = wait_for(oai, batch.id, ENDED, timeout=600)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 200, 0)
    answers = output_lines(oai, done.output_file_id)
    assert sorted(answer["custom_id"] for answer in answers) == sorted(line["custom_id"] for line in lines)
    assert attempts(genq, batch.id, 200) == [1] * 200


def test_files_and_batches_list_newest_first_in_pages(oai: openai.OpenAI):
    files = [oai.files.create(file=(f"page-{i}.jsonl", jsonl([chat_line("p", f"page {i}")])), purpose="batch")
             for i in range(3)]
    batches = [oai.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
               for file in files]
    first = oai.files.list(limit=2, purpose="batch")
    assert [file.id for file in first.data] == [files[2].id, files[1].id] and first.has_more
    second = oai.files.list(limit=1, purpose="batch", after=first.data[-1].id)
    assert [file.id for file in second.data] == [files[0].id]
    first_batches = oai.batches.list(limit=2)
    assert [batch.id for batch in first_batches.data] == [batches[2].id, batches[1].id] and first_batches.has_more
    second_batches = oai.batches.list(limit=1, after=first_batches.data[-1].id)
    assert [batch.id for batch in second_batches.data] == [batches[0].id]
    for batch in batches:
        assert wait_for(oai, batch.id, {"completed"}).request_counts.completed == 1
