"""The genq wire protocol: what goes into a `genq.generate` task and what comes out.

This module is the contract between producers (any Celery client, in any
language) and the GPU worker. It imports only the standard library and
pydantic, so a backend service can validate requests without torch; the
human-readable version of the contract is docs/protocol.md.

- A request is sent as the keyword arguments of the Celery task TASK_NAME:
  ``send_task("genq.generate", kwargs=request.to_kwargs(), task_id=identifier)``.
  The worker validates them with ``GenerationRequest.parse_payload``.
- While it runs, the worker publishes ``StreamEvent`` JSON on the request's
  pub/sub channel and appends the same JSON to its replay stream.
- The task's return value (the Celery result backend) is ``GenerationResult.to_dict()``.

Validation is strict on purpose: unknown fields are rejected (a misspelt
option must not be silently ignored), and numbers are not coerced from strings
or booleans ("1" and true are errors; an int is fine where a float is expected).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

__all__ = [
    "CANCEL_KEY_TTL_S",
    "CANCEL_KEY_VALUE",
    "CONTROL_CHANNEL",
    "DEFAULT_KEY_PREFIX",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_QUEUE",
    "DRY_DEFAULT_SEQUENCE_BREAKERS",
    "DRY_MAX_NGRAM",
    "EOS_REASON_TO_FINISH_REASON",
    "IDENTIFIER_PATTERN",
    "MAX_ABS_PENALTY",
    "MAX_ABS_SKEW",
    "MAX_BANNED_TOKEN_IDS",
    "MAX_CHOICES",
    "MAX_CHOICE_CHARS",
    "MAX_CONSTRAINT_CHARS",
    "MAX_CONTEXT_SPAN",
    "MAX_DEADLINE",
    "MAX_DRY_SEQUENCE_BREAKERS",
    "MAX_DRY_SEQUENCE_BREAKER_CHARS",
    "MAX_IDENTIFIER_CHARS",
    "MAX_INPUT_IDS",
    "MAX_MESSAGES",
    "MAX_MESSAGE_CHARS",
    "MAX_METADATA_KEYS",
    "MAX_METADATA_KEY_CHARS",
    "MAX_METADATA_VALUE_CHARS",
    "MAX_N",
    "MAX_NEW_TOKENS",
    "MAX_PRIORITY",
    "MAX_PROMPT_CHARS",
    "MAX_REPETITION_PENALTY",
    "MAX_SEED",
    "MAX_SKIPS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_BANNED_STRINGS",
    "MAX_TEMPERATURE",
    "MAX_TIMEOUT_S",
    "MAX_TOKEN_BIAS",
    "MAX_TOKEN_BIAS_VALUE",
    "MAX_TOKEN_ID",
    "MAX_TOP_K",
    "MAX_TOP_LOGPROBS",
    "MIN_PRIORITY",
    "PROTOCOL_VERSION",
    "STREAM_FIELD",
    "TASK_NAME",
    "TERMINAL_EVENTS",
    "XTC_SPARED",
    "ChatMessage",
    "Choice",
    "ChoiceConstraint",
    "ControlMessage",
    "EventType",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "GrammarConstraint",
    "JsonObjectConstraint",
    "JsonSchemaConstraint",
    "OutputConstraint",
    "ProtocolError",
    "RegexConstraint",
    "Role",
    "SamplingParams",
    "StreamEvent",
    "StreamOptions",
    "Timings",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "attempt_key",
    "cancel_key",
    "cancel_message",
    "channel_name",
    "control_channel",
    "finish_reason_from_eos",
    "stream_key",
    "validate_task_id",
]

# --- Names -------------------------------------------------------------------

TASK_NAME = "genq.generate"
DEFAULT_QUEUE = "genq"
"""One queue per model is the intended deployment; the queue name is worker configuration."""
DEFAULT_KEY_PREFIX = "genq"
"""Every Redis channel and key genq uses starts with ``{prefix}:``."""
PROTOCOL_VERSION = 1
STREAM_FIELD = "data"
"""The field of each replay-stream entry that holds the event JSON (``XADD key * data <json>``)."""
CANCEL_KEY_VALUE = "1"
CANCEL_KEY_TTL_S = 3600
#: Redis transport priority levels (kombu's priority_steps): 10 levels, 0 served first.
PRIORITY_STEPS = list(range(10))
"""How long a cancel key should live: long enough to catch a task still waiting in the broker."""

# --- Limits ------------------------------------------------------------------
# They bound what one task may ask of a shared GPU worker and keep Redis
# payloads small; the worker enforces model-dependent limits (vocabulary size,
# context length) on top of these.

MAX_PROMPT_CHARS = 1_000_000
"""Characters in `prompt`, and in all `messages` contents together."""
MAX_MESSAGES = 512
MAX_MESSAGE_CHARS = MAX_PROMPT_CHARS
MAX_INPUT_IDS = 131_072
MAX_TOKEN_ID = 2**31 - 1
"""Token ids are checked against the model's vocabulary by the worker; this only keeps them int32."""
DEFAULT_MAX_NEW_TOKENS = 256
MAX_NEW_TOKENS = 32_768
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_BANNED_STRINGS = 64
MAX_TOKEN_BIAS = 300
"""Entries in `sampling.token_bias` (OpenAI's logit_bias allows 300 too)."""
MAX_TOKEN_BIAS_VALUE = 100.0
"""A bias lies in [-100, 100], as in OpenAI's logit_bias: +-100 effectively forces or bans a token."""
MAX_BANNED_TOKEN_IDS = 1024
MAX_TEMPERATURE = 2.0
MAX_REPETITION_PENALTY = 10.0
MAX_ABS_PENALTY = 2.0
"""Bound of frequency_penalty and presence_penalty, as in OpenAI's API."""
MAX_SEED = 2**63 - 1
MAX_TOP_K = MAX_TOKEN_ID
IDENTIFIER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
"""An identifier names Redis keys and channels, so it is short and shell/URL-safe; a UUID fits."""
MAX_IDENTIFIER_CHARS = 128
MIN_PRIORITY = 0
MAX_PRIORITY = 9
"""Celery's Redis transport priorities: 0 is the HIGHEST, 9 the lowest (see docs/protocol.md)."""
MAX_TIMEOUT_S = 86_400.0
MAX_DEADLINE = 253_402_300_799.0
"""9999-12-31T23:59:59Z as a unix time in seconds: a deadline in milliseconds exceeds it and is caught."""
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 1024
MAX_TOP_LOGPROBS = 20
MAX_CONSTRAINT_CHARS = 65_536
"""Bounds the text of a JSON Schema (as JSON), a regex or a grammar: compiling is per request."""
MAX_CHOICES = 256
MAX_N = 16
MAX_SKIPS = 1024
"""Bound of `max_skips`."""
"""Parallel samples one request may ask for (`n`); each costs a batch row of its own."""
MAX_CHOICE_CHARS = 1024
MAX_ABS_SKEW = 10.0
MAX_CONTEXT_SPAN = 2**31 - 1
"""Bound of the token counts repetition_penalty_range, repetition_penalty_decay and dry_range."""
DRY_MAX_NGRAM = 20
"""DRY looks for repeated sequences of at most this many tokens (exllamav2's dry_max_ngram)."""
MAX_DRY_SEQUENCE_BREAKERS = 64
MAX_DRY_SEQUENCE_BREAKER_CHARS = 32
DRY_DEFAULT_SEQUENCE_BREAKERS = (".", ",", "!", "?", "<", ">", "[", "]", "(", ")", "{", "}", "\n", "\t", '"')
"""exllamav2's default: a token whose text holds one of these, or a special token, breaks DRY's sequences."""
XTC_SPARED = ("\n",)
"""exllamav2's default: XTC never excludes a token whose text holds one of these, nor a special token."""

