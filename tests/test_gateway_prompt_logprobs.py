"""The prompt's log-probabilities streamed (a real redis-server, a real `genq worker`, the gateway
under uvicorn, the official openai client): completions' echo with logprobs opens each choice
with the echoed prompt and its tokens' logprobs, and vLLM's prompt_logprobs ride on each
choice's first chunk (chat: the stream's first chunk); assembled, a stream equals the
non-streamed answer to the same seeded request."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import openai
import pytest

from producer.gateway.openai_api import MissingPromptLogprobs, ScoredPrompt
from producer.gateway.prompt_gate import PromptGate
from producer.protocol import StreamEvent, TokenLogprob
from tests.gateway_service import MODEL

PROMPTS = ["Once upon a time", "The weather today"]
SEEDED: dict[str, Any] = {"max_tokens": 5, "seed": 11, "temperature": 1.0}


def assembled(chunks: Iterable[Any]) -> tuple[dict[int, dict[str, Any]], dict[int, Any]]:
    """Each index's text and legacy logprobs lists joined, and each index's first chunk."""
    joined: dict[int, dict[str, Any]] = {}
    firsts: dict[int, Any] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice)
            into = joined.setdefault(choice.index, {"text": "", "tokens": [], "token_logprobs": [],
                                                    "top_logprobs": [], "text_offset": []})
            into["text"] += choice.text
            if choice.logprobs is not None:
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    into[name] += getattr(choice.logprobs, name)
    return joined, firsts


CLOSE = {"abs": 1e-5}
"""Two runs of one request agree to float32's rounding, not bit for bit: the worker batches them
with different neighbours (the other prompts' tasks, other samples), and a batch's matmuls
round differently; seen: 1.7e-6 apart. The tokens, their order and the text are equal."""


def assert_close(streamed: list[float | None], whole: list[float | None]) -> None:
    assert len(streamed) == len(whole)
    assert [v is None for v in streamed] == [v is None for v in whole]
    assert [v for v in streamed if v is not None] == pytest.approx([v for v in whole if v is not None], **CLOSE)


def assert_same_prompt_logprobs(streamed: list[Any], whole: list[Any]) -> None:
    """vLLM's shape, as JSON: the same tokens, ranks and texts, logprobs CLOSE."""
    assert len(streamed) == len(whole) and streamed[0] is None and whole[0] is None
    for ours, theirs in zip(streamed[1:], whole[1:]):
        assert {k: (v["rank"], v["decoded_token"]) for k, v in ours.items()} == {
            k: (v["rank"], v["decoded_token"]) for k, v in theirs.items()}
        assert [ours[k]["logprob"] for k in theirs] == pytest.approx([v["logprob"] for v in theirs.values()], **CLOSE)


def test_streamed_echo_with_logprobs_assembles_to_the_non_streamed_answer(oai: openai.OpenAI):
    whole = oai.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, logprobs=2, **SEEDED)
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPTS[0], echo=True, logprobs=2, stream=True,
                                         **SEEDED))
    joined, firsts = assembled(chunks)
    expected = whole.choices[0].logprobs
    assert expected is not None and list(joined) == [0]
    streamed = joined[0]
    assert streamed["text"] == whole.choices[0].text
    assert streamed["tokens"] == expected.tokens
    assert_close(streamed["token_logprobs"], expected.token_logprobs)
    assert streamed["text_offset"] == expected.text_offset
    assert [None if top is None else sorted(top) for top in streamed["top_logprobs"]] == [
        None if top is None else sorted(top) for top in expected.top_logprobs]
    first = firsts[0]  # the echo, alone, with the prompt's tokens: their count is the prompt's
    assert first.text == PROMPTS[0] and first.logprobs is not None
    assert len(first.logprobs.tokens) == whole.usage.prompt_tokens
    assert first.logprobs.token_logprobs[0] is None and first.logprobs.top_logprobs[0] is None


