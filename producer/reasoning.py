"""Reasoning in a model's output: the thought a thinking model writes between ``<think>`` and
``</think>`` (Qwen 3, DeepSeek-R1 and its distills) separated from the answer, as
``reasoning_content`` and ``content`` (docs/reasoning.md).

Imports only the standard library: the worker splits a finished output, the gateway splits the
streamed one, and both must read it the same way.

Formats:

- ``qwen3``: the output may open with ``<think>``; the thought runs to ``</think>``. An output
  that does not open with it (``enable_thinking: false``) is all content.
- ``deepseek_r1``: the chat template's generation prompt opens the thought (it ends in
  ``<think>\\n``), so the output starts inside it, and only ``</think>`` appears; a ``<think>``
  the model writes again at the start is skipped.
- ``none``: no split (a template that knows no thinking).

One thought per output, at its start: a ``<think>`` later in the answer is content. Whitespace
around the thought is dropped (the templates write ``<think>\\n...\\n</think>\\n\\n``). A thought
that never closes (the length limit cut it) is all reasoning, with no content.

``ReasoningStream`` is fed text as it is decoded and returns the reasoning and content each piece
settles; ``split()`` runs the same stream over a whole text, so a streamed and a non-streamed
answer are equal by construction, however the text is split into pieces. This differs from
vLLM's reasoning parsers, which decide on token ids while streaming and with ``str.partition``
on the whole text (two paths).
"""

from __future__ import annotations

from typing import Literal

ReasoningFormat = Literal["qwen3", "deepseek_r1", "none"]
REASONING_FORMATS: tuple[ReasoningFormat, ...] = ("qwen3", "deepseek_r1", "none")

THINK_START = "<think>"
THINK_END = "</think>"

_START, _THOUGHT_START, _THOUGHT, _AFTER, _CONTENT = range(5)


class ReasoningStream:
    """Incremental reasoning splitter for one output in one format; see the module docstring.
    ``feed(text)`` and ``finish()`` return (reasoning, content): the text each adds to both, the
    reasoning coming first in the output."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        if fmt not in REASONING_FORMATS:
            raise ValueError(f"reasoning format must be one of {', '.join(REASONING_FORMATS)}, got {fmt!r}")
        self.format: ReasoningFormat = fmt
        self.state = _CONTENT if fmt == "none" else _START
        self.held = ""
        self.thought = False  # a thought was opened (by the output or by the prompt)
        self.finished = False

    def feed(self, text: str) -> tuple[str, str]:
        if self.finished:
            raise RuntimeError("ReasoningStream.feed after finish()")
        self.held += text
        return self._run()

    def finish(self) -> tuple[str, str]:
        """What is left at the end: a held prefix of a tag, or whitespace."""
        if self.finished:
            return "", ""
        self.finished = True
        reasoning, content = self._run()
        held, self.held = self.held, ""
        if self.state == _START:
            if self.format == "deepseek_r1":
                self.thought = True
                return reasoning + held.strip(), content
            return reasoning, content + held
        if self.state == _THOUGHT:
            return reasoning + held.rstrip(), content
        if self.state == _CONTENT:
            return reasoning, content + held
        return reasoning, content  # whitespace at a thought's start or after its end

    def _run(self) -> tuple[str, str]:
        reasoning: list[str] = []
        while True:
            state = self.state
            if state == _START:
                stripped = self.held.lstrip()
                if stripped.startswith(THINK_START):
                    self.held, self.thought, self.state = stripped[len(THINK_START):], True, _THOUGHT_START
                elif THINK_START.startswith(stripped):
                    break  # not yet decided
                elif self.format == "deepseek_r1":
                    self.thought, self.state = True, _THOUGHT_START
                else:
                    self.state = _CONTENT
            elif state in (_THOUGHT_START, _AFTER):
                self.held = self.held.lstrip()
                if not self.held:
                    break
                self.state = _THOUGHT if state == _THOUGHT_START else _CONTENT
            elif state == _THOUGHT:
                at = self.held.find(THINK_END)
                if at >= 0:
                    reasoning.append(self.held[:at].rstrip())
                    self.held, self.state = self.held[at + len(THINK_END):], _AFTER
                    continue
                keep = max((n for n in range(1, len(THINK_END)) if self.held.endswith(THINK_END[:n])), default=0)
                body = self.held[: len(self.held) - keep]
                settled = body.rstrip()
                reasoning.append(settled)
                self.held = self.held[len(settled):]
                break
            else:
                content, self.held = self.held, ""
                return "".join(reasoning), content
        return "".join(reasoning), ""


def split(text: str, fmt: ReasoningFormat) -> tuple[str | None, str]:
    """The reasoning (None when the output holds no thought) and the content of a whole output:
    the stream run over it."""
    stream = ReasoningStream(fmt)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning if stream.thought else None), content + more_content


def template_thinks(chat_template: str | None) -> bool:
    """Whether a chat template knows thinking: it writes <think> or reads enable_thinking."""
    return chat_template is not None and (THINK_START in chat_template or "enable_thinking" in chat_template)


def detect_reasoning_format(chat_template: str | None, generation_prompt: str) -> ReasoningFormat:
    """The format a model thinks in, from its chat template and the text the template renders for
    a one-message chat with the generation prompt: "deepseek_r1" when that prompt leaves a
    thought open, "qwen3" when the template otherwise mentions thinking, "none" when it does not."""
    if not template_thinks(chat_template):
        return "none"
    opened, closed = generation_prompt.rfind(THINK_START), generation_prompt.rfind(THINK_END)
    return "deepseek_r1" if opened > closed else "qwen3"
