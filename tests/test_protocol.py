"""The wire protocol (producer/protocol.py) and its documentation (docs/protocol.md)."""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

from producer import protocol as p
from producer.gateway.settings import GatewaySettings
from producer.protocol import (
    GenerationRequest,
    GenerationResult,
    ProtocolError,
    StreamEvent,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from producer.settings import ClientSettings

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "protocol.md"


def problems(payload: Any) -> str:
    with pytest.raises(ProtocolError) as info:
        GenerationRequest.parse_payload(payload)
    return str(info.value)


def refusal(payload: Any, expected: list[str]) -> str:
    """The message refusing payload, which must contain every expected fragment."""
    message = problems(payload)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# (payload, substrings the message must contain: the field, and the limit where there is one)
INVALID: dict[str, tuple[Any, list[str]]] = {
    "unknown field": ({"prompt": "x", "temprature": 0.5}, ["temprature: unknown field", "allowed: prompt"]),
    "unknown sampling field": ({"prompt": "x", "sampling": {"topk": 5}}, ["sampling.topk: unknown field"]),
    "no input": ({"max_new_tokens": 5}, ["prompt|messages|input_ids", "exactly one", "got none"]),
    "two inputs": ({"prompt": "x", "input_ids": [1]}, ["prompt|messages|input_ids", "got 2: prompt, input_ids"]),
    "three inputs": (
        {"prompt": "x", "messages": [{"role": "user", "content": "y"}], "input_ids": [1]},
        ["got 3: prompt, messages, input_ids"],
    ),
    "empty prompt": ({"prompt": ""}, ["prompt:", "at least 1 character"]),
    "empty input_ids": ({"input_ids": []}, ["input_ids:", "at least 1 item"]),
    "max_new_tokens 0": ({"prompt": "x", "max_new_tokens": 0}, ["max_new_tokens:", "greater than or equal to 1"]),
    "max_new_tokens too large": (
        {"prompt": "x", "max_new_tokens": p.MAX_NEW_TOKENS + 1},
        ["max_new_tokens:", f"less than or equal to {p.MAX_NEW_TOKENS}"],
    ),
    "min above max": ({"prompt": "x", "max_new_tokens": 8, "min_new_tokens": 9}, ["min_new_tokens:", "<= max_new_tokens (8)"]),
    "negative temperature": ({"prompt": "x", "sampling": {"temperature": -0.1}}, ["sampling.temperature:", "0"]),
    "temperature too high": ({"prompt": "x", "sampling": {"temperature": 2.5}}, ["sampling.temperature:", "equal to 2"]),
    "top_p 0": ({"prompt": "x", "sampling": {"top_p": 0}}, ["sampling.top_p:", "greater than 0"]),
    "top_p above 1": ({"prompt": "x", "sampling": {"top_p": 1.01}}, ["sampling.top_p:", "less than or equal to 1"]),
    "negative top_k": ({"prompt": "x", "sampling": {"top_k": -1}}, ["sampling.top_k:", "greater than or equal to 0"]),
    "repetition_penalty 0": ({"prompt": "x", "sampling": {"repetition_penalty": 0}}, ["sampling.repetition_penalty:"]),
    "presence_penalty too big": ({"prompt": "x", "sampling": {"presence_penalty": 3}}, ["sampling.presence_penalty:", "2"]),
    "seed too big": ({"prompt": "x", "sampling": {"seed": 2**63}}, ["sampling.seed:", str(2**63 - 1)]),
    "NaN": ({"prompt": "x", "sampling": {"min_p": float("nan")}}, ["sampling.min_p:", "finite"]),
    "bad identifier chars": ({"prompt": "x", "identifier": "a b/c"}, ["identifier:", "A-Z a-z 0-9", "'a b/c'"]),
    "identifier starting with a dash": ({"prompt": "x", "identifier": "-abc"}, ["identifier:", "starting with"]),
    "identifier with a newline": ({"prompt": "x", "identifier": "abc\n"}, ["identifier:"]),
    "identifier too long": ({"prompt": "x", "identifier": "a" * 129}, ["identifier:", "at most 128 characters", "got 129"]),
    "too many stop strings": ({"prompt": "x", "stop": ["s"] * 17}, ["stop:", "at most 16 items", "got 17"]),
    "over-long stop string": ({"prompt": "x", "stop": ["ok", "s" * 257]}, ["stop[1]:", "at most 256 characters", "got 257"]),
    "empty stop string": ({"prompt": "x", "stop": [""]}, ["stop[0]:", "at least 1 character"]),
    "too many stop token ids": ({"prompt": "x", "stop_token_ids": list(range(65))}, ["stop_token_ids:", "at most 64", "got 65"]),
    "negative token id": ({"input_ids": [5, -1]}, ["input_ids[1]:", "greater than or equal to 0"]),
    "huge token id": ({"input_ids": [2**31]}, ["input_ids[0]:", str(2**31 - 1)]),
    "too many input ids": ({"input_ids": [1] * (p.MAX_INPUT_IDS + 1)}, ["input_ids:", f"at most {p.MAX_INPUT_IDS}"]),
    "string for a number": ({"prompt": "x", "max_new_tokens": "16"}, ["max_new_tokens:", "valid integer", "string '16'"]),
    "string for a float": ({"prompt": "x", "sampling": {"temperature": "0.5"}}, ["sampling.temperature:", "valid number"]),
    "bool for a number": ({"prompt": "x", "max_new_tokens": True}, ["max_new_tokens:", "valid integer", "boolean true"]),
    "bool for a float": ({"prompt": "x", "timeout_s": False}, ["timeout_s:", "valid number", "boolean false"]),
    "float for an int": ({"prompt": "x", "max_new_tokens": 16.0}, ["max_new_tokens:", "valid integer"]),
    "string for a bool": ({"prompt": "x", "ignore_eos": "true"}, ["ignore_eos:", "valid boolean"]),
    "token_bias non-integer key": ({"prompt": "x", "sampling": {"token_bias": {"abc": 1}}}, ["sampling.token_bias:", "'abc'", "not a token id"]),
    "token_bias negative key": ({"prompt": "x", "sampling": {"token_bias": {"-3": 1}}}, ["sampling.token_bias[-3] (key):", "0"]),
    "token_bias value": ({"prompt": "x", "sampling": {"token_bias": {"3": 101}}}, ["sampling.token_bias[3]:", "100"]),
    "token_bias too many": (
        {"prompt": "x", "sampling": {"token_bias": {str(i): 1 for i in range(301)}}},
        ["sampling.token_bias:", "at most 300 items", "got 301"],
    ),
    "too many banned ids": (
        {"prompt": "x", "sampling": {"banned_token_ids": list(range(1025))}},
        ["sampling.banned_token_ids:", "at most 1024"],
    ),
    "priority 10": ({"prompt": "x", "priority": 10}, ["priority:", "less than or equal to 9"]),
    "negative priority": ({"prompt": "x", "priority": -1}, ["priority:", "greater than or equal to 0"]),
    "constraint and banned_strings": (
        {"prompt": "x", "constraint": {"type": "json_object"}, "banned_strings": ["no"]},
        ["constraint|banned_strings:", "at most one of constraint and banned_strings"],
    ),
    "constraint and token_healing": (
        {"prompt": "x", "constraint": {"type": "json_object"}, "token_healing": True},
        ["constraint|token_healing:", "at most one of constraint and token_healing"],
    ),
    "deadline and timeout": ({"prompt": "x", "deadline": 2e9, "timeout_s": 10}, ["deadline|timeout_s:", "not both"]),
    "deadline in milliseconds": ({"prompt": "x", "deadline": 1.7e12}, ["deadline:", "253402300799"]),
    "timeout 0": ({"prompt": "x", "timeout_s": 0}, ["timeout_s:", "greater than 0"]),
    "timeout too long": ({"prompt": "x", "timeout_s": 86401}, ["timeout_s:", "86400"]),
    "bad message role": ({"messages": [{"role": "robot", "content": "hi"}]}, ["messages[0].role:", "'user'", "'robot'"]),
    "message without content": ({"messages": [{"role": "user"}]}, ["messages[0].content:", "required"]),
    "unknown message field": ({"messages": [{"role": "user", "content": "x", "author": "a"}]}, ["messages[0].author: unknown field", "allowed: role, content"]),
    "too many messages": ({"messages": [{"role": "user", "content": "x"}] * 513}, ["messages:", "at most 512", "got 513"]),
    "messages too long in all": (
        {"messages": [{"role": "user", "content": "x" * 600_000}] * 2},
        ["messages:", f"at most {p.MAX_PROMPT_CHARS} characters", "got 1200000"],
    ),
    "metadata too many keys": ({"prompt": "x", "metadata": {str(i): "v" for i in range(17)}}, ["metadata:", "at most 16", "got 17"]),
    "metadata value too long": ({"prompt": "x", "metadata": {"k": "v" * 1025}}, ["metadata.k:", "at most 1024 characters"]),
    "metadata non-string value": ({"prompt": "x", "metadata": {"k": 1}}, ["metadata.k:", "valid string"]),
    "stream option type": ({"prompt": "x", "stream": {"enabled": 1}}, ["stream.enabled:", "valid boolean"]),
    "sampling not an object": ({"prompt": "x", "sampling": [0.5]}, ["sampling:", "array"]),
    "payload not an object": (["x"], ["request:", "object of keyword arguments"]),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_request_is_rejected_with_a_message_naming_the_field_and_limit(case: str):
    message = refusal(*INVALID[case])
    assert all(re.match(r"^[\w.\[\]|()\- ]+: \S", line) for line in message.splitlines()), message


def test_every_problem_is_listed_at_once_one_per_line():
    message = problems({
        "prompt": "x",
        "input_ids": [1],
        "max_new_tokens": 0,
        "sampling": {"temperature": 9, "top_p": 0},
        "identifier": "bad id",
        "deadline": 2e9,
        "timeout_s": 1,
        "extra": 1,
    })
    lines = message.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "max_new_tokens", "sampling.temperature", "sampling.top_p", "identifier", "extra",
        "prompt|messages|input_ids", "deadline|timeout_s",
    ]


def test_protocol_error_is_a_value_error_that_survives_being_rebuilt_from_its_message():
    with pytest.raises(ValueError) as info:
        GenerationRequest.parse_payload({"prompt": "", "priority": 10})
    error = info.value
    assert isinstance(error, ProtocolError) and len(error.problems) == 2
    rebuilt = ProtocolError(*error.args)  # how Celery recreates a stored exception
    assert rebuilt.problems == error.problems and str(rebuilt) == str(error)


def test_direct_construction_enforces_the_cross_field_rules_too():
    with pytest.raises(ValueError, match="exactly one of prompt, messages or input_ids"):
        GenerationRequest(prompt="x", input_ids=[1])
    with pytest.raises(ValueError, match="not both"):
        GenerationRequest(prompt="x", deadline=2e9, timeout_s=1.0)


def test_defaults_are_greedy_and_documented_values():
    request = GenerationRequest.parse_payload({"prompt": "hello"})
    assert request.max_new_tokens == p.DEFAULT_MAX_NEW_TOKENS == 256
    assert request.min_new_tokens == 0
    assert request.sampling.temperature == 0.0 and request.sampling.top_p == 1.0 and request.sampling.top_k == 0
    assert request.stream.enabled is True and request.stream.include_token_ids is False
    assert request.identifier is None and request.priority is None and request.add_bos is None
    assert request.metadata == {} and request.stop == [] and request.stop_token_ids == []


def test_limits_are_inclusive():
    request = GenerationRequest.parse_payload({
        "input_ids": [0, p.MAX_TOKEN_ID],
        "max_new_tokens": p.MAX_NEW_TOKENS,
        "min_new_tokens": p.MAX_NEW_TOKENS,
        "sampling": {"temperature": 2, "top_p": 1, "min_p": 1, "repetition_penalty": 10,
                     "frequency_penalty": -2, "presence_penalty": 2, "seed": 2**63 - 1,
                     "token_bias": {"0": -100, "1": 100}},
        "stop": ["s" * p.MAX_STOP_STRING_CHARS] * p.MAX_STOP_STRINGS,
        "identifier": "a" * p.MAX_IDENTIFIER_CHARS,
        "priority": 0,
        "timeout_s": p.MAX_TIMEOUT_S,
        "metadata": {f"k{i}": "v" * p.MAX_METADATA_VALUE_CHARS for i in range(p.MAX_METADATA_KEYS)},
    })
    assert request.sampling.temperature == 2.0 and isinstance(request.sampling.temperature, float)
    assert GenerationRequest.parse_payload({"prompt": "x", "priority": 9}).priority == 9


VALID = [
    {"prompt": "Once upon a time"},
    {
        "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": ""}, {"role": "tool", "content": "{}"}],
        "max_new_tokens": 64,
        "min_new_tokens": 4,
        "sampling": {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1,
                     "frequency_penalty": 0.5, "presence_penalty": -0.5, "seed": 12345,
                     "token_bias": {"17": -100, "42": 2.5}, "banned_token_ids": [3, 4]},
        "stop": ["\n\n", "END"],
        "stop_token_ids": [2],
        "ignore_eos": True,
        "decode_special_tokens": True,
        "identifier": "3f0c2a52-1c53-4c1e-9a4b-6f3e2f1d9a10",
        "priority": 3,
        "deadline": 1_900_000_000.5,
        "stream": {"enabled": False, "include_token_ids": True},
        "metadata": {"tenant": "acme", "callback": "https://example.com/hook"},
    },
    {"input_ids": [1, 2, 3], "add_bos": False, "timeout_s": 30, "identifier": "job:42.b_c"},
]


