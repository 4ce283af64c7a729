"""The model card and the gateway's checks before queueing (issue 12): a real worker publishes its
card, the gateway (a real `genq gateway`, and the app in-process on a queue no worker drains, so
that what was queued can be counted) refuses what the worker would refuse with a 400 before a
stream starts, and lets through what the worker decides."""


from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
import redis
import redis.asyncio
import tokenizers
from fastapi.testclient import TestClient

from engine import Tokenizer
from producer.bounded_json import MAX_JSON_DEPTH, JsonLimitError, loads_bounded
from producer.gateway import GatewaySettings, create_app
from producer.gateway.model_limits import CardReader, PromptTokenizer
from producer.model_card import CARD_TTL_S, WorkerCard, card_key, tokenizer_key
from tests.gateway_service import MODEL, SECRET, TOKEN, GatewayProcess, bearer, read_sse
from worker.processes import WorkerProcess

QUEUE = "genq-limits"
MAX_SEQ_LEN = 256
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", max_position_embeddings=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def worker(module_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    """A worker of its own queue: another module's worker leaves no card entry to widen the limits."""
    return module_worker(QUEUE, "limits-worker")


@pytest.fixture(scope="module")
def gateway(worker: WorkerProcess, module_gateway: Callable[..., GatewayProcess]) -> str:
    return module_gateway(QUEUE, "limits-gateway").url


@pytest.fixture(scope="module")
def card(worker: WorkerProcess, redis_client: redis.Redis) -> WorkerCard:
    return WorkerCard.model_validate_json(redis_client.hget(card_key(QUEUE, "genq"), worker.node))


def in_process_gateway(redis_url: str, queue: str, **settings: Any) -> TestClient:
    """The gateway app in this process, in front of `queue`, which no worker consumes."""
    return TestClient(create_app(GatewaySettings(token=TOKEN, webhook_secret=SECRET, redis_url=redis_url,
                                                 queue=queue, model_name=MODEL, **settings)))


@pytest.fixture
def idle_gateway(card: WorkerCard, redis_url: str, redis_client: redis.Redis) -> Iterator[tuple[TestClient, str]]:
    """The in-process gateway on a queue whose model card is the real worker's (copied), so that
    nothing sent to it is consumed and the queue's length shows what was queued."""
    queue = f"genq-limits-idle-{uuid.uuid4().hex[:8]}"
    redis_client.copy(card_key(QUEUE, "genq"), card_key(queue, "genq"))
    try:
        with in_process_gateway(redis_url, queue) as client:
            yield client, queue
    finally:
        redis_client.delete(queue, card_key(queue, "genq"))


def words(count: int) -> str:
    return "word " * count


def prompt_tokens(tokenizer: Tokenizer, prompt: str) -> int:
    """What the worker counts for a completions prompt (worker/jobs.py)."""
    return len(tokenizer.encode(prompt, add_special_tokens=tokenizer.add_bos_token))


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, (response.status_code, response.text)
    assert response.headers["content-type"] == "application/json", "an error, not a stream"
    return response.json()["error"]


# --- the card ------------------------------------------------------------------------------


def test_the_worker_publishes_its_model_card(worker: WorkerProcess, card: WorkerCard, model_dir: Path,
                                             tokenizer: Tokenizer, redis_client: redis.Redis):
    config = json.loads((model_dir / "config.json").read_text())
    assert list(redis_client.hkeys(card_key(QUEUE, "genq"))) == [worker.node.encode()]
    assert card.vocab_size == config["vocab_size"] and card.max_seq_len == config["max_position_embeddings"]
    assert card.add_bos == tokenizer.add_bos_token and card.chat_template
    assert time.time() - card.heartbeat_at < CARD_TTL_S
    tokenizer_json = redis_client.get(tokenizer_key(card.tokenizer_digest, "genq"))
    assert hashlib.sha256(tokenizer_json).hexdigest() == card.tokenizer_digest
    assert 0 < redis_client.ttl(card_key(QUEUE, "genq")) <= CARD_TTL_S
    counter = PromptTokenizer(tokenizers.Tokenizer.from_str(tokenizer_json.decode()), card.add_bos,
                              card.bos_correction)
    for text in ("Hello world", "<s>starts with BOS", "  spaces \n\n and lines  ", "ünïcödé 🙂"):
        assert counter.prompt_tokens(text, None) == prompt_tokens(tokenizer, text), text
        for add_bos in (True, False):
            assert counter.prompt_tokens(text, add_bos) == len(tokenizer.encode(text, add_special_tokens=add_bos))