_IDENTIFIER_RE = re.compile(IDENTIFIER_PATTERN)
_TOKEN_ID_KEY_RE = re.compile(r"-?[0-9]{1,19}")
_INPUT_FIELDS = ("prompt", "messages", "input_ids")
_RULES_ERROR = "request_rules"

# --- Enumerations ------------------------------------------------------------

Role = Literal["system", "user", "assistant", "tool"]
EventType = Literal["started", "chunk", "done", "error", "cancelled"]
FinishReason = Literal["stop", "length", "cancelled", "error", "deadline"]
"""OpenAI's names where they exist: stop (a stop token or string), length (max_new_tokens)."""
TERMINAL_EVENTS: frozenset[str] = frozenset({"done", "error", "cancelled"})
_FINISH_REASONS_BY_EVENT: dict[str, frozenset[str]] = {
    "done": frozenset({"stop", "length", "deadline"}),
    "error": frozenset({"error"}),
    "cancelled": frozenset({"cancelled"}),
}
EOS_REASON_TO_FINISH_REASON: dict[str, FinishReason] = {
    "stop_token": "stop",
    "stop_string": "stop",
    "constraint_complete": "stop",
    "error": "error",  # a request that failed inside a step: its error event (the worker sends no result)
    "max_new_tokens": "length",
    "cancelled": "cancelled",
}
"""The engine's eos_reason values and the finish_reason each one is reported as."""


