"""The gateway's SSE coalescing (issue 30) end to end: a real redis-server, a real `genq worker`
that publishes a chunk per step, and `genq gateway` whose default merges a choice's chunks into
one SSE chunk at most every 10 s (GENQ_GATEWAY_STREAM_COALESCE_MS), read with the openai SDK.
Whatever the interval, the streamed deltas concatenate to the answer; the first goes out at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest
import redis

from producer.client import GenqClient
from producer.control import request_cancel
from producer.protocol import StreamEvent
from tests.gateway_service import MODEL, TOKEN, GatewayProcess
from tests.service import replay
from worker.processes import WorkerProcess

QUEUE = "genq-sse-coalesce"
GATEWAY_MS = 10_000
"""The gateway's default: longer than any request here runs, so only the first chunk and the end
let text out unless a request sets its own interval."""
TOKENS = 40
LONG = 900
"""Tokens of a request that runs for seconds, until cancelled (the tiny model's context is 1,024)."""


@pytest.fixture(scope="module")
def worker(module_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker(QUEUE, "sse-coalesce-worker")


@pytest.fixture(scope="module")
def oai(worker: WorkerProcess, module_gateway: Callable[..., GatewayProcess]) -> openai.OpenAI:
    gateway = module_gateway(QUEUE, "sse-coalesce-gateway", GENQ_GATEWAY_STREAM_COALESCE_MS=str(GATEWAY_MS))
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=TOKEN, max_retries=0, timeout=120)


def completion_options(max_tokens: int, coalesce_ms: int | None) -> dict[str, Any]:
    stream_options = {} if coalesce_ms is None else {"coalesce_ms": coalesce_ms}
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 1, "extra_body": {"ignore_eos": True}, "stream_options": stream_options}


@pytest.mark.parametrize("coalesce_ms", [None, 0, 20, 200])
def test_completions_deltas_concatenate_to_the_answer_at_every_interval(oai: openai.OpenAI, coalesce_ms: int | None):
    options = completion_options(TOKENS, coalesce_ms)
    answer = oai.completions.create(**{**options, "stream_options": None})
    texts, sizes, tokens = [], [], []
    for chunk in oai.completions.create(**options, stream=True):
        for choice in chunk.choices:
            texts.append(choice.text)
            if choice.logprobs is not None and choice.logprobs.tokens:
                sizes.append(len(choice.logprobs.tokens))
                tokens += choice.logprobs.tokens
    assert "".join(texts) == answer.choices[0].text
    assert answer.choices[0].logprobs is not None and tokens == answer.choices[0].logprobs.tokens
    assert sizes[0] == 1 and sum(sizes) == TOKENS  # the first token alone, at once
    if coalesce_ms is None:  # the gateway's 10 s: the first chunk, then the rest with the final event
        assert sizes == [1, TOKENS - 1]
    elif coalesce_ms == 0:
        assert sizes == [1] * TOKENS
    else:
        assert len(sizes) < TOKENS


@pytest.mark.parametrize("coalesce_ms", [None, 0, 20])
def test_chat_deltas_concatenate_to_the_answer_at_every_interval(oai: openai.OpenAI, coalesce_ms: int | None):
    options: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
                               "max_tokens": TOKENS, "temperature": 0, "logprobs": True,
                               "extra_body": {"ignore_eos": True}}
    answer = oai.chat.completions.create(**options)
    stream_options = {} if coalesce_ms is None else {"coalesce_ms": coalesce_ms}
    pieces, sizes = [], []
    for chunk in oai.chat.completions.create(**options, stream=True, stream_options=stream_options):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.logprobs is not None and choice.logprobs.content:
                sizes.append(len(choice.logprobs.content))
    assert "".join(pieces) == answer.choices[0].message.content
    assert sizes[0] == 1 and sum(sizes) == TOKENS
    if coalesce_ms is None:
        assert sizes == [1, TOKENS - 1]


def test_the_first_delta_comes_while_the_task_runs_and_a_cancel_lets_out_the_rest(
    oai: openai.OpenAI, redis_client: redis.Redis, genq: GenqClient
):
    stream = oai.completions.create(**completion_options(LONG, None), stream=True)
    first = next(stream)
    # Held back for the gateway's 10 s, the first text would come with the final event: here the
    # task has not ended, and has not been asked to.
    events: list[StreamEvent] = replay(redis_client, first.id)
    assert first.choices[0].text and not any(e.is_terminal for e in events)
    request_cancel(redis_client, first.id)
    rest = list(stream)
    texts = [first.choices[0].text] + [c.text for chunk in rest for c in chunk.choices]
    result = genq.handle(first.id).result(timeout=60)
    assert result.finish_reason == "cancelled" and result.usage.completion_tokens < LONG
    assert "".join(texts) == result.text
    assert [bool(text) for text in texts] == [True, True, False]  # the first, the rest, the finish chunk
    assert rest[-1].choices[0].finish_reason == "length"
