"""The reasoning splitter (producer/reasoning.py): every way of cutting an output into streamed
pieces gives the whole parse; an output that starts inside the thought (DeepSeek-R1's prompt
opens it), one with no thought, and one whose thought the length limit cut; the format read from
the chat template; and the rendering options (chat_template_kwargs, continue_final_message)
against transformers' apply_chat_template on Qwen 3's template."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from engine.tokenizer import Tokenizer
from producer.chat_rendering import model_reasoning_format, render_messages
from producer.protocol import Choice, GenerationRequest, ProtocolError
from producer.reasoning import ReasoningFormat, ReasoningStream, detect_reasoning_format, split
from tests.test_chat_template_tools import CHATML, QWEN3, tokenizer_pair  # noqa: F401 - the fixture
from worker.tool_results import with_reasoning, with_tool_calls

R1 = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] }}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|assistant|><think>\\n' }}{% endif %}")
"""DeepSeek-R1's shape: the generation prompt opens the thought."""

CASES: list[tuple[ReasoningFormat, str, str | None, str]] = [
    ("qwen3", "<think>\nLet me see.\n</think>\n\nThe answer.", "Let me see.", "The answer."),
    ("qwen3", "  <think>a b</think>c <think>d</think>", "a b", "c <think>d</think>"),
    ("qwen3", "The answer, no thought.", None, "The answer, no thought."),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "<think>\nstill thinking when cut </thi", "still thinking when cut </thi", ""),
    ("qwen3", "<think></think>", "", ""),
    ("qwen3", "", None, ""),
    ("deepseek_r1", "Let me see.\n</think>\n\nThe answer.", "Let me see.", "The answer."),
    ("deepseek_r1", "<think>\nLet me see.</think>The answer.", "Let me see.", "The answer."),
    ("deepseek_r1", "all thought, cut by max_tokens", "all thought, cut by max_tokens", ""),
    ("deepseek_r1", "", "", ""),
    ("none", "<think>x</think>y", None, "<think>x</think>y"),
]


def _streamed(text: str, fmt: ReasoningFormat, cuts: list[int]) -> tuple[str, str]:
    stream = ReasoningStream(fmt)
    reasoning, content = "", ""
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        more_reasoning, more_content = stream.feed(text[start:end])
        reasoning, content = reasoning + more_reasoning, content + more_content
    more_reasoning, more_content = stream.finish()
    return reasoning + more_reasoning, content + more_content


@pytest.mark.parametrize(("fmt", "text", "reasoning", "content"), CASES)
def test_whole_parse(fmt: ReasoningFormat, text: str, reasoning: str | None, content: str) -> None:
    assert split(text, fmt) == (reasoning, content)


@pytest.mark.parametrize(("fmt", "text", "reasoning", "content"), CASES)
def test_every_chunking_equals_the_whole_parse(fmt: ReasoningFormat, text: str, reasoning: str | None,
                                               content: str) -> None:
    """Every split into two or three pieces, and one character at a time."""
    whole = (reasoning or "", content)
    splits = [[i] for i in range(len(text) + 1)]
    splits += [[i, j] for i in range(len(text) + 1) for j in range(i, len(text) + 1)]
    splits.append(list(range(1, len(text))))
    for cuts in splits:
        assert _streamed(text, fmt, cuts) == whole, cuts


def test_feed_after_finish_is_a_bug() -> None:
    stream = ReasoningStream("qwen3")
    stream.finish()
    with pytest.raises(RuntimeError):
        stream.feed("x")


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="qwen3, deepseek_r1, none"):
        ReasoningStream("harmony")  # type: ignore[arg-type]


def test_format_is_read_from_the_template() -> None:
    assert detect_reasoning_format(QWEN3, "<|im_start|>assistant\n") == "qwen3"
    assert detect_reasoning_format(R1, "<|assistant|><think>\n") == "deepseek_r1"
    assert detect_reasoning_format(CHATML, "<|im_start|>assistant\n") == "none"
    assert detect_reasoning_format(None, "") == "none"


def test_the_worker_reads_the_format_from_the_rendered_generation_prompt(tokenizer_pair) -> None:  # noqa: F811
    assert model_reasoning_format(tokenizer_pair(QWEN3)[0].chat) == "qwen3"
    assert model_reasoning_format(tokenizer_pair(R1)[0].chat) == "deepseek_r1"
    assert model_reasoning_format(tokenizer_pair(CHATML)[0].chat) == "none"