def finish_reason_from_eos(eos_reason: str) -> FinishReason:
    """The wire finish_reason for an engine eos_reason; unknown reasons are a bug, not a default."""
    try:
        return EOS_REASON_TO_FINISH_REASON[eos_reason]
    except KeyError:
        known = ", ".join(EOS_REASON_TO_FINISH_REASON)
        raise ValueError(f"unknown engine eos_reason {eos_reason!r} (known: {known})") from None


# --- Errors ------------------------------------------------------------------


class ProtocolError(ValueError):
    """An invalid request or name. The message has one "field.path: problem" line per problem,
    ready for an error event or the task's FAILURE state."""

    def __init__(self, problems: list[str] | str) -> None:
        # A str is accepted so that Celery can rebuild the exception from its stored message.
        self.problems = problems.splitlines() if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


# --- Field types ---------------------------------------------------------------


def _preview(value: object, limit: int = 40) -> str:
    """A short repr for error messages, so a huge or hostile input is not echoed whole."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_identifier(value: str) -> str:
    if len(value) > MAX_IDENTIFIER_CHARS:
        raise PydanticCustomError(
            "identifier_too_long",
            "at most {max} characters allowed, got {length}",
            {"max": MAX_IDENTIFIER_CHARS, "length": len(value)},
        )
    if not _IDENTIFIER_RE.fullmatch(value):
        raise PydanticCustomError(
            "identifier_pattern",
            "must be 1 to {max} characters from A-Z a-z 0-9 _ . : - starting with a letter or digit "
            "(it names Redis keys and channels), got {value}",
            {"max": MAX_IDENTIFIER_CHARS, "value": _preview(value)},
        )
    return value


Identifier = Annotated[str, AfterValidator(_check_identifier)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
TokenBiasValue = Annotated[float, Field(ge=-MAX_TOKEN_BIAS_VALUE, le=MAX_TOKEN_BIAS_VALUE)]
MetadataKey = Annotated[str, Field(min_length=1, max_length=MAX_METADATA_KEY_CHARS)]
MetadataValue = Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA_KEYS)]


class _Input(BaseModel):
    """Requests: strict, closed. A misspelt option or a "1" for 1 is an error, not a guess."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Output(BaseModel):
    """What the worker emits: typed as strictly as a request, but unknown fields are ignored
    so that a client keeps working when a newer worker adds one."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


# --- Request -------------------------------------------------------------------


class ChatMessage(_Input):
    """One chat turn; the worker renders the list with the model's chat template."""

    role: Role
    content: Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)]