@pytest.mark.parametrize("payload", VALID, ids=["prompt", "messages", "input_ids"])
def test_valid_requests_round_trip_through_json(payload: dict[str, Any]):
    request = GenerationRequest.parse_payload(payload)
    for wire in (request.model_dump(mode="json"), request.to_kwargs()):
        again = GenerationRequest.parse_payload(json.loads(json.dumps(wire)))
        assert again == request
        assert again.model_dump(mode="json") == request.model_dump(mode="json")


def test_token_bias_json_keys_become_ints():
    request = GenerationRequest.parse_payload({"prompt": "x", "sampling": {"token_bias": {"17": -100, "42": 2}}})
    assert request.sampling.token_bias == {17: -100.0, 42: 2.0}
    assert all(type(k) is int for k in request.sampling.token_bias)
    assert request.model_dump(mode="json")["sampling"]["token_bias"] == {"17": -100.0, "42": 2.0}
    from_python = GenerationRequest.parse_payload({"prompt": "x", "sampling": {"token_bias": {17: -100}}})
    assert from_python.sampling.token_bias == {17: -100.0}


def test_to_kwargs_leaves_defaults_out():
    request = GenerationRequest.parse_payload({"prompt": "x", "sampling": {"seed": 1}, "identifier": "q1"})
    assert request.to_kwargs() == {"prompt": "x", "sampling": {"seed": 1}, "identifier": "q1"}


