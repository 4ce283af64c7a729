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
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from pydantic import BaseModel, Field

from engine import Tokenizer
from producer.gateway import openai_api
from tests.gateway_service import MODEL, TOKEN, GatewayProcess, bearer, service_env

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


def test_schema_bearing_json_object_and_vllm_structured_outputs_are_honoured(oai: openai.OpenAI):
    """llama.cpp's / Together's {"type": "json_object", "schema": ...} keeps its schema; vLLM's
    current structured_outputs object works as its older guided_* fields do (issue 25, item 4)."""
    reply = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=60, temperature=1.0, seed=4,
                                        response_format={"type": "json_object", "schema": SCHEMA})  # type: ignore
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    chat = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=60, temperature=1.0, seed=5,
                                       extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    regex = oai.completions.create(model=MODEL, prompt="Code:", max_tokens=20,
                                   extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.choices[0].text)
    choice = oai.completions.create(model=MODEL, prompt="Sentiment:", max_tokens=10,
                                    extra_body={"structured_outputs": {"choice": ["positive", "negative"]}})
    assert choice.choices[0].text in ("positive", "negative")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_an_unknown_parameter_is_a_400_naming_it(oai: openai.OpenAI, endpoint: str):
    """A misspelt max_tokens must not fall back to the default silently (issue 25, item 4)."""
    with pytest.raises(openai.BadRequestError) as refused:
        if endpoint == "chat":
            oai.chat.completions.create(model=MODEL, messages=QUESTION, extra_body={"max_token": 5, "tmperature": 0})
        else:
            oai.completions.create(model=MODEL, prompt="Hi", extra_body={"max_token": 5})
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "unknown_parameter" and error["param"] == "max_token"
    assert "'max_token'" in error["message"]


def test_openai_parameters_genq_cannot_honour_are_refused_and_harmless_ones_ignored(oai: openai.OpenAI):
    reply = oai.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=3, user="u-1", store=False, metadata={"team": "a"},
        service_tier="auto", prompt_cache_key="k", safety_identifier="s", reasoning_effort="low",
        modalities=["text"], prediction={"type": "content", "content": "Yes"})
    assert reply.choices[0].finish_reason in ("stop", "length")
    for params, param in (({"audio": {"voice": "alloy", "format": "mp3"}, "modalities": ["text", "audio"]}, "audio"),
                          ({"modalities": ["text", "audio"]}, "modalities"),
                          ({"web_search_options": {}}, "web_search_options")):
        with pytest.raises(openai.BadRequestError) as refused:
            oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, **params)
        assert isinstance(refused.value.body, dict) and refused.value.body["param"] == param


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_parameter_of_the_openai_sdk_is_declared(endpoint: str):
    """Each parameter the installed SDK can send is supported, ignored for a stated reason or
    refused by name: none reaches the unknown-parameter refusal."""
    params = (chat_create_params if endpoint == "chat" else completion_create_params).CompletionCreateParamsBase
    request = openai_api.ChatCompletionRequest if endpoint == "chat" else openai_api.CompletionRequest
    declared = set(request.model_fields) | openai_api.IGNORED_PARAMS.keys() | openai_api.REFUSED_PARAMS.keys()
    assert set(params.__annotations__) - declared - {"modalities"} == set()


def test_the_ignore_unknown_params_setting_lets_vendor_extras_through(worker: object, redis_url: str,
                                                                      tmp_path: Path):
    env = {**service_env(redis_url), "GENQ_GATEWAY_TOKEN": TOKEN, "GENQ_GATEWAY_MODEL_NAME": MODEL,
           "GENQ_GATEWAY_IGNORE_UNKNOWN_PARAMS": "true"}
    with GatewayProcess(env, tmp_path / "gateway.log") as lenient:
        client = openai.OpenAI(base_url=f"{lenient.url}/v1", api_key=TOKEN, max_retries=0, timeout=60)
        reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3,
                                               extra_body={"vendor_extra": {"x": 1}})
        assert reply.choices[0].message.content is not None
        assert "ignoring unknown parameters: vendor_extra" in lenient.log()
