"""Tool calling through the gateway's chat endpoint with the real clients (the official openai SDK,
instructor, langchain-openai) against a real gateway and worker on a tiny random model: forced
calls (a named function and "required"), streamed and not, whose arguments validate against the
tool's schema; streamed tool-call deltas that assemble into exactly the worker's result (ids
included); a tool-result round trip in the history; the legacy functions parameters; and the
refusals of tool requests that cannot be honoured. The tiny model's template has no tool support:
the worker renders the generic tool prompt (docs/tools.md). Random weights would go on calling
until max_tokens where a forced grammar allows more calls, so the client-library tests ask for one
call (parallel_tool_calls false), as a trained model ends after its calls by itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from engine import Tokenizer
from producer.client import GenqClient
from producer.tool_calls import template_messages, with_generic_tool_prompt
from tests.gateway_service import MODEL, TOKEN

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 16},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


class Forecast(BaseModel):
    """The forecast to report."""

    model_config = ConfigDict(extra="forbid")  # closed: else random weights add keys until max_tokens
    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


def _calls(message: Any) -> list[tuple[str, str, str]]:
    return [(call.id, call.function.name, call.function.arguments) for call in message.tool_calls or ()]


def _assemble(stream: Any) -> tuple[str, list[tuple[str, str, str]], str | None, str]:
    """(content, calls, finish_reason, completion id) of a streamed chat answer, assembled as
    OpenAI documents it: a call's first delta has its id, type and name, later ones add arguments."""
    content, calls, finish, identifier = "", {}, None, ""
    for chunk in stream:
        identifier = chunk.id
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for piece in delta.tool_calls or ():
                if piece.id is not None:
                    assert piece.type == "function" and piece.function.name and piece.function.arguments == ""
                    calls[piece.index] = [piece.id, piece.function.name, ""]
                else:
                    assert piece.function.name is None
                calls[piece.index][2] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, identifier  # type: ignore[misc]


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_a_forced_call_validates_streamed_and_not_and_the_stream_assembles_to_the_result(
        oai: openai.OpenAI, genq: GenqClient, choice: Any):
    params: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": choice,
                              "max_tokens": 120, "temperature": 1.0, "seed": 11}
    reply = oai.chat.completions.create(**params)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    calls = _calls(message)
    assert len(calls) >= 1 and len({call[0] for call in calls}) == len(calls)
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_") and (name == "get_weather" or choice == "required")
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    content, streamed, finish, identifier = _assemble(oai.chat.completions.create(**params, stream=True))
    assert (content, finish) == ("", "tool_calls")
    # The same seed writes the same calls; ids are the request's own.
    assert [call[1:] for call in streamed] == [call[1:] for call in calls]
    result = genq.handle(identifier).result(timeout=60)
    assert result.finish_reason == "tool_calls" and result.content == ""
    assert streamed == [(call.id, call.name, call.arguments) for call in result.tool_calls or ()]


def test_tool_choice_auto_answers_streamed_as_not_and_a_call_it_makes_validates(oai: openai.OpenAI):
    """tool_choice auto through the SDK: the worker applies the auto grammar (free text until a
    call starts; tests/test_tool_calls.py checks what it lets through), and the streamed answer,
    content and calls, assembles to the non-streamed one for the same seed."""
    for seed in range(3):
        params: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "auto",
                                  "parallel_tool_calls": False, "max_tokens": 40, "temperature": 1.0, "seed": seed}
        reply = oai.chat.completions.create(**params)
        calls = _calls(reply.choices[0].message)
        for _, name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert reply.choices[0].finish_reason == ("tool_calls" if calls else "length")
        content, streamed, finish, _ = _assemble(oai.chat.completions.create(**params, stream=True))
        assert ([call[1:] for call in streamed], finish) == ([call[1:] for call in calls],
                                                              reply.choices[0].finish_reason)
        assert content == (reply.choices[0].message.content or "")


