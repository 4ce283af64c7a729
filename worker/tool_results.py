"""Reasoning and tool calls in a finished output: a choice of a thinking model's chat gets its
thought as reasoning_content and the text after it as content (producer/reasoning.py); a choice
of a request that offered tools gets the content outside its calls as content, the calls
themselves, and finish_reason "tool_calls" when the model ended after calling (docs/tools.md).
The gateway reads a streamed output with the same splitter and parser, in the same formats and
with the same ids."""

from __future__ import annotations

from producer.protocol import Choice, GenerationRequest, ToolCall
from producer.reasoning import split
from producer.tool_calls import call_seed, parse


def with_reasoning(choices: list[Choice], request: GenerationRequest) -> list[Choice]:
    """The choices with their thought split off, when the request has a reasoning format
    (build_job fills a chat's in); otherwise as they are. The text stays the whole output."""
    fmt = request.reasoning_format
    if fmt is None or fmt == "none":
        return choices
    split_choices = []
    for choice in choices:
        reasoning, content = split(choice.text, fmt)
        split_choices.append(choice.model_copy(update={"reasoning_content": reasoning, "content": content}))
    return split_choices


def with_tool_calls(choices: list[Choice], request: GenerationRequest, identifier: str) -> list[Choice]:
    """The choices with their content and tool calls read out, when the request offered tools and
    did not turn them off (tool_choice "none"); otherwise as they are. The calls are read from the
    content after a thought (with_reasoning), or the whole text. The text stays the whole output,
    as the chunks streamed it."""
    if request.tools is None or request.tool_choice == "none":
        return choices
    assert request.tool_format is not None, "build_job resolves it"
    parsed = []
    for choice in choices:
        text = choice.text if choice.content is None else choice.content
        content, calls = parse(text, request.tool_format, call_seed(identifier, choice.index))
        finish_reason = "tool_calls" if calls and choice.finish_reason == "stop" else choice.finish_reason
        parsed.append(choice.model_copy(update={
            "content": content, "finish_reason": finish_reason,
            "tool_calls": [ToolCall(id=call.id, name=call.name, arguments=call.arguments) for call in calls]}))
    return parsed