# --- refused before anything is queued ---------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_streamed_prompt_over_the_context_is_a_400_before_anything_is_queued(
        idle_gateway: tuple[TestClient, str], redis_client: redis.Redis, path: str):
    client, queue = idle_gateway
    text = words(2 * MAX_SEQ_LEN)
    body = {"messages": [{"role": "user", "content": text}]} if path == CHAT else {"prompt": text}
    response = client.post(path, headers=bearer(), json={"model": MODEL, "stream": True, "max_tokens": 8, **body})
    error = error_of(response)
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    assert error["param"] == ("messages" if path == CHAT else "prompt")
    assert f"maximum context length is {MAX_SEQ_LEN} tokens" in error["message"]
    too_long = client.post(path, headers=bearer(), json={"model": MODEL, "stream": True, "max_tokens": MAX_SEQ_LEN,
                                                         **({"messages": [{"role": "user", "content": "hi"}]}
                                                            if path == CHAT else {"prompt": "hi"})})
    assert error_of(too_long)["param"] == "max_tokens"
    assert redis_client.llen(queue) == 0


def test_the_prompt_count_is_exact_at_the_limit(idle_gateway: tuple[TestClient, str], redis_client: redis.Redis,
                                               tokenizer: Tokenizer):
    client, queue = idle_gateway
    prompt = words(100)
    room = MAX_SEQ_LEN - prompt_tokens(tokenizer, prompt)
    over = client.post("/v1/tasks", headers=bearer(), json={"prompt": prompt, "max_new_tokens": room + 1})
    assert over.status_code == 422 and over.json()["error"]["code"] == "context_length_exceeded", over.text
    ids = client.post(COMPLETIONS, headers=bearer(), json={"model": MODEL, "stream": True, "max_tokens": 2,
                                                           "prompt": list(range(MAX_SEQ_LEN - 1))})
    assert error_of(ids)["param"] == "prompt"
    assert redis_client.llen(queue) == 0
    at_limit = client.post("/v1/tasks", headers=bearer(), json={"prompt": prompt, "max_new_tokens": room})
    assert at_limit.status_code == 202, at_limit.text
    assert redis_client.llen(queue) == 1


def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_field(
        idle_gateway: tuple[TestClient, str], redis_client: redis.Redis, card: WorkerCard):
    client, queue = idle_gateway
    outside = card.vocab_size
    for path, extra, field in (
        (CHAT, {"allowed_token_ids": [5, outside]}, "allowed_token_ids"),
        (COMPLETIONS, {"logit_bias": {str(outside): 5}}, "logit_bias"),
        (COMPLETIONS, {"prompt": [1, outside]}, "prompt"),
    ):
        text = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
        error = error_of(client.post(path, headers=bearer(), json={"model": MODEL, "stream": True, **text, **extra}))
        assert error["code"] == "invalid_request" and error["param"] == field, error
        assert error["message"] == (f"{field}: token id {outside} is outside the model's vocabulary "
                                    f"[0, {card.vocab_size})")
    webhook = client.post("/v1/tasks", headers=bearer(), json={"prompt": "hi", "stop_token_ids": [outside]})
    assert webhook.status_code == 422 and webhook.json()["error"]["param"] == "stop_token_ids"
    assert redis_client.llen(queue) == 0


def test_without_a_card_nothing_is_checked_and_the_request_is_queued(
        redis_url: str, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture):
    queue = f"genq-limits-nocard-{uuid.uuid4().hex[:8]}"
    caplog.set_level(logging.INFO, logger="producer.gateway.model_limits")
    try:
        with in_process_gateway(redis_url, queue, card_refresh_s=0.01) as client:
            for _ in range(2):
                time.sleep(0.02)  # each request reads the (absent) card again
                accepted = client.post("/v1/tasks", headers=bearer(), json={
                    "prompt": words(2 * MAX_SEQ_LEN), "max_new_tokens": 8, "sampling": {"token_bias": {"99999": 1}}})
                assert accepted.status_code == 202, accepted.text
        assert redis_client.llen(queue) == 2
        assert sum("no model card for queue" in record.getMessage() for record in caplog.records) == 1
    finally:
        redis_client.delete(queue)


