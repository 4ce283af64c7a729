"""OpenAI-compatible request and response shapes, and their translation to the genq protocol.

Requests accept what OpenAI clients send: unknown fields are ignored (as vLLM does: SDKs add
fields over time), known features genq lacks are refused with a 400 that names them (echo,
suffix, best_of > 1, tools), and the values themselves are checked by GenerationRequest, so the
limits are the protocol's. `n` (1 to MAX_N) is vLLM v1's parallel sampling: the gateway sends
n child requests `<id>-0` ... `<id>-<n-1>` with the same prompt and settings (seeds seed + i, or
each its own random seed), and the response, under `<id>`, has one choice per child
(producer/gateway/app.py). Structured output: chat's response_format (json_object, json_schema)
and vLLM's guided_json / guided_regex / guided_choice / guided_grammar on both endpoints become
the request's constraint. Log-probabilities in OpenAI's shapes: chat's logprobs + top_logprobs,
completions' logprobs (an int: that many alternatives). Extensions, as in vLLM: top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, allowed_token_ids; and where vLLM has none, exllamav2's
samplers under TabbyAPI's names: top_a, typical (or typical_p), tfs, skew, smoothing_factor,
min_temp, max_temp, temp_exponent, temperature_last, mirostat_mode (0 or 2), mirostat_tau,
mirostat_eta, dry_multiplier, dry_base, dry_allowed_length, dry_range, dry_sequence_breakers,
xtc_probability, xtc_threshold, penalty_range (or repetition_penalty_range), repetition_decay,
banned_strings, token_healing.

finish_reason: the protocol's "stop" and "length" are OpenAI's; "deadline" and "cancelled" are
reported as "length", since the text was cut short by a limit rather than ended by the model.
An omitted temperature means 1.0, OpenAI's default (genq's own default is greedy).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)

from producer.protocol import DEFAULT_MAX_NEW_TOKENS, GenerationResult, TokenLogprob, Usage

OPENAI_DEFAULT_TEMPERATURE = 1.0
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for /v1/completions; chat completions default to the protocol's."""
FINISH_REASONS = {"stop": "stop", "length": "length", "deadline": "length", "cancelled": "length"}

OpenAIFinishReason = Literal["stop", "length"]
MAX_N = 16
"""The most choices (`n`) one request may ask for: each is a child request of its own, a slot in a
worker's batch and a stream for the gateway to follow, so n is bounded like the protocol's other
per-request sizes (vLLM bounds it only by its batch; OpenAI's own limit is 128)."""
SAME_NAMED_SAMPLERS = (
    "top_a", "typical", "tfs", "skew", "smoothing_factor", "min_temp", "max_temp", "temp_exponent",
    "temperature_last", "mirostat_tau", "mirostat_eta", "dry_multiplier", "dry_base", "dry_allowed_length",
    "dry_range", "xtc_probability", "xtc_threshold",
)
"""The extensions whose TabbyAPI name is the protocol's sampling field."""


class UnsupportedParameter(ValueError):
    """A request asks for an OpenAI feature genq does not implement."""

    code = "unsupported_parameter"

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class InvalidParameter(UnsupportedParameter):
    """A parameter of the wrong shape that the request model leaves open (a message content
    part is any object until its type says which kind it is)."""

    code = "invalid_request"


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptionsParam(_Lenient):
    include_usage: bool = False


