"""The HTTP gateway end to end: a real redis-server, a real `genq worker` on its own queue, the
gateway under uvicorn (`genq gateway`), a real callback worker (`genq callback-worker`), and
clients that know nothing of genq: the official openai package, raw HTTP with SSE."""


from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis
from celery import Celery
from fastapi.testclient import TestClient

from producer.callbacks import DELIVERY_HEADER
from producer.client import GenerationError, GenqClient
from producer.gateway import GatewaySettings, create_app
from producer.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, SignatureError, sign, verify
from tests.gateway_service import MODEL, SECRET, TOKEN, Receiver, bearer, read_sse, signed_post
from worker.processes import ChildProcess, WorkerProcess, wait_until

# --- signatures (no server) -------------------------------------------------------------


def test_signatures_bind_body_and_timestamp_and_expire():
    body, now = b'{"prompt":"x"}', 1_700_000_000
    signature = sign(SECRET, now, body)
    assert signature.startswith("sha256=") and len(signature) == 7 + 64
    assert verify(SECRET, body, str(now), signature, window_s=300, now=now + 299) == signature[7:]
    for args, problem in [((body + b" ", str(now), signature, now), "mismatch"),
                          ((body, str(now + 1), signature, now), "mismatch"),
                          ((body, str(now), sign("other", now, body), now), "mismatch"),
                          ((body, str(now), signature, now + 301), "stale"),
                          ((body, str(now), signature, now - 301), "stale"),
                          ((body, "soon", signature, now), "malformed"),
                          ((body, str(now), "md5=abc", now), "malformed"),
                          ((body, None, signature, now), "missing")]:
        with pytest.raises(SignatureError) as error:
            verify(SECRET, args[0], args[1], args[2], window_s=300, now=args[3])
        assert error.value.problem == problem


# --- OpenAI compatibility -------------------------------------------------------------------


def test_openai_sdk_streams_completions_equal_to_the_workers_result(oai: openai.OpenAI, genq: GenqClient,
                                                                   worker: WorkerProcess):
    assert [m.id for m in oai.models.list()] == [MODEL, str(worker.model)]  # the name, and the card's model
    prompt = "Once upon a time"
    expected = genq.submit({"prompt": prompt, "max_new_tokens": 24}).result(timeout=120)

    pieces, finish, usage = [], None, None
    for chunk in oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                        stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == expected.text and len(pieces) > 2
    assert finish == expected.finish_reason
    assert usage is not None and usage.completion_tokens == expected.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    whole = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text == expected.text
    assert whole.usage is not None and whole.usage.prompt_tokens == expected.usage.prompt_tokens


def test_openai_sdk_streams_chat_completions_equal_to_the_workers_result(oai: openai.OpenAI, genq: GenqClient):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    expected = genq.submit({"messages": messages, "max_new_tokens": 20}).result(timeout=120)

    stream = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"

    reply = oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0)
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == expected.text
    assert reply.usage is not None and reply.usage.completion_tokens == expected.usage.completion_tokens


def test_openai_errors_are_openai_errors(oai: openai.OpenAI, gateway: str):
    with pytest.raises(openai.BadRequestError, match="best_of"):
        oai.completions.create(model=MODEL, prompt="x", best_of=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=3)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.completions.create(model="gpt-4o", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gateway}/v1", api_key="wrong", max_retries=0).models.list()


def test_an_image_to_a_text_only_model_gets_a_400_naming_it(oai: openai.OpenAI):
    """The card of this module's worker (a tiny Llama) says its model takes no images (issue 27;
    tests/test_gateway_images.py has the vision worker)."""
    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}])
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "messages[0].content[1]", body
    assert "this model takes no images" in body["message"], body
    reply = oai.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert reply.choices[0].finish_reason == "length"


