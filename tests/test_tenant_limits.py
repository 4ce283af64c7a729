"""API keys end to end (issue 29): a real worker, two real gateway processes on one Redis, the
openai SDK. Limits hold exactly across both gateways; 429s carry Retry-After and OpenAI's
x-ratelimit-* headers (successes too); a revoked key is refused at once by both; another
tenant's task is a 404; the usage counters equal the sum of the tasks' own results' usage."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from producer.client import GenqClient
from producer.protocol import Usage
from producer.tenants.keys import KeyLimits, KeyStore
from tests.gateway_service import (
    MODEL,
    TOKEN,
    GatewayProcess,
    bearer,
    model_dir,
    module_gateway,
    module_worker,
    sdk,
    store,
)
from worker.processes import WorkerProcess, free_port

__all__ = ["model_dir", "module_gateway", "module_worker", "store"]

QUEUE = "genq-tenants"
IDLE_QUEUE = "genq-tenants-idle"
"""No worker serves it until test_a_cancelled_task_frees_its_slot starts one: its tasks wait queued."""
MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(module_worker: Callable[..., WorkerProcess], metrics_port: int) -> WorkerProcess:
    return module_worker(QUEUE, "tenants-worker", metrics_port=metrics_port)


@pytest.fixture(scope="module")
def gateways(worker: WorkerProcess, module_gateway: Callable[..., GatewayProcess]) -> list[str]:
    return [module_gateway(QUEUE, f"tenants-gateway-{i}").url for i in range(2)]


@pytest.fixture(scope="module")
def genq(redis_url: str) -> Iterator[GenqClient]:
    with GenqClient(redis_url, queue=QUEUE) as client:
        yield client


def chat(gateway: str, key: str, **options: Any) -> tuple[int, httpx.Headers, Any]:
    """(status, headers, the completion or the error body) of one chat completion."""
    try:
        raw = sdk(gateway, key).chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=options.pop("max_tokens", 2), **options)
    except openai.APIStatusError as error:
        return error.status_code, error.response.headers, error.body
    return raw.http_response.status_code, raw.headers, raw.parse()


def post_task(gateway: str, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gateway}/v1/tasks", json=body, headers=bearer(key), timeout=60)


def test_requests_per_minute_hold_exactly_across_two_gateways(gateways: list[str], store: KeyStore):
    keys = {tenant: store.create(tenant, "rpm", KeyLimits(rpm=5))[1] for tenant in ("rpm-a", "rpm-b")}
    calls = [(tenant, gateways[i % 2]) for tenant in keys for i in range(8)]
    with ThreadPoolExecutor(len(calls)) as pool:
        answers = list(pool.map(lambda call: (call[0], *chat(call[1], keys[call[0]])), calls))
    for tenant in keys:
        mine = [(status, headers) for who, status, headers, _ in answers if who == tenant]
        assert Counter(status for status, _ in mine) == {200: 5, 429: 3}
        passed = [headers for status, headers in mine if status == 200]
        assert sorted(h["x-ratelimit-remaining-requests"] for h in passed) == ["0", "1", "2", "3", "4"]
        for status, headers in mine:
            assert headers["x-ratelimit-limit-requests"] == "5"
            assert headers["x-ratelimit-reset-requests"].endswith("s")
            if status == 429:
                assert headers["x-ratelimit-remaining-requests"] == "0"
                assert 1 <= int(headers["Retry-After"]) <= 60
            assert "x-ratelimit-limit-tokens" not in headers  # no tokens limit on these keys


def test_tokens_per_minute_refuse_a_request_too_large_and_refund_what_a_task_did_not_use(
        gateways: list[str], store: KeyStore, genq: GenqClient):
    _, key = store.create("tpm", "tpm", KeyLimits(tpm=800))
    status, headers, body = chat(gateways[0], key, max_tokens=900)
    assert status == 429
    assert "more than this API key's whole limit of 800 per minute" in body["message"]
    assert headers["x-ratelimit-limit-tokens"] == "800" and int(headers["Retry-After"]) >= 1

    first = post_task(gateways[0], key, {"prompt": "count to a thousand", "max_new_tokens": 700,
                                         "ignore_eos": True})
    assert first.status_code == 202, first.text
    reserved = 800 - int(first.headers["x-ratelimit-remaining-tokens"])
    assert reserved > 700  # the prompt's tokens and max_new_tokens
    httpx.delete(f"{gateways[1]}{first.json()['result_url']}", headers=bearer(key), timeout=30)
    used = genq.handle(first.json()["id"]).result(timeout=120).usage
    status, headers, second = chat(gateways[1], key, max_tokens=10)
    assert status == 200
    second_reserved = second.usage.prompt_tokens + 10  # the gateway counts a chat's prompt as the worker does
    remaining = int(headers["x-ratelimit-remaining-tokens"])
    # The bucket only refills (and is floored to whole tokens): after the refund it holds at least
    # 800 - what the first task used.
    first_used = used.prompt_tokens + used.completion_tokens
    assert 800 - second_reserved >= remaining >= 800 - first_used - second_reserved - 1


def test_concurrent_tasks_are_limited_and_a_cancelled_task_frees_its_slot(
        module_gateway: Callable[..., GatewayProcess], module_worker: Callable[..., WorkerProcess],
        store: KeyStore, genq: GenqClient, worker: WorkerProcess):
    idle = module_gateway(IDLE_QUEUE, "tenants-idle-gateway").url
    _, key = store.create("conc", "conc", KeyLimits(concurrent=2))
    task = {"prompt": "hello", "max_new_tokens": 4}
    held = [post_task(idle, key, task) for _ in range(2)]
    assert [answer.status_code for answer in held] == [202, 202]
    refused = post_task(idle, key, task)
    assert refused.status_code == 429
    assert "concurrent tasks: this API key's 2 tasks at once" in refused.json()["error"]["message"]
    assert int(refused.headers["Retry-After"]) >= 1
    for answer in held:
        assert httpx.delete(f"{idle}{answer.json()['result_url']}", headers=bearer(key), timeout=30).status_code == 202
    module_worker(IDLE_QUEUE, "tenants-idle-worker")  # picks the cancelled tasks up and ends them
    for answer in held:
        assert genq.handle(answer.json()["id"]).result(timeout=120).finish_reason == "cancelled"
    assert post_task(idle, key, task).status_code == 202


def test_a_revoked_key_is_refused_at_once_by_every_gateway(gateways: list[str], store: KeyStore):
    record, key = store.create("revoked", "soon revoked", KeyLimits())
    assert chat(gateways[0], key)[0] == 200
    store.revoke(record.id)
    for gateway in gateways:
        status, _, body = chat(gateway, key)
        assert status == 401 and "revoked" in body["message"]


def test_a_tenant_sees_only_its_own_tasks(gateways: list[str], store: KeyStore, genq: GenqClient):
    _, mine = store.create("scope-a", "a", KeyLimits())
    _, theirs = store.create("scope-b", "b", KeyLimits())
    accepted = post_task(gateways[0], mine, {"prompt": "hello", "max_new_tokens": 3, "tenant": "scope-b"})
    assert accepted.status_code == 202, accepted.text
    task = accepted.json()
    genq.handle(task["id"]).result(timeout=120)
    for gateway in gateways:
        for method, path in (("GET", task["result_url"]), ("GET", task["stream_url"]),
                             ("DELETE", task["result_url"])):
            answer = httpx.request(method, f"{gateway}{path}", headers=bearer(theirs), timeout=30)
            assert answer.status_code == 404, (method, path, answer.text)
            assert answer.json()["error"]["code"] == "task_not_found"
        assert httpx.get(f"{gateway}{task['result_url']}", headers=bearer(mine), timeout=30).status_code == 200
        assert httpx.get(f"{gateway}{task['result_url']}", headers=bearer(TOKEN), timeout=30).status_code == 200
    unknown = httpx.get(f"{gateways[0]}/v1/tasks/no-such-task", headers=bearer(theirs), timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "task_not_found"


def totals(usages: list[Usage], requests: int) -> dict[str, int]:
    return {"prompt_tokens": sum(u.prompt_tokens for u in usages),
            "completion_tokens": sum(u.completion_tokens for u in usages),
            "cached_tokens": sum(u.cached_tokens for u in usages), "requests": requests}


def test_usage_counters_equal_the_tasks_own_usage(gateways: list[str], store: KeyStore, genq: GenqClient,
                                                   metrics_port: int):
    record, key = store.create("usage", "usage", KeyLimits())
    _, other = store.create("usage-other", "other", KeyLimits())
    ids = [chat(gateways[i % 2], key, max_tokens=3 + i)[2].id for i in range(3)]
    accepted = post_task(gateways[1], key, {"prompt": "hello", "max_new_tokens": 5, "tenant": "someone-else"})
    ids.append(accepted.json()["id"])
    listed = sdk(gateways[0], key).completions.create(model=MODEL, prompt=["one", "two"], max_tokens=4)
    ids += [f"{listed.id}-0", f"{listed.id}-1"]
    usages = [genq.handle(identifier).result(timeout=120).usage for identifier in ids]
    expected = totals(usages, len(ids))

    for gateway in gateways:
        own = httpx.get(f"{gateway}/v1/usage", headers=bearer(key), timeout=30).json()
        assert own["totals"] == expected
        assert {row["tenant"] for row in own["data"]} == {"usage"}
        per_key = httpx.get(f"{gateway}/v1/usage", params={"key": record.id}, headers=bearer(key), timeout=30)
        assert per_key.json()["totals"] == expected
    everyone = httpx.get(f"{gateways[0]}/v1/usage", headers=bearer(TOKEN), timeout=30).json()
    assert totals([], 0) | {k: sum(r[k] for r in everyone["data"] if r["tenant"] == "usage") for k in expected} \
        == expected
    assert "someone-else" not in {row["tenant"] for row in everyone["data"]}  # the key's tenant, not the body's
    for params in ({"tenant": "usage"}, {"key": record.id}):
        refused = httpx.get(f"{gateways[0]}/v1/usage", params=params, headers=bearer(other), timeout=30)
        assert refused.status_code == 404
    too_long = httpx.get(f"{gateways[0]}/v1/usage", params={"start": 0}, headers=bearer(TOKEN), timeout=30)
    assert too_long.status_code == 400 and "GENQ_GATEWAY_USAGE_MAX_HOURS" in too_long.text

    scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in scraped.splitlines()
             if line.startswith("genq_tenant_") and "_created" not in line}
    assert lines['genq_tenant_requests_total{tenant="usage"}'] == len(ids)
    assert lines['genq_tenant_tokens_total{kind="completion",tenant="usage"}'] == expected["completion_tokens"]
    assert lines['genq_tenant_tokens_total{kind="prompt",tenant="usage"}'] == expected["prompt_tokens"]


def test_a_streamed_answer_carries_the_rate_limit_headers(gateways: list[str], store: KeyStore):
    _, key = store.create("streamed", "s", KeyLimits(rpm=50, tpm=100_000))
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{gateways[1]}/v1/chat/completions", json=body, headers=bearer(key),
                      timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert (response.headers["x-ratelimit-limit-requests"], response.headers["x-ratelimit-remaining-requests"]) \
            == ("50", "49")
        assert response.headers["x-ratelimit-limit-tokens"] == "100000"
        assert int(response.headers["x-ratelimit-remaining-tokens"]) < 100_000 - 3
        assert "data: [DONE]" in response.read().decode()
