"""OpenAI-compatible request and response shapes, and their translation to the genq protocol.

Requests accept what OpenAI clients send. Every OpenAI parameter is either supported, accepted
and ignored for a stated reason (IGNORED_PARAMS: it cannot change the output genq gives), or
refused with a 400 that names it (suffix, best_of > 1, audio, web search). A
parameter nobody defines is refused too, as OpenAI does, so a misspelt `max_token` is a 400 and
not a silent default, and so is a key nobody defines inside the request's objects, named by its
dotted path (`stream_options.include_usages`; JSON Schemas are free-form and not looked into);
a deployment whose clients send vendor extras sets GENQ_GATEWAY_IGNORE_UNKNOWN_PARAMS (ignored,
with a log line). The values themselves are checked
by GenerationRequest, so the limits are the protocol's. `n` (1 to MAX_N) is the protocol's `n`: one task whose worker
generates n samples side by side on the prompt computed once (seeds seed + i, or each its own
random seed); the response has one choice per sample, by its index, and the usage counts the
prompt once (streamed: see producer/gateway/app.py). Structured output: chat's response_format
(json_object, json_schema) and vLLM's guided_json / guided_regex / guided_choice / guided_grammar
and vLLM's newer structured_outputs object on both endpoints become the request's constraint;
response_format {"type": "json_object", "schema": {...}} (llama.cpp's and Together's) keeps its
schema. Log-probabilities in OpenAI's shapes: chat's logprobs + top_logprobs,
completions' logprobs (an int: that many alternatives); the prompt's own, as vLLM's
prompt_logprobs (both endpoints; streamed on the first chunk, where vLLM refuses them) and completions'
echo with logprobs (streamed: each choice's first chunk). Completions'
prompt is one prompt or a list of up to MAX_PROMPTS (CompletionRequest.prompts), each its own task
(producer/gateway/completions.py). Tools: chat's tools, tool_choice and
parallel_tool_calls (legacy functions / function_call become them) are the protocol's; history
messages with tool_calls and role "tool" pass through; the answer's tool calls come from the
worker's result, and streamed from ToolCallStream over the streamed text (docs/tools.md).
Extensions, as in vLLM: top_k, min_p,
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
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)

from producer.bounded_json import JsonLimitError, loads_bounded
from producer.client import GenerationError, StreamRestarted
from producer.gateway.images import IMAGE_URL_PART_SHAPE
from producer.protocol import (
    DEFAULT_MAX_NEW_TOKENS,
    MAX_N,
    Choice,
    GenerationResult,
    StreamEvent,
    TokenLogprob,
    ToolCall,
    Usage,
    grammar_syntax,
)
from producer.tool_calls import ArgumentsDelta, CallStart

log = logging.getLogger(__name__)

OPENAI_DEFAULT_TEMPERATURE = 1.0
MAX_PROMPTS = 32
"""Prompts in one /v1/completions request: each is a task, and the request holds their streams."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for /v1/completions; chat completions default to the protocol's."""
OpenAIFinishReason = Literal["stop", "length", "tool_calls", "function_call"]
FINISH_REASONS: dict[str, OpenAIFinishReason] = {
    "stop": "stop", "length": "length", "deadline": "length", "cancelled": "length", "tool_calls": "tool_calls"}

SAME_NAMED_SAMPLERS = (
    "top_a", "typical", "tfs", "skew", "smoothing_factor", "min_temp", "max_temp", "temp_exponent",
    "temperature_last", "mirostat_tau", "mirostat_eta", "dry_multiplier", "dry_base", "dry_allowed_length",
    "dry_range", "xtc_probability", "xtc_threshold",
)
"""The extensions whose TabbyAPI name is the protocol's sampling field."""
OPENAI_NAMES: dict[str, str] = {
    "input_ids": "prompt", "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
    "sampling.token_bias": "logit_bias", "stream.coalesce_ms": "stream_options.coalesce_ms",
    "sampling.repetition_penalty_range": "penalty_range",
    "sampling.repetition_penalty_decay": "repetition_decay", "sampling.mirostat": "mirostat_mode",
    **{f"sampling.{name}": name for name in (
        "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
        "repetition_penalty", "allowed_token_ids", "banned_token_ids", "dry_sequence_breakers",
        *SAME_NAMED_SAMPLERS)},
}
"""The OpenAI endpoints' names of the protocol fields a refusal names."""
_PROMPT_CACHE = "genq's prefix cache finds shared prompt prefixes by itself"
_ABUSE_ID = "an end-user identifier for OpenAI's abuse monitoring; genq keeps none"
IGNORED_PARAMS: dict[str, str] = {
    "user": _ABUSE_ID,
    "safety_identifier": _ABUSE_ID,
    "store": "OpenAI's stored completions; genq stores none for later retrieval",
    "metadata": "tags of OpenAI's stored completions",
    "service_tier": "genq has one tier; the queue's priority is the native API's `priority`",
    "prompt_cache_key": _PROMPT_CACHE,
    "prompt_cache_retention": _PROMPT_CACHE,
    "prompt_cache_options": _PROMPT_CACHE,
    "prediction": "a speed hint (predicted output): the output is the same without it",
    "reasoning_effort": "the models genq serves have no reasoning-effort control",
    "verbosity": "the models genq serves have no verbosity control",
    "moderation": "genq runs no moderation model",
}
"""OpenAI parameters accepted and ignored, each with the reason (docs/gateway.md lists them)."""
REFUSED_PARAMS: dict[str, str] = {
    "audio": "audio output is not supported by genq",
    "web_search_options": "web search is not supported by genq",
}
"""OpenAI parameters refused whenever they are set (tools, echo, ... are checked by their models)."""
COMPLETIONS_IMAGE_PARAMS = ("images", "multi_modal_data", "image_url")
"""What clients send images to a completions endpoint as (genq's `images`, vLLM's offline
multi_modal_data): refused by name, the completions endpoint takes no images."""
_FIELD_RE = re.compile(r"(?:sampling\.)?\w+")


