"""The worker's side of tool calling without a model: build_job renders a chat with tools through
each family's real tool template (the tiny tokenizer with the template swapped in), resolves the
request's tool format from it, turns a forced choice into that format's grammar, and
with_tool_calls reads a finished output back into content, calls and finish_reason."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import Tokenizer
from producer.chat_rendering import model_tool_format
from producer.protocol import Choice, GenerationRequest
from producer.tool_calls import auto_call_grammar, call_id, call_seed, forced_call_grammar, template_messages
from tests.test_chat_template_tools import CHATML, FAMILIES, TOOLS, _tokenizer_dir
from worker.jobs import build_job
from worker.tool_results import with_tool_calls

VOCAB = 10_000


def _history(call: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call, "type": "function",
                 "function": {"name": TOOLS[0]["function"]["name"], "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": call, "name": TOOLS[0]["function"]["name"], "content": "21 C"}]


@pytest.fixture(scope="module")
def tokenizer_for(tiny_model_factory: Callable[..., Path],
                  tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Tokenizer]:
    base = tiny_model_factory("llama")
    return lambda template: Tokenizer.from_dir(_tokenizer_dir(base, tmp_path_factory.mktemp("tools"), template))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_chat_with_tools_renders_through_the_family_template_and_forces_its_format(
        tokenizer_for: Callable[[str], Tokenizer], family: str):
    template, fmt = FAMILIES[family]
    tokenizer = tokenizer_for(template)
    history = _history("abcDEF123" if fmt == "mistral" else "call_1")
    request = GenerationRequest.parse_payload({"messages": history, "tools": TOOLS, "tool_choice": "required"})
    job = build_job(request, tokenizer, "req-1", VOCAB)
    assert request.tool_format == fmt == model_tool_format(tokenizer.chat)
    expected = tokenizer.encode_chat(template_messages([m.model_dump(exclude_none=True) for m in request.messages
                                                        or ()]), tools=TOOLS)
    assert job.input_ids == expected
    assert job.constraint is not None
    assert (job.constraint.kind, job.constraint.source) == forced_call_grammar(TOOLS, "required", fmt)


def test_auto_constrains_a_call_once_it_starts_none_leaves_the_output_free_and_a_template_without_tools_gets_the_generic_prompt(  # noqa: E501
        tokenizer_for: Callable[[str], Tokenizer]):
    tokenizer = tokenizer_for(CHATML)
    for choice in ("auto", None, "none"):
        payload = {"messages": _history("call_1"), "tools": TOOLS, "parallel_tool_calls": False}
        request = GenerationRequest.parse_payload(payload if choice is None else {**payload, "tool_choice": choice})
        job = build_job(request, tokenizer, "req-2", VOCAB)
        assert request.tool_format == "hermes"
        if choice == "none":
            assert job.constraint is None
        else:
            assert job.constraint is not None
            assert (job.constraint.kind, job.constraint.source) == auto_call_grammar(TOOLS, "hermes", False)
        assert "<tools>" in tokenizer.decode(job.input_ids) and "<tool_response>" in tokenizer.decode(job.input_ids)


def test_a_finished_output_is_read_into_content_calls_and_finish_reason():
    request = GenerationRequest.parse_payload({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                               "tool_format": "hermes"})
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    choices = [Choice(index=0, text=text, finish_reason="stop"), Choice(index=1, text=text, finish_reason="length"),
               Choice(index=2, text="Sunny.", finish_reason="stop")]
    called, cut, plain = with_tool_calls(choices, request, "req-3")
    assert (called.content, called.finish_reason, called.text) == ("Let me look.\n", "tool_calls", text)
    [call] = called.tool_calls or []
    assert (call.id, call.name, call.arguments) == (call_id(call_seed("req-3", 0), 0), "get_weather",
                                                    '{"city": "Paris"}')
    assert cut.finish_reason == "length" and cut.tool_calls and cut.tool_calls[0].id != call.id
    assert (plain.content, plain.tool_calls, plain.finish_reason) == ("Sunny.", [], "stop")
    off = GenerationRequest.parse_payload({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                           "tool_choice": "none"})
    assert with_tool_calls(choices, off, "req-3") == choices