class SamplingParams(_Input):
    """How tokens are picked. The default is greedy (temperature 0): a service should be
    deterministic unless a caller asks for randomness. Order of application (exllamav2's):
    token_bias and banned/allowed ids, penalties (repetition with its range and decay,
    frequency, presence, DRY), then (when sampling) temperature (unless temperature_last) with
    smoothing_factor, top_k, top_p, top_a, min_p, tfs, typical, mirostat, temperature_last or
    dynamic temperature, XTC, skew. docs/protocol.md says what each does."""

    temperature: float = Field(0.0, ge=0.0, le=MAX_TEMPERATURE, description="0 = greedy")
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="0 = off; keep the k most likely tokens")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="1 = off; nucleus sampling mass")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="0 = off; drop tokens below min_p * max prob")
    top_a: float = Field(0.0, ge=0.0, le=1.0, description="0 = off; drop tokens below top_a * max prob squared")
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY, description="1 = off (HF/CTRL)")
    frequency_penalty: float = Field(0.0, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY, description="OpenAI's")
    presence_penalty: float = Field(0.0, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY, description="OpenAI's")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="same seed + same prompt -> same output")
    token_bias: Annotated[dict[TokenId, TokenBiasValue], Field(max_length=MAX_TOKEN_BIAS)] = Field(
        default_factory=dict, description="token id -> logit bias"
    )
    banned_token_ids: Annotated[list[TokenId], Field(max_length=MAX_BANNED_TOKEN_IDS)] = Field(default_factory=list)
    allowed_token_ids: Annotated[list[TokenId], Field(max_length=MAX_BANNED_TOKEN_IDS)] = Field(
        default_factory=list, description="only these tokens may be generated (empty = all)")
    repetition_penalty_range: int = Field(-1, ge=-1, le=MAX_CONTEXT_SPAN,
                                          description="-1 = the whole context; else the last N tokens")
    repetition_penalty_decay: int = Field(0, ge=0, le=MAX_CONTEXT_SPAN,
                                          description="tokens before the range over which the penalty fades out")
    dry_multiplier: float = Field(0.0, ge=0.0, description="0 = off; DRY's penalty scale")
    dry_base: float = Field(1.75, ge=1.0, description="DRY's penalty grows as dry_base ** (match - allowed)")
    dry_allowed_length: int = Field(2, ge=1, le=DRY_MAX_NGRAM - 1, description="longest repeat not penalised")
    dry_range: int = Field(0, ge=0, le=MAX_CONTEXT_SPAN, description="0 = the whole context; else the last N")
    dry_sequence_breakers: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MAX_DRY_SEQUENCE_BREAKER_CHARS)]],
        Field(max_length=MAX_DRY_SEQUENCE_BREAKERS),
    ] | None = Field(None, description="a token whose text holds one of these breaks a repeat; "
                                       "null = exllamav2's default (DRY_DEFAULT_SEQUENCE_BREAKERS)")
    smoothing_factor: float = Field(0.0, ge=0.0, description="0 = off; quadratic sampling")
    tfs: float = Field(1.0, gt=0.0, le=1.0, description="1 = off; tail-free sampling")
    typical: float = Field(1.0, gt=0.0, le=1.0, description="1 = off; locally typical sampling mass")
    mirostat: bool = Field(False, description="mirostat v2 (temperature > 0)")
    mirostat_tau: float = Field(1.5, ge=0.0, description="mirostat's target surprise, in bits")
    mirostat_eta: float = Field(0.1, ge=0.0, description="mirostat's learning rate")
    temperature_last: bool = Field(False, description="apply temperature after the truncation samplers")
    min_temp: float = Field(0.0, ge=0.0, le=MAX_TEMPERATURE, description="dynamic temperature's low end")
    max_temp: float = Field(0.0, ge=0.0, le=MAX_TEMPERATURE,
                            description="dynamic temperature is on when max_temp > min_temp")
    temp_exponent: float = Field(1.0, gt=0.0, description="dynamic temperature's exponent")
    xtc_probability: float = Field(0.0, ge=0.0, le=1.0, description="0 = off; XTC's chance of excluding")
    xtc_threshold: float = Field(0.1, ge=0.0, le=1.0, description="XTC excludes top choices at least this likely")
    skew: float = Field(0.0, ge=-MAX_ABS_SKEW, le=MAX_ABS_SKEW, description="0 = off; > 0 favours less likely tokens")

    @field_validator("max_temp")
    @classmethod
    def _at_least_min_temp(cls, max_temp: float, info: ValidationInfo) -> float:
        min_temp = info.data.get("min_temp")
        if min_temp is not None and max_temp != 0.0 and max_temp < min_temp:
            raise PydanticCustomError(
                "temperature_range",
                "must be >= min_temp ({min_temp}) (dynamic temperature is on when max_temp > min_temp; "
                "0 = off), got {max_temp}",
                {"min_temp": min_temp, "max_temp": max_temp},
            )
        return max_temp

    @field_validator("token_bias", mode="before")
    @classmethod
    def _token_ids_from_json_keys(cls, value: Any) -> Any:
        """JSON object keys are always strings: "123" means token 123."""
        if not isinstance(value, Mapping):
            return value
        converted: dict[Any, Any] = {}
        for key, bias in value.items():
            if isinstance(key, str):
                if not _TOKEN_ID_KEY_RE.fullmatch(key):
                    raise PydanticCustomError(
                        "token_id_key",
                        "key {key} is not a token id: keys must be integers, written as decimal strings "
                        "in JSON (for example \"123\")",
                        {"key": _preview(key)},
                    )
                key = int(key)
            converted[key] = bias
        return converted