class _CommonParams(_Lenient):
    model: str
    stream: bool = False
    stream_options: StreamOptionsParam | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, description="accepted and ignored")
    top_k: int | None = Field(None, description="genq extension (vLLM's): 0 = off")
    min_p: float | None = Field(None, description="genq extension (vLLM's)")
    repetition_penalty: float | None = Field(None, description="genq extension (vLLM's)")
    min_tokens: int | None = Field(None, description="genq extension (vLLM's): stop tokens blocked until reached")
    ignore_eos: bool | None = Field(None, description="genq extension (vLLM's)")
    allowed_token_ids: list[int] | None = Field(None, description="genq extension (vLLM's): only these tokens")
    top_a: float | None = Field(None, description="genq extension (TabbyAPI's)")
    typical: float | None = Field(None, validation_alias=AliasChoices("typical", "typical_p"),
                                  description="genq extension (TabbyAPI's): locally typical sampling")
    tfs: float | None = Field(None, description="genq extension (TabbyAPI's): tail-free sampling")
    skew: float | None = Field(None, description="genq extension (TabbyAPI's)")
    smoothing_factor: float | None = Field(None, description="genq extension (TabbyAPI's): quadratic sampling")
    min_temp: float | None = Field(None, description="genq extension (TabbyAPI's): dynamic temperature")
    max_temp: float | None = Field(None, description="genq extension (TabbyAPI's): dynamic temperature")
    temp_exponent: float | None = Field(None, description="genq extension (TabbyAPI's): dynamic temperature")
    temperature_last: bool | None = Field(None, description="genq extension (TabbyAPI's)")
    mirostat_mode: int | None = Field(None, description="genq extension (TabbyAPI's): 0 = off, 2 = mirostat v2")
    mirostat_tau: float | None = Field(None, description="genq extension (TabbyAPI's)")
    mirostat_eta: float | None = Field(None, description="genq extension (TabbyAPI's)")
    dry_multiplier: float | None = Field(None, description="genq extension (TabbyAPI's): DRY, 0 = off")
    dry_base: float | None = Field(None, description="genq extension (TabbyAPI's)")
    dry_allowed_length: int | None = Field(None, description="genq extension (TabbyAPI's)")
    dry_range: int | None = Field(None, description="genq extension (TabbyAPI's): 0 = the whole context")
    dry_sequence_breakers: list[str] | str | None = Field(
        None, description='genq extension (TabbyAPI\'s): strings, or JSON strings in a string: "\\n", ":"')
    xtc_probability: float | None = Field(None, description="genq extension (TabbyAPI's): XTC, 0 = off")
    xtc_threshold: float | None = Field(None, description="genq extension (TabbyAPI's)")
    penalty_range: int | None = Field(
        None, validation_alias=AliasChoices("penalty_range", "repetition_penalty_range"),
        description="genq extension (TabbyAPI's): repetition_penalty over the last N tokens, -1 = all")
    repetition_decay: int | None = Field(None, description="genq extension (TabbyAPI's): the penalty fades out "
                                                           "over this many tokens before the range")
    banned_strings: list[str] | str | None = Field(None, description="genq extension (TabbyAPI's): text the "
                                                                     "output never contains")
    token_healing: bool | None = Field(None, description="genq extension (TabbyAPI's): regenerate the prompt's "
                                                         "last token")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM extension: a JSON Schema")
    guided_regex: str | None = Field(None, description="vLLM extension")
    guided_choice: list[str] | None = Field(None, description="vLLM extension")
    guided_grammar: str | None = Field(None, description="vLLM extension: Lark, or GBNF (llama.cpp's)")

    def _check_supported(self) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise InvalidParameter("n", f"the number of choices must be from 1 to {MAX_N}, got {self.n}")

    @property
    def n_choices(self) -> int:
        """How many choices (child requests) the request asks for."""
        return 1 if self.n is None else self.n

    def _guided(self) -> dict[str, tuple[str, Any]]:
        """The vLLM guided_* parameters given: name -> the protocol constraint they ask for."""
        guided: dict[str, tuple[str, Any]] = {}
        if self.guided_json is not None:
            schema = self.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as error:
                    raise InvalidParameter("guided_json", f"not valid JSON ({error})") from None
            guided["guided_json"] = ("json_schema", {"type": "json_schema", "json_schema": schema})
        if self.guided_regex is not None:
            guided["guided_regex"] = ("regex", {"type": "regex", "pattern": self.guided_regex})
        if self.guided_choice is not None:
            guided["guided_choice"] = ("choice", {"type": "choice", "choices": self.guided_choice})
        if self.guided_grammar is not None:
            syntax = "gbnf" if "::=" in self.guided_grammar else "lark"
            guided["guided_grammar"] = ("grammar", {"type": "grammar", "syntax": syntax,
                                                    "grammar": self.guided_grammar})
        return guided

    @staticmethod
    def _one_constraint(asked: dict[str, Any]) -> Any:
        if len(asked) > 1:
            raise InvalidParameter(next(iter(asked)), f"one output constraint per request, got {', '.join(asked)}")
        return next(iter(asked.values()), None)

    def _exl2_sampling(self) -> dict[str, Any]:
        """The protocol's sampling fields for the TabbyAPI-named extensions given."""
        sampling = {name: getattr(self, name) for name in SAME_NAMED_SAMPLERS}
        sampling["repetition_penalty_range"] = self.penalty_range
        sampling["repetition_penalty_decay"] = self.repetition_decay
        if self.mirostat_mode is not None:
            if self.mirostat_mode not in (0, 2):
                raise InvalidParameter("mirostat_mode", f"0 (off) or 2 (mirostat v2), got {self.mirostat_mode}")
            sampling["mirostat"] = self.mirostat_mode == 2
        breakers = self.dry_sequence_breakers
        if isinstance(breakers, str):  # TabbyAPI's (SillyTavern's): JSON strings in a string, brackets optional
            try:
                breakers = json.loads(breakers if breakers.lstrip().startswith("[") else f"[{breakers}]")
            except json.JSONDecodeError as error:
                raise InvalidParameter("dry_sequence_breakers", f"not a JSON array of strings ({error})") from None
        sampling["dry_sequence_breakers"] = breakers
        return sampling

    def _request_fields(self, max_tokens: int | None, default_max_tokens: int) -> dict[str, Any]:
        sampling = {
            "temperature": OPENAI_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            "top_p": self.top_p, "seed": self.seed, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "token_bias": self.logit_bias, "top_k": self.top_k,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "allowed_token_ids": self.allowed_token_ids, **self._exl2_sampling(),
        }
        fields: dict[str, Any] = {
            "max_new_tokens": default_max_tokens if max_tokens is None else max_tokens,
            "sampling": {name: value for name, value in sampling.items() if value is not None},
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
        }
        if self.min_tokens is not None:
            fields["min_new_tokens"] = self.min_tokens
        if self.ignore_eos is not None:
            fields["ignore_eos"] = self.ignore_eos
        if self.banned_strings is not None:
            banned = self.banned_strings
            fields["banned_strings"] = [banned] if isinstance(banned, str) else banned
        if self.token_healing is not None:
            fields["token_healing"] = self.token_healing
        return fields

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_CommonParams):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(None, description="the chosen tokens' logprobs and this many alternatives")
    best_of: int | None = None
    suffix: str | None = None

    def to_request_fields(self) -> dict[str, Any]:
        """The GenerationRequest fields (not yet validated) this request asks for."""
        self._check_supported()
        for param, value, neutral in (("echo", self.echo, (None, False)), ("best_of", self.best_of, (None, 1)),
                                      ("suffix", self.suffix, (None, ""))):
            if value not in neutral:
                raise UnsupportedParameter(param, "not supported by genq")
        fields = self._request_fields(self.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
        if self.logprobs is not None:
            fields["logprobs"] = True
            fields["top_logprobs"] = self.logprobs
        constraint = self._one_constraint({name: c for name, (_, c) in self._guided().items()})
        if constraint is not None:
            fields["constraint"] = constraint
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise UnsupportedParameter("prompt", f"one prompt per request, got a batch of {len(prompt)}")
            prompt = prompt[0]
        fields["input_ids" if isinstance(prompt, list) else "prompt"] = prompt
        return fields


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessageParam(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part_index, part in enumerate(self.content):
            if part.get("type") != "text":
                raise UnsupportedParameter(f"messages[{index}].content[{part_index}]",
                                           f"only text parts are supported, got type {part.get('type')!r}")
            try:
                texts.append(TextPart.model_validate(part).text)
            except ValidationError:
                raise InvalidParameter(f"messages[{index}].content[{part_index}]",
                                       'a text part is {"type": "text", "text": <string>}') from None
        return "".join(texts)


class ChatCompletionRequest(_CommonParams):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageParam]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def to_request_fields(self) -> dict[str, Any]:
        self._check_supported()
        if self.tools or self.functions or self.tool_choice not in (None, "none"):
            raise UnsupportedParameter("tools", "tool calling is not supported by genq")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        fields = self._request_fields(max_tokens, DEFAULT_MAX_NEW_TOKENS)
        if self.top_logprobs and not self.logprobs:
            raise InvalidParameter("top_logprobs", "needs logprobs: true (as in OpenAI's API)")
        if self.logprobs:
            fields["logprobs"] = True
            fields["top_logprobs"] = self.top_logprobs or 0
        asked = {name: c for name, (_, c) in self._guided().items()}
        response_format = self._response_format()
        if response_format is not None:
            asked["response_format"] = response_format
        constraint = self._one_constraint(asked)
        if constraint is not None:
            fields["constraint"] = constraint
        # OpenAI's "developer" role is its newer name for the system prompt.
        fields["messages"] = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
                              for i, m in enumerate(self.messages)]
        return fields

    def _response_format(self) -> dict[str, Any] | None:
        """OpenAI's response_format as a protocol constraint (None for text)."""
        format_ = self.response_format
        kind = "text" if format_ is None else format_.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            spec = format_.get("json_schema") if format_ else None
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InvalidParameter("response_format.json_schema.schema",
                                       'json_schema needs {"name": ..., "schema": {<a JSON Schema>}}')
            return {"type": "json_schema", "json_schema": schema}
        raise InvalidParameter("response_format.type", f"text, json_object or json_schema, got {kind!r}")