def test_ints_are_accepted_for_float_fields():
    request = GenerationRequest.parse_payload({"prompt": "x", "sampling": {"temperature": 1, "top_p": 1}, "timeout_s": 5})
    assert request.sampling.temperature == 1.0 and request.timeout_s == 5.0


# --- events and results ----------------------------------------------------------

USAGE = Usage(prompt_tokens=31, completion_tokens=7, cached_tokens=16)
TIMINGS = Timings(queued_s=0.004, prefill_s=0.021, generate_s=0.112)


def test_stream_events_round_trip_and_know_when_they_end():
    events = [
        StreamEvent(id="q1", seq=0, attempt=1, event="started"),
        StreamEvent(id="q1", seq=1, attempt=1, event="chunk", text="Two, ", token_ids=[5, 6]),
        StreamEvent(id="q1", seq=2, attempt=1, event="done", text="Two, three", finish_reason="stop",
                    usage=USAGE, timings=TIMINGS),
        StreamEvent(id="q1", seq=0, attempt=2, event="cancelled", finish_reason="cancelled"),
        StreamEvent(id="q1", seq=1, attempt=2, event="error", finish_reason="error", error="boom"),
        StreamEvent(id="q1", seq=2, attempt=2, event="done", finish_reason="deadline"),
    ]
    for event in events:
        wire = event.to_json()
        assert " " not in wire.replace("Two, ", "").replace("Two, three", "")
        assert "null" not in wire
        assert StreamEvent.from_json(wire) == event
        assert StreamEvent.from_json(wire.encode()) == event
    assert [e.is_terminal for e in events] == [False, False, True, True, True, True]