def test_an_image_to_a_text_only_worker_fails_naming_it(genq: GenqClient):
    """Past the gateway (a producer on the protocol alone), the worker refuses it too."""
    request = {"messages": [{"role": "user", "content": [{"type": "text", "text": "see"},
                                                         {"type": "image", "data": "iVBORw0KGgo="}]}],
               "max_new_tokens": 2}
    with pytest.raises(GenerationError) as info:
        genq.submit(request).result(timeout=60)
    assert info.value.message == "messages[0].content[1]: this worker's model takes no images"


def test_closing_an_openai_stream_cancels_its_generation(oai: openai.OpenAI, worker: WorkerProcess,
                                                         celery_client: Celery, genq: GenqClient):
    stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A long story"}],
                                         max_tokens=900, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    identifier = chunk.id
    stream.close()
    result = genq.handle(identifier).result(timeout=60)
    assert result.finish_reason == "cancelled" and 3 <= result.usage.completion_tokens < 900

    def engine_idle() -> bool:
        stats = worker.engine_stats(celery_client)
        return bool(stats) and stats["pages_used"] == 0 and stats["active_jobs"] == 0

    wait_until(engine_idle, 30, "the engine to free the cancelled job's pages")


def test_a_client_that_leaves_a_non_streamed_request_cancels_it(gateway: str, worker: WorkerProcess,
                                                                  celery_client: Celery):
    before = worker.engine_stats(celery_client)
    assert before is not None
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway}/v1/completions", headers=bearer(), timeout=httpx.Timeout(10, read=0.5), json={
            "model": MODEL, "prompt": "Never read", "max_tokens": 900, "ignore_eos": True})

    def cancelled() -> bool:
        stats = worker.engine_stats(celery_client)
        return bool(stats) and stats["cancelled"] == before["cancelled"] + 1 and stats["pages_used"] == 0

    wait_until(cancelled, 30, "the abandoned request to be cancelled")


# --- webhooks, SSE, callbacks ------------------------------------------------------------


def test_signed_webhook_streams_over_sse_and_its_callback_survives_two_failures(
    gateway: str, callback_worker: ChildProcess, receiver: tuple[Receiver, str]
):
    state, receiver_url = receiver
    response, _, _ = signed_post(gateway, {"prompt": "The weather today", "max_new_tokens": 16,
                                           "metadata": {"tenant": "acme"}, "callback_url": f"{receiver_url}/done"})
    assert response.status_code == 202, response.text
    accepted = response.json()
    identifier = accepted["id"]
    assert accepted["stream_url"] == f"/v1/tasks/{identifier}/events"
    assert accepted["result_url"] == f"/v1/tasks/{identifier}"
    access = {"Authorization": f"Bearer {accepted['access_token']}"}

    # The access token as a query parameter, as a browser EventSource (no headers) would send it.
    with httpx.stream("GET", gateway + accepted["stream_url"], params={"access_token": accepted["access_token"]},
                      timeout=60) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        messages = read_sse(stream)
    events = [json.loads(m.data) for m in messages]
    assert [m.id for m in messages] == [f"1-{i}" for i in range(len(messages))]
    assert [m.event for m in messages] == [e["event"] for e in events]
    assert events[0]["event"] == "started" and events[-1]["event"] == "done"
    assert "".join(e["text"] for e in events if e["event"] == "chunk") == events[-1]["text"]

    status = httpx.get(gateway + accepted["result_url"], headers=access, timeout=10).json()
    assert status["state"] == "SUCCESS" and status["result"]["text"] == events[-1]["text"]
    assert status["result"]["metadata"] == {"tenant": "acme"}
    assert httpx.get(gateway + accepted["result_url"], headers=bearer("forged"), timeout=10).status_code == 401

    tries = state.wait("/done", 3)
    assert len({headers[DELIVERY_HEADER] for headers, _ in tries}) == 1
    for headers, body in tries:
        verify(SECRET, body, headers[TIMESTAMP_HEADER], headers[SIGNATURE_HEADER], window_s=60)
    delivered = json.loads(tries[-1][1])
    assert delivered["event"] == "generation.succeeded" and delivered["id"] == identifier
    assert delivered["result"] == status["result"]


