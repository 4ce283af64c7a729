"""OpenAI's `n` on the gateway, end to end (a real redis-server, a real `genq worker`, the
gateway under uvicorn, the official openai client): an n > 1 request is one task with the
protocol's `n` (the worker's parallel samples, seeds seed + i), answered as one response with a
choice per sample, streamed or not."""


from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import openai
import pytest
from celery import Celery

from producer.client import GenqClient
from producer.gateway.openai_api import MAX_N, CompletionUsage
from producer.protocol import Usage
from tests.gateway_service import MODEL, bearer, close_once_two_choices_stream
from worker.processes import WorkerProcess, wait_until

PROMPT = "Once upon a time"
TOKENS = 8


def test_usage_is_the_protocol_s_which_counts_the_shared_prompt_once():
    one = CompletionUsage.from_usage(Usage(prompt_tokens=40, completion_tokens=8, cached_tokens=32))
    assert (one.prompt_tokens, one.completion_tokens, one.prompt_tokens_details.cached_tokens) == (40, 8, 32)
    assert one.total_tokens == 48


def test_n_seeded_choices_are_the_single_requests_with_seeds_seed_plus_i(oai: openai.OpenAI, genq: GenqClient):
    reply = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, seed=5, n=3,
                                   extra_body={"ignore_eos": True})
    assert reply.id.startswith("cmpl-") and [c.index for c in reply.choices] == [0, 1, 2]
    task = genq.handle(reply.id).result(timeout=30)  # one task holds every choice
    assert task.choices is not None and [c.text for c in task.choices] == [c.text for c in reply.choices]
    singles = [oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, seed=5 + i,
                                      extra_body={"ignore_eos": True}) for i in range(3)]
    assert [c.text for c in reply.choices] == [s.choices[0].text for s in singles]
    assert len({c.text for c in reply.choices}) > 1  # each child its own seed
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage is not None and reply.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == 3 * TOKENS
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 3 * TOKENS


def test_greedy_choices_are_equal_and_each_carries_its_logprobs(oai: openai.OpenAI):
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0, n=2,
                                       logprobs=True, top_logprobs=2)
    assert [c.index for c in chat.choices] == [0, 1]
    first, second = chat.choices
    assert first.message.content == second.message.content and first.finish_reason == second.finish_reason
    assert first.logprobs is not None and second.logprobs is not None
    assert [t.token for t in first.logprobs.content] == [t.token for t in second.logprobs.content]
    assert len(first.logprobs.content) == chat.usage.completion_tokens // 2
    assert all(len(t.top_logprobs) == 2 for t in first.logprobs.content)

    text = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0, n=2, logprobs=1)
    assert text.choices[0].text == text.choices[1].text
    assert all(c.logprobs is not None and len(c.logprobs.tokens) >= 1 for c in text.choices)


def test_streamed_choices_equal_the_non_streamed_ones(oai: openai.OpenAI):
    request: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "seed": 11, "n": 3,
                               "extra_body": {"ignore_eos": True}}
    whole = oai.completions.create(**request)
    texts: dict[int, str] = {}
    finishes: Counter[int] = Counter()
    usage, ids = None, set()
    for chunk in oai.completions.create(**request, stream=True, stream_options={"include_usage": True}):
        ids.add(chunk.id)
        assert len(chunk.choices) <= 1  # one choice per chunk, as OpenAI sends them for n > 1
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finishes[choice.index] += choice.finish_reason is not None
        if chunk.usage is not None:
            assert sum(finishes.values()) == 3  # after every choice finished
            usage = chunk.usage
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == Counter({0: 1, 1: 1, 2: 1})
    assert len(ids) == 1 and not ids.pop().endswith(("-0", "-1", "-2"))
    assert usage is not None and usage.completion_tokens == 3 * TOKENS
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_chat_sends_each_choice_its_role_first(oai: openai.OpenAI):
    messages = [{"role": "user", "content": "Name a colour."}]
    chunks = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0,
                                              n=2, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1] and chunks[0].choices[0].delta.role == "assistant"
    contents = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in (0, 1)}
    assert contents[0] == contents[1] and contents[0]


@pytest.mark.parametrize("n", [0, -1, MAX_N + 1])
def test_n_out_of_range_is_a_400_naming_n(gateway: str, oai: openai.OpenAI, n: int):
    for path, body in (("completions", {"prompt": "x"}), ("chat/completions", {"messages": [
            {"role": "user", "content": "x"}]})):
        refused = httpx.post(f"{gateway}/v1/{path}", headers=bearer(), timeout=30,
                             json={"model": MODEL, "max_tokens": 2, "n": n, **body})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "n" and f"from 1 to {MAX_N}" in error["message"], error
    with pytest.raises(openai.BadRequestError, match="n: "):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=2, n=n)


def test_closing_an_n_stream_cancels_the_task_of_every_choice(oai: openai.OpenAI, genq: GenqClient,
                                                               worker: WorkerProcess, celery_client: Celery):
    stream = oai.completions.create(model=MODEL, prompt="A long story", max_tokens=900, temperature=0, n=2,
                                    stream=True, extra_body={"ignore_eos": True})
    result = genq.handle(close_once_two_choices_stream(stream)).result(timeout=60)  # the one task of both choices
    assert result.finish_reason == "cancelled" and result.choices is not None
    assert [c.index for c in result.choices] == [0, 1]
    assert all(c.finish_reason == "cancelled" and len(c.token_ids or ()) < 900 for c in result.choices)
    assert result.usage.completion_tokens < 2 * 900

    def engine_idle() -> bool:
        stats = worker.engine_stats(celery_client)
        return bool(stats) and stats["pages_used"] == 0 and stats["active_jobs"] == 0

    wait_until(engine_idle, 30, "the engine to free the cancelled samples' pages")