class StreamOptions(_Input):
    """What the worker publishes while generating."""

    enabled: bool = Field(True, description="publish chunk events (started and the final event always are)")
    include_token_ids: bool = Field(False, description="put token ids in chunk and final events")


class JsonSchemaConstraint(_Input):
    """The output is a JSON value matching `json_schema` (compact: no whitespace between tokens)."""

    type: Literal["json_schema"]
    json_schema: dict[str, Any]

    @field_validator("json_schema")
    @classmethod
    def _bounded(cls, schema: dict[str, Any]) -> dict[str, Any]:
        size = len(json.dumps(schema))
        if size > MAX_CONSTRAINT_CHARS:
            raise PydanticCustomError("constraint_too_long", "at most {max} characters of JSON allowed, got {size}",
                                      {"max": MAX_CONSTRAINT_CHARS, "size": size})
        return schema


class JsonObjectConstraint(_Input):
    """The output is a JSON object, any object (OpenAI's response_format json_object)."""

    type: Literal["json_object"]


class RegexConstraint(_Input):
    """The output matches the regular expression as a whole."""

    type: Literal["regex"]
    pattern: Annotated[str, Field(min_length=1, max_length=MAX_CONSTRAINT_CHARS)]


class ChoiceConstraint(_Input):
    """The output is exactly one of the choices."""

    type: Literal["choice"]
    choices: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]],
                       Field(min_length=1, max_length=MAX_CHOICES)]


class GrammarConstraint(_Input):
    """The output is a sentence of a context-free grammar, in Lark or llama.cpp's GBNF syntax."""

    type: Literal["grammar"]
    syntax: Literal["lark", "gbnf"] = "lark"
    grammar: Annotated[str, Field(min_length=1, max_length=MAX_CONSTRAINT_CHARS)]


OutputConstraint = Annotated[
    JsonSchemaConstraint | JsonObjectConstraint | RegexConstraint | ChoiceConstraint | GrammarConstraint,
    Field(discriminator="type"),
]