def test_the_limits_are_the_largest_any_live_worker_allows(card: WorkerCard, redis_url: str,
                                                          redis_client: redis.Redis):
    queue = f"genq-limits-merge-{uuid.uuid4().hex[:8]}"
    now = time.time()
    entries = {"small@host": card.model_copy(update={"max_seq_len": 100, "heartbeat_at": now}),
               "large@host": card.model_copy(update={"max_seq_len": 300, "vocab_size": 600, "heartbeat_at": now}),
               "dead@host": card.model_copy(update={"max_seq_len": 9000, "heartbeat_at": now - 2 * CARD_TTL_S})}
    key = card_key(queue, "genq")

    async def limits() -> Any:
        client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        try:
            return await CardReader(client, "genq", queue, refresh_s=60).current()
        finally:
            await client.aclose()

    try:
        redis_client.hset(key, mapping={node: entry.model_dump_json() for node, entry in entries.items()})
        merged = anyio.run(limits)
        assert (merged.max_seq_len, merged.vocab_size, merged.workers) == (300, 600, 2)
        assert merged.tokenizer is not None
        other = card.model_copy(update={"tokenizer_digest": "0" * 64, "heartbeat_at": now})
        redis_client.hset(key, "other@host", other.model_dump_json())
        assert anyio.run(limits).tokenizer is None  # workers disagree: prompts are not counted
    finally:
        redis_client.delete(key)


# --- through the real gateway and worker -------------------------------------------------------


def test_at_the_limit_the_worker_decides_and_its_count_is_the_gateways(gateway: str, tokenizer: Tokenizer):
    prompt = words(120)
    counted = prompt_tokens(tokenizer, prompt)
    room = MAX_SEQ_LEN - counted
    assert 0 < room < 32
    oai = openai.OpenAI(base_url=f"{gateway}/v1", api_key=TOKEN, max_retries=0, timeout=120)
    usage = [chunk.usage for chunk in oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=room, temperature=0, stream=True, stream_options={"include_usage": True})
        if chunk.usage is not None]
    assert usage and usage[0].prompt_tokens == counted
    with httpx.stream("POST", f"{gateway}{COMPLETIONS}", headers=bearer(), timeout=30, json={
            "model": MODEL, "prompt": prompt, "max_tokens": room + 1, "stream": True}) as response:
        response.read()
        assert error_of(response)["code"] == "context_length_exceeded"


def test_a_conversation_the_template_pushes_over_the_limit_is_refused_with_its_exact_count(
        gateway: str, tokenizer: Tokenizer, card: WorkerCard):
    """The card carries the chat template: the gateway renders the chat as the worker does and
    counts it exactly, template included (its contents alone would fit)."""
    messages = [{"role": "user", "content": words(100)}]
    bound = PromptTokenizer(tokenizer.backend, card.add_bos, card.bos_correction).content_tokens_lower_bound(
        [m["content"] for m in messages])
    exact = len(tokenizer.encode_chat(messages))
    room = MAX_SEQ_LEN - exact
    assert exact > bound and room > 0
    refused = httpx.post(f"{gateway}{CHAT}", headers=bearer(), timeout=30, json={
        "model": MODEL, "messages": messages, "max_tokens": room + 1, "stream": True})
    error = error_of(refused)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert f"needs {MAX_SEQ_LEN + 1}: {exact} in the messages and {room + 1} for the completion" in error["message"]
    with httpx.stream("POST", f"{gateway}{CHAT}", headers=bearer(), timeout=60, json={
            "model": MODEL, "messages": messages, "max_tokens": room, "stream": True}) as response:
        assert response.status_code == 200
        assert not [m for m in read_sse(response) if m.data.startswith('{"error"')]


# --- the protocol's numeric bounds -------------------------------------------------------------


def test_a_sampling_value_past_the_protocol_s_bound_is_a_400_naming_the_param(redis_url: str,
                                                                             redis_client: redis.Redis):
    """Issue 23: dry_base 1e308 was queued and overflowed in the engine."""
    queue = f"genq-limits-bounds-{uuid.uuid4().hex[:8]}"
    with in_process_gateway(redis_url, queue) as client:
        for path, body in ((COMPLETIONS, {"prompt": "hi"}), (CHAT, {"messages": [{"role": "user", "content": "hi"}]})):
            for param, value, limit in (
                    ("dry_base", 1e308, "less than or equal to 8"),
                    ("penalty_range", 2**31, "less than or equal to 2147483647"),
                    ("mirostat_eta", 2, "less than or equal to 1"),
                    ("logit_bias[5]", {"5": 1e308}, "less than or equal to 100")):
                name = param.split("[")[0]
                error = error_of(client.post(path, headers=bearer(), json={"model": MODEL, "stream": True,
                                                                            name: value, **body}))
                assert error["param"] == param and error["message"].startswith(f"{param}: "), error
                assert limit in error["message"], error
        webhook = client.post("/v1/tasks", headers=bearer(), json={"prompt": "hi", "sampling": {"dry_base": 1e308}})
        assert webhook.status_code == 422 and webhook.json()["error"]["param"] == "sampling.dry_base"
    assert redis_client.llen(queue) == 0