def test_a_streamed_list_of_prompts_opens_every_choice_with_its_echoed_prompt(oai: openai.OpenAI):
    whole = oai.completions.create(model=MODEL, prompt=PROMPTS, n=2, echo=True, logprobs=1, **SEEDED)
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPTS, n=2, echo=True, logprobs=1, stream=True,
                                         **SEEDED))
    joined, firsts = assembled(chunks)
    assert sorted(joined) == list(range(4))
    for choice in whole.choices:
        assert choice.logprobs is not None
        streamed = joined[choice.index]
        assert streamed["text"] == choice.text
        assert (streamed["tokens"], streamed["text_offset"]) == (choice.logprobs.tokens, choice.logprobs.text_offset)
        assert_close(streamed["token_logprobs"], choice.logprobs.token_logprobs)
        first = firsts[choice.index]
        assert first.text == PROMPTS[choice.index // 2] and first.logprobs is not None
        assert first.logprobs.token_logprobs[0] is None
        assert first.logprobs.tokens == choice.logprobs.tokens[:len(first.logprobs.tokens)]


def test_streamed_prompt_logprobs_equal_the_non_streamed_ones_on_both_endpoints(oai: openai.OpenAI):
    extra = {"extra_body": {"prompt_logprobs": 2}}
    whole = oai.completions.create(model=MODEL, prompt=PROMPTS, **SEEDED, **extra)
    chunks = list(oai.completions.create(model=MODEL, prompt=PROMPTS, stream=True, **SEEDED, **extra))
    joined, firsts = assembled(chunks)
    for choice in whole.choices:
        assert joined[choice.index]["text"] == choice.text
        assert firsts[choice.index].text == ""  # no echo: the first chunk shows the scores alone
        assert_same_prompt_logprobs(firsts[choice.index].model_extra["prompt_logprobs"],
                                    choice.model_extra["prompt_logprobs"])
    carrying = [c for chunk in chunks for c in chunk.choices if (c.model_extra or {}).get("prompt_logprobs")]
    assert len(carrying) == len(PROMPTS)  # once per choice

    messages = [{"role": "user", "content": "Hi there"}]
    chat = oai.chat.completions.create(model=MODEL, messages=messages, n=2, **SEEDED, **extra)
    streamed = list(oai.chat.completions.create(model=MODEL, messages=messages, n=2, stream=True, **SEEDED, **extra))
    assert [bool((c.model_extra or {}).get("prompt_logprobs")) for c in streamed] == [True] + [False] * (
        len(streamed) - 1)  # on the stream's first chunk, as vLLM puts its prompt_token_ids
    assert streamed[0].choices[0].delta.role == "assistant"
    assert_same_prompt_logprobs(streamed[0].model_extra["prompt_logprobs"], chat.model_extra["prompt_logprobs"])
    texts: dict[int, str] = {}
    for chunk in streamed:
        for delta in chunk.choices:
            texts[delta.index] = texts.get(delta.index, "") + (delta.delta.content or "")
    assert texts == {c.index: c.message.content for c in chat.choices}


# --- the gate that holds a task's text behind its prompt's scores ----------------------------------


def event(seq: int, kind: str = "chunk", attempt: int = 1, **fields: Any) -> StreamEvent:
    ends = {"done": "stop", "cancelled": "cancelled", "error": "error"}
    return StreamEvent(id="t", seq=seq, attempt=attempt, event=kind, finish_reason=ends.get(kind),
                       error="boom" if kind == "error" else None, **fields)


SCORES = {"prompt_token_ids": [1, 5], "prompt_logprobs": [None, TokenLogprob(token_id=5, token="x", logprob=-1.0)]}


def test_the_gate_holds_other_samples_chunks_until_the_scores_come_then_passes_everything():
    gate = PromptGate(waiting=True)
    early = [event(0, "started"), event(1, text="b", index=1)]
    assert [gate.feed(e) for e in early] == [(None, []), (None, [])]
    opening = event(2, text="", index=0, **SCORES)
    scored, ready = gate.feed(opening)
    assert scored == ScoredPrompt([1, 5], SCORES["prompt_logprobs"]) and ready == [*early, opening]
    again = event(1, attempt=2, index=0, text="a", **SCORES)  # a redelivered attempt's copy: shown once only
    assert gate.feed(again) == (None, [again])
    assert PromptGate(waiting=False).feed(early[1]) == (None, [early[1]])


def test_the_gate_lets_a_failure_through_and_refuses_an_end_without_the_scores():
    failed = event(1, "error")
    assert PromptGate(waiting=True).feed(failed) == (None, [failed])
    with pytest.raises(MissingPromptLogprobs, match="request t: the worker returned no prompt log-probabilities"):
        PromptGate(waiting=True).feed(event(1, "done"))