class GenerationRequest(_Input):
    """The keyword arguments of a `genq.generate` task."""

    prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    input_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_INPUT_IDS)] | None = None
    max_new_tokens: int = Field(DEFAULT_MAX_NEW_TOKENS, ge=1, le=MAX_NEW_TOKENS)
    min_new_tokens: int = Field(0, ge=0, le=MAX_NEW_TOKENS, description="stop tokens are blocked until reached")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    stop: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] = Field(
        default_factory=list, description="stop strings; never included in the output"
    )
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] = Field(
        default_factory=list, description="extra stop tokens, besides the model's EOS ids"
    )
    ignore_eos: bool = Field(False, description="do not stop on the model's EOS ids (stop_token_ids still stop)")
    add_bos: bool | None = Field(None, description="None = the tokenizer's default; prompt only")
    decode_special_tokens: bool = False
    identifier: Identifier | None = Field(None, description="names the channel and keys; None = the task id")
    priority: int | None = Field(None, ge=MIN_PRIORITY, le=MAX_PRIORITY, description="0 = highest")
    deadline: float | None = Field(None, gt=0.0, le=MAX_DEADLINE, description="unix time, seconds")
    timeout_s: float | None = Field(None, gt=0.0, le=MAX_TIMEOUT_S, description="seconds from pick-up")
    stream: StreamOptions = Field(default_factory=StreamOptions)
    metadata: Metadata = Field(default_factory=dict, description="passed through to the result")
    constraint: OutputConstraint | None = Field(None, description="what the output must match (docs/protocol.md)")
    logprobs: bool = Field(False, description="each generated token's log-probability, in chunks and the result")
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS, description="that many alternatives per token "
                                                                       "(implies logprobs)")
    banned_strings: Annotated[list[StopString], Field(max_length=MAX_BANNED_STRINGS)] = Field(
        default_factory=list, description="text the output never contains (the engine rewinds; exllamav2's)")
    token_healing: bool = Field(False, description="regenerate the prompt's last token among those beginning "
                                                   "with its text (exllamav2's)")
    max_skips: int | None = Field(None, ge=0, le=MAX_SKIPS, description="times a request that does not fit "
                                  "the cache yet may be passed over by later ones; None = the worker's (16)")
    n: int = Field(1, ge=1, le=MAX_N, description="parallel samples of the prompt, which is computed once; "
                                                 "sample i is seeded seed + i, its chunks carry index i")

    @field_validator("messages")
    @classmethod
    def _bound_total_message_chars(cls, messages: list[ChatMessage] | None) -> list[ChatMessage] | None:
        total = sum(len(m.content) for m in messages or ())
        if total > MAX_PROMPT_CHARS:
            raise PydanticCustomError(
                "messages_too_long",
                "at most {max} characters of content allowed in all messages together, got {total}",
                {"max": MAX_PROMPT_CHARS, "total": total},
            )
        return messages

    @model_validator(mode="after")
    def _check_rules(self) -> GenerationRequest:
        problems = _rule_problems(dict(self))
        if problems:
            raise PydanticCustomError(_RULES_ERROR, "{problems}", {"problems": "; ".join(problems)})
        return self

    @classmethod
    def parse_payload(cls, kwargs: Mapping[str, Any]) -> GenerationRequest:
        """Validate task kwargs, reporting every problem at once (not just the first) as
        "field.path: message" lines in one ProtocolError."""
        if not isinstance(kwargs, Mapping):
            raise ProtocolError([f"request: must be an object of keyword arguments, got {_json_type(kwargs)}"])
        try:
            return cls.model_validate(dict(kwargs))
        except ValidationError as exc:
            # Cross-field rules only run once every field is valid; re-check them on the raw
            # payload so that they are listed together with the field errors.
            problems = [_describe(error) for error in exc.errors(include_url=False) if error["type"] != _RULES_ERROR]
            problems += _rule_problems(kwargs)
            raise ProtocolError(problems) from None

    def to_kwargs(self) -> dict[str, Any]:
        """The task kwargs: JSON-ready, without the fields left at their defaults."""
        return self.model_dump(mode="json", exclude_defaults=True)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rule_problems(data: Mapping[str, Any]) -> list[str]:
    """The cross-field rules, on validated values or on a raw payload of any shape."""
    problems: list[str] = []
    given = [name for name in _INPUT_FIELDS if data.get(name) is not None]
    if len(given) != 1:
        got = "none" if not given else f"{len(given)}: {', '.join(given)}"
        problems.append(
            f"prompt|messages|input_ids: exactly one of prompt, messages or input_ids is required, got {got}")
    max_new = data.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    min_new = data.get("min_new_tokens", 0)
    if _is_int(max_new) and _is_int(min_new) and 1 <= max_new <= MAX_NEW_TOKENS and min_new > max_new:
        problems.append(f"min_new_tokens: must be <= max_new_tokens ({max_new}), got {min_new}")
    if data.get("deadline") is not None and data.get("timeout_s") is not None:
        problems.append(
            "deadline|timeout_s: give at most one of deadline (absolute) and timeout_s (relative), not both")
    return problems


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"number {_preview(value)}"
    if isinstance(value, str):
        return f"string {_preview(value)}"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _field_name(name: str) -> str:
    """A field name as it can be shown: hostile names (a lone surrogate cannot even be encoded as
    UTF-8, a newline would split the one-problem-per-line message) are escaped, long ones cut."""
    if not name.isprintable():
        name = ascii(name)[1:-1]
    return name if len(name) <= 40 else name[:37] + "..."


def _format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if part == "[key]":
            out += " (key)"
        elif isinstance(part, int):
            out += f"[{part}]"
        else:
            name = _field_name(part)
            out += f".{name}" if out else name
    return out or "request"


def _fields_at(loc: tuple[int | str, ...]) -> list[str] | None:
    shape = tuple(int if isinstance(part, int) else part for part in loc)
    model = {(): GenerationRequest, ("sampling",): SamplingParams, ("stream",): StreamOptions,
             ("messages", int): ChatMessage}.get(shape)
    return list(model.model_fields) if model else None