def openai_param(path: str, names: Mapping[str, str] = OPENAI_NAMES) -> str:
    """The OpenAI request's name of the parameter a protocol field path stands for
    ("sampling.dry_base" -> "dry_base", "sampling.token_bias[3]" -> "logit_bias[3]"), so that a
    refusal's `param` points at what was sent; a path with no OpenAI name is kept."""
    field = _FIELD_RE.match(path)
    if field is None or field[0] not in names:
        return path
    return names[field[0]] + path[field.end():]


def openai_problem(problem: str, names: Mapping[str, str]) -> str:
    """A protocol problem line ("max_new_tokens: ...") under the caller's names ("max_tokens: ..."),
    the fields it names in its text too (a cross-field rule's "constraint|banned_strings: give at
    most one of constraint and banned_strings")."""
    path, colon, rest = problem.partition(":")
    if not colon:
        return problem
    fields = path.split("|")
    for field in fields:
        rest = re.sub(rf"\b{re.escape(field)}\b", openai_param(field, names), rest)
    return "|".join(openai_param(field, names) for field in fields) + colon + rest


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


class UnknownParameter(UnsupportedParameter):
    """A parameter neither OpenAI nor genq defines (a misspelling, or another vendor's extra)."""

    code = "unknown_parameter"


class _Nested(BaseModel):
    """A request object inside the request. The keys it does not define are kept aside
    (model_extra), never used: unknown_keys names them, but for the ones in ACCEPTED, which OpenAI
    or vLLM define and genq accepts and ignores."""

    model_config = ConfigDict(extra="allow")
    ACCEPTED: ClassVar[frozenset[str]] = frozenset()

    def unknown_keys(self, path: str) -> list[str]:
        return [f"{path}.{key_name(key)}" for key in self.model_extra or {} if key not in self.ACCEPTED]


def refuse_unknown(unknown: list[str], ignore_unknown: bool) -> None:
    """UnknownParameter naming the first of `unknown` (dotted paths), or, under
    GENQ_GATEWAY_IGNORE_UNKNOWN_PARAMS, a log line."""
    if unknown and ignore_unknown:
        log.info("ignoring unknown parameters: %s", ", ".join(unknown))
    elif unknown:
        raise UnknownParameter(unknown[0], f"unknown parameter{'s' if len(unknown) > 1 else ''} "
                                           f"{', '.join(repr(name) for name in unknown)} (neither OpenAI's nor a "
                                           "genq extension; docs/gateway.md lists them)")


def key_name(key: str) -> str:
    """A key as a refusal can show it (as the protocol's field names): a hostile one (a lone
    surrogate cannot be encoded as UTF-8) escaped, a long one cut."""
    if not key.isprintable():
        key = ascii(key)[1:-1]
    return key if len(key) <= 40 else key[:37] + "..."


Shape = Mapping[str, "Shape | None"]
"""The keys a request object given as a plain dict may hold, each with the Shape of its value, or
None for a value not looked into (a scalar, or free-form: a JSON Schema)."""
FUNCTION_SHAPE: Shape = {"name": None, "description": None, "parameters": None, "strict": None}
"""A tool's function, and a legacy `functions` entry (which becomes one)."""
TOOL_SHAPE: Shape = {"type": None, "function": FUNCTION_SHAPE}
NAMED_TOOL_CHOICE_SHAPE: Shape = {"type": None, "function": {"name": None}}
TEXT_PART_SHAPE: Shape = {"type": None, "text": None, "prompt_cache_breakpoint": None}
"""prompt_cache_breakpoint: a prompt-caching hint; genq's prefix cache needs none."""
RESPONSE_FORMAT_SHAPES: dict[str, Shape] = {
    "text": {"type": None},
    "json_object": {"type": None, "schema": None},  # schema: llama.cpp's and Together's form
    "json_schema": {"type": None, "json_schema": {"name": None, "description": None, "schema": None, "strict": None}},
}


def unknown_keys(value: Any, shape: Shape, path: str) -> list[str]:
    """The dotted paths of the keys of `value` that `shape` does not name, looking into the values
    whose shape it gives; a value that is not an object is left to the checks of its own."""
    if not isinstance(value, Mapping):
        return []
    found = []
    for key, item in value.items():
        if key not in shape:
            found.append(f"{path}.{key_name(key)}")
        elif (inner := shape[key]) is not None:
            found += unknown_keys(item, inner, f"{path}.{key}")
    return found


def known_only(value: Any, shape: Shape) -> Any:
    """`value` without the keys `shape` does not name (those unknown_keys named, ignored under
    GENQ_GATEWAY_IGNORE_UNKNOWN_PARAMS), so that the protocol's closed models take it."""
    if not isinstance(value, Mapping):
        return value
    kept = {}
    for key, item in value.items():
        if key in shape:
            inner = shape[key]
            kept[key] = item if inner is None else known_only(item, inner)
    return kept


class StreamOptionsParam(_Nested):
    ACCEPTED = frozenset({"include_obfuscation"})
    """OpenAI's padding of streamed chunks against length side channels; genq adds none."""

    include_usage: bool = False
    coalesce_ms: int | None = Field(
        default=None, description="genq extension: the worker's and this gateway's chunks merged and sent at most "
                                  "this often per choice (ms; 0: every step; unset: GENQ_STREAM_COALESCE_MS on the "
                                  "worker, GENQ_GATEWAY_STREAM_COALESCE_MS here); the first chunk and the last go "
                                  "out at once")


