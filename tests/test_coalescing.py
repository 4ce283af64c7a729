"""Chunk coalescing (issue 30) end to end: a real redis-server, a real `genq worker` whose default
is a chunk every 5 tokens (GENQ_STREAM_COALESCE_TOKENS), requests that set their own
stream.coalesce_ms / coalesce_tokens, and the gateway under uvicorn read with the openai SDK.
Whatever the setting, a sample's chunks concatenate to its final text and token ids."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import redis
from celery import Celery

from producer.control import request_cancel
from producer.protocol import TASK_NAME, StreamEvent, channel_name
from tests.gateway_service import MODEL, TOKEN, GatewayProcess, bearer, oai, read_sse  # noqa: F401 - oai: fixture
from tests.service import chunk_text, next_event, replay
from worker.processes import WorkerProcess, wait_until

QUEUE = "genq-coalesce"
WORKER_TOKENS = 5
"""The module's worker publishes a sample's chunks every 5 tokens unless a request says otherwise."""
TOKENS = 50
LONG = 1000
"""Tokens of a request that runs until cancelled or cut by its deadline (the tiny model's context
is 1,024)."""
ONLY_LONG_INTERVAL = {"coalesce_ms": 10_000, "coalesce_tokens": 0}
"""A chunk at most every 10 s, whatever the worker's default token count."""