def test_stream_events_match_the_documented_example():
    wire = ('{"id":"q1","seq":3,"attempt":1,"event":"done","text":"Two, three and five.","finish_reason":"stop",'
            '"usage":{"prompt_tokens":31,"completion_tokens":7,"cached_tokens":16},'
            '"timings":{"queued_s":0.004,"prefill_s":0.021,"generate_s":0.112}}')
    assert wire in DOC.read_text()
    event = StreamEvent.from_json(wire)
    assert event.usage == USAGE and event.timings == TIMINGS and event.to_json() == wire


def test_stream_event_nulls_and_unknown_fields_from_newer_workers_are_accepted():
    event = StreamEvent.from_json('{"id":"q1","seq":1,"attempt":1,"event":"chunk","text":"a","token_ids":null,'
                                  '"finish_reason":null,"usage":null,"timings":null,"error":null,"new_field":1}')
    assert event.text == "a" and event.token_ids is None


@pytest.mark.parametrize("fields, fragment", [
    ({"event": "chunk", "finish_reason": "stop"}, "only terminal events"),
    ({"event": "done"}, "a done event needs one of deadline, length, stop"),
    ({"event": "done", "finish_reason": "cancelled"}, "a done event needs"),
    ({"event": "cancelled", "finish_reason": "stop"}, "a cancelled event needs one of cancelled"),
    ({"event": "error", "finish_reason": "error"}, "error: set on error events"),
    ({"event": "done", "finish_reason": "stop", "error": "x"}, "error: set on error events"),
    ({"event": "finished"}, "event"),
    ({"event": "chunk", "seq": -1}, "seq"),
    ({"event": "chunk", "attempt": 0}, "attempt"),
    ({"event": "chunk", "seq": "1"}, "seq"),
    ({"event": "chunk", "id": "bad id"}, "id"),
])
def test_inconsistent_stream_events_are_rejected(fields: dict[str, Any], fragment: str):
    data = {"id": "q1", "seq": 0, "attempt": 1, **fields}
    with pytest.raises(ValueError, match=re.escape(fragment)):
        StreamEvent.model_validate(data)


PROMPT_SCORES = [None, {"token_id": 9, "token": "b", "logprob": -2.5, "top_logprobs": [
    {"token_id": 4, "token": "c", "logprob": -0.5}]}]


def test_a_chunk_of_sample_0_carries_the_prompt_logprobs_even_with_empty_text():
    for index in (None, 0):
        wire = json.dumps({"id": "q1", "seq": 1, "attempt": 2, "event": "chunk", "text": "", "index": index,
                           "prompt_token_ids": [1, 9], "prompt_logprobs": PROMPT_SCORES})
        event = StreamEvent.from_json(wire)
        assert (event.text, event.prompt_token_ids) == ("", [1, 9])
        assert event.prompt_logprobs is not None and event.prompt_logprobs[0] is None
        assert event.prompt_logprobs[1] == TokenLogprob(token_id=9, token="b", logprob=-2.5, top_logprobs=[
            TopLogprob(token_id=4, token="c", logprob=-0.5)])
        assert StreamEvent.from_json(event.to_json()) == event  # the leading null survives exclude_none


@pytest.mark.parametrize("fields, fragment", [
    ({"event": "done", "finish_reason": "stop"}, "only chunk events of sample 0 carry them"),
    ({"event": "started"}, "only chunk events of sample 0 carry them"),
    ({"event": "chunk", "index": 1}, "only chunk events of sample 0 carry them"),
    ({"event": "chunk", "prompt_token_ids": [1]}, "one per prompt_token_ids entry, got 2 for 1 tokens"),
    ({"event": "chunk", "prompt_token_ids": None}, "set together or not at all"),
    ({"event": "chunk", "prompt_logprobs": None}, "set together or not at all"),
])
def test_prompt_logprobs_break_the_event_rules_elsewhere(fields: dict[str, Any], fragment: str):
    data = {"id": "q1", "seq": 0, "attempt": 1, "prompt_token_ids": [1, 9], "prompt_logprobs": PROMPT_SCORES,
            **fields}
    with pytest.raises(ValueError, match=re.escape(fragment)):
        StreamEvent.model_validate(data)


def test_generation_result_round_trips_through_a_dict():
    result = GenerationResult(id="q1", attempt=2, text="Two, three", token_ids=[5, 6, 7, 2], finish_reason="length",
                              usage=USAGE, timings=TIMINGS, metadata={"tenant": "acme"})
    data = result.to_dict()
    assert data["usage"] == {"prompt_tokens": 31, "completion_tokens": 7, "cached_tokens": 16}
    assert GenerationResult.from_dict(data) == result
    assert GenerationResult.from_dict(json.loads(json.dumps(data))) == result


def test_a_result_never_carries_an_error():
    with pytest.raises(ValueError, match="FAILURE"):
        GenerationResult(id="q1", attempt=1, text="", finish_reason="error", usage=USAGE, timings=TIMINGS)


# --- names -----------------------------------------------------------------------