# --- responses -----------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def from_usage(cls, usage: Usage | Sequence[Usage]) -> CompletionUsage:
        """One request's usage, or the sum over the children of an n > 1 request: their prompt is
        the same, so it is counted once (the first child's count), their completions are summed,
        and cached_tokens is what no child had to compute: the prompt less the prompt tokens each
        child computed, at least 0 (the single usage's own cached_tokens when n = 1)."""
        usages = [usage] if isinstance(usage, Usage) else list(usage)
        prompt = usages[0].prompt_tokens
        completion = sum(u.completion_tokens for u in usages)
        computed = sum(max(0, u.prompt_tokens - u.cached_tokens) for u in usages)
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=max(0, prompt - computed)))


class TopLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprobEntry):
    top_logprobs: list[TopLogprobEntry]


class ChatLogprobs(BaseModel):
    """Chat's logprobs object: one entry per generated token."""

    content: list[ChatTokenLogprob]
    refusal: None = None

    @classmethod
    def from_tokens(cls, logprobs: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if logprobs is None:
            return None
        return cls(content=[
            ChatTokenLogprob(token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode()),
                             top_logprobs=[TopLogprobEntry(token=t.token, logprob=t.logprob,
                                                           bytes=list(t.token.encode())) for t in lp.top_logprobs])
            for lp in logprobs
        ])


