"""A model's chat templates and the special tokens they see, and the BOS rule of an encoded
conversation: what rendering a chat needs, and nothing of the tokenizer's vocabulary."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2

from chat_template.environment import compile_template


class NoChatTemplate(ValueError):
    """The model has no chat template: a chat cannot be rendered."""


@dataclass(frozen=True)
class ChatTemplate:
    """The templates of one model: `template` (the default, None when the model has none) and
    `tool_template` (a "tool_use" one, which transformers prefers when tools are given), with the
    named special tokens (bos_token, eos_token, ...) each template sees as a variable. Frozen and
    hashable, so what is read from it (the tool-call format) can be cached per template."""

    template: str | None
    tool_template: str | None = None
    special_tokens: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, template: str | None, tool_template: str | None, special_tokens: Mapping[str, str]) -> ChatTemplate:
        return cls(template, tool_template, tuple(sorted(special_tokens.items())))

    @property
    def tools_template(self) -> str | None:
        """The template a chat with tools is rendered with."""
        return self.tool_template or self.template

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The conversation as transformers' apply_chat_template(tokenize=False) renders it.

        tools (OpenAI's tool entries) and documents reach the template as the variables of those
        names, None when absent; with tools the "tool_use" template is chosen when there is one.
        Messages go in as given (assistant tool calls with their arguments as the template expects
        them); keys whose value is None are dropped, as transformers does (templates handle a
        missing key but often print "None"). template_kwargs reach the template too (e.g.
        enable_thinking for Qwen3). NoChatTemplate without a template; ValueError for a
        conversation the template refuses (its raise_exception) or cannot render."""
        template = self.tool_template if tools is not None and self.tool_template else self.template
        if not template:
            raise NoChatTemplate("the model has no chat template; send a plain prompt instead")
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        for message in messages:
            if not isinstance(message, dict):
                raise TypeError(f"chat messages must be dicts, got {message!r}")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        context = {**dict(self.special_tokens), **template_kwargs}
        try:
            return compile_template(template).render(
                messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template rejected the conversation: {exc}") from exc


def with_bos(ids: list[int], add_bos: bool, bos_token_id: int | None) -> list[int]:
    """A rendered conversation's token ids (encoded without special tokens) with exactly one BOS
    when the model wants one: templates usually write BOS themselves, so it is prepended only where
    the template left it out."""
    if add_bos and bos_token_id is not None and ids[:1] != [bos_token_id]:
        return [bos_token_id, *ids]
    return ids