def _describe(error: Mapping[str, Any]) -> str:
    """One "field.path: message" line; pydantic's wording, made to state limits and what was given."""
    loc, kind, message, value = error["loc"], error["type"], error["msg"], error.get("input")
    ctx = error.get("ctx") or {}
    if kind == "extra_forbidden":
        allowed = _fields_at(loc[:-1])
        message = "unknown field" + (f" (allowed: {', '.join(allowed)})" if allowed else "")
    elif kind == "string_unicode" and isinstance(value, str) and (allowed := _fields_at(loc)) is not None:
        # A key that is not valid Unicode (a lone surrogate) fails the whole object before its
        # fields are looked at; no field has such a name, so it is an unknown one.
        return f"{_format_loc((*loc, value))}: unknown field (allowed: {', '.join(allowed)})"
    elif kind == "string_unicode":
        if loc and loc[-1] == "[key]":  # pydantic names the key by a lossy decoding of it
            loc = (*loc[:-2], value, "[key]")
        message = f"{message}, got {_preview(value)}"
    elif kind == "too_long" and isinstance(value, (list, Mapping)):
        message = f"at most {ctx['max_length']} items allowed, got {len(value)}"
    elif kind == "too_short" and isinstance(value, (list, Mapping)):
        message = f"at least {ctx['min_length']} item(s) required, got {len(value)}"
    elif kind == "string_too_long" and isinstance(value, str):
        message = f"at most {ctx['max_length']} characters allowed, got {len(value)}"
    elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        message = f"{message}, got {_preview(value)}"
    elif kind.endswith("_type") or kind == "literal_error":
        message = f"{message}, got {_json_type(value)}"
    return f"{_format_loc(loc)}: {message}"


# --- Events and results ----------------------------------------------------------


class Usage(_Output):
    """Token counts, as in OpenAI's usage object (cached_tokens: prompt tokens served from cache)."""

    prompt_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(0, ge=0)
    cached_tokens: int = Field(0, ge=0)


class Timings(_Output):
    """Where the time went: waiting for the engine, computing the prompt, generating."""

    queued_s: float = Field(0.0, ge=0.0)
    prefill_s: float = Field(0.0, ge=0.0)
    generate_s: float = Field(0.0, ge=0.0)


class TopLogprob(_Output):
    """An alternative at a generated token's position."""

    token_id: TokenId
    token: str  # the token's text (a piece of a character for byte tokens: see docs/protocol.md)
    logprob: float


class TokenLogprob(_Output):
    """A generated token's log-probability and its position's best alternatives (best first)."""

    token_id: TokenId
    token: str
    logprob: float
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class Choice(_Output):
    """One of the n samples of a request with n > 1, on its final event and in its result."""

    index: int = Field(ge=0, lt=MAX_N)
    text: str
    token_ids: list[TokenId] | None = None
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason


class StreamEvent(_Output):
    """One message on a request's channel and replay stream (the same JSON on both).

    Per attempt: `started` (seq 0), `chunk`s, then exactly one terminal event whose text is the
    concatenation of that attempt's chunk texts. seq is contiguous from 0 within an attempt;
    attempt grows by one each time the task is redelivered. With n > 1 every chunk carries the
    `index` of its sample, the terminal event's `choices` hold each sample's whole text, and its
    top-level text is sample 0's (the concatenation of the chunks with index 0)."""

    id: Identifier
    seq: int = Field(ge=0)
    attempt: int = Field(ge=1)
    event: EventType
    text: str = ""
    token_ids: list[TokenId] | None = None
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: str | None = None
    index: int | None = Field(None, ge=0, lt=MAX_N)
    choices: list[Choice] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> StreamEvent:
        if self.index is not None and self.event != "chunk":
            raise PydanticCustomError("event_rules", "index: only chunk events carry one", {})
        if self.choices is not None and self.event not in ("done", "cancelled"):
            raise PydanticCustomError("event_rules", "choices: only done and cancelled events carry them", {})
        allowed = _FINISH_REASONS_BY_EVENT.get(self.event)
        if allowed is None and self.finish_reason is not None:
            raise PydanticCustomError("event_rules", "finish_reason: only terminal events carry one, got {reason}",
                                      {"reason": repr(self.finish_reason)})
        if allowed is not None and self.finish_reason not in allowed:
            raise PydanticCustomError(
                "event_rules", "finish_reason: a {event} event needs one of {allowed}, got {reason}",
                {"event": self.event, "allowed": ", ".join(sorted(allowed)), "reason": repr(self.finish_reason)})
        if (self.event == "error") != (self.error is not None):
            raise PydanticCustomError("event_rules", "error: set on error events and only on them", {})
        return self

    @property
    def is_terminal(self) -> bool:
        """Whether this event ends its attempt (done, error or cancelled)."""
        return self.event in TERMINAL_EVENTS

    def to_json(self) -> str:
        """Compact JSON; null fields are left out (a missing field means null)."""
        return self.model_dump_json(exclude_none=True)

    @classmethod
    def from_json(cls, data: str | bytes) -> StreamEvent:
        return cls.model_validate_json(data)