def test_redis_names_share_one_prefix():
    assert p.channel_name("q1") == "genq:chan:q1"
    assert p.stream_key("q1") == "genq:events:q1"
    assert p.cancel_key("q1") == "genq:cancel:q1"
    assert p.control_channel() == "genq:control" == p.CONTROL_CHANNEL()
    assert p.channel_name("a:b.c-d_e", prefix="prod.llama") == "prod.llama:chan:a:b.c-d_e"
    assert p.stream_key("q1", "x") == "x:events:q1" and p.cancel_key("q1", "x") == "x:cancel:q1"
    assert p.control_channel("x") == "x:control"


def test_cancel_message_is_the_documented_json():
    assert json.loads(p.cancel_message("q1")) == {"cancel": "q1"}
    assert p.ControlMessage.model_validate_json('{"cancel": "q1"}').cancel == "q1"
    doc = DOC.read_text()
    assert 'SET {prefix}:cancel:{id} "1" EX 3600' in doc
    assert "PUBLISH {prefix}:control '{\"cancel\": \"<id>\"}'" in doc
    assert p.CANCEL_KEY_VALUE == "1" and p.CANCEL_KEY_TTL_S == 3600


def test_adapter_control_messages_are_the_documented_json_and_strict():
    assert json.loads(p.load_adapter_message("genq", "sql-bot", "/srv/lora/sql")) == {
        "load_adapter": {"queue": "genq", "name": "sql-bot", "path": "/srv/lora/sql"}}
    assert json.loads(p.unload_adapter_message("genq", "sql-bot")) == {
        "unload_adapter": {"queue": "genq", "name": "sql-bot"}}
    doc = DOC.read_text()
    assert """PUBLISH {prefix}:control '{"load_adapter": {"queue": "<queue>", "name": "<name>", "path": "<dir>"}}'""" \
        in doc
    assert """PUBLISH {prefix}:control '{"unload_adapter": {"queue": "<queue>", "name": "<name>"}}'""" in doc
    with pytest.raises(ProtocolError, match="^load_adapter.name: must be 1 to 128"):
        p.load_adapter_message("genq", "a b", "/x")
    with pytest.raises(ProtocolError, match="^load_adapter.path: a path holds no NUL"):
        p.load_adapter_message("genq", "a", "/x\x00")
    with pytest.raises(ProtocolError, match=f"^load_adapter.path: at most {p.MAX_ADAPTER_PATH_CHARS} characters"):
        p.load_adapter_message("genq", "a", "/" * (p.MAX_ADAPTER_PATH_CHARS + 1))
    with pytest.raises(ProtocolError, match="^unload_adapter.queue: must be 1 to 128"):
        p.unload_adapter_message("a queue", "a")
    for two in ({"cancel": "q1", "unload_adapter": {"queue": "q", "name": "a"}}, {}):
        with pytest.raises(ValueError, match="exactly one of cancel, load_adapter, unload_adapter"):
            p.ControlMessage.model_validate(two)
    with pytest.raises(ValueError, match="extra"):
        p.ControlMessage.model_validate({"unload_adapter": {"queue": "q", "name": "a", "path": "/x"}})


def test_a_request_names_its_adapter_by_the_identifier_rule():
    assert GenerationRequest.parse_payload({"prompt": "x", "adapter": "sql-bot.v2"}).adapter == "sql-bot.v2"
    assert GenerationRequest.parse_payload({"prompt": "x"}).adapter is None
    assert "adapter: at most 128 characters" in problems({"prompt": "x", "adapter": "a" * 129})
    assert "adapter: must be 1 to 128 characters" in problems({"prompt": "x", "adapter": "sql bot"})


@pytest.mark.parametrize("bad", ["", "a b", "a/b", "-a", "a" * 129, "ü", "a\n", None, 5])
@pytest.mark.parametrize("helper", [p.channel_name, p.stream_key, p.cancel_key])
def test_name_helpers_reject_bad_identifiers(helper, bad):
    with pytest.raises(ProtocolError, match="^identifier: must match"):
        helper(bad)


@pytest.mark.parametrize("helper", [p.channel_name, p.stream_key, p.cancel_key])
def test_name_helpers_reject_bad_prefixes(helper):
    with pytest.raises(ProtocolError, match="^prefix: must match"):
        helper("q1", prefix="bad prefix")
    with pytest.raises(ProtocolError, match="^prefix: must match"):
        p.control_channel("")
    with pytest.raises(ProtocolError, match="^identifier: must match"):
        p.cancel_message("a b")


# --- constants and docs ------------------------------------------------------------


def test_constants():
    assert (p.TASK_NAME, p.DEFAULT_QUEUE, p.DEFAULT_KEY_PREFIX, p.PROTOCOL_VERSION) == (
        "genq.generate", "genq", "genq", 1)
    assert (p.MIN_PRIORITY, p.MAX_PRIORITY) == (0, 9)
    assert set(p.__all__) <= set(dir(p))


