"""Structured output and log-probabilities through the gateway's OpenAI endpoints, with the
official openai client against a real gateway and worker: response_format json_schema /
json_object, the client's parse() with a Pydantic model, vLLM's guided_* extensions, chat and
completions logprobs in OpenAI's shapes (streamed and not), and a constraint that does not
compile refused with 400 before anything is queued or streamed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine import Tokenizer
from tests.gateway_service import MODEL, bearer

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "confidence"], "additionalProperties": False}
QUESTION = [{"role": "user", "content": "Is the sky blue?"}]


class Verdict(BaseModel):
    label: Literal["spam", "ham"]
    score: int = Field(ge=0, le=9)


def test_chat_response_format_json_schema_and_json_object(oai: openai.OpenAI):
    reply = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=60, temperature=1.0, seed=3,
                                        response_format={"type": "json_schema",
                                                         "json_schema": {"name": "answer", "schema": SCHEMA}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    assert reply.choices[0].finish_reason == "stop"
    anything = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=200, temperature=0,
                                           response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
    else:  # cut at max_tokens: still a prefix of an object
        assert anything.choices[0].message.content.startswith("{")


def test_the_openai_client_parse_helper_returns_the_pydantic_model(oai: openai.OpenAI):
    parse = oai.chat.completions.parse if hasattr(oai.chat.completions, "parse") else \
        oai.beta.chat.completions.parse
    completion = parse(model=MODEL, messages=QUESTION, max_tokens=60, response_format=Verdict, temperature=0)
    verdict = completion.choices[0].message.parsed
    assert isinstance(verdict, Verdict) and verdict.label in ("spam", "ham")


def test_vllm_guided_extensions_on_both_endpoints(oai: openai.OpenAI):
    choice = oai.completions.create(model=MODEL, prompt="Sentiment:", max_tokens=10,
                                    extra_body={"guided_choice": ["positive", "negative"]})
    assert choice.choices[0].text in ("positive", "negative")
    regex = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20,
                                        extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.choices[0].message.content)
    grammar = oai.completions.create(model=MODEL, prompt="List:", max_tokens=30,
                                     extra_body={"guided_grammar": 'root ::= "[" [a-c] ("," [a-c])? "]"'})
    assert re.fullmatch(r"\[[a-c](,[a-c])?\]", grammar.choices[0].text)


def test_chat_logprobs_in_openai_shape_streamed_and_not(oai: openai.OpenAI):
    reply = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0,
                                        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 8
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy: the best
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
    stream = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0,
                                         logprobs=True, top_logprobs=3, stream=True, extra_body={"ignore_eos": True})
    streamed = [entry for chunk in stream for choice in chunk.choices if choice.logprobs
                for entry in choice.logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_completions_logprobs_in_the_legacy_shape(oai: openai.OpenAI):
    reply = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2,
                                   extra_body={"ignore_eos": True})
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    assert all(len(top) <= 2 and max(top.values()) >= lp - 1e-6
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True))


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_that_does_not_compile_is_a_400_before_anything_is_queued(gateway: str, stream: bool):
    for body, problem in (
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "constraint: json_schema"),
        ({"guided_regex": "(unclosed"}, "constraint: regex"),
        ({"guided_grammar": "start: missing_rule"}, "constraint: lark"),
    ):
        reply = httpx.post(f"{gateway}/v1/chat/completions", headers=bearer(), timeout=30,
                           json={"model": MODEL, "messages": QUESTION, "stream": stream, **body})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == "invalid_constraint" and error["message"].startswith(problem), error
    two = httpx.post(f"{gateway}/v1/chat/completions", headers=bearer(), timeout=30,
                     json={"model": MODEL, "messages": QUESTION, "guided_regex": "a", "guided_choice": ["b"]})
    assert two.status_code == 400 and "one output constraint" in two.json()["error"]["message"]


def test_allowed_token_ids_restrict_the_completion(oai: openai.OpenAI, model_dir: Path):
    allowed = [40, 41, 42]
    tokenizer = Tokenizer.from_pretrained(model_dir)
    texts = {tokenizer.decode([token], skip_special_tokens=False) for token in allowed}
    reply = oai.completions.create(model=MODEL, prompt="Counting:", max_tokens=10, temperature=1.0, seed=5,
                                   logprobs=0, extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    tokens = reply.choices[0].logprobs.tokens
    assert len(tokens) == 10 and set(tokens) <= texts