class StructuredOutputsParam(_Nested):
    """vLLM's structured_outputs object: one of json, regex, choice, grammar or json_object.
    Its whitespace and fallback options tune vLLM's own backends and are ignored (genq's JSON
    has no whitespace between tokens)."""

    ACCEPTED = frozenset({"disable_fallback", "disable_any_whitespace", "whitespace_pattern"})

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None


class _CommonParams(BaseModel):
    model_config = ConfigDict(extra="allow")

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
    top_k: int | None = Field(default=None, description="genq extension (vLLM's): 0 = off")
    min_p: float | None = Field(default=None, description="genq extension (vLLM's)")
    repetition_penalty: float | None = Field(default=None, description="genq extension (vLLM's)")
    min_tokens: int | None = Field(default=None,
                                   description="genq extension (vLLM's): stop tokens blocked until reached")
    ignore_eos: bool | None = Field(default=None, description="genq extension (vLLM's)")
    allowed_token_ids: list[int] | None = Field(default=None, description="genq extension (vLLM's): only these tokens")
    top_a: float | None = Field(default=None, description="genq extension (TabbyAPI's)")
    typical: float | None = Field(default=None, validation_alias=AliasChoices("typical", "typical_p"),
                                  description="genq extension (TabbyAPI's): locally typical sampling")
    tfs: float | None = Field(default=None, description="genq extension (TabbyAPI's): tail-free sampling")
    skew: float | None = Field(default=None, description="genq extension (TabbyAPI's)")
    smoothing_factor: float | None = Field(default=None, description="genq extension (TabbyAPI's): quadratic sampling")
    min_temp: float | None = Field(default=None, description="genq extension (TabbyAPI's): dynamic temperature")
    max_temp: float | None = Field(default=None, description="genq extension (TabbyAPI's): dynamic temperature")
    temp_exponent: float | None = Field(default=None, description="genq extension (TabbyAPI's): dynamic temperature")
    temperature_last: bool | None = Field(default=None, description="genq extension (TabbyAPI's)")
    mirostat_mode: int | None = Field(default=None, description="genq extension (TabbyAPI's): 0 = off, 2 = mirostat v2")
    mirostat_tau: float | None = Field(default=None, description="genq extension (TabbyAPI's)")
    mirostat_eta: float | None = Field(default=None, description="genq extension (TabbyAPI's)")
    dry_multiplier: float | None = Field(default=None, description="genq extension (TabbyAPI's): DRY, 0 = off")
    dry_base: float | None = Field(default=None, description="genq extension (TabbyAPI's)")
    dry_allowed_length: int | None = Field(default=None, description="genq extension (TabbyAPI's)")
    dry_range: int | None = Field(default=None, description="genq extension (TabbyAPI's): 0 = the whole context")
    dry_sequence_breakers: list[str] | str | None = Field(
        default=None, description='genq extension (TabbyAPI\'s): strings, or JSON strings in a string: "\\n", ":"')
    xtc_probability: float | None = Field(default=None, description="genq extension (TabbyAPI's): XTC, 0 = off")
    xtc_threshold: float | None = Field(default=None, description="genq extension (TabbyAPI's)")
    penalty_range: int | None = Field(
        default=None, validation_alias=AliasChoices("penalty_range", "repetition_penalty_range"),
        description="genq extension (TabbyAPI's): repetition_penalty over the last N tokens, -1 = all")
    repetition_decay: int | None = Field(default=None, description="genq extension (TabbyAPI's): the penalty fades out "
                                                                   "over this many tokens before the range")
    banned_strings: list[str] | str | None = Field(default=None, description="genq extension (TabbyAPI's): text the "
                                                                             "output never contains")
    token_healing: bool | None = Field(default=None, description="genq extension (TabbyAPI's): regenerate the prompt's "
                                                                 "last token")
    guided_json: dict[str, Any] | str | None = Field(default=None, description="vLLM extension: a JSON Schema")
    guided_regex: str | None = Field(default=None, description="vLLM extension")
    guided_choice: list[str] | None = Field(default=None, description="vLLM extension")
    guided_grammar: str | None = Field(default=None, description="vLLM extension: Lark, or GBNF (llama.cpp's)")
    structured_outputs: StructuredOutputsParam | None = Field(
        default=None, description="vLLM extension: {json | regex | choice | grammar | json_object: ...}")
    prompt_logprobs: int | None = Field(
        default=None, description="vLLM extension: each prompt token's logprob and this many alternatives "
                                  "(streamed too, unlike vLLM: on the first chunk)")

    def _check_supported(self, ignore_unknown: bool) -> None:
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise InvalidParameter("n", f"the number of choices must be from 1 to {MAX_N}, got {self.n}")
        extras = self.model_extra or {}
        for name, why in REFUSED_PARAMS.items():
            if extras.get(name) is not None:
                raise UnsupportedParameter(name, why)
        if extras.get("modalities") not in (None, ["text"]):
            raise UnsupportedParameter("modalities", f'only ["text"] is supported, got {extras["modalities"]!r}')
        unknown = sorted(set(extras) - IGNORED_PARAMS.keys() - REFUSED_PARAMS.keys() - {"modalities"})
        refuse_unknown(unknown + self._unknown_nested_keys(), ignore_unknown)

    def _unknown_nested_keys(self) -> list[str]:
        """The keys inside the request's objects that nobody defines, by their dotted paths
        ("stream_options.include_usages"); JSON Schemas and other free-form values are not looked into."""
        found = []
        if self.stream_options is not None:
            found += self.stream_options.unknown_keys("stream_options")
        if self.structured_outputs is not None:
            found += self.structured_outputs.unknown_keys("structured_outputs")
        return found

    def param_names(self) -> dict[str, str]:
        """The names this request gave the protocol fields a refusal may name: OPENAI_NAMES, with
        the constraint named after the parameter that asked for it."""
        asked = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                   "structured_outputs") if getattr(self, name) is not None]
        return {**OPENAI_NAMES, **({"constraint": asked[0]} if asked else {})}

    @property
    def n_choices(self) -> int:
        """How many choices (the protocol's samples) the request asks for."""
        return 1 if self.n is None else self.n

    def _guided(self) -> dict[str, dict[str, Any]]:
        """The vLLM guided_* parameters given: name -> the protocol constraint they ask for."""
        guided = _constraints(self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar,
                              "guided_{}".format)
        if self.structured_outputs is not None:
            guided["structured_outputs"] = _structured_output(self.structured_outputs)
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
                breakers = loads_bounded(breakers if breakers.lstrip().startswith("[") else f"[{breakers}]")
            except JsonLimitError as error:
                raise InvalidParameter("dry_sequence_breakers", f"a JSON string {error}") from None
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
            "n": self.n_choices,
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
        if self.prompt_logprobs is not None:
            fields["prompt_logprobs"] = self.prompt_logprobs
        if self.coalesce_ms is not None:
            fields["stream"] = {"coalesce_ms": self.coalesce_ms}
        return fields

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def coalesce_ms(self) -> int | None:
        """stream_options.coalesce_ms, the request's own coalescing interval, if it gives one."""
        return None if self.stream_options is None else self.stream_options.coalesce_ms

    def coalesce_s(self, default_ms: int) -> float:
        """The gateway's interval between a choice's chunks: the request's, else `default_ms`."""
        return (default_ms if self.coalesce_ms is None else self.coalesce_ms) / 1000