def test_a_failed_generation_is_called_back_with_its_error(
    gateway: str, callback_worker: ChildProcess, receiver: tuple[Receiver, str]
):
    state, receiver_url = receiver
    state.failures = 0
    # Valid for the protocol and for the gateway's checks, refused by the worker: the model's chat
    # template allows a system message only first (the gateway does not render templates).
    response = httpx.post(f"{gateway}/v1/tasks", headers=bearer(), timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}],
        "callback_url": f"{receiver_url}/failed"})
    assert response.status_code == 202, response.text
    (headers, body), = state.wait("/failed", 1)
    verify(SECRET, body, headers[TIMESTAMP_HEADER], headers[SIGNATURE_HEADER], window_s=60)
    delivered = json.loads(body)
    assert delivered["event"] == "generation.failed" and delivered["state"] == "FAILURE"
    assert "system message" in delivered["error"] and delivered["result"] is None
    status = httpx.get(f"{gateway}/v1/tasks/{response.json()['id']}", headers=bearer(), timeout=10).json()
    assert status["state"] == "FAILURE" and "system message" in status["error"]


def test_webhook_refuses_bad_signatures_stale_timestamps_and_replays(gateway: str):
    body = {"prompt": "replayed", "max_new_tokens": 2}
    raw = json.dumps(body).encode()
    forged = {TIMESTAMP_HEADER: str(int(time.time())), SIGNATURE_HEADER: sign("not-the-secret", int(time.time()), raw)}
    refused = httpx.post(f"{gateway}/v1/tasks", content=raw, headers=forged, timeout=10)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_signature"

    stale, _, _ = signed_post(gateway, body, timestamp=int(time.time()) - 3600)
    assert stale.status_code == 401 and stale.json()["error"]["code"] == "stale_timestamp"
    unsigned = httpx.post(f"{gateway}/v1/tasks", json=body, timeout=10)
    assert unsigned.status_code == 401 and unsigned.json()["error"]["code"] == "missing_signature"

    first, raw, headers = signed_post(gateway, body)
    assert first.status_code == 202
    replayed = httpx.post(f"{gateway}/v1/tasks", content=raw, headers=headers, timeout=10)
    assert replayed.status_code == 409 and replayed.json()["error"]["code"] == "replayed_request"

    invalid, _, _ = signed_post(gateway, {"prompt": "x", "bogus": 1, "sampling": {"temperature": 9}})
    assert invalid.status_code == 422
    problems = invalid.json()["error"]["problems"]
    assert any(p.startswith("bogus: unknown field") for p in problems)
    assert any(p.startswith("sampling.temperature:") for p in problems)


