"""Files and batches kept per tenant (issue 29): the `openai` SDK with API keys made by the real
KeyStore against a real gateway and worker. A tenant's file or batch is 404 to another tenant on
every call, as an unknown id is, and absent from its lists (paging over its own only); the admin
sees every one; a tenant's batch lines run as that tenant, at the batch priority clamped to its
key's max_priority, outside the key's per-minute limits, and count in its usage exactly."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from fastapi.testclient import TestClient

from producer.client import GenqClient
from producer.gateway import GatewaySettings, create_app
from producer.tenants.keys import KeyLimits, KeyStore
from tests.gateway_service import TOKEN, GatewayProcess, bearer, sdk, store
from tests.test_batches import ENDED, batch_env, chat_line, jsonl, output_lines, wait_for
from worker.processes import WorkerProcess

__all__ = ["store"]

QUEUE = "genq-batch-tenants"


@pytest.fixture(scope="module")
def worker(module_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker(QUEUE, "batch-tenants-worker")


@pytest.fixture(scope="module")
def gateway(worker: WorkerProcess, module_gateway: Callable[..., GatewayProcess],
            tmp_path_factory: pytest.TempPathFactory) -> str:
    return module_gateway(QUEUE, "batch-tenants-gateway", **batch_env(tmp_path_factory.mktemp("files"))).url


@pytest.fixture(scope="module")
def genq(redis_url: str) -> Iterator[GenqClient]:
    with GenqClient(redis_url, queue=QUEUE) as client:
        yield client


def tenant_name(stem: str) -> str:
    """A tenant of this run only, so its usage starts at nothing."""
    return f"{stem}-{uuid.uuid4().hex[:8]}"


def upload(client: openai.OpenAI, name: str, lines: list[dict[str, Any]]) -> str:
    return client.files.create(file=(name, jsonl(lines)), purpose="batch").id


def create_batch(client: openai.OpenAI, file_id: str) -> str:
    return client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def not_found(call: Callable[[], object]) -> str:
    """The error code of a call that must answer 404."""
    with pytest.raises(openai.NotFoundError) as refused:
        call()
    assert refused.value.code is not None
    return refused.value.code


def test_a_tenants_files_and_batches_are_404_to_another_tenant_and_absent_from_its_lists(
        gateway: str, store: KeyStore):
    a = sdk(gateway, store.create(tenant_name("files-a"), "a", KeyLimits())[1])
    b = sdk(gateway, store.create(tenant_name("files-b"), "b", KeyLimits())[1])
    admin = sdk(gateway, TOKEN)
    a_file = upload(a, "a.jsonl", [chat_line("a1", "hello"), chat_line("a2", "world")])
    b_file = upload(b, "b.jsonl", [chat_line("b1", "hello")])
    a_batch = create_batch(a, a_file)
    assert not_found(lambda: b.batches.cancel(a_batch)) == "batch_not_found"  # while it runs
    b_batch = create_batch(b, b_file)
    a_done = wait_for(a, a_batch, ENDED)
    assert (a_done.status, a_done.request_counts.completed) == ("completed", 2)  # B's cancel changed nothing
    b_done = wait_for(b, b_batch, ENDED)
    assert b_done.status == "completed" and a_done.output_file_id is not None
    unknown_file, unknown_batch = "file-doesnotexist", f"batch_{uuid.uuid4().hex}"

    for file_id in (a_file, a_done.output_file_id, unknown_file):
        assert not_found(lambda f=file_id: b.files.retrieve(f)) == "file_not_found"
        assert not_found(lambda f=file_id: b.files.content(f)) == "file_not_found"
        assert not_found(lambda f=file_id: b.files.delete(f)) == "file_not_found"
        assert not_found(lambda f=file_id: b.batches.create(
            input_file_id=f, endpoint="/v1/chat/completions", completion_window="24h")) == "file_not_found"
    for batch_id in (a_batch, unknown_batch):
        assert not_found(lambda i=batch_id: b.batches.retrieve(i)) == "batch_not_found"
        assert not_found(lambda i=batch_id: b.batches.cancel(i)) == "batch_not_found"

    assert {f.id for f in b.files.list()} == {b_file, b_done.output_file_id}
    assert [batch.id for batch in b.batches.list()] == [b_batch]
    assert {f.id for f in a.files.list()} == {a_file, a_done.output_file_id}
    assert [batch.id for batch in a.batches.list()] == [a_batch]
    assert a.files.content(a_file).content == jsonl([chat_line("a1", "hello"), chat_line("a2", "world")])
    assert [line["custom_id"] for line in output_lines(a, a_done.output_file_id)] == ["a1", "a2"]
    with pytest.raises(openai.BadRequestError) as output_as_input:  # its own, but not a batch input file
        a.batches.create(input_file_id=a_done.output_file_id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    assert output_as_input.value.body["param"] == "input_file_id"  # type: ignore[index]

    admin_file = upload(admin, "admin.jsonl", [chat_line("x", "admin")])
    for client in (a, b):
        assert not_found(lambda c=client: c.files.retrieve(admin_file)) == "file_not_found"
    admin_files = {f.id for f in admin.files.list()}
    assert {a_file, b_file, a_done.output_file_id, admin_file} <= admin_files
    assert {a_batch, b_batch} <= {batch.id for batch in admin.batches.list(limit=100)}
    assert admin.batches.retrieve(a_batch).status == "completed"
    assert admin.files.retrieve(b_file).id == b_file
    assert admin.files.delete(b_file).deleted
    assert not_found(lambda: b.files.retrieve(b_file)) == "file_not_found"
    assert a.files.delete(a_file).deleted
    assert a_file not in {f.id for f in admin.files.list()}


def test_a_tenants_listing_pages_over_its_own_files_and_batches_only(gateway: str, store: KeyStore,
                                                                     redis_client: redis.Redis):
    tenant = tenant_name("pages-a")
    a = sdk(gateway, store.create(tenant, "a", KeyLimits())[1])
    b = sdk(gateway, store.create(tenant_name("pages-b"), "b", KeyLimits())[1])
    mine, batches = [], []
    for i in range(3):  # another tenant's files and batches in between each of A's
        mine.append(upload(a, f"a{i}.jsonl", [chat_line("p", f"a {i}")]))
        batches.append(create_batch(a, mine[-1]))
        create_batch(b, upload(b, f"b{i}.jsonl", [chat_line("p", f"b {i}")]))
    first = a.files.list(limit=2, purpose="batch")
    assert [f.id for f in first.data] == [mine[2], mine[1]] and first.has_more
    rest = a.files.list(limit=2, purpose="batch", after=first.data[-1].id)
    assert [f.id for f in rest.data] == [mine[0]] and not rest.has_more
    first_batches = a.batches.list(limit=2)
    assert [batch.id for batch in first_batches.data] == [batches[2], batches[1]] and first_batches.has_more
    rest_batches = a.batches.list(limit=2, after=first_batches.data[-1].id)
    assert [batch.id for batch in rest_batches.data] == [batches[0]] and not rest_batches.has_more
    for batch_id in batches:
        assert wait_for(a, batch_id, ENDED).status == "completed"
    # A tenant's listings go when their newest entry would: a file's retention (30 days), a
    # batch's window (24 h) and retention.
    assert 30 * 86400 - 60 < redis_client.ttl(f"genq:files:tenant:{tenant}") <= 30 * 86400
    assert 31 * 86400 - 60 < redis_client.ttl(f"genq:batches:tenant:{tenant}") <= 31 * 86400


def test_a_tenants_batch_lines_run_as_it_outside_its_key_limits_and_count_exactly_in_its_usage(
        gateway: str, store: KeyStore, genq: GenqClient, redis_client: redis.Redis):
    """The key allows one request a minute, one token a minute and one task at a time: the batch's
    creation is its one request, and its three lines, outside the per-minute limits, all run; their
    usage counts exactly, as the output file states it, under the tenant and under the key."""
    tenant = tenant_name("usage")
    record, key = store.create(tenant, "batch", KeyLimits(rpm=1, tpm=1, concurrent=1))
    client = sdk(gateway, key)
    file_id = upload(client, "usage.jsonl", [chat_line(f"u{i}", f"count {i}", max_tokens=3 + i) for i in range(3)])
    created = client.batches.with_raw_response.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                                      completion_window="24h")
    assert created.headers["x-ratelimit-remaining-requests"] == "0"
    batch_id = created.parse().id
    done = wait_for(client, batch_id, ENDED)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 3, 0)
    results = [genq.handle(f"{batch_id}-{i}").result(timeout=30) for i in range(3)]
    answered = {line["custom_id"]: line["response"]["body"]["usage"] for line in output_lines(client,
                                                                                               done.output_file_id)}
    for i, result in enumerate(results):
        assert answered[f"u{i}"]["completion_tokens"] == result.usage.completion_tokens
    expected = {"prompt_tokens": sum(r.usage.prompt_tokens for r in results),
                "completion_tokens": sum(r.usage.completion_tokens for r in results),
                "cached_tokens": sum(r.usage.cached_tokens for r in results), "requests": 3}
    assert expected == {"prompt_tokens": sum(u["prompt_tokens"] for u in answered.values()),
                        "completion_tokens": sum(u["completion_tokens"] for u in answered.values()),
                        "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in answered.values()),
                        "requests": len(answered)}  # the output file's own usage
    usage = httpx.get(f"{gateway}/v1/usage", headers=bearer(key), timeout=30).json()
    assert usage["totals"] == expected
    assert {row["tenant"] for row in usage["data"]} == {tenant}
    admin = httpx.get(f"{gateway}/v1/usage", params={"tenant": tenant}, headers=bearer(TOKEN), timeout=30).json()
    assert admin["totals"] == expected
    for asker in (key, TOKEN):  # the key that made the batch counts its lines, as the admin sees it too
        by_key = httpx.get(f"{gateway}/v1/usage", params={"key": record.id}, headers=bearer(asker), timeout=30)
        assert by_key.json()["totals"] == expected
        assert {(row["tenant"], row["key"]) for row in by_key.json()["data"]} == {(tenant, record.id)}
    assert not redis_client.keys(f"*:tenancy:task:{batch_id}-*")  # every line settled: no record left

    with pytest.raises(openai.RateLimitError) as refused:
        create_batch(client, file_id)
    assert "requests per minute" in refused.value.body["message"]  # type: ignore[index]


def test_a_tenants_batch_lines_are_queued_as_its_tenant_at_the_priority_its_key_allows(
        redis_url: str, redis_client: redis.Redis, tmp_path: Path):
    """On a queue no worker consumes, each line's message is read back from the broker: a key's
    batch runs as its tenant, the batch priority (5 here) clamped to its key's max_priority (7);
    the admin's batch keeps the batch priority and no tenant."""
    queue = f"genq-unconsumed-{uuid.uuid4().hex[:8]}"
    prefix = f"p{uuid.uuid4().hex[:8]}"
    settings = GatewaySettings(token=TOKEN, redis_url=redis_url, queue=queue, key_prefix=prefix,
                               files_dir=tmp_path, batch_poll_s=0.1, batch_priority=5, batch_max_in_flight=2)
    tenant = tenant_name("clamped")
    _, key = KeyStore(redis_client, prefix).create(tenant, "clamped", KeyLimits(max_priority=7))
    lists = [queue] + [f"{queue}\x06\x16{level}" for level in range(1, 10)]
    try:
        with TestClient(create_app(settings)) as client:
            batches = {}
            for who, token in ((tenant, key), (None, TOKEN)):
                uploaded = client.post("/v1/files", headers=bearer(token), data={"purpose": "batch"}, files={
                    "file": ("two.jsonl", jsonl([chat_line(f"q{i}", "x") for i in range(2)]))})
                assert uploaded.status_code == 200, uploaded.text
                created = client.post("/v1/batches", headers=bearer(token), json={
                    "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions",
                    "completion_window": "24h"})
                assert created.status_code == 200, created.text
                batches[created.json()["id"]] = who
            deadline = time.monotonic() + 30
            while sum(redis_client.llen(name) for name in lists) < 4:
                assert time.monotonic() < deadline, "the batches' lines were not queued within 30 s"
                time.sleep(0.05)
            messages = [json.loads(raw) for name in lists for raw in redis_client.lrange(name, 0, -1)]
        assert sorted(message["headers"]["id"] for message in messages) == sorted(
            f"{batch_id}-{i}" for batch_id in batches for i in range(2))
        for message in messages:
            who = batches[message["headers"]["id"].rsplit("-", 1)[0]]
            _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
            priority = 7 if who is not None else 5
            assert (kwargs.get("tenant"), kwargs["priority"], message["properties"]["priority"]) == (
                who, priority, priority)
    finally:
        redis_client.delete(*lists)