def test_parallel_tool_calls_false_makes_exactly_one_call(oai: openai.OpenAI):
    for seed in range(3):
        reply = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=seed)
        assert len(reply.choices[0].message.tool_calls or ()) == 1


def test_a_tool_result_round_trip_renders_the_history_and_answers(oai: openai.OpenAI, model_dir: Path):
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    reply = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    # The worker rendered exactly the generic tool prompt's conversation (the template has no tools).
    tokenizer = Tokenizer.from_pretrained(model_dir)
    expected = tokenizer.encode_chat(with_generic_tool_prompt(template_messages(history), TOOLS))
    assert reply.usage is not None and reply.usage.prompt_tokens == len(expected)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
    assert reply.choices[0].message.content or reply.choices[0].message.tool_calls


def test_tool_choice_none_leaves_the_output_as_text(oai: openai.OpenAI):
    reply = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=6,
                                        temperature=0)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason in ("stop", "length")


def test_the_legacy_functions_parameters_force_a_call_answered_as_function_call_streamed_and_not(
        oai: openai.OpenAI):
    """As OpenAI answers the legacy functions: one `message.function_call` (no tool_calls) and
    finish_reason "function_call"; streamed, `delta.function_call` pieces."""
    params: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 120, "temperature": 0,
                              "functions": [TOOLS[1]["function"]], "function_call": {"name": "get_time"}}
    reply = oai.chat.completions.create(**params)
    message = reply.choices[0].message
    assert message.tool_calls is None and message.function_call is not None
    assert message.function_call.name == "get_time" and reply.choices[0].finish_reason == "function_call"
    jsonschema.validate(json.loads(message.function_call.arguments), TIME)
    name, arguments, finish = None, "", None
    for chunk in oai.chat.completions.create(**params, stream=True):
        for choice in chunk.choices:
            assert choice.delta.tool_calls is None
            call = choice.delta.function_call
            if call is not None:
                name = call.name or name
                arguments += call.arguments or ""
            finish = choice.finish_reason or finish
    assert (name, arguments, finish) == ("get_time", message.function_call.arguments, "function_call")


def test_the_parse_helper_returns_the_pydantic_arguments(oai: openai.OpenAI):
    completion = oai.chat.completions.parse(
        model=MODEL, messages=ASK, max_tokens=120, temperature=0, parallel_tool_calls=False,
        tools=[openai.pydantic_function_tool(Forecast)],
        tool_choice={"type": "function", "function": {"name": "Forecast"}})
    [call] = completion.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Forecast)


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format|tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "functions": [TOOLS[0]["function"]]}, "functions"),
])
def test_tool_requests_genq_cannot_honour_are_a_400_naming_the_parameter(oai: openai.OpenAI, body: dict[str, Any],
                                                                        param: str):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=body)
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == param


def test_instructor_in_tools_and_json_schema_modes(oai: openai.OpenAI):
    instructor = pytest.importorskip("instructor")
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(oai, mode=mode)
        forecast = client.chat.completions.create(model=MODEL, response_model=Forecast, messages=ASK, max_tokens=120,
                                                  temperature=0, max_retries=0, parallel_tool_calls=False)
        assert isinstance(forecast, Forecast)


def test_langchain_bind_tools_and_with_structured_output(gateway: str):
    chat_models = pytest.importorskip("langchain_openai")
    llm = chat_models.ChatOpenAI(model=MODEL, base_url=f"{gateway}/v1", api_key=TOKEN, max_retries=0,
                                 temperature=0, max_tokens=120)
    message = llm.bind_tools([Forecast], tool_choice="Forecast", parallel_tool_calls=False).invoke("Weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "Forecast" and Forecast.model_validate(call["args"])
    for method in (None, "function_calling", "json_schema"):
        options = {} if method is None else {"method": method}
        assert isinstance(llm.with_structured_output(Forecast, **options).invoke("Weather in Paris?"), Forecast)