class CompletionRequest(_CommonParams):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = Field(default=None, description="each choice's text begins with its prompt")
    logprobs: int | None = Field(default=None, description="the chosen tokens' logprobs and this many alternatives")
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each its own task: a string or a token-id list alone, or each of a list of
        them (at most MAX_PROMPTS)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise InvalidParameter("prompt", "give a prompt: a string, token ids, or a list of either")
        if len(prompt) > MAX_PROMPTS:
            raise InvalidParameter("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        return list(prompt)  # type: ignore[arg-type]  # strings or token-id lists, as the union's members

    @property
    def batched(self) -> bool:
        """Whether the prompt is a list of prompts (each named prompt[i] in a refusal)."""
        return isinstance(self.prompt, list) and bool(self.prompt) and not isinstance(self.prompt[0], int)

    @property
    def echo_logprobs(self) -> bool:
        """echo with logprobs: each choice's logprobs begin with its prompt's."""
        return bool(self.echo) and self.logprobs is not None

    def to_request_fields(self, ignore_unknown: bool = False) -> dict[str, Any]:
        """The GenerationRequest fields (not yet validated) this request asks for, but its prompt:
        prompts() gives each task's."""
        for param in COMPLETIONS_IMAGE_PARAMS:
            if (self.model_extra or {}).get(param) is not None:
                raise UnsupportedParameter(param, "the completions endpoint takes no images; send them as image_url "
                                                  "parts of a user message to POST /v1/chat/completions")
        self._check_supported(ignore_unknown)
        for param, value, neutral in (("best_of", self.best_of, (None, 1)), ("suffix", self.suffix, (None, ""))):
            if value not in neutral:
                raise UnsupportedParameter(param, "not supported by genq")
        fields = self._request_fields(self.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS)
        if self.logprobs is not None:
            fields["logprobs"] = True
            fields["top_logprobs"] = self.logprobs
        if self.echo_logprobs:
            fields["prompt_logprobs"] = max(self.logprobs or 0, self.prompt_logprobs or 0)
        constraint = self._one_constraint(self._guided())
        if constraint is not None:
            fields["constraint"] = constraint
        return fields


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessageParam(_Nested):
    """A message of `messages`. ACCEPTED: what a response's message has besides (a client may send
    the answer back as it got it): OpenAI's refusal, audio and annotations, genq's (vLLM's)
    reasoning_content; the templates render none of them. A legacy function_call in the history
    is accepted when null."""

    ACCEPTED = frozenset({"refusal", "audio", "annotations", "reasoning_content", "function_call"})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def unknown_keys(self, path: str) -> list[str]:
        """The message's unknown keys, and those of its text and image parts."""
        found = super().unknown_keys(path)
        for index, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if part.get("type") == "text":
                found += unknown_keys(part, TEXT_PART_SHAPE, f"{path}.content[{index}]")
            elif part.get("type") == "image_url":
                found += unknown_keys(part, IMAGE_URL_PART_SHAPE, f"{path}.content[{index}]")
        return found

    def fields(self, index: int, images: Mapping[int, dict[str, Any]] | None = None) -> dict[str, Any]:
        """The protocol's ChatMessage fields of this message. OpenAI's "developer" role is its
        newer name for the system prompt; a tool call's arguments given as an object (some
        clients send one) become its JSON text. With `images` (content index -> the protocol's
        image part, producer/gateway/images.py) the content stays a list of parts, one per part
        sent; without, it is the text parts joined."""
        if (self.model_extra or {}).get("function_call") is not None:
            raise UnsupportedParameter(f"messages[{index}].function_call", "a legacy function call in the history "
                                       "is not supported; send it as tool_calls (and its answer as a tool message)")
        fields: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                  "content": self.parts(index, images) if images else self.text(index)}
        if self.tool_calls:
            fields["tool_calls"] = [_history_call(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            fields["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            fields["name"] = self.name
        return fields

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(self._text_part(index, part_index, part) for part_index, part in enumerate(self.content))

    def parts(self, index: int, images: Mapping[int, dict[str, Any]]) -> list[dict[str, Any]]:
        """The content as the protocol's parts: the resolved images where the image_url parts were."""
        assert isinstance(self.content, list)
        return [images[part_index] if part_index in images
                else {"type": "text", "text": self._text_part(index, part_index, part)}
                for part_index, part in enumerate(self.content)]

    @staticmethod
    def _text_part(index: int, part_index: int, part: dict[str, Any]) -> str:
        if part.get("type") != "text":
            where = (" here (POST /v1/chat/completions takes them)" if part.get("type") == "image_url"
                     else ", and image_url parts")
            raise UnsupportedParameter(f"messages[{index}].content[{part_index}]",
                                       f"only text parts are supported{where}, got type {part.get('type')!r}")
        try:
            return TextPart.model_validate(part).text
        except ValidationError:
            raise InvalidParameter(f"messages[{index}].content[{part_index}]",
                                   'a text part is {"type": "text", "text": <string>}') from None


class ChatCompletionRequest(_CommonParams):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageParam]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="vLLM extension: extra chat template variables (e.g. enable_thinking)")
    add_generation_prompt: bool | None = Field(default=None, description="vLLM extension (default true)")
    continue_final_message: bool | None = Field(
        default=None, description="vLLM extension: continue the last (assistant) message instead of answering it")

    def _unknown_nested_keys(self) -> list[str]:
        found = super()._unknown_nested_keys()
        for index, message in enumerate(self.messages):
            found += message.unknown_keys(f"messages[{index}]")
        kind = self.response_format.get("type") if self.response_format is not None else None
        if isinstance(kind, str) and kind in RESPONSE_FORMAT_SHAPES:
            found += unknown_keys(self.response_format, RESPONSE_FORMAT_SHAPES[kind], "response_format")
        for index, tool in enumerate(self.tools or ()):
            if tool.get("type", "function") == "function":  # the protocol refuses the other kinds by type
                found += unknown_keys(tool, TOOL_SHAPE, f"tools[{index}]")
        for index, function in enumerate(self.functions or ()):
            found += unknown_keys(function, FUNCTION_SHAPE, f"functions[{index}]")
        if isinstance(self.tool_choice, dict) and self.tool_choice.get("type") == "function":
            found += unknown_keys(self.tool_choice, NAMED_TOOL_CHOICE_SHAPE, "tool_choice")
        if isinstance(self.function_call, dict):
            found += unknown_keys(self.function_call, {"name": None}, "function_call")
        return found

    def param_names(self) -> dict[str, str]:
        names = super().param_names()
        if self.max_completion_tokens is not None:
            names["max_new_tokens"] = "max_completion_tokens"
        if self.response_format is not None and self.response_format.get("type") != "text":
            names["constraint"] = "response_format"
        return names

    def check_params(self, ignore_unknown: bool = False) -> None:
        """Refuse unsupported and unknown parameters (before any image is fetched)."""
        self._check_supported(ignore_unknown)

    def to_request_fields(self, ignore_unknown: bool = False,
                          images: Mapping[tuple[int, int], dict[str, Any]] | None = None) -> dict[str, Any]:
        """The GenerationRequest fields (not yet validated); `images`: (message, part) -> the
        protocol's image part of each image_url part (producer/gateway/images.py resolves them)."""
        self._check_supported(ignore_unknown)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        fields = self._request_fields(max_tokens, DEFAULT_MAX_NEW_TOKENS)
        if self.top_logprobs and not self.logprobs:
            raise InvalidParameter("top_logprobs", "needs logprobs: true (as in OpenAI's API)")
        if self.logprobs:
            fields["logprobs"] = True
            fields["top_logprobs"] = self.top_logprobs or 0
        asked = self._guided()
        response_format = self._response_format()
        if response_format is not None:
            asked["response_format"] = response_format
        constraint = self._one_constraint(asked)
        if constraint is not None:
            fields["constraint"] = constraint
        by_message: dict[int, dict[int, dict[str, Any]]] = {}
        for (message, part), image in (images or {}).items():
            by_message.setdefault(message, {})[part] = image
        fields["messages"] = [m.fields(i, by_message.get(i)) for i, m in enumerate(self.messages)]
        fields.update(self._tool_fields())
        for name in ("chat_template_kwargs", "add_generation_prompt", "continue_final_message"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        return fields

    @property
    def legacy_functions(self) -> bool:
        """The request uses the legacy functions: its call is answered as `function_call`."""
        return self.functions is not None

    def _tool_fields(self) -> dict[str, Any]:
        """tools, tool_choice and parallel_tool_calls, from the legacy functions and function_call
        where those are given instead (the values are the protocol's to check; the keys nobody
        defines, which _check_supported refused unless told to ignore them, left out)."""
        if self.functions is not None or self.function_call is not None:
            if self.tools is not None or self.tool_choice is not None:
                raise InvalidParameter("functions", "give tools and tool_choice, or the legacy functions and "
                                                    "function_call, not both")
            tools = None if self.functions is None else [
                {"type": "function", "function": known_only(f, FUNCTION_SHAPE)} for f in self.functions]
            call = self.function_call
            choice = {"type": "function", "function": known_only(call, {"name": None})} if isinstance(call, dict) \
                else call
            # The legacy answer holds one function_call.
            fields: dict[str, Any] = {"tools": tools, "tool_choice": choice, "parallel_tool_calls": False}
        else:
            choice = self.tool_choice
            if isinstance(choice, dict) and choice.get("type") == "function":
                choice = known_only(choice, NAMED_TOOL_CHOICE_SHAPE)
            tools = None if self.tools is None else [
                known_only(tool, TOOL_SHAPE) if tool.get("type", "function") == "function" else tool
                for tool in self.tools]
            fields = {"tools": tools, "tool_choice": choice}
        if self.parallel_tool_calls is not None and not self.legacy_functions:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        return {name: value for name, value in fields.items() if value is not None}

    def _response_format(self) -> dict[str, Any] | None:
        """OpenAI's response_format as a protocol constraint (None for text)."""
        format_ = self.response_format
        kind = "text" if format_ is None else format_.get("type")
        if kind == "text":
            return None
        if kind == "json_object" and format_ and "schema" in format_:  # llama.cpp's and Together's form
            return _json_schema(format_["schema"], "response_format.schema")
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


def _history_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool call as the protocol takes it: OpenAI's id, type and function
    (name, arguments as JSON text); other keys some clients add are dropped."""
    function = call.get("function")
    if not isinstance(function, dict):
        return {key: call.get(key) for key in ("id", "type", "function") if key in call}
    arguments = function.get("arguments")
    if isinstance(arguments, (dict, list)):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call.get("id"), "type": call.get("type", "function"),
            "function": {"name": function.get("name"), "arguments": arguments}}


def _json_schema(schema: dict[str, Any] | str | Any, param: str) -> dict[str, Any]:
    """A JSON Schema given as an object or as a JSON string, as the protocol's constraint."""
    if isinstance(schema, str):
        try:
            schema = loads_bounded(schema)
        except JsonLimitError as error:
            raise InvalidParameter(param, f"a JSON string {error}") from None
        except json.JSONDecodeError as error:
            raise InvalidParameter(param, f"not valid JSON ({error})") from None
    if not isinstance(schema, dict):
        raise InvalidParameter(param, f"a JSON Schema is an object, got {type(schema).__name__}")
    return {"type": "json_schema", "json_schema": schema}


def _constraints(schema: dict[str, Any] | str | None, regex: str | None, choice: list[str] | None,
                 grammar: str | None, param: Callable[[str], str]) -> dict[str, dict[str, Any]]:
    """The constraints vLLM's json / regex / choice / grammar parameters ask for, by the name
    `param` gives each ("guided_json", "structured_outputs.json", ...)."""
    asked: dict[str, dict[str, Any]] = {}
    if schema is not None:
        asked[param("json")] = _json_schema(schema, param("json"))
    if regex is not None:
        asked[param("regex")] = {"type": "regex", "pattern": regex}
    if choice is not None:
        asked[param("choice")] = {"type": "choice", "choices": choice}
    if grammar is not None:
        asked[param("grammar")] = {"type": "grammar", "syntax": grammar_syntax(grammar), "grammar": grammar}
    return asked


def _structured_output(param: StructuredOutputsParam) -> dict[str, Any]:
    if param.structural_tag is not None:
        raise UnsupportedParameter("structured_outputs.structural_tag", "structural tags are not supported by genq")
    asked = _constraints(param.json_, param.regex, param.choice, param.grammar, "structured_outputs.{}".format)
    if param.json_object:
        asked["structured_outputs.json_object"] = {"type": "json_object"}
    if len(asked) != 1:
        raise InvalidParameter("structured_outputs", "exactly one of json, regex, choice, grammar or json_object, "
                                                     f"got {', '.join(asked) or 'none'}")
    return next(iter(asked.values()))


# --- responses -----------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def from_usage(cls, usage: Usage) -> CompletionUsage:
        """A request's usage; with n > 1 the protocol's already counts the shared prompt once and
        sums the samples' completions."""
        return cls(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                   total_tokens=usage.prompt_tokens + usage.completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens))


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
    """The completions endpoint's (legacy) logprobs object: parallel lists per token; with echo the
    prompt's tokens come first, the first of them with null logprob and alternatives."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    @classmethod
    def from_tokens(cls, logprobs: list[TokenLogprob] | None, offset: int = 0) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        return cls.of([(lp.token, lp) for lp in logprobs], offset)

    @classmethod
    def of(cls, tokens: list[tuple[str, TokenLogprob | None]], offset: int = 0, alternatives: int | None = None
           ) -> CompletionLogprobs:
        """From (text, logprob or None) per token; `alternatives` cuts each token's alternatives."""
        offsets = []
        for text, _ in tokens:
            offsets.append(offset)
            offset += len(text)
        return cls(tokens=[text for text, _ in tokens],
                   token_logprobs=[None if lp is None else lp.logprob for _, lp in tokens],
                   top_logprobs=[None if lp is None else {t.token: t.logprob for t in lp.top_logprobs[:alternatives]}
                                 for _, lp in tokens],
                   text_offset=offsets)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: rank 1 is the likeliest token; genq knows the ranks of the alternatives
    only, so a prompt token that is not among them has rank null."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's prompt_logprobs: per prompt token, {token id: its logprob} for the token itself and its
position's alternatives; null for the first token, which nothing precedes."""


@dataclass(frozen=True)
class ScoredPrompt:
    """A task's prompt as the model read it, with its log-probabilities: from its result, or,
    streamed, from the one chunk of an attempt that carries them (docs/protocol.md section 3)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]

    @classmethod
    def of(cls, source: GenerationResult | StreamEvent) -> ScoredPrompt:
        if source.prompt_logprobs is None or source.prompt_token_ids is None:
            raise MissingPromptLogprobs(source.id)
        return cls(source.prompt_token_ids, source.prompt_logprobs)


def prompt_logprobs(scored: ScoredPrompt, alternatives: int) -> PromptLogprobs:
    """The prompt log-probabilities in vLLM's shape, `alternatives` per token."""
    shaped: PromptLogprobs = []
    for lp in scored.logprobs:
        if lp is None:
            shaped.append(None)
            continue
        top = lp.top_logprobs[:alternatives]
        ranks = {t.token_id: rank for rank, t in enumerate(lp.top_logprobs, start=1)}
        entry = {str(lp.token_id): PromptLogprob(logprob=lp.logprob, rank=ranks.get(lp.token_id),
                                                 decoded_token=lp.token)}
        for rank, t in enumerate(top, start=1):
            entry.setdefault(str(t.token_id), PromptLogprob(logprob=t.logprob, rank=rank, decoded_token=t.token))
        shaped.append(entry)
    return shaped


class MissingPromptLogprobs(RuntimeError):
    """A worker answered a request for prompt log-probabilities without them (one that predates them)."""

    def __init__(self, identifier: str) -> None:
        super().__init__(f"request {identifier}: the worker returned no prompt log-probabilities (a worker older "
                         "than prompt_logprobs?)")


class _PromptLogprobsWhenAsked(BaseModel):
    """Leaves prompt_logprobs out unless asked for, as vLLM does."""

    @model_serializer(mode="wrap")
    def _prompt_logprobs_when_asked(self, serialize: SerializerFunctionWrapHandler) -> dict[str, Any]:
        fields: dict[str, Any] = serialize(self)
        if fields.get("prompt_logprobs") is None:
            fields.pop("prompt_logprobs", None)
        return fields


class CompletionChoice(_PromptLogprobsWhenAsked):
    index: int = 0
    text: str
    finish_reason: OpenAIFinishReason | None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = Field(default=None, description="vLLM's, when asked (streamed: on "
                                                                         "each choice's first chunk)")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ChatToolCall(BaseModel):
    """A call in the answer's message: OpenAI's id, type and function (arguments as JSON text)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut

    @classmethod
    def from_call(cls, call: ToolCall) -> ChatToolCall:
        return cls(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))


class AssistantMessage(BaseModel):
    """The answer: with tool calls, content is the text outside them; after a thought
    (reasoning_content, vLLM's field), the text after it; null when there is none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ChatToolCall] | None = None
    function_call: FunctionCallOut | None = Field(
        default=None, description="the call, for a request with the legacy functions (which allow one)")

    @classmethod
    def from_choice(cls, choice: Choice, legacy_functions: bool = False) -> AssistantMessage:
        if choice.tool_calls is None and choice.reasoning_content is None:
            return cls(content=choice.text)
        calls = [ChatToolCall.from_call(call) for call in choice.tool_calls or ()]
        if legacy_functions:
            return cls(content=choice.content or None, reasoning_content=choice.reasoning_content,
                       function_call=calls[0].function if calls else None)
        return cls(content=choice.content or None, reasoning_content=choice.reasoning_content,
                   tool_calls=None if choice.tool_calls is None else calls or None)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: OpenAIFinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletion(_PromptLogprobsWhenAsked):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    prompt_logprobs: PromptLogprobs | None = Field(default=None, description="vLLM's, when asked")


class ChatDelta(BaseModel):
    """Only what changed: `{"role": "assistant", "content": ""}` first, then
    `{"reasoning_content": ...}` (a thought, vLLM's field), `{"content": ...}` or
    `{"tool_calls": [...]}` (tool_call_delta; `{"function_call": ...}` for the legacy functions),
    and `{}` in the final chunk, as OpenAI sends them."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    function_call: dict[str, Any] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, serialize: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {name: value for name, value in serialize(self).items() if value is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: OpenAIFinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_PromptLogprobsWhenAsked):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = None
    prompt_logprobs: PromptLogprobs | None = Field(default=None, description="vLLM's, when asked: on the first chunk")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "genq"
    parent: str | None = Field(default=None, description="an adapter's base model (vLLM's LoRA modules); "
                                                          "null for a base model")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


STREAM_FAILURES = (GenerationError, MissingPromptLogprobs, StreamRestarted, TimeoutError)
"""What ends an OpenAI stream after its 200 with an error chunk (stream_error)."""
_STREAM_FAILURE_CODES: dict[type[Exception], str] = {
    GenerationError: "generation_failed", MissingPromptLogprobs: "missing_prompt_logprobs",
    StreamRestarted: "stream_restarted", TimeoutError: "timeout"}


def stream_error(failure: Exception) -> str:
    """The last message of a stream that failed after its 200: OpenAI's error object, with the
    failure's code (the worker's own message for a failed task)."""
    code = next(code for kind, code in _STREAM_FAILURE_CODES.items() if isinstance(failure, kind))
    message = failure.message if isinstance(failure, GenerationError) else str(failure)
    return f"data: {json.dumps({'error': {'message': message, 'type': 'server_error', 'code': code}})}\n\n"


def openai_finish_reason(finish_reason: str, legacy_functions: bool = False) -> OpenAIFinishReason:
    """OpenAI's finish_reason; a call answers a request with the legacy `functions` "function_call"."""
    reason = FINISH_REASONS[finish_reason]
    return "function_call" if legacy_functions and reason == "tool_calls" else reason


def tool_call_delta(delta: CallStart | ArgumentsDelta) -> dict[str, Any]:
    """A parser delta as OpenAI's streamed `delta.tool_calls[i]`: the call's id, type, name and
    arguments "" when it starts, then pieces of its arguments."""
    if isinstance(delta, CallStart):
        return {"index": delta.index, "id": delta.id, "type": "function",
                "function": {"name": delta.name, "arguments": ""}}
    return {"index": delta.index, "function": {"arguments": delta.text}}


def function_call_delta(delta: CallStart | ArgumentsDelta) -> dict[str, Any]:
    """A parser delta as the legacy streamed `delta.function_call` (a request with `functions`):
    the name and arguments "" when the call starts, then pieces of its arguments."""
    if isinstance(delta, CallStart):
        return {"name": delta.name, "arguments": ""}
    return {"arguments": delta.text}


def samples(result: GenerationResult) -> list[Choice]:
    """The result's samples, by index: its choices, or (n = 1) the result itself as choice 0."""
    if result.choices is not None:
        return sorted(result.choices, key=lambda choice: choice.index)
    return [Choice(index=0, text=result.text, token_ids=result.token_ids, logprobs=result.logprobs,
                   finish_reason=result.finish_reason, content=result.content, tool_calls=result.tool_calls,
                   reasoning_content=result.reasoning_content)]


def total_usage(usages: list[Usage]) -> Usage:
    """The usage of a request of several tasks (one per prompt): their counts summed."""
    return Usage(prompt_tokens=sum(u.prompt_tokens for u in usages),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=sum(u.cached_tokens for u in usages))


@dataclass(frozen=True)
class Echo:
    """What a completions request shows of each prompt: its text (echo), its tokens' logprobs in
    the legacy object (echo with logprobs: `alternatives` each; token_text names the tokens that
    have none, the first), and vLLM's prompt_logprobs."""

    texts: list[str] | None = None
    alternatives: int | None = None
    token_text: Callable[[int], str] | None = None
    prompt_logprobs: int | None = None

    @property
    def scores_prompts(self) -> bool:
        """Whether the answer shows the prompts' log-probabilities (streamed, each choice's first
        chunk waits for them)."""
        return self.alternatives is not None or self.prompt_logprobs is not None

    def choice(self, prompt: int, index: int, result: GenerationResult, sample: Choice) -> CompletionChoice:
        """Choice `index` of the answer: sample `sample` of the task of prompt `prompt`."""
        scored = ScoredPrompt.of(result) if self.scores_prompts else None
        opening = self.opening(prompt, index, scored)
        logprobs = CompletionLogprobs.from_tokens(sample.logprobs)
        if opening.logprobs is not None:
            assert scored is not None
            logprobs = CompletionLogprobs.of([*self._prompt_tokens(scored),
                                              *((lp.token, lp) for lp in sample.logprobs or ())],
                                             alternatives=self.alternatives)
        return opening.model_copy(update={"text": opening.text + sample.text, "logprobs": logprobs,
                                          "finish_reason": openai_finish_reason(sample.finish_reason)})

    def opening(self, prompt: int, index: int, scored: ScoredPrompt | None) -> CompletionChoice:
        """What choice `index` shows of its prompt, streamed as its first chunk: the echo (with
        logprobs, the prompt's tokens in the legacy object) and vLLM's prompt_logprobs, from
        `scored` (needed when scores_prompts)."""
        echoed = "" if self.texts is None else self.texts[prompt]
        logprobs = None
        if self.alternatives is not None and self.texts is not None:
            assert scored is not None
            logprobs = CompletionLogprobs.of(self._prompt_tokens(scored), alternatives=self.alternatives)
        shaped = None
        if self.prompt_logprobs is not None:
            assert scored is not None
            shaped = prompt_logprobs(scored, self.prompt_logprobs)
        return CompletionChoice(index=index, text=echoed, logprobs=logprobs, finish_reason=None,
                                prompt_logprobs=shaped)

    def _prompt_tokens(self, scored: ScoredPrompt) -> list[tuple[str, TokenLogprob | None]]:
        """The prompt's tokens as the legacy object lists them: a token with no logprob (the
        first) named by the model card's tokenizer."""
        assert self.token_text is not None, "echo with logprobs is answered with the card's tokenizer"
        return [(self.token_text(token) if lp is None else lp.token, lp)
                for token, lp in zip(scored.token_ids, scored.logprobs)]


def completion_response(identifier: str, model: str, results: list[GenerationResult], echo: Echo) -> Completion:
    """The answer to a request of one task per prompt: each task's samples in turn, choice
    prompt * n + sample (OpenAI's order), and the usage of all."""
    choices = []
    for prompt, result in enumerate(results):
        picked = samples(result)
        choices += [echo.choice(prompt, prompt * len(picked) + sample.index, result, sample) for sample in picked]
    return Completion(id=identifier, created=int(time.time()), model=model, choices=choices,
                      usage=CompletionUsage.from_usage(total_usage([result.usage for result in results])))


def chat_response(identifier: str, model: str, result: GenerationResult, alternatives: int | None = None,
                  legacy_functions: bool = False) -> ChatCompletion:
    """The answer to a request: one choice per sample; with `alternatives` (prompt_logprobs) the
    prompt's log-probabilities, vLLM's top-level field; a call as `function_call` for a request
    with the legacy functions."""
    return ChatCompletion(id=identifier, created=int(time.time()), model=model,
                          prompt_logprobs=None if alternatives is None
                          else prompt_logprobs(ScoredPrompt.of(result), alternatives),
                          choices=[ChatChoice(index=choice.index,
                                              message=AssistantMessage.from_choice(choice, legacy_functions),
                                              finish_reason=openai_finish_reason(choice.finish_reason,
                                                                                 legacy_functions),
                                              logprobs=ChatLogprobs.from_tokens(choice.logprobs))
                                   for choice in samples(result)],
                          usage=CompletionUsage.from_usage(result.usage))
