"""A chat request's prompt text, rendered from the model's chat templates (chat_template/): the
one copy the worker renders a chat with before encoding it and the gateway renders POST /tokenize
with, so that the gateway's count is the worker's. Tools, chat_template_kwargs,
add_generation_prompt and continue_final_message shape the rendering as vLLM's do; so does what
the template itself says about the model (its tool-call and reasoning formats)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jinja2

from chat_template import ChatTemplate
from producer.protocol import ChatMessage, GenerationRequest, ImageContentPart, ProtocolError, TextContentPart
from producer.reasoning import ReasoningFormat, detect_reasoning_format, template_thinks
from producer.tool_calls import (
    ToolFormat,
    detect_format,
    template_messages,
    template_supports_tools,
    with_generic_tool_prompt,
)

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""The mark put after the last message's content to find where the template rendered it
(transformers' continue_final_message_tag)."""


def render_messages(request: GenerationRequest, chat: ChatTemplate, image_placeholder: str | None = None) -> str:
    """The chat's prompt text (_render). A chat with images goes to the template as transformers'
    processors pass it, content as a list of text and image parts; a template that only takes text
    content (it fails on the list) gets each message's parts joined by newlines instead, an image
    as `image_placeholder`, the text the model's image token is (vLLM's "string" content format)."""
    try:
        return _render(request, chat, parts=True)
    except (TypeError, jinja2.TemplateError):
        if image_placeholder is None or not any(m.image_parts for m in request.messages or ()):
            raise
        return _render(request, chat, parts=False, image_placeholder=image_placeholder)


def _render(request: GenerationRequest, chat: ChatTemplate, parts: bool, image_placeholder: str = "") -> str:
    """The chat's prompt text. Assistant tool calls in the history go to the template with
    their arguments as objects (template_messages); tools go in through the template's `tools`
    variable, or, for a template without tool support, as the generic tool prompt (which also
    writes the history's calls and results as text). With tool_choice "none" the tools are still
    shown (as vLLM does): the model knows them, its output is not read for calls.
    chat_template_kwargs and add_generation_prompt reach the template; continue_final_message
    leaves the last message open (render_continued)."""
    messages = [_template_message(m, parts, image_placeholder) for m in request.messages or ()]
    tools = None
    if request.tools is None:
        messages = template_messages(messages)
    else:
        entries = [tool.model_dump(exclude_none=True) for tool in request.tools]
        if template_supports_tools(chat.tools_template):
            messages, tools = template_messages(messages), entries
        else:
            messages = with_generic_tool_prompt(messages, entries)
    options = request.chat_template_kwargs or {}
    if request.continue_final_message:
        return render_continued(chat, messages, tools, options)
    return chat.render(messages, request.add_generation_prompt, tools=tools, **options)


def _template_message(message: ChatMessage, parts: bool = True, image_placeholder: str = "") -> dict[str, Any]:
    """A message as the template sees it: content a string, as ever, unless the message holds images;
    then, as transformers' processors pass a multimodal chat to the template, a list of
    {"type": "text", "text": ...} and {"type": "image"} parts (the image's data stays out of the
    template: the engine puts its tokens where the template put the image)."""
    fields = message.model_dump(exclude_none=True)
    if not message.image_parts:
        fields["content"] = message.text
    elif not parts:
        fields["content"] = "\n".join(image_placeholder if isinstance(part, ImageContentPart) else part.text
                                      for part in message.content
                                      if isinstance(part, (ImageContentPart, TextContentPart)))
    else:
        fields["content"] = [{"type": "image"} if isinstance(part, ImageContentPart)
                             else {"type": "text", "text": part.text}
                             for part in message.content if isinstance(part, (ImageContentPart, TextContentPart))]
    return fields


def render_continued(chat: ChatTemplate, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     options: dict[str, Any]) -> str:
    """The conversation rendered up to the end of its last message's content, without what the
    template closes the message with, so that the model continues it: as transformers'
    apply_chat_template(continue_final_message=True) does it, by marking the content's end,
    rendering, and cutting at the mark (before the whitespace the template trimmed, if it did)."""
    final = messages[-1].get("content") or ""
    marked = [*messages[:-1], {**messages[-1], "content": final + CONTINUE_TAG}]
    rendered = chat.render(marked, False, tools=tools, **options)
    if final.strip() not in rendered or CONTINUE_TAG.strip() not in rendered:
        raise ProtocolError(["continue_final_message: the chat template does not render the last message's content "
                             "as given, so it cannot be continued"])
    at = rendered.rindex(CONTINUE_TAG.strip())
    if rendered[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


@lru_cache(maxsize=4)
def model_tool_format(chat: ChatTemplate) -> ToolFormat:
    """The format the model writes tool calls in: the one its tool template renders history in
    (the generic tool prompt's, hermes, for a template without tools). Once per template."""
    return detect_format(chat.tools_template)


@lru_cache(maxsize=4)
def model_reasoning_format(chat: ChatTemplate) -> ReasoningFormat:
    """The format the model thinks in (producer/reasoning.py): read from its chat template and the
    generation prompt it renders for a one-message chat. Once per template, not per request."""
    if not template_thinks(chat.template):
        return "none"
    try:
        prompt = chat.render([{"role": "user", "content": "Hello"}])
    except Exception:  # noqa: BLE001 - a template may refuse a probe chat in any way (its filters raise what they raise)
        prompt = ""
    return detect_reasoning_format(chat.template, prompt)