class GenerationResult(_Output):
    """The task's return value in the Celery result backend. A failed request is not a result:
    the task ends in FAILURE with the error message instead."""

    id: Identifier
    attempt: int = Field(ge=1)
    text: str
    token_ids: list[TokenId] = Field(default_factory=list, description="the completion's token ids")
    logprobs: list[TokenLogprob] | None = Field(None, description="per completion token, if requested")
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    metadata: Metadata = Field(default_factory=dict, description="the request's, unchanged")
    choices: list[Choice] | None = Field(None, description="n > 1: every sample, by index (the top-level "
                                                            "text, token_ids, logprobs and finish_reason are "
                                                            "choice 0's)")

    @field_validator("finish_reason")
    @classmethod
    def _not_an_error(cls, reason: FinishReason) -> FinishReason:
        if reason == "error":
            raise PydanticCustomError("result_rules", "a failed task has no result: it ends in FAILURE", {})
        return reason

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationResult:
        return cls.model_validate(dict(data))


class ControlMessage(_Output):
    """A message on the control channel; today the only command is cancel."""

    cancel: Identifier


# --- Redis names -----------------------------------------------------------------


def _name_part(value: object, what: str) -> str:
    if not isinstance(value, str) or not _IDENTIFIER_RE.fullmatch(value):
        raise ProtocolError([
            f"{what}: must match {IDENTIFIER_PATTERN} (it names Redis keys and channels), got {_preview(value)}"
        ])
    return value


def validate_task_id(task_id: object) -> str:
    """A Celery task id the worker accepts: it names the result backend's key
    (celery-task-meta-<id>) and stands in for a missing identifier, so it obeys the identifier
    rule (no spaces, glob characters, newlines or NUL in Redis keys). ProtocolError if not."""
    return _name_part(task_id, "task id")


def channel_name(identifier: str, prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The pub/sub channel a request's events are published on."""
    return f"{_name_part(prefix, 'prefix')}:chan:{_name_part(identifier, 'identifier')}"


def stream_key(identifier: str, prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The Redis stream that replays a request's events to late or reconnecting subscribers."""
    return f"{_name_part(prefix, 'prefix')}:events:{_name_part(identifier, 'identifier')}"


def cancel_key(identifier: str, prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The key whose existence cancels a request, even one still waiting in the broker."""
    return f"{_name_part(prefix, 'prefix')}:cancel:{_name_part(identifier, 'identifier')}"


def attempt_key(identifier: str, prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The counter of a request's deliveries, which numbers the `attempt` of its events."""
    return f"{_name_part(prefix, 'prefix')}:attempt:{_name_part(identifier, 'identifier')}"


def lease_key(identifier: str, prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The key a worker holds (SET NX, refreshed) while it generates a request: proof the request is alive."""
    return f"{_name_part(prefix, 'prefix')}:running:{_name_part(identifier, 'identifier')}"


def control_channel(prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The channel every worker listens on for cancellations (a running job stops within a step)."""
    return f"{_name_part(prefix, 'prefix')}:control"


CONTROL_CHANNEL = control_channel
"""Alias under the name the design brief uses."""


def cancel_message(identifier: str) -> str:
    """The control-channel JSON that cancels a request: {"cancel": "<id>"}."""
    return ControlMessage(cancel=_name_part(identifier, "identifier")).model_dump_json()