def test_protocol_imports_without_torch_numpy_or_the_rest_of_genq():
    code = (
        "import sys\n"
        "for name in ('torch', 'numpy', 'engine', 'kernels', 'worker', 'triton', 'celery', 'redis'):\n"
        "    sys.modules[name] = None\n"
        "import producer.protocol\n"
        "mods = {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n"
        "assert not mods & {'torch', 'numpy', 'engine', 'kernels', 'worker'}, mods\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_documented_python_example_compiles():
    section = DOC.read_text().split("## 8. A complete Python producer", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1
    source = blocks[0]
    compile(source, "docs/protocol.md", "exec")
    imported = {m for m in re.findall(r"^(?:import|from) (\w+)", source, flags=re.M)}
    assert imported <= {"json", "time", "uuid", "redis", "celery"}, imported
    assert '"genq.generate"' in source and 'f"{PREFIX}:chan:{request_id}"' in source


def test_the_docs_state_every_limit():
    doc = DOC.read_text()
    for number in ("1,000,000", "512", "131,072", "32,768", "256", "16", "64", "300", "1,024", "86400",
                   "253402300799", p.IDENTIFIER_PATTERN):
        assert number in doc, number
    for field in GenerationRequest.model_fields:
        assert f"| `{field}` |" in doc, field
    for model in (p.SamplingParams, p.StreamOptions, p.ChatMessage, GenerationResult):
        for field in model.model_fields:
            assert f"| `{field}` |" in doc, (model.__name__, field)
    for field in StreamEvent.model_fields:
        assert f"| `{field}` |" in doc, field


# --- numeric bounds (issue 23: dry_base 1e308 overflowed in the engine) ---------------------------

# sampling field -> (a value past a limit, the limit the message must name)
OUT_OF_RANGE: dict[str, tuple[float, str]] = {
    "temperature": (1e-300, "at least 1e-05"),
    "repetition_penalty": (1e-300, "greater than or equal to 0.01"),
    "dry_multiplier": (1e308, "less than or equal to 100"),
    "dry_base": (1e308, "less than or equal to 8"),
    "dry_allowed_length": (20, "less than or equal to 19"),
    "dry_range": (2**31, "less than or equal to 2147483647"),
    "repetition_penalty_range": (2**31, "less than or equal to 2147483647"),
    "repetition_penalty_decay": (2**31, "less than or equal to 2147483647"),
    "smoothing_factor": (1e308, "less than or equal to 100"),
    "mirostat_tau": (1e308, "less than or equal to 100"),
    "mirostat_eta": (1.5, "less than or equal to 1"),
    "temp_exponent": (1e308, "less than or equal to 100"),
    "min_temp": (1e308, "less than or equal to 2"),
    "max_temp": (1e308, "less than or equal to 2"),
    "xtc_probability": (1.5, "less than or equal to 1"),
    "xtc_threshold": (-0.5, "greater than or equal to 0"),
    "skew": (-1e308, "greater than or equal to -10"),
    "tfs": (0, "greater than 0"),
    "typical": (1.5, "less than or equal to 1"),
    "top_a": (2, "less than or equal to 1"),
    "min_p": (-1, "greater than or equal to 0"),
    "top_k": (2**31, "less than or equal to 2147483647"),
    "frequency_penalty": (-1e308, "greater than or equal to -2"),
}


@pytest.mark.parametrize("field", sorted(OUT_OF_RANGE))
def test_out_of_range_sampling_values_are_refused_naming_field_and_limit(field: str):
    value, limit = OUT_OF_RANGE[field]
    message = problems({"prompt": "x", "sampling": {field: value}})
    assert message.startswith(f"sampling.{field}: ") and limit in message, message


def test_token_bias_values_are_bounded():
    message = problems({"prompt": "x", "sampling": {"token_bias": {"3": -1e308}}})
    assert message.startswith("sampling.token_bias[3]: ") and "greater than or equal to -100" in message


def _numeric_fields() -> list[tuple[str, Any]]:
    """(wire path, FieldInfo) of every number-valued request field."""
    fields = []
    for prefix, model in (("", GenerationRequest), ("sampling.", p.SamplingParams)):
        for name, info in model.model_fields.items():
            kinds = {kind for kind in typing.get_args(info.annotation) or (info.annotation,) if kind is not type(None)}
            if kinds <= {int, float}:
                fields.append((prefix + name, info))
    return fields


def _bounds(info: Any) -> tuple[str, Any, Any, str]:
    """The field's range as the docs write it: '[', lower, upper, ']' (or parentheses where open)."""
    lower = [(("(" if hasattr(m, "gt") else "["), getattr(m, "gt", getattr(m, "ge", None)))
             for m in info.metadata if hasattr(m, "gt") or hasattr(m, "ge")]
    upper = [(getattr(m, "lt", getattr(m, "le", None)), (")" if hasattr(m, "lt") else "]"))
             for m in info.metadata if hasattr(m, "lt") or hasattr(m, "le")]
    assert len(lower) == 1 and len(upper) == 1, info
    return lower[0][0], lower[0][1], upper[0][0], upper[0][1]


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


@pytest.mark.parametrize(("path", "info"), _numeric_fields(), ids=[path for path, _ in _numeric_fields()])
def test_every_numeric_field_is_bounded_both_ways_and_listed_in_the_limits_table(path: str, info: Any):
    opening, lower, upper, closing = _bounds(info)
    documented = f"| `{path}` | {opening}{_number(lower)}, {_number(upper)}{closing} |"
    assert documented in DOC.read_text(), documented
    number = int if isinstance(upper, int) else float
    for beyond, limit in ((upper * 2 + 1, upper), (lower if opening == "(" else lower - 1, lower)):
        if path.startswith("sampling."):
            payload = {"prompt": "x", "sampling": {path.split(".", 1)[1]: number(beyond)}}
        else:
            payload = {"prompt": "x", path: number(beyond)}
        message = problems(payload)
        assert f"{path}: " in message and _plain(limit) in message, message


def _plain(value: float) -> str:
    """A limit as pydantic's messages write it."""
    return str(int(value)) if float(value).is_integer() else str(value)


# The gateway's own numeric settings and module constants that are not limits on what a client
# may hold or send; every other one must be in the Gateway limits table.
NOT_GATEWAY_LIMITS = {
    "PORT": "where it listens",
    "RETRY_AFTER_S": "the Retry-After of a 429 (the setting; tokens.py's for /tokenize)",
    "KEEPALIVE_S": "an interval between SSE comments",
    "STREAM_COALESCE_MS": "an interval between an OpenAI stream's chunks",
    "CARD_REFRESH_S": "how often the model card is re-read",
    "TASK_RECORD_TTL_S": "GENQ_RESULT_EXPIRES_S, the workers' result lifetime, shared with them",
    "NONCE_BYTES": "the size of an access token's random part",
    "CLIENT_CLOSED_REQUEST": "an HTTP status code",
    "REDIS_RETRY_AFTER_S": "the Retry-After of a 503",
    "TIMEOUT_GRACE_S": "slack past GRAMMAR_CHECK_TIMEOUT_S for the check process's own timer",
    "OPENAI_DEFAULT_TEMPERATURE": "OpenAI's default, not a limit",
    "COMPLETIONS_DEFAULT_MAX_TOKENS": "OpenAI's default max_tokens, not a limit",
}
GATEWAY_MODULES = ("producer/bounded_json.py", *sorted(
    str(path.relative_to(ROOT)) for path in (ROOT / "producer" / "gateway").glob("*.py")))


def _gateway_numbers() -> list[tuple[str, str | None, float]]:
    """(name as the docs write it, the file of a module constant or None for a GENQ_GATEWAY_*
    setting, default) of every number the gateway's own settings and modules define: the
    fields GatewaySettings adds to the settings it shares with the workers, and each module's
    upper-case constants bound to a number."""
    numbers: list[tuple[str, str | None, float]] = []
    for name, info in GatewaySettings.model_fields.items():
        kinds = {kind for kind in typing.get_args(info.annotation) or (info.annotation,) if kind is not type(None)}
        if name not in ClientSettings.model_fields and kinds and kinds <= {int, float}:
            numbers.append((name.upper(), None, info.default))
    for path in GATEWAY_MODULES:
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        for node in ast.parse((ROOT / path).read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            for target in targets:
                if isinstance(target, ast.Name) and target.id.isupper():
                    value = getattr(module, target.id)
                    if isinstance(value, int | float) and not isinstance(value, bool):
                        numbers.append((target.id, path, value))
    return numbers


def _gateway_limit_rows() -> list[list[str]]:
    text = DOC.read_text()
    section = text[text.index("### Gateway limits"):]
    section = section[:section.index("\n### ", 1)]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| ") and not line.startswith("| limit |")]


def _default(name: str, value: float) -> str:
    """A default as the Gateway limits table writes it: 1,024; 4 MiB; 600 s."""
    if name.endswith("_BYTES") and value % 2**20 == 0:
        return f"{value // 2**20} MiB"
    return _number(value) + (" s" if name.endswith("_S") else "")


@pytest.mark.parametrize(("name", "path", "default"), _gateway_numbers(), ids=[n for n, _, _ in _gateway_numbers()])
def test_every_numeric_gateway_limit_is_listed_in_the_gateway_limits_table_with_its_default(
        name: str, path: str | None, default: float):
    if name in NOT_GATEWAY_LIMITS:
        return
    label = f"`{name}`" + (f" ({path})" if path else "")
    rows = [row for row in _gateway_limit_rows() if row[0].endswith(label)]
    assert len(rows) == 1, f"no row of docs/protocol.md's Gateway limits ends with {label}"
    documented, expected = rows[0][1], _default(name, default)
    assert documented == expected or documented.startswith(expected + " "), (name, documented, expected)


def test_the_gateway_limits_table_names_nothing_the_gateway_does_not_define():
    names = {(name, path) for name, path, _ in _gateway_numbers()}
    assert set(NOT_GATEWAY_LIMITS) <= {name for name, _ in names}
    for row in _gateway_limit_rows():
        label = re.search(r"`([A-Z0-9_]+)`(?: \(([\w/.]+)\))?$", row[0])
        assert label is not None and (label[1], label[2]) in names, row[0]


# --- constraints as grammars -------------------------------------------------------------------------


def _constraint(payload: dict[str, Any]) -> Any:
    return GenerationRequest.parse_payload({"prompt": "x", "constraint": payload}).constraint


@pytest.mark.parametrize(("payload", "expected"), [
    ({"type": "json_schema", "json_schema": {"type": "integer"}},
     ("json_schema", '{"type": "integer", "x-guidance": {"whitespace_flexible": false}}')),
    ({"type": "json_schema", "json_schema": {"type": "integer", "x-guidance": {"whitespace_flexible": True}}},
     ("json_schema", '{"type": "integer", "x-guidance": {"whitespace_flexible": true}}')),
    ({"type": "json_object"}, ("json_schema", '{"type": "object", "x-guidance": {"whitespace_flexible": false}}')),
    ({"type": "regex", "pattern": "[a-z]+"}, ("regex", "[a-z]+")),
    ({"type": "choice", "choices": ["yes", "no"]}, ("choice", '["yes", "no"]')),
    ({"type": "grammar", "grammar": 'start: "a"'}, ("lark", 'start: "a"')),
    ({"type": "grammar", "syntax": "gbnf", "grammar": 'root ::= "a"'}, ("gbnf", 'root ::= "a"')),
], ids=["json_schema", "own x-guidance", "json_object", "regex", "choice", "lark", "gbnf"])
def test_every_constraint_is_one_llguidance_source(payload: dict[str, Any], expected: tuple[str, str]):
    assert p.grammar_source(_constraint(payload)) == expected


def test_a_grammar_without_a_syntax_is_gbnf_when_its_rules_use_the_gbnf_arrow():
    assert p.grammar_syntax('root ::= "a" | "b"') == "gbnf" and p.grammar_syntax('start: "a" | "b"') == "lark"


def test_the_identifier_regex_is_compiled_once_from_the_pattern():
    assert p.IDENTIFIER_RE.pattern == p.IDENTIFIER_PATTERN and p.IDENTIFIER_RE.fullmatch("cmpl-1.a:b_c")


# --- images (issue 27) ---------------------------------------------------------------------------------

IMAGE = {"data": "iVBORw0KGgo=", "media_type": "image/png"}
IMAGE_PART = {"type": "image", "data": "iVBORw0KGgo="}


def chat_with(*parts: Any, role: str = "user") -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "be brief"}, {"role": role, "content": list(parts)}]}