@pytest.fixture(scope="module")
def worker(module_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker(QUEUE, "coalesce-worker", stream_coalesce_tokens=WORKER_TOKENS)


@pytest.fixture(scope="module")
def gateway(worker: WorkerProcess, module_gateway: Callable[..., GatewayProcess]) -> str:
    return module_gateway(QUEUE, "coalesce-gateway").url


def send(client: Celery, identifier: str, stream: dict[str, Any], **request: Any) -> Any:
    payload = {"prompt": f"Coalesced {identifier}", "max_new_tokens": TOKENS, "min_new_tokens": TOKENS,
               "ignore_eos": True, "identifier": identifier, "stream": {"include_token_ids": True, **stream},
               **request}
    return client.send_task(TASK_NAME, kwargs=payload, queue=QUEUE)


def chunks(events: list[StreamEvent]) -> list[StreamEvent]:
    return [e for e in events if e.event == "chunk"]


def check_stream(events: list[StreamEvent], result: dict[str, Any]) -> list[int]:
    """The stream's rules, coalesced or not: seq without gaps, started first, one final event whose
    text is the chunks' (and the result's), the chunks' token ids the result's; the tokens per chunk."""
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[0].event == "started" and events[-1].is_terminal
    assert sum(e.is_terminal for e in events) == 1
    assert chunk_text(events) == events[-1].text == result["text"]
    assert [t for e in chunks(events) for t in e.token_ids or []] == result["token_ids"]
    return [len(e.token_ids or []) for e in chunks(events)]


SETTINGS: dict[str, tuple[dict[str, Any], list[int] | None]] = {
    "every-step": ({"coalesce_ms": 0, "coalesce_tokens": 0}, [1] * TOKENS),
    # the worker's default: the first token at once, then every 5, then the rest with the final event
    "worker-default": ({}, [1] + [WORKER_TOKENS] * 9 + [4]),
    "7-tokens": ({"coalesce_ms": 0, "coalesce_tokens": 7}, [1] + [7] * 7),
    "20ms": ({"coalesce_ms": 20, "coalesce_tokens": 0}, None),
    "200ms": ({"coalesce_ms": 200, "coalesce_tokens": 0}, None),
}
"""Stream options -> the tokens of each chunk, where a count (not a clock) decides them."""


@pytest.mark.parametrize("setting", SETTINGS)
def test_chunks_concatenate_to_the_final_text_at_every_setting(
    worker: WorkerProcess, celery_client: Celery, redis_client: redis.Redis, setting: str
):
    stream, expected = SETTINGS[setting]
    identifier = f"setting-{setting}"
    result = send(celery_client, identifier, stream).get(timeout=120)
    assert result["usage"]["completion_tokens"] == TOKENS
    events = replay(redis_client, identifier)
    sizes = check_stream(events, result)
    if expected is not None:
        assert sizes == expected
        return
    # A chunk at once, then at most one per interval of generation, and the rest with the final event.
    interval_s = stream["coalesce_ms"] / 1000
    generate_s = events[-1].timings.generate_s if events[-1].timings else 0.0
    assert sizes[0] == 1 and len(sizes) <= 2 + math.ceil(generate_s / interval_s), (sizes, generate_s)
    assert len(sizes) < TOKENS


def test_a_long_interval_sends_the_first_chunk_at_once_and_the_rest_when_cancelled(
    worker: WorkerProcess, celery_client: Celery, redis_client: redis.Redis
):
    identifier = "cancel-long-interval"
    live = redis_client.pubsub(ignore_subscribe_messages=True)
    live.subscribe(channel_name(identifier))
    handle = send(celery_client, identifier, ONLY_LONG_INTERVAL, max_new_tokens=LONG, min_new_tokens=0)
    assert next_event(live).event == "started"
    first = next_event(live)
    assert first.event == "chunk" and first.seq == 1 and len(first.token_ids or []) == 1
    stats = worker.engine_stats(celery_client)
    assert stats is not None
    before = stats["generated_tokens"]

    def generated_more() -> bool:
        now = worker.engine_stats(celery_client)
        return now is not None and now["generated_tokens"] >= before + 20

    wait_until(generated_more, 60, "20 more tokens generated")
    request_cancel(redis_client, identifier)
    rest = next_event(live)
    final = next_event(live)
    result = handle.get(timeout=60)
    assert result["finish_reason"] == "cancelled" and 20 < result["usage"]["completion_tokens"] < LONG
    assert rest.event == "chunk" and len(rest.token_ids or []) == result["usage"]["completion_tokens"] - 1
    assert final.event == "cancelled"
    assert check_stream(replay(redis_client, identifier), result) == [1, len(rest.token_ids or [])]


def test_a_deadline_flushes_the_pending_text_before_the_final_event(
    worker: WorkerProcess, celery_client: Celery, redis_client: redis.Redis
):
    identifier = "deadline-long-interval"
    handle = send(celery_client, identifier, ONLY_LONG_INTERVAL, max_new_tokens=LONG, min_new_tokens=0,
                  timeout_s=0.5)
    result = handle.get(timeout=60)
    assert result["finish_reason"] == "deadline" and 1 < result["usage"]["completion_tokens"] < LONG
    events = replay(redis_client, identifier)
    assert events[-1].event == "done" and events[-1].finish_reason == "deadline"
    assert check_stream(events, result) == [1, result["usage"]["completion_tokens"] - 1]


def test_a_late_reader_replays_the_same_coalesced_events_the_live_one_saw(
    worker: WorkerProcess, celery_client: Celery, redis_client: redis.Redis
):
    identifier = "replayed-20ms"
    live = redis_client.pubsub(ignore_subscribe_messages=True)
    live.subscribe(channel_name(identifier))
    handle = send(celery_client, identifier, {"coalesce_ms": 20, "coalesce_tokens": 0}, max_new_tokens=200,
                  min_new_tokens=200)
    seen = [next_event(live)]
    while not seen[-1].is_terminal:
        seen.append(next_event(live))
    result = handle.get(timeout=60)
    replayed = replay(redis_client, identifier)
    assert replayed == seen
    sizes = check_stream(replayed, result)
    assert sizes[0] == 1 and len(sizes) < 200


def test_the_gateway_s_sse_replays_one_frame_per_coalesced_event_to_a_late_reader(
    gateway: str, celery_client: Celery, redis_client: redis.Redis
):
    identifier = "gateway-replay-5-tokens"
    result = send(celery_client, identifier, {}).get(timeout=120)
    with httpx.stream("GET", f"{gateway}/v1/tasks/{identifier}/events", headers=bearer(), timeout=60) as response:
        frames = read_sse(response)
    events = replay(redis_client, identifier)
    assert [(f.id, f.event) for f in frames] == [(f"{e.attempt}-{e.seq}", e.event) for e in events]
    assert [StreamEvent.from_json(f.data) for f in frames] == events
    assert check_stream(events, result) == [1] + [WORKER_TOKENS] * 9 + [4]


def test_a_sample_s_chunks_are_merged_on_their_own_with_n_samples(
    worker: WorkerProcess, celery_client: Celery, redis_client: redis.Redis
):
    identifier = "samples-5-tokens"
    result = send(celery_client, identifier, {}, n=3, max_new_tokens=12, min_new_tokens=12,
                  sampling={"temperature": 1.0, "seed": 3}).get(timeout=120)
    events = replay(redis_client, identifier)
    assert events[-1].choices is not None
    for choice in result["choices"]:
        own = [e for e in chunks(events) if e.index == choice["index"]]
        assert "".join(e.text for e in own) == choice["text"] == events[-1].choices[choice["index"]].text
        assert [t for e in own for t in e.token_ids or []] == choice["token_ids"]
        assert [len(e.token_ids or []) for e in own] == [1, 5, 5, 1]


def test_openai_chat_stream_of_coalesced_chunks_equals_the_answer_with_a_logprob_per_token(oai: openai.OpenAI):  # noqa: F811
    messages = [{"role": "user", "content": "Tell me a story."}]
    options: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 31, "temperature": 0,
                               "logprobs": True, "top_logprobs": 2, "extra_body": {"ignore_eos": True}}
    answer = oai.chat.completions.create(**options)
    pieces, logprobs = [], []
    for chunk in oai.chat.completions.create(**options, stream=True):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.logprobs is not None and choice.logprobs.content:
                logprobs.append(choice.logprobs.content)
    assert "".join(pieces) == answer.choices[0].message.content
    # One list per coalesced chunk: the first token alone, then 5 at a time, then the last one.
    assert [len(lps) for lps in logprobs] == [1] + [WORKER_TOKENS] * 6
    assert answer.choices[0].logprobs is not None
    streamed = [t for lps in logprobs for t in lps]
    answered = answer.choices[0].logprobs.content
    assert [t.token for t in streamed] == [t.token for t in answered]
    # The streamed request finds the first one's prompt in the prefix cache and prefills only its
    # last token, so its fp32 sums round differently: equal to float32's precision, not bit for bit.
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in answered], rel=1e-5, abs=1e-6)
    assert all(len(t.top_logprobs) == 2 for lps in logprobs for t in lps)


def test_openai_completions_stream_keeps_text_offsets_across_multi_token_chunks(oai: openai.OpenAI):  # noqa: F811
    options: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0,
                               "logprobs": 1, "extra_body": {"ignore_eos": True}}
    answer = oai.completions.create(**options)
    tokens, offsets, sizes = [], [], []
    for chunk in oai.completions.create(**options, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.tokens:
                tokens += choice.logprobs.tokens
                offsets += choice.logprobs.text_offset
                sizes.append(len(choice.logprobs.tokens))
    assert sizes == [1, 5, 5, 5]
    assert answer.choices[0].logprobs is not None
    assert tokens == answer.choices[0].logprobs.tokens
    assert offsets == answer.choices[0].logprobs.text_offset
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
