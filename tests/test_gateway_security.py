"""The attacks of issue 16, each replayed against the real service (redis-server, `genq worker`,
`genq gateway` under uvicorn, the callback task) and answered as documented: no cross-task
access through a reused identifier, no access token in the logs, no 500 on hostile input, a
refused webhook can be retried, callbacks cannot reach internal addresses, and raw Celery
messages cannot slip past the protocol."""


from __future__ import annotations

import hashlib
import hmac
import json
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from celery import Celery
from fastapi.testclient import TestClient

from producer.batches.records import BATCH_ID_PATTERN
from producer.batches.storage import FILE_ID_PATTERN
from producer.callback_targets import CallbackUrlRefused, resolve_target
from producer.callbacks import DELIVER_CALLBACK_TASK, CallbackRejected, CallbackSettings
from producer.callbacks import create_app as create_callback_app
from producer.client import GenqClient
from producer.gateway import GatewaySettings, create_app
from producer.gateway.errors import ErrorBody
from producer.gateway.logs import REDACTED
from producer.protocol import IDENTIFIER_PATTERN, TASK_NAME, GenerationResult, Timings, Usage, channel_name
from tests.gateway_service import (
    MODEL,
    QUEUE,
    SECRET,
    TOKEN,
    GatewayProcess,
    Receiver,
    bearer,
    read_sse,
    service_env,
    signed_post,
)
from tests.service import next_event
from worker.processes import ROOT, ChildProcess, free_port, wait_until

IDLE_QUEUE = "genq-gateway-security-idle"
IDLE_QUEUE_LIMIT = 50