IMAGE_REFUSALS: dict[str, tuple[Any, list[str]]] = {
    "too many images": ({"prompt": "<image>" * 9, "images": [IMAGE] * 9}, ["images: at most 8 items allowed, got 9"]),
    "too many image parts": (chat_with(*[IMAGE_PART] * 9), ["messages: at most 8 images", "(MAX_IMAGES), got 9"]),
    "too many image parts across messages": (
        {"messages": [{"role": "user", "content": [IMAGE_PART] * 5}] * 2}, ["messages: at most 8 images", "got 10"]),
    "data URL": ({"prompt": "x", "images": [{"data": "data:image/png;base64,iVBO"}]},
                 ["images[0].data: send the base64 text alone, without a data: URL prefix"]),
    "empty data": ({"prompt": "x", "images": [{"data": ""}]}, ["images[0].data:", "at least 1 character"]),
    "base64 too long": ({"prompt": "x", "images": [{"data": "A" * (p.MAX_IMAGE_BASE64_CHARS + 1)}]},
                        [f"images[0].data: at most {p.MAX_IMAGE_BASE64_CHARS} characters of base64",
                         f"MAX_IMAGE_BYTES = {p.MAX_IMAGE_BYTES} bytes"]),
    "bad media type": ({"prompt": "x", "images": [{"data": "aaaa", "media_type": "text/html"}]},
                       ["images[0].media_type:", "image/"]),
    "unknown image field": ({"prompt": "x", "images": [{"data": "aaaa", "url": "http://x"}]},
                            ["images[0].url: unknown field (allowed: data, media_type)"]),
    "images with messages": ({**chat_with({"type": "text", "text": "x"}), "images": [IMAGE]},
                             ["images: only with prompt"]),
    "images with input_ids": ({"input_ids": [1], "images": [IMAGE]}, ["images: only with prompt"]),
    "image part data URL": (chat_with({"type": "text", "text": "see"}, {**IMAGE_PART, "data": "data:image/png;base64,"}),
                            ["messages[1].content[1].data: send the base64 text alone"]),
    "image part without data": (chat_with({"type": "image"}), ["messages[1].content[0].data: Field required"]),
    "unknown part type": (chat_with({"type": "image_url", "image_url": {"url": "x"}}),
                          ["messages[1].content[0]:", "'text', 'image'"]),
    "image in an assistant message": (chat_with(IMAGE_PART, role="assistant"),
                                      ["messages[1]: content[0]: image parts only in user messages"]),
    "no parts": (chat_with(), ["messages[1].content: at least 1 item(s) required, got 0"]),
    "too many parts": (chat_with(*[{"type": "text", "text": "x"}] * 65), ["messages[1].content: at most 64 items"]),
    "text parts too long in all": (
        chat_with({"type": "text", "text": "x" * 600_000}, {"type": "text", "text": "x" * 600_000}),
        ["messages:", f"at most {p.MAX_PROMPT_CHARS} characters", "got 1200008"]),  # with the system message's
}