def _render(ours: Tokenizer, **fields: Any) -> str:
    return render_messages(GenerationRequest.parse_payload(fields), ours.chat)


CHAT: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("thinking", [False, True])
def test_enable_thinking_reaches_the_template_as_transformers_passes_it(tokenizer_pair, thinking: bool) -> None:  # noqa: F811
    ours, reference = tokenizer_pair(QWEN3)
    rendered = _render(ours, messages=CHAT, chat_template_kwargs={"enable_thinking": thinking})
    assert rendered == reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True,
                                                     enable_thinking=thinking)
    assert rendered.endswith("<think>\n\n</think>\n\n") is not thinking


def test_without_a_generation_prompt(tokenizer_pair) -> None:  # noqa: F811
    ours, reference = tokenizer_pair(QWEN3)
    rendered = _render(ours, messages=CHAT, add_generation_prompt=False)
    assert rendered == reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    assert not rendered.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("partial", ["The answer is", "The answer is ", "<think>\nHmm.\n</think>\n\nSo"])
def test_continue_final_message_matches_transformers(tokenizer_pair: Callable[[Any], tuple[Tokenizer, Any]],  # noqa: F811
                                                     partial: str) -> None:
    ours, reference = tokenizer_pair(QWEN3)
    chat = [*CHAT, {"role": "assistant", "content": partial}]
    rendered = _render(ours, messages=chat, add_generation_prompt=False, continue_final_message=True)
    assert rendered == reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=False,
                                                     continue_final_message=True)
    assert rendered.endswith(partial) and not rendered.endswith("<|im_end|>\n")


def test_continue_final_message_refuses_a_template_that_rewrites_the_message(tokenizer_pair) -> None:  # noqa: F811
    """Qwen 3's template re-renders a final message's thought (it moves it into its own block), so
    the content is not there as given to be continued (transformers raises too)."""
    ours, _ = tokenizer_pair(QWEN3)
    with pytest.raises(ProtocolError, match="continue_final_message: the chat template does not render"):
        _render(ours, messages=[*CHAT, {"role": "assistant", "content": "<think>a thought</think>"}],
                add_generation_prompt=False, continue_final_message=True)


@pytest.mark.parametrize(("fields", "problem"), [
    ({"continue_final_message": True}, "continue_final_message|add_generation_prompt: continuing the final message "
                                       "needs add_generation_prompt false"),
    ({"continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message: the last message must be the assistant's to continue, got role 'user'"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs: cannot set messages: genq sets them itself"),
    ({"chat_template_kwargs": {"x": "y" * 70_000}}, "chat_template_kwargs: at most 65536 characters of JSON"),
])
def test_rendering_options_are_checked(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem.replace("|", r"\|")):
        GenerationRequest.parse_payload({"messages": CHAT, **fields})


def test_rendering_options_need_messages() -> None:
    with pytest.raises(ProtocolError) as refused:
        GenerationRequest.parse_payload({"prompt": "x", "chat_template_kwargs": {"enable_thinking": False},
                                         "add_generation_prompt": False})
    assert str(refused.value).count("needs messages") == 2


def test_the_result_splits_the_thought_before_reading_tool_calls() -> None:
    """A thought that mentions a call is reasoning; the call after it is read from the content."""
    request = GenerationRequest.parse_payload({
        "messages": CHAT, "reasoning_format": "qwen3", "tool_format": "hermes",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
    text = ('<think>\nI could write <tool_call>{"name": "g", "arguments": {}}</tool_call>.\n</think>\n\n'
            'Calling.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    choices = [Choice(index=0, text=text, finish_reason="stop")]
    [choice] = with_tool_calls(with_reasoning(choices, request), request, "req")
    assert choice.reasoning_content == 'I could write <tool_call>{"name": "g", "arguments": {}}</tool_call>.'
    assert choice.content == "Calling.\n"
    assert choice.tool_calls is not None and [(c.name, c.arguments) for c in choice.tool_calls] == [("f", '{"a": 1}')]
    assert choice.finish_reason == "tool_calls" and choice.text == text


def test_a_request_that_turns_reasoning_off_keeps_the_text_whole() -> None:
    request = GenerationRequest.parse_payload({"messages": CHAT, "reasoning_format": "none"})
    [choice] = with_reasoning([Choice(index=0, text="<think>x</think>y", finish_reason="stop")], request)
    assert choice.reasoning_content is None and choice.content is None