def test_sse_client_resumes_with_last_event_id_without_gap_or_duplicate(gateway: str, genq: GenqClient):
    accepted = httpx.post(f"{gateway}/v1/tasks", headers=bearer(), timeout=30, json={
        "prompt": "A long walk", "max_new_tokens": 120, "ignore_eos": True}).json()
    url = gateway + accepted["stream_url"]
    with httpx.stream("GET", url, headers=bearer(), timeout=60) as first:
        before = read_sse(first, limit=5)
    with httpx.stream("GET", url, headers={**bearer(), "Last-Event-ID": before[-1].id}, timeout=60) as second:
        after = read_sse(second)
    ids = [m.id for m in before + after]
    assert ids == [f"1-{i}" for i in range(len(ids))] and len(after) > 5
    events = [json.loads(m.data) for m in before + after]
    result = genq.handle(accepted["id"]).result(timeout=60)
    assert result.finish_reason == "length"  # dropping the SSE connection does not cancel a task
    assert "".join(e["text"] for e in events if e["event"] == "chunk") == result.text == events[-1]["text"]

    bad = httpx.get(url, headers={**bearer(), "Last-Event-ID": "latest"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_last_event_id"


def test_delete_cancels_a_running_task(gateway: str, genq: GenqClient):
    accepted = httpx.post(f"{gateway}/v1/tasks", headers=bearer(), timeout=30, json={
        "prompt": "Cancel me", "max_new_tokens": 900, "ignore_eos": True}).json()
    with httpx.stream("GET", gateway + accepted["stream_url"], headers=bearer(), timeout=60) as stream:
        read_sse(stream, limit=3)
    assert httpx.delete(gateway + accepted["result_url"], headers=bearer(), timeout=10).status_code == 202
    assert genq.handle(accepted["id"]).result(timeout=60).finish_reason == "cancelled"


# --- admission control, limits, schema (the app in-process) --------------------------------


@pytest.fixture
def admission_app(redis_url: str) -> Iterator[tuple[TestClient, str]]:
    queue = f"genq-unconsumed-{uuid.uuid4().hex[:8]}"
    settings = GatewaySettings(token=TOKEN, webhook_secret=SECRET, redis_url=redis_url, queue=queue,
                               max_queue_depth=1, max_body_bytes=4096, retry_after_s=7)
    with TestClient(create_app(settings)) as client:
        yield client, queue
    keys = [queue] + [f"{queue}\x06\x16{level}" for level in range(1, 10)]
    redis.Redis.from_url(redis_url).delete(*keys)


def test_admission_control_answers_429_with_retry_after(admission_app: tuple[TestClient, str], redis_url: str):
    client, queue = admission_app
    for priority in (None, 5):  # two priority levels: two Redis lists, both counted
        request = {"prompt": "waits", **({"priority": priority} if priority is not None else {})}
        assert client.post("/v1/tasks", headers=bearer(), json=request).status_code == 202
    assert redis.Redis.from_url(redis_url).llen(queue) == 1
    refused = client.post("/v1/tasks", headers=bearer(), json={"prompt": "one too many"})
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "7"
    assert refused.json()["error"]["code"] == "queue_full"
    chat = client.post("/v1/chat/completions", headers=bearer(), json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 429 and chat.json()["error"]["type"] == "rate_limit_error"


def test_body_limit_auth_and_openapi(admission_app: tuple[TestClient, str]):
    client, _ = admission_app
    big = client.post("/v1/tasks", headers=bearer(), json={"prompt": "x" * 10_000})
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
    chunked = client.post("/v1/completions", headers={**bearer(), "Content-Type": "application/json"},
                          content=iter([b'{"model": "genq", "prompt": "', b"x" * 5000, b'"}']))
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "body_too_large"
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/tasks/some-task").status_code == 401
    schema = client.get("/openapi.json").json()
    assert {"/v1/tasks", "/v1/tasks/{task_id}/events", "/v1/completions", "/v1/chat/completions",
            "/v1/models"} <= schema["paths"].keys()
    assert "callback_url" in schema["components"]["schemas"]["WebhookTask"]["properties"]


def test_gateway_refuses_to_start_without_credentials(monkeypatch: pytest.MonkeyPatch):
    for name in ("GENQ_GATEWAY_TOKEN", "GENQ_WEBHOOK_SECRET", "GENQ_GATEWAY_ALLOW_ANONYMOUS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="no credentials configured"):
        GatewaySettings()


def test_the_task_status_read_right_after_the_stream_ends_is_the_result(gateway: str):
    """Issue 25, item 3: state and result were read separately, and a read right after the SSE
    `done` answered SUCCESS with a null result in 2 of 7 tries. Now one read, and the worker's
    final record answers until Celery has stored the result."""
    for i in range(10):
        accepted = httpx.post(f"{gateway}/v1/tasks", headers=bearer(), timeout=30,
                              json={"prompt": f"Status {i}", "max_new_tokens": 3, "ignore_eos": True}).json()
        with httpx.stream("GET", gateway + accepted["stream_url"], headers=bearer(), timeout=60) as stream:
            final = json.loads(read_sse(stream)[-1].data)
        status = httpx.get(gateway + accepted["result_url"], headers=bearer(), timeout=10).json()
        assert final["event"] == "done" and status["state"] == "SUCCESS", status
        assert status["result"] is not None and status["result"]["text"] == final["text"], status
