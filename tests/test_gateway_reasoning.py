"""Reasoning output through a real worker and gateway with the openai SDK, on a tiny random model
whose chat template is Qwen 3's (it thinks in <think>...</think>): the worker and the gateway read
the format from the template (the model card), a forced regex makes the random model write a
thought, and the non-streamed message.reasoning_content and the streamed delta.reasoning_content
assemble to the same; enable_thinking reaches the template; a thought cut by max_tokens is all
reasoning."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from producer.client import GenqClient
from tests.gateway_service import MODEL
from tests.test_chat_template_tools import QWEN3

THOUGHT_THEN_ANSWER = r"<think>\n[a-z]{1,10}( [a-z]{1,10}){0,2}\n</think>\n\n[a-z]{1,10}( [a-z]{1,10}){0,2}"
ASK: list[Any] = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The gateway tests' tiny model with Qwen 3's chat template."""
    out = tmp_path_factory.mktemp("thinking-model") / "model"
    shutil.copytree(tiny_model_factory("llama", max_position_embeddings=1024), out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = QWEN3
    config_path.write_text(json.dumps(config))
    return out


def _assemble(stream: Any) -> tuple[str, str, str | None]:
    """(reasoning, content, finish_reason) of a streamed answer; every thought delta comes before
    the first content delta."""
    reasoning, content, finish = "", "", None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            piece = getattr(delta, "reasoning_content", None) or ""
            assert not (piece and content), "a thought delta after content"
            reasoning += piece
            content += delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_thought_is_split_off_and_the_stream_assembles_to_the_message(oai: openai.OpenAI, seed: int) -> None:
    params: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 200, "temperature": 1.0, "seed": seed,
                              "extra_body": {"guided_regex": THOUGHT_THEN_ANSWER}}
    message = oai.chat.completions.create(**params).choices[0].message
    reasoning: str = message.reasoning_content  # type: ignore[attr-defined]
    assert re.fullmatch(r"[a-z]+( [a-z]+)*", reasoning), reasoning
    assert message.content is not None and re.fullmatch(r"[a-z]+( [a-z]+)*", message.content), message.content
    assert _assemble(oai.chat.completions.create(**params, stream=True)) == (reasoning, message.content, "stop")


def test_the_native_result_carries_the_thought_and_the_whole_text(genq: GenqClient) -> None:
    result = genq.submit({"messages": ASK, "max_new_tokens": 200,
                          "constraint": {"type": "regex", "pattern": THOUGHT_THEN_ANSWER}}).result(timeout=120)
    assert result.text.startswith("<think>\n") and result.reasoning_content and result.content
    assert result.text == f"<think>\n{result.reasoning_content}\n</think>\n\n{result.content}"


def test_without_thinking_there_is_no_thought(oai: openai.OpenAI) -> None:
    """enable_thinking false reaches the template, which closes an empty thought in the prompt: the
    output is all content."""
    params: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 20,
                              "extra_body": {"guided_regex": "[a-z]{1,10}",
                                             "chat_template_kwargs": {"enable_thinking": False}}}
    reply = oai.chat.completions.create(**params)
    message = reply.choices[0].message
    assert getattr(message, "reasoning_content", None) is None and message.content
    assert reply.usage is not None
    thinking = oai.chat.completions.create(**{**params, "extra_body": {"guided_regex": "[a-z]{1,10}"}})
    assert thinking.usage is not None
    # The empty thought block "<think>\n\n</think>\n\n" is in the prompt only without thinking.
    assert reply.usage.prompt_tokens > thinking.usage.prompt_tokens


def test_a_thought_cut_by_max_tokens_is_all_reasoning(oai: openai.OpenAI) -> None:
    params: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 8, "seed": 5,
                              "extra_body": {"guided_regex": "<think>[a-z]{40,60}</think>done"}}
    reply = oai.chat.completions.create(**params)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "length" and message.content is None
    reasoning: str = message.reasoning_content  # type: ignore[attr-defined]
    assert reasoning and re.fullmatch("[a-z]+", reasoning)
    assert _assemble(oai.chat.completions.create(**params, stream=True)) == (reasoning, "", "length")


def test_continue_final_message_continues_the_assistant_turn(oai: openai.OpenAI) -> None:
    """The prompt ends inside the assistant's message (no end-of-turn after it), so the model's
    tokens extend it: the prompt is shorter than the closed message's by the end-of-turn."""
    chat: list[Any] = [*ASK, {"role": "assistant", "content": "Because"}]
    params: dict[str, Any] = {"model": MODEL, "messages": chat, "max_tokens": 4}
    continued = oai.chat.completions.create(**params, extra_body={"continue_final_message": True,
                                                                  "add_generation_prompt": False})
    closed = oai.chat.completions.create(**params, extra_body={"add_generation_prompt": False})
    assert continued.usage is not None and closed.usage is not None
    assert continued.usage.prompt_tokens < closed.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        oai.chat.completions.create(**params, extra_body={"continue_final_message": True})
