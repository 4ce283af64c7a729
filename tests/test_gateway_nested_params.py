"""Unknown keys inside the OpenAI request's objects (issue 25, item 4): a misspelt
`stream_options.include_usages`, a key nobody defines in `response_format`, a tool's function,
`tool_choice`, a message or a text part, is a 400 `unknown_parameter` naming its dotted path, as
a top-level one is, unless GENQ_GATEWAY_IGNORE_UNKNOWN_PARAMS is set; every key the installed
openai SDK can send there is accepted, a response's message can be sent back as the client got
it, and JSON Schemas (a tool's parameters, response_format's schema) are never looked into. The
official openai client against a real gateway and worker."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import shared_params
from openai.types.chat import (
    ChatCompletionAssistantMessageParam,
    ChatCompletionContentPartTextParam,
    ChatCompletionDeveloperMessageParam,
    ChatCompletionFunctionToolParam,
    ChatCompletionMessage,
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionStreamOptionsParam,
    ChatCompletionSystemMessageParam,
    ChatCompletionToolMessageParam,
    ChatCompletionUserMessageParam,
)
from openai.types.chat import completion_create_params as chat_create_params

from producer.gateway import openai_api
from tests.gateway_service import MODEL, TOKEN, GatewayProcess, service_env

ASK: list[Any] = [{"role": "user", "content": "Is the sky blue?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
ODD_SCHEMA = {**SCHEMA, "x-vendor": {"anything": True}, "title": "Answer", "$comment": "free-form: never checked"}
TOOL: dict[str, Any] = {"type": "function", "function": {"name": "answer", "description": "Answer",
                                                         "parameters": ODD_SCHEMA, "strict": True}}
MISSPELT: list[tuple[dict[str, Any], str]] = [
    ({"stream_options": {"include_usages": True}, "stream": True}, "stream_options.include_usages"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strct": True}}},
     "response_format.json_schema.strct"),
    ({"response_format": {"type": "json_object", "shema": SCHEMA}}, "response_format.shema"),
    ({"tools": [{"type": "function", "function": {"name": "answer", "descripton": "x", "parameters": SCHEMA}}]},
     "tools[0].function.descripton"),
    ({"tools": [{**TOOL, "cache_control": {"type": "ephemeral"}}]}, "tools[0].cache_control"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "answer", "nmae": "x"}}},
     "tool_choice.function.nmae"),
    ({"functions": [{"name": "answer", "parameters": SCHEMA, "descripton": "x"}]}, "functions[0].descripton"),
    ({"messages": [{"role": "user", "content": "Hi", "nmae": "ann"}]}, "messages[0].nmae"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {}}]}]},
     "messages[0].content[0].cache_control"),
    ({"structured_outputs": {"choice": ["yes", "no"], "choices": ["yes"]}}, "structured_outputs.choices"),
]


def sdk_keys(typed_dict: Any) -> set[str]:
    return set(typing.get_type_hints(typed_dict))


def create(client: openai.OpenAI, body: dict[str, Any]) -> Any:
    """A chat request of `body` (its messages, or ASK) through the SDK; extra_body carries what
    the SDK's signature has no parameter for."""
    body = {"messages": ASK, **body}
    declared = set(chat_create_params.CompletionCreateParamsBase.__annotations__)
    known = {name: value for name, value in body.items() if name in declared}
    extra = {name: value for name, value in body.items() if name not in declared}
    reply = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, **known, extra_body=extra)
    return list(reply) if body.get("stream") else reply


@pytest.mark.parametrize("body, param", MISSPELT, ids=[param for _, param in MISSPELT])
def test_an_unknown_key_inside_a_request_object_is_a_400_naming_its_path(oai: openai.OpenAI, body: dict[str, Any],
                                                                        param: str):
    with pytest.raises(openai.BadRequestError) as refused:
        create(oai, body)
    error = refused.value.body
    assert isinstance(error, dict) and (error["code"], error["param"]) == ("unknown_parameter", param)
    assert f"'{param}'" in error["message"]


HI = b'"messages": [{"role": "user", "content": "Hi"}]'