def test_a_refusal_names_the_parameter_the_caller_sent(redis_url: str):
    """Issue 25, item 5: `param` and the message name max_tokens / max_completion_tokens /
    temperature / response_format as sent, never the protocol's max_new_tokens or sampling.*."""
    queue = f"genq-limits-names-{uuid.uuid4().hex[:8]}"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with in_process_gateway(redis_url, queue) as client:
        for path, body, param in (
                (CHAT, {**chat, "max_completion_tokens": 0}, "max_completion_tokens"),
                (CHAT, {**chat, "max_tokens": 0}, "max_tokens"),
                (CHAT, {**chat, "temperature": 5}, "temperature"),
                (COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
                (CHAT, {**chat, "response_format": bad_schema}, "response_format"),
                (CHAT, {**chat, "guided_regex": "(unclosed"}, "guided_regex"),
                (COMPLETIONS, {"model": MODEL, "prompt": "hi", "structured_outputs": {"regex": "("}},
                 "structured_outputs")):
            error = error_of(client.post(path, headers=bearer(), json=body))
            assert error["param"] == param, error
            assert "max_new_tokens" not in error["message"] and "sampling." not in error["message"], error


def test_json_inside_a_string_nested_too_deep_or_with_a_huge_number_is_a_400_naming_the_param(
        redis_url: str, redis_client: redis.Redis):
    """Issue 23 item 6: guided_json and dry_sequence_breakers strings nested 5,000 deep or holding a
    5,000-digit number were 500s (RecursionError / ValueError inside json.loads)."""
    queue = f"genq-limits-json-{uuid.uuid4().hex[:8]}"
    deep, huge = "[" * 5000 + "]" * 5000, "[" + "9" * 5000 + "]"
    with in_process_gateway(redis_url, queue) as client:
        for param, value, problem in (("guided_json", '{"a": ' + deep + "}", "nested more than 64"),
                                      ("guided_json", '{"maxLength": ' + "9" * 5000 + "}", "more than 100 characters"),
                                      ("dry_sequence_breakers", deep, "nested more than 64"),
                                      ("dry_sequence_breakers", huge, "more than 100 characters")):
            response = client.post(CHAT, headers=bearer(), json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], param: value})
            assert response.status_code == 400, response.text
            error = error_of(response)
            assert error["param"] == param and problem in error["message"], error
    assert redis_client.llen(queue) == 0


def test_bounded_json_parses_what_json_parses_within_the_limits():
    text = json.dumps({"type": "object", "properties": {"n": {"maximum": 1e30, "enum": [1, "[{", -2.5]}}})
    assert loads_bounded(text) == json.loads(text)
    assert loads_bounded("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) == json.loads("[" * 64 + "]" * 64)
    with pytest.raises(JsonLimitError):
        loads_bounded("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1))
    assert loads_bounded('["' + "[" * 500 + '"]') == ["[" * 500]  # brackets inside strings do not nest


def test_each_refusal_raises_the_openai_sdk_s_own_exception_class(idle_gateway: tuple[TestClient, str],
                                                                  redis_url: str):
    """Issue 24, item 5: refusals are OpenAI-shaped (error.type, code, param, message), so the
    official SDK raises the class a caller catches for each case."""
    client, _ = idle_gateway
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key=TOKEN, http_client=client, max_retries=0)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    cases: list[tuple[type[openai.APIStatusError], Callable[[], object], str | None]] = [
        (openai.BadRequestError, lambda: sdk.chat.completions.create(**chat, temperature=5), "temperature"),
        (openai.BadRequestError, lambda: sdk.completions.create(model=MODEL, prompt="x", extra_body={"tmp": 1}),
         "tmp"),
        (openai.NotFoundError, lambda: sdk.chat.completions.create(**{**chat, "model": "no-such-model"}), "model"),
        (openai.AuthenticationError, lambda: openai.OpenAI(
            base_url="http://testserver/v1", api_key="wrong", http_client=client, max_retries=0).models.list(), None),
    ]
    for expected, call, param in cases:
        with pytest.raises(openai.APIStatusError) as raised:
            call()
        assert type(raised.value) is expected, (expected, raised.value)
        body = raised.value.body
        assert isinstance(body, dict) and body["type"] and body["code"] and body["message"], body
        assert body.get("param") == param, body
    queue = f"genq-limits-sdk-{uuid.uuid4().hex[:8]}"
    with in_process_gateway(redis_url, queue, max_queue_depth=0) as full:
        redis.Redis.from_url(redis_url).rpush(queue, "waiting")
        busy = openai.OpenAI(base_url="http://testserver/v1", api_key=TOKEN, http_client=full, max_retries=0)
        with pytest.raises(openai.RateLimitError) as limited:
            busy.chat.completions.create(**chat)
        assert limited.value.response.headers["Retry-After"] and limited.value.code == "queue_full"
    redis.Redis.from_url(redis_url).delete(queue)