@pytest.mark.parametrize("case", sorted(IMAGE_REFUSALS))
def test_image_refusals_name_the_field_path_and_the_limit(case: str):
    refusal(*IMAGE_REFUSALS[case])


def test_images_travel_in_prompt_order_with_their_paths():
    prompt = GenerationRequest.parse_payload({"prompt": "<image><image> compare", "images": [IMAGE, IMAGE]})
    assert [path for path, _ in prompt.image_inputs()] == ["images[0]", "images[1]"]
    assert prompt.to_kwargs()["images"] == [IMAGE, IMAGE]
    chat = GenerationRequest.parse_payload({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, IMAGE_PART]},
        {"role": "assistant", "content": [{"type": "text", "text": "b"}]},
        {"role": "user", "content": [IMAGE_PART, {"type": "text", "text": "c"}, IMAGE_PART]}]})
    assert [path for path, _ in chat.image_inputs()] == ["messages[0].content[1]", "messages[2].content[0]",
                                                         "messages[2].content[2]"]
    assert [m.text for m in chat.messages or ()] == ["a", "b", "c"]
    assert GenerationRequest.parse_payload(chat.to_kwargs()) == chat
    # the limits are inclusive
    GenerationRequest.parse_payload({"prompt": "x", "images": [{"data": "A" * p.MAX_IMAGE_BASE64_CHARS}] * 1})
    GenerationRequest.parse_payload(chat_with(*[IMAGE_PART] * p.MAX_IMAGES))


def test_text_only_requests_are_unchanged_on_the_wire():
    for payload in ({"prompt": "x"}, {"messages": [{"role": "user", "content": "hi"}]}):
        request = GenerationRequest.parse_payload(payload)
        assert request.to_kwargs() == payload and request.image_inputs() == [] and request.images == []