@pytest.mark.parametrize("fields, param", [
    (HI + b', "response_format": {"type": "json_object", "\\ud800": 1}', "response_format.\\ud800"),
    (HI + b', "tools": [{"type": "function", "function": {"name": "f", "a\\nb": 1}}]', "tools[0].function.a\\nb"),
    (b'"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "' + b"k" * 5000 + b'": 1}]}]',
     "messages[0].content[0]." + "k" * 37 + "..."),
])
def test_a_hostile_or_long_unknown_key_is_named_escaped_and_cut(gateway: str, fields: bytes, param: str):
    """A lone surrogate (which cannot be encoded as UTF-8), a newline or a long key is named as the
    protocol names such fields: escaped and cut, never a 500."""
    body = b'{"model": "%s", %s}' % (MODEL.encode(), fields)
    reply = httpx.post(f"{gateway}/v1/chat/completions", content=body, timeout=30,
                       headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert (reply.json()["error"]["code"], reply.json()["error"]["param"]) == ("unknown_parameter", param)


def test_the_completions_endpoints_objects_are_checked_too(oai: openai.OpenAI):
    for extra, param in (({"stream_options": {"include_usage": True, "continuous_usage": True}},
                          "stream_options.continuous_usage"),
                         ({"structured_outputs": {"regex": "[0-9]", "regx": "x"}}, "structured_outputs.regx")):
        with pytest.raises(openai.BadRequestError) as refused:
            oai.completions.create(model=MODEL, prompt="Hi", max_tokens=4, stream=True, extra_body=extra)
        assert isinstance(refused.value.body, dict) and refused.value.body["param"] == param


def test_what_the_sdk_and_a_response_carry_is_accepted_and_schemas_are_free_form(oai: openai.OpenAI):
    """OpenAI's include_obfuscation, a text part's prompt_cache_breakpoint, a tool's strict, a JSON
    Schema with vendor keywords, vLLM's ignored structured_outputs options, and the answer's
    message sent back in the history as the SDK returned it (refusal, annotations, audio,
    function_call all null)."""
    first = oai.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0, stream=False, tools=[TOOL], tool_choice="auto",
        messages=[{"role": "developer", "content": "Answer."},
                  {"role": "user", "content": [{"type": "text", "text": "Is the sky blue?",
                                                "prompt_cache_breakpoint": {"ttl": "5m"}}]}])
    history = [*ASK, first.choices[0].message.model_dump(), {"role": "user", "content": "Sure?"}]
    chunks = list(oai.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0, messages=history, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "description": "d",
                                                                "schema": ODD_SCHEMA, "strict": True}}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    reply = oai.completions.create(model=MODEL, prompt="Sky:", max_tokens=4, extra_body={
        "structured_outputs": {"choice": ["yes", "no"], "disable_fallback": True, "disable_any_whitespace": True,
                               "whitespace_pattern": " "}})
    assert reply.choices[0].text in ("yes", "no")


def test_every_nested_key_of_the_openai_sdk_is_declared():
    """Each key the installed SDK can send inside the request's objects, or that a response's
    message holds (sent back in the history), is accepted: none reaches the refusal."""
    message_keys = set(openai_api.ChatMessageParam.model_fields) | openai_api.ChatMessageParam.ACCEPTED
    for param in (ChatCompletionSystemMessageParam, ChatCompletionDeveloperMessageParam,
                  ChatCompletionUserMessageParam, ChatCompletionAssistantMessageParam,
                  ChatCompletionToolMessageParam):
        assert sdk_keys(param) <= message_keys, param
    assert set(ChatCompletionMessage.model_fields) <= message_keys
    assert sdk_keys(ChatCompletionContentPartTextParam) <= openai_api.TEXT_PART_SHAPE.keys()
    stream_options = openai_api.StreamOptionsParam
    assert sdk_keys(ChatCompletionStreamOptionsParam) <= set(stream_options.model_fields) | stream_options.ACCEPTED
    for kind, param in (("text", shared_params.ResponseFormatText),
                        ("json_object", shared_params.ResponseFormatJSONObject),
                        ("json_schema", shared_params.ResponseFormatJSONSchema)):
        assert sdk_keys(param) <= openai_api.RESPONSE_FORMAT_SHAPES[kind].keys()
    json_schema = openai_api.RESPONSE_FORMAT_SHAPES["json_schema"]["json_schema"]
    assert json_schema is not None
    assert sdk_keys(shared_params.response_format_json_schema.JSONSchema) <= json_schema.keys()
    assert sdk_keys(ChatCompletionFunctionToolParam) <= openai_api.TOOL_SHAPE.keys()
    assert sdk_keys(shared_params.FunctionDefinition) <= openai_api.FUNCTION_SHAPE.keys()
    assert sdk_keys(chat_create_params.Function) <= openai_api.FUNCTION_SHAPE.keys()
    assert sdk_keys(ChatCompletionNamedToolChoiceParam) <= openai_api.NAMED_TOOL_CHOICE_SHAPE.keys()


def test_the_opt_out_lets_unknown_nested_keys_through_and_logs_them(worker: object, redis_url: str, tmp_path: Path):
    env = {**service_env(redis_url), "GENQ_GATEWAY_TOKEN": TOKEN, "GENQ_GATEWAY_MODEL_NAME": MODEL,
           "GENQ_GATEWAY_IGNORE_UNKNOWN_PARAMS": "true"}
    with GatewayProcess(env, tmp_path / "gateway.log") as lenient:
        client = openai.OpenAI(base_url=f"{lenient.url}/v1", api_key=TOKEN, max_retries=0, timeout=60)
        for body, param in MISSPELT:
            create(client, body)
            assert f"ignoring unknown parameters: {param}" in lenient.log()