class CompletionLogprobs(BaseModel):
    """The completions endpoint's (legacy) logprobs object: parallel lists per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]

    @classmethod
    def from_tokens(cls, logprobs: list[TokenLogprob] | None, offset: int = 0) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        offsets = []
        for lp in logprobs:
            offsets.append(offset)
            offset += len(lp.token)
        return cls(tokens=[lp.token for lp in logprobs], token_logprobs=[lp.logprob for lp in logprobs],
                   top_logprobs=[{t.token: t.logprob for t in lp.top_logprobs} for lp in logprobs],
                   text_offset=offsets)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: OpenAIFinishReason | None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: OpenAIFinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


class ChatDelta(BaseModel):
    """Only what changed: `{"role": "assistant", "content": ""}` first, then `{"content": ...}`,
    and `{}` in the final chunk, as OpenAI sends them."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, serialize: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {name: value for name, value in serialize(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: OpenAIFinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "genq"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def openai_finish_reason(finish_reason: str) -> OpenAIFinishReason:
    return FINISH_REASONS[finish_reason]  # type: ignore[return-value]


def completion_response(identifier: str, model: str, results: Sequence[GenerationResult]) -> Completion:
    """The answer to a request of len(results) choices, choice i from results[i]."""
    return Completion(id=identifier, created=int(time.time()), model=model,
                      choices=[CompletionChoice(index=i, text=result.text,
                                                finish_reason=openai_finish_reason(result.finish_reason),
                                                logprobs=CompletionLogprobs.from_tokens(result.logprobs))
                               for i, result in enumerate(results)],
                      usage=CompletionUsage.from_usage([result.usage for result in results]))


def chat_response(identifier: str, model: str, results: Sequence[GenerationResult]) -> ChatCompletion:
    """The answer to a request of len(results) choices, choice i from results[i]."""
    return ChatCompletion(id=identifier, created=int(time.time()), model=model,
                          choices=[ChatChoice(index=i, message=AssistantMessage(content=result.text),
                                              finish_reason=openai_finish_reason(result.finish_reason),
                                              logprobs=ChatLogprobs.from_tokens(result.logprobs))
                                   for i, result in enumerate(results)],
                          usage=CompletionUsage.from_usage([result.usage for result in results]))