@pytest.fixture(scope="module")
def idle_gateway(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway with the DEFAULT callback policy, in front of a queue no worker consumes (its
    tasks stay queued)."""
    env = {**service_env(redis_url), "GENQ_QUEUE": IDLE_QUEUE, "GENQ_GATEWAY_TOKEN": TOKEN,
           "GENQ_GATEWAY_MAX_QUEUE_DEPTH": str(IDLE_QUEUE_LIMIT)}
    del env["GENQ_CALLBACK_ALLOW_PRIVATE_HOSTS"]
    started = GatewayProcess(env, tmp_path_factory.mktemp("idle-gateway") / "gateway.log").start()
    try:
        yield started
    finally:
        started.stop()
        redis.Redis.from_url(redis_url).delete(IDLE_QUEUE)


@pytest.fixture(scope="module")
def redis_client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def error_of(response: httpx.Response, status: int | tuple[int, ...]) -> dict[str, Any]:
    """The error of a refused request, checked to be the gateway's single error shape."""
    statuses = (status,) if isinstance(status, int) else status
    assert response.status_code in statuses, (response.status_code, response.text)
    return ErrorBody.model_validate(response.json()).error.model_dump()


def id_only_token(identifier: str) -> str:
    """The access token as it used to be derived (HMAC of the id alone): what an attacker who
    knows the id and, as a webhook sender, the scheme could compute or obtain by reuse."""
    return hmac.new(SECRET.encode(), f"genq-task-access:{identifier}".encode(), hashlib.sha256).hexdigest()


# --- identifiers and access tokens -----------------------------------------------------------


def test_reusing_the_identifier_of_a_running_task_is_refused_and_yields_no_access(gateway: str,
                                                                                  genq: GenqClient,
                                                                                  redis_client: redis.Redis):
    identifier = f"victim-{uuid.uuid4().hex[:8]}"
    first, _, _ = signed_post(gateway, {"prompt": "A long tale", "max_new_tokens": 900, "ignore_eos": True,
                                        "identifier": identifier})
    assert first.status_code == 202, first.text
    token = first.json()["access_token"]
    with httpx.stream("GET", f"{gateway}/v1/tasks/{identifier}/events", headers=bearer(token), timeout=60) as stream:
        assert json.loads(read_sse(stream, limit=1)[0].data)["event"] == "started"  # it runs now

    # The attack: a second sender signs a request with the same identifier.
    second, _, _ = signed_post(gateway, {"prompt": "Give me its token", "identifier": identifier})
    error = error_of(second, 409)
    assert error["code"] == "identifier_in_use" and error["param"] == "identifier"
    assert repr(identifier) in error["message"] and "access_token" not in second.text
    assert error_of(httpx.post(f"{gateway}/v1/tasks", headers=bearer(), timeout=30, json={
        "prompt": "me too", "identifier": identifier}), 409)["code"] == "identifier_in_use"

    # The token is bound to the nonce stored with the task, which expires with the task's result.
    record = f"genq:task:{identifier}"
    assert 0 < redis_client.ttl(record) <= 86400 and len(redis_client.get(record)) == 32
    assert id_only_token(identifier) != token
    for forged in (id_only_token(identifier), "0" * 64):
        for method, path in (("GET", ""), ("GET", "/events"), ("DELETE", "")):
            refused = httpx.request(method, f"{gateway}/v1/tasks/{identifier}{path}", headers=bearer(forged),
                                    timeout=10)
            assert error_of(refused, 401)["code"] == "invalid_api_key"
        assert error_of(httpx.get(f"{gateway}/v1/tasks/{identifier}", params={"access_token": forged},
                                  timeout=10), 401)["code"] == "invalid_api_key"

    # Another task's genuine token opens that task only.
    other, _, _ = signed_post(gateway, {"prompt": "Another", "max_new_tokens": 2})
    other_token = other.json()["access_token"]
    assert httpx.get(f"{gateway}/v1/tasks/{other.json()['id']}", headers=bearer(other_token),
                     timeout=10).status_code == 200
    error_of(httpx.delete(f"{gateway}/v1/tasks/{identifier}", headers=bearer(other_token), timeout=10), 401)

    assert httpx.delete(f"{gateway}/v1/tasks/{identifier}", headers=bearer(token), timeout=10).status_code == 202
    assert genq.handle(identifier).result(timeout=60).finish_reason == "cancelled"
    # Finished, the identifier stays taken while its result is kept: its result is the first sender's.
    error_of(signed_post(gateway, {"prompt": "now?", "identifier": identifier})[0], 409)


def test_reusing_the_identifier_of_a_queued_task_is_refused(idle_gateway: GatewayProcess):
    identifier = f"queued-{uuid.uuid4().hex[:8]}"
    first, _, _ = signed_post(idle_gateway.url, {"prompt": "waits", "identifier": identifier})
    assert first.status_code == 202, first.text
    status = httpx.get(f"{idle_gateway.url}/v1/tasks/{identifier}", headers=bearer(first.json()["access_token"]),
                       timeout=10)
    assert status.json()["state"] == "PENDING"
    second, _, _ = signed_post(idle_gateway.url, {"prompt": "mine now", "identifier": identifier})
    assert error_of(second, 409)["code"] == "identifier_in_use"


def test_the_identifier_of_a_task_sent_straight_to_celery_is_refused(gateway: str, genq: GenqClient):
    identifier = f"direct-{uuid.uuid4().hex[:8]}"
    genq.submit({"prompt": "Not through the gateway", "max_new_tokens": 4, "identifier": identifier}).result(
        timeout=60)
    response, _, _ = signed_post(gateway, {"prompt": "Let me read it", "identifier": identifier})
    assert error_of(response, 409)["code"] == "identifier_in_use"


def test_access_tokens_never_reach_the_access_log(gateway_process: GatewayProcess):
    base = gateway_process.url
    accepted, _, _ = signed_post(base, {"prompt": "Logged?", "max_new_tokens": 2})
    identifier, token = accepted.json()["id"], accepted.json()["access_token"]
    assert httpx.get(f"{base}/v1/tasks/{identifier}", params={"access_token": token}, timeout=10).status_code == 200
    # The name percent-encoded: the gateway decodes it (and accepts the token); the log must hide it too.
    assert httpx.get(f"{base}/v1/tasks/{identifier}?access%5Ftoken={token}&x=1", timeout=10).status_code == 200
    with httpx.stream("GET", f"{base}/v1/tasks/{identifier}/events", params={"access_token": token},
                      timeout=60) as stream:
        assert json.loads(read_sse(stream)[-1].data)["event"] == "done"

    log = gateway_process.log()
    assert token not in log
    lines = [line for line in log.splitlines() if f"/v1/tasks/{identifier}" in line]
    assert f'"GET /v1/tasks/{identifier}?access_token={REDACTED} HTTP/1.1" 200' in log
    assert f"?access%5Ftoken={REDACTED}&x={REDACTED}" in log
    assert f"/v1/tasks/{identifier}/events?access_token={REDACTED}" in log
    assert len(lines) == 3


def test_genq_gateway_says_where_it_listens_and_logs_requests_at_its_default_level(redis_url: str,
                                                                                   tmp_path: Path):
    """Issue 25, item 7: run as an operator runs it (no --log-level), the gateway is not silent."""
    port = free_port()
    env = {**service_env(redis_url), "GENQ_GATEWAY_TOKEN": TOKEN}
    command = [sys.executable, "-m", "worker.cli", "gateway", "--port", str(port)]
    with ChildProcess("gateway", command, tmp_path / "gateway.log", env) as gateway:
        wait_until(lambda: gateway.serves_health(f"http://127.0.0.1:{port}"), 30, "the gateway to answer /healthz")
        wait_until(lambda: '"GET /healthz HTTP/1.1" 200' in gateway.log_path.read_text(), 10, "the access log line")
        assert f"running on http://127.0.0.1:{port}" in gateway.log_path.read_text()


# --- hostile bodies and headers --------------------------------------------------------------


def test_hostile_bodies_and_headers_are_400_or_422_not_500(gateway: str):
    deep = b"[" * 100_000 + b"]" * 100_000
    huge_number = b'{"prompt": "x", "max_new_tokens": ' + b"9" * 5000 + b"}"
    huge_openai = b'{"model": "genq", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
    json_headers = {**bearer(), "Content-Type": "application/json"}
    for path, body, status in (("/v1/tasks", deep, 422), ("/v1/tasks", huge_number, 422),
                               ("/v1/completions", deep, 400), ("/v1/completions", huge_openai, 400),
                               ("/v1/chat/completions", deep, 400), ("/v1/chat/completions", huge_openai, 400)):
        error = error_of(httpx.post(gateway + path, content=body, headers=json_headers, timeout=30), status)
        assert error["code"] == "invalid_json", (path, error)

    # Shapes the request models leave open, checked by hand (found by the fuzz test).
    for part in ({"type": "text"}, {"type": "text", "text": 5}):
        chat = httpx.post(f"{gateway}/v1/chat/completions", headers=bearer(), timeout=30, json={
            "model": "genq", "messages": [{"role": "user", "content": [part]}]})
        assert error_of(chat, 400)["param"] == "messages[0].content[0]"
    for url in ("http://a..b/", f"http://{'a' * 64}.example/", "http://./"):
        response, _, _ = signed_post(gateway, {"prompt": "x", "callback_url": url})
        assert "not a valid host name" in error_of(response, 422)["message"], url

    accepted = httpx.post(f"{gateway}/v1/tasks", headers=bearer(), timeout=30, json={
        "prompt": "resume me", "max_new_tokens": 2}).json()
    # '²' passes str.isdigit but not int(); raw latin-1 bytes, as a hostile client sends them.
    for value in (b"1-\xb2", "1-²".encode(), b"1-" + b"9" * 5000, b"9" * 5000 + b"-1", b"-1-2", b"1-"):
        response = httpx.get(f"{gateway}{accepted['stream_url']}", headers={**bearer(), "Last-Event-ID": value},
                             timeout=10)
        error = error_of(response, 400)
        assert error["code"] == "invalid_last_event_id" and len(error["message"]) < 300


# --- signatures are used up by acceptance only ------------------------------------------------


def test_a_signed_request_refused_with_422_or_429_can_be_retried_with_the_same_bytes(
    idle_gateway: GatewayProcess, redis_client: redis.Redis
):
    url = f"{idle_gateway.url}/v1/tasks"
    invalid, raw, headers = signed_post(idle_gateway.url, {"prompt": "x", "max_new_tokens": 0})
    error_of(invalid, 422)
    assert error_of(httpx.post(url, content=raw, headers=headers, timeout=10), 422)["code"] == "invalid_request"

    redis_client.lpush(IDLE_QUEUE, *["filler"] * (IDLE_QUEUE_LIMIT + 1))  # the queue is full
    try:
        busy, raw, headers = signed_post(idle_gateway.url, {"prompt": "later", "max_new_tokens": 2})
        assert error_of(busy, 429)["code"] == "queue_full"
    finally:
        redis_client.lrem(IDLE_QUEUE, 0, "filler")
    retried = httpx.post(url, content=raw, headers=headers, timeout=10)  # the sender's retry, same bytes
    assert retried.status_code == 202, retried.text
    replayed = httpx.post(url, content=raw, headers=headers, timeout=10)
    assert error_of(replayed, 409)["code"] == "replayed_request"


# --- callback URLs ----------------------------------------------------------------------------

INTERNAL_CALLBACKS = [
    "http://127.0.0.1:6379/", "http://2130706433/", "http://0x7f000001/", "http://017700000001/",
    "http://0x7f.1/", "http://127.1/", "http://0/", "http://localhost/hook", "http://[::1]/", "http://[::]/",
    "http://[::ffff:127.0.0.1]/", "http://[::ffff:a00:1]/", "http://169.254.169.254/latest/meta-data/",
    "http://10.0.0.1/", "http://172.16.5.4/", "http://192.168.1.1/", "http://100.64.0.1/", "http://224.0.0.1/",
    "http://[fe80::1]/", "http://[fc00::1]/", "http://[ff02::1]/", "http://[2002:7f00:1::]/",
    "http://[64:ff9b::a9fe:a9fe]/",
]
FOREIGN_SCHEMES = ["file:///etc/passwd", "gopher://127.0.0.1:6379/_INFO", "ftp://example.com/x",
                   "redis://127.0.0.1:6379/0", "javascript:alert(1)", "//example.com/x"]


def test_callbacks_to_internal_addresses_are_refused_by_default(idle_gateway: GatewayProcess,
                                                                 redis_client: redis.Redis,
                                                                 receiver: tuple[Receiver, str]):
    _, receiver_url = receiver  # the tests' own receiver, on loopback
    before = redis_client.llen(IDLE_QUEUE)
    for url in [*INTERNAL_CALLBACKS, f"{receiver_url}/done", *FOREIGN_SCHEMES]:
        response, _, _ = signed_post(idle_gateway.url, {"prompt": "x", "callback_url": url})
        error = error_of(response, 422)
        assert error["param"] == "callback_url" and error["message"].startswith("callback_url: "), (url, error)
    assert redis_client.llen(IDLE_QUEUE) == before  # nothing was enqueued


def test_the_opt_out_allows_private_addresses_but_never_other_schemes(gateway: str):
    for url in FOREIGN_SCHEMES:
        response, _, _ = signed_post(gateway, {"prompt": "x", "callback_url": url})
        assert error_of(response, 422)["param"] == "callback_url", url


@pytest.fixture
def trusting_gateway(redis_url: str, redis_client: redis.Redis) -> Iterator[tuple[TestClient, str]]:
    """The gateway app in this process, allowing private callback hosts (so that only the rule
    under test refuses), in front of a queue no worker consumes."""
    queue = f"genq-security-trusting-{uuid.uuid4().hex[:8]}"
    settings = GatewaySettings(token=TOKEN, webhook_secret=SECRET, redis_url=redis_url, queue=queue,
                               model_name=MODEL, callback_allow_private_hosts=True)
    try:
        with TestClient(create_app(settings)) as client:
            yield client, queue
    finally:
        redis_client.delete(queue)


@pytest.mark.parametrize("spliced", ["\r\n", "\n", "\r", "\t", "\x00", "\x7f"])
def test_a_callback_url_with_a_control_character_is_refused_not_stripped(
        trusting_gateway: tuple[TestClient, str], redis_client: redis.Redis, receiver: tuple[Receiver, str],
        spliced: str):
    client, queue = trusting_gateway
    _, receiver_url = receiver
    accepted = client.post("/v1/tasks", headers=bearer(), json={"prompt": "x", "callback_url": f"{receiver_url}/ok"})
    assert accepted.status_code == 202, accepted.text  # the same URL without the character passes
    for url in (f"{receiver_url}/do{spliced}ne", f"http://127.0.0{spliced}.1/", f"{receiver_url}/x{spliced}"):
        error = error_of(client.post("/v1/tasks", headers=bearer(), json={"prompt": "x", "callback_url": url}), 422)
        assert error["param"] == "callback_url" and "control character" in error["message"], (url, error)
    assert redis_client.llen(queue) == 1
    with pytest.raises(CallbackUrlRefused, match="control character"):  # and again at delivery
        resolve_target(f"{receiver_url}/do{spliced}ne", allow_private=True)


def test_a_constraint_with_banned_strings_or_token_healing_is_refused_naming_both(
        trusting_gateway: tuple[TestClient, str], redis_client: redis.Redis):
    client, queue = trusting_gateway
    regex = {"type": "regex", "pattern": "[a-z]+"}
    for extra, other in (({"banned_strings": ["no"]}, "banned_strings"), ({"token_healing": True}, "token_healing")):
        error = error_of(client.post("/v1/tasks", headers=bearer(), json={"prompt": "x", "constraint": regex,
                                                                          **extra}), 422)
        assert error["param"] == f"constraint|{other}" and f"constraint and {other}" in error["message"], error
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            error = error_of(client.post(path, headers=bearer(), json={"model": MODEL, "guided_regex": "[a-z]+",
                                                                       **body, **extra}), 400)
            # Named as the caller sent them (issue 25, item 5).
            assert error["param"] == f"guided_regex|{other}", error
            assert f"guided_regex and {other}" in error["message"], error
    assert redis_client.llen(queue) == 0


def test_public_addresses_pass_the_default_policy_and_names_stay_in_host_and_sni():
    public = resolve_target("https://user:pw@8.8.8.8:8443/hook?x=1", allow_private=False)
    assert (public.address, public.connect_url) == ("8.8.8.8", "https://user:pw@8.8.8.8:8443/hook?x=1")
    assert public.host_header == "8.8.8.8:8443" and public.sni_hostname is None
    assert resolve_target("http://[2606:4700:4700::1111]/", allow_private=False).address == "2606:4700:4700::1111"
    named = resolve_target("https://localhost/hook", allow_private=True)  # resolved from /etc/hosts, offline
    assert named.connect_url in ("https://127.0.0.1/hook", "https://[::1]/hook")
    assert named.host_header == "localhost" and named.sni_hostname == "localhost"


def _deliver(redis_url: str, callback_url: str, allow_private: bool) -> Any:
    """Run the callback worker's task in-process, as the callback worker would for one delivery."""
    app = create_callback_app(CallbackSettings(redis_url=redis_url, webhook_secret=SECRET,
                                               allow_private_hosts=allow_private, max_retries=0))
    result = GenerationResult(id="cb", attempt=1, text="hi", finish_reason="stop", usage=Usage(), timings=Timings())
    return app.tasks[DELIVER_CALLBACK_TASK].apply(args=[result.to_dict()], kwargs={
        "callback_url": callback_url, "identifier": "cb", "event": "generation.succeeded"})


def test_the_callback_worker_checks_the_address_again_and_connects_to_the_checked_one(
    redis_url: str, receiver: tuple[Receiver, str]
):
    state, receiver_url = receiver
    state.failures = 0
    port = receiver_url.rsplit(":", 1)[1]
    # Accepted by a gateway with the opt-out, delivered by a callback worker without it: refused there.
    refused = _deliver(redis_url, f"http://localhost:{port}/late", allow_private=False)
    assert refused.state == "FAILURE" and isinstance(refused.result, CallbackRejected)
    assert "loopback" in str(refused.result)
    assert not state.calls

    delivered = _deliver(redis_url, f"http://localhost:{port}/pinned", allow_private=True)
    assert delivered.state == "SUCCESS" and delivered.result == 200
    (headers, body), = state.wait("/pinned", 1)
    # The connection went to the address that was checked; the name is still the URL's.
    assert headers["Host"] == f"localhost:{port}" and json.loads(body)["result"]["text"] == "hi"


# --- raw Celery messages (the worker) -----------------------------------------------------------


def _outcome(celery_client: Celery, kwargs: dict[str, Any], task_id: str) -> str:
    """The stored failure message of a task sent as a raw Celery message."""
    result = celery_client.send_task(TASK_NAME, kwargs=kwargs, task_id=task_id, queue=QUEUE)
    with pytest.raises(Exception) as failure:  # Celery rebuilds the worker's exception type
        result.get(timeout=60)
    return str(failure.value)


def test_stop_token_ids_outside_the_vocabulary_are_refused(worker: Any, celery_client: Celery):
    identifier = f"stops-{uuid.uuid4().hex[:8]}"
    message = _outcome(celery_client, {"prompt": "x", "stop_token_ids": [5, 10**6], "identifier": identifier},
                       identifier)
    assert re.match(r"stop_token_ids\[1\]: token id 1000000 is outside the vocabulary \[0, \d+\)", message)


def test_an_unknown_field_named_by_a_lone_surrogate_is_named_escaped(worker: Any, celery_client: Celery):
    identifier = f"surrogate-{uuid.uuid4().hex[:8]}"
    message = _outcome(celery_client, {"prompt": "x", "\ud800": 1, "identifier": identifier}, identifier)
    assert message.startswith("\\ud800: unknown field (allowed: prompt, ")


@pytest.mark.parametrize("task_id", ["with space", "star*", "what?", "[set]", "new\nline", "nul\x00", "x" * 129])
def test_task_ids_that_would_make_unsafe_redis_keys_are_refused(worker: Any, celery_client: Celery,
                                                                redis_client: redis.Redis, genq: GenqClient,
                                                                task_id: str):
    identifier = f"badid-{uuid.uuid4().hex[:8]}"
    pubsub = redis_client.pubsub()
    pubsub.subscribe(channel_name(identifier))
    try:
        celery_client.send_task(TASK_NAME, kwargs={"prompt": "x", "max_new_tokens": 2, "identifier": identifier},
                                task_id=task_id, queue=QUEUE)
        while (event := next_event(pubsub)).event not in ("done", "error", "cancelled"):
            pass
    finally:
        pubsub.close()
    assert event.event == "error" and event.error is not None and event.error.startswith("task id: must match")
    assert not redis_client.exists(f"celery-task-meta-{task_id}")
    unsafe = [key for key in redis_client.keys("*") if re.search(rb"[\s*?\[\]\x00]", key)]
    assert not unsafe
    assert genq.submit({"prompt": "still serving", "max_new_tokens": 2}).result(timeout=60).finish_reason


# --- every key the service writes is documented ----------------------------------------------

def documented_genq_keys() -> list[re.Pattern[str]]:
    """The `{prefix}:...` names of docs/protocol.md section 4, as patterns for the default prefix."""
    section = (ROOT / "docs" / "protocol.md").read_text().split("## 4. Redis names", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^\| `(\{prefix\}:[^`]+)` \|", section, re.M)
    assert len(names) >= 9, names
    identifier = IDENTIFIER_PATTERN.strip("^$")
    parts = {"{prefix}": "genq", "{id}": identifier, "{task id}": identifier, "{queue}": identifier,
             "{digest}": "[0-9A-Za-z_-]+", "{key id}": "[0-9a-f]{16}", "{tenant}": identifier, "{hour}": "[0-9]+",
             "{file id}": FILE_ID_PATTERN.strip("^$"), "{batch id}": BATCH_ID_PATTERN.strip("^$")}
    patterns = []
    for name in names:
        pattern = re.escape(name)
        for placeholder, replacement in parts.items():
            pattern = pattern.replace(re.escape(placeholder), replacement)
        assert "\\{" not in pattern, f"undocumented placeholder in {name}"
        patterns.append(re.compile(pattern))
    return patterns


def test_every_key_genq_wrote_is_documented_in_the_protocol(redis_client: redis.Redis):
    """Runs last in this module, after webhooks, callbacks, cancels and refusals wrote their keys."""
    patterns = documented_genq_keys()
    keys = [key.decode() for key in redis_client.scan_iter(match="genq:*", count=1000)]
    assert len({key.split(":")[1] for key in keys}) >= 4  # events, attempt, task, final, ... were written
    undocumented = [key for key in keys if not any(p.fullmatch(key) for p in patterns)]
    assert not undocumented, undocumented
    results = [key.decode() for key in redis_client.scan_iter(match="celery-task-meta-*", count=1000)]
    identifier = re.compile(IDENTIFIER_PATTERN)
    assert results and all(identifier.fullmatch(key.removeprefix("celery-task-meta-")) for key in results)
