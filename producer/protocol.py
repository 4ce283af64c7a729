"""The genq wire protocol: what goes into a `genq.generate` task and what comes out.

This module is the contract between producers (any Celery client, in any
language) and the GPU worker. It imports only the standard library, pydantic
and producer/tool_calls.py (itself standard library only), so a backend service
can validate requests without torch; the human-readable version of the
contract is docs/protocol.md.

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
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from producer.reasoning import ReasoningFormat
from producer.tool_calls import NAME_PATTERN, ToolFormat

__all__ = [
    "CANCEL_KEY_TTL_S",
    "CANCEL_KEY_VALUE",
    "CONTROL_CHANNEL",
    "DEFAULT_KEY_PREFIX",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_QUEUE",
    "DRY_DEFAULT_SEQUENCE_BREAKERS",
    "DRY_MAX_NGRAM",
    "IDENTIFIER_PATTERN",
    "IDENTIFIER_RE",
    "MAX_ABS_PENALTY",
    "MAX_ADAPTER_PATH_CHARS",
    "MAX_ABS_SKEW",
    "MAX_BANNED_TOKEN_IDS",
    "MAX_CHOICES",
    "MAX_CHOICE_CHARS",
    "MAX_CONSTRAINT_CHARS",
    "MAX_CONTEXT_SPAN",
    "MAX_DEADLINE",
    "MAX_DRY_BASE",
    "MAX_DRY_MULTIPLIER",
    "MAX_DRY_SEQUENCE_BREAKERS",
    "MAX_DRY_SEQUENCE_BREAKER_CHARS",
    "MAX_IDENTIFIER_CHARS",
    "MAX_CONTENT_PARTS",
    "MAX_IMAGES",
    "MAX_IMAGE_BASE64_CHARS",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_PIXELS",
    "MAX_INPUT_IDS",
    "MAX_MESSAGES",
    "MAX_MESSAGE_CHARS",
    "MAX_METADATA_KEYS",
    "MAX_METADATA_KEY_CHARS",
    "MAX_METADATA_VALUE_CHARS",
    "MAX_MIROSTAT_ETA",
    "MAX_MIROSTAT_TAU",
    "MAX_N",
    "MAX_NEW_TOKENS",
    "MAX_PRIORITY",
    "MAX_PROMPT_CHARS",
    "MAX_REPETITION_PENALTY",
    "MAX_SEED",
    "MAX_SKIPS",
    "MAX_SMOOTHING_FACTOR",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_BANNED_STRINGS",
    "MAX_TEMPERATURE",
    "MAX_TEMP_EXPONENT",
    "MAX_TIMEOUT_S",
    "MAX_TOKEN_BIAS",
    "MAX_TOKEN_BIAS_VALUE",
    "MAX_TOKEN_ID",
    "MAX_TOP_K",
    "MAX_TOP_LOGPROBS",
    "MIN_PRIORITY",
    "MIN_REPETITION_PENALTY",
    "MIN_SAMPLED_TEMPERATURE",
    "PROTOCOL_VERSION",
    "STREAM_FIELD",
    "TASK_NAME",
    "TERMINAL_EVENTS",
    "XTC_SPARED",
    "ChatMessage",
    "ContentPart",
    "ImageContentPart",
    "ImageData",
    "TextContentPart",
    "ChainAs",
    "FunctionCall",
    "MAX_TOOLS",
    "MAX_TOOLS_CHARS",
    "MAX_TOOL_CALLS",
    "MAX_TOOL_CALL_ID_CHARS",
    "MAX_CHAT_TEMPLATE_KWARGS_CHARS",
    "MessageToolCall",
    "NamedToolChoice",
    "TOOL_NAME_PATTERN",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "ToolFormat",
    "ToolFunction",
    "Choice",
    "ChoiceConstraint",
    "ControlMessage",
    "EventType",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "GrammarConstraint",
    "GrammarSyntax",
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
    "final_key",
    "cancel_key",
    "cancel_message",
    "load_adapter_message",
    "unload_adapter_message",
    "chained_payload",
    "channel_name",
    "control_channel",
    "grammar_source",
    "grammar_syntax",
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
"""The field of each replay-stream entry that holds the event JSON (``XADD key <attempt>-<seq> data <json>``)."""
CANCEL_KEY_VALUE = "1"
CANCEL_KEY_TTL_S = 3600
"""How long a cancel key should live: long enough to catch a task still waiting in the broker."""
#: Redis transport priority levels (kombu's priority_steps): 10 levels, 0 served first.
PRIORITY_STEPS = list(range(10))

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
"""OpenAI's bound; the dynamic temperature's min_temp and max_temp share it."""
MIN_SAMPLED_TEMPERATURE = 1e-5
"""The least temperature other than 0 (greedy), vLLM's _SAMPLING_EPS: the logits are divided by it in
fp32, where a smaller one (1e-300 is 0 there) turns them into infinities."""
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
"""Positive logits are divided by the penalty, negative ones multiplied: a logit of 100 stays below
1e4 at 0.01, where an fp32 division by 1e-300 (0) is infinite. Useful values lie in 0.8 to 1.5."""
MAX_ABS_PENALTY = 2.0
"""Bound of frequency_penalty and presence_penalty, as in OpenAI's API."""
MAX_SEED = 2**63 - 1
MAX_TOP_K = MAX_TOKEN_ID
IDENTIFIER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
"""An identifier names Redis keys and channels, so it is short and shell/URL-safe; a UUID fits."""
MAX_IDENTIFIER_CHARS = 128
MAX_ADAPTER_PATH_CHARS = 4096
"""Longest adapter directory path a load_adapter control message may carry (Linux's PATH_MAX)."""
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
"""Parallel samples one request may ask for (`n`); each costs a batch row of its own."""
MAX_SKIPS = 1024
"""Bound of `max_skips`."""
MAX_CHOICE_CHARS = 1024
MAX_TOOLS = 128
"""Tools one request may offer (OpenAI's limit)."""
MAX_TOOLS_CHARS = 4 * MAX_CONSTRAINT_CHARS
"""Characters of all the tools' JSON together: they are rendered into the prompt, and a forced call's
grammar holds the parameters schemas of the tools it may call."""
MAX_TOOL_CALLS = 128
"""Tool calls of one assistant message in the history."""
MAX_TOOL_CALL_ID_CHARS = 256
TOOL_NAME_PATTERN = f"^{NAME_PATTERN}$"
"""OpenAI's rule for a function name."""
MAX_CHAT_TEMPLATE_KWARGS_CHARS = 65_536
"""Characters of `chat_template_kwargs` as JSON."""
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")
"""Template variables genq sets itself: chat_template_kwargs cannot name them."""
MAX_ABS_SKEW = 10.0
MAX_COALESCE_MS = 10_000
"""Bound of `stream.coalesce_ms`: a chunk at least every 10 s keeps a stream's reader (and a proxy's
idle timeout) alive."""
MAX_COALESCE_TOKENS = 1_024
"""Bound of `stream.coalesce_tokens`."""
MAX_CONTEXT_SPAN = 2**31 - 1
"""Bound of the token counts repetition_penalty_range, repetition_penalty_decay and dry_range: windows
over the context, clipped to it, so any length is finite; int32, as the engine's token positions."""
DRY_MAX_NGRAM = 20
"""DRY looks for repeated sequences of at most this many tokens (exllamav2's dry_max_ngram)."""
MAX_DRY_MULTIPLIER = 100.0
MAX_DRY_BASE = 8.0
"""DRY subtracts count * dry_multiplier * dry_base ** (length - dry_allowed_length) from a logit, the
exponent at most DRY_MAX_NGRAM - 2 = 18: 100 * 8**18 * a count of 2**31 is 4e27, finite in fp32
(3.4e38), where dry_base 1e308 is not. SillyTavern's sliders stop at 5 and 4; llama.cpp's default
base is 1.75."""
MAX_SMOOTHING_FACTOR = 100.0
"""Quadratic sampling maps a logit to -smoothing_factor * (logit - max)**2; typical factors lie in 0.1
to 10 (SillyTavern's slider stops at 10)."""
MAX_MIROSTAT_TAU = 100.0
"""Mirostat's target surprise in bits: above log2 of any vocabulary (17 bits for 128k tokens) it
truncates nothing, so 100 leaves room to spare."""
MAX_MIROSTAT_ETA = 1.0
"""Mirostat's learning rate: mu moves by eta * (tau - surprise) per token; above 1 it overshoots
(llama.cpp's default is 0.1, SillyTavern's slider stops at 1)."""
MAX_TEMP_EXPONENT = 100.0
"""Dynamic temperature raises the normalized entropy (in [0, 1]) to this power: any positive
exponent is finite; beyond 100 the temperature is min_temp for every distribution."""
MAX_DRY_SEQUENCE_BREAKERS = 64
MAX_DRY_SEQUENCE_BREAKER_CHARS = 32
DRY_DEFAULT_SEQUENCE_BREAKERS = (".", ",", "!", "?", "<", ">", "[", "]", "(", ")", "{", "}", "\n", "\t", '"')
"""exllamav2's default: a token whose text holds one of these, or a special token, breaks DRY's sequences."""
XTC_SPARED = ("\n",)
"""exllamav2's default: XTC never excludes a token whose text holds one of these, nor a special token."""

MAX_IMAGES = 8
"""Images one request may carry (`images`, or the image parts of all its messages together)."""
MAX_IMAGE_BYTES = 20 * 1024 * 1024
"""Bytes of one image file, decoded from its base64 (what the gateway and the worker decode with
image_input.ImageLimits)."""
MAX_IMAGE_BASE64_CHARS = 4 * -(-MAX_IMAGE_BYTES // 3)
"""Characters of one image's base64 text: MAX_IMAGE_BYTES, padded (27,962,028)."""
MAX_IMAGE_PIXELS = 40_000_000
"""Pixels (width x height, as the file's header claims them) of one image: a decompression bomb is
refused by its header before any pixel is decoded."""
MAX_CONTENT_PARTS = 64
"""Parts of one message's content when it is a list (text and image parts)."""
MEDIA_TYPE_PATTERN = r"^image/[A-Za-z0-9][A-Za-z0-9.+-]{0,62}$"

IDENTIFIER_RE = re.compile(IDENTIFIER_PATTERN)
"""IDENTIFIER_PATTERN compiled once, for every check of an identifier, a task id or a key prefix."""
_TOKEN_ID_KEY_RE = re.compile(r"-?[0-9]{1,19}")
_INPUT_FIELDS = ("prompt", "messages", "input_ids")
_RULES_ERROR = "request_rules"

# --- Enumerations ------------------------------------------------------------

Role = Literal["system", "user", "assistant", "tool"]
EventType = Literal["started", "chunk", "done", "error", "cancelled"]
FinishReason = Literal["stop", "length", "cancelled", "error", "deadline", "tool_calls"]
"""OpenAI's names where they exist: stop (a stop token or string), length (max_new_tokens),
tool_calls (the model ended after calling tools)."""
ChainAs = Literal["user", "assistant", "prompt_suffix"]
"""How a chain child's parent result joins its request: appended to `prompt`, or a chat turn of that role."""
TERMINAL_EVENTS: frozenset[str] = frozenset({"done", "error", "cancelled"})
_FINISH_REASONS_BY_EVENT: dict[str, frozenset[str]] = {
    "done": frozenset({"stop", "length", "deadline", "tool_calls"}),
    "error": frozenset({"error"}),
    "cancelled": frozenset({"cancelled"}),
}

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
    if not IDENTIFIER_RE.fullmatch(value):
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
ToolName = Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
ToolCallId = Annotated[str, Field(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)]


def _check_base64_image(value: str) -> str:
    """The protocol bounds an image's base64 text and refuses a data: URL; whether it is base64 at
    all, and an image, is decoded by the gateway and the worker (image_input/): this module imports
    no Pillow."""
    if value.startswith("data:"):
        raise PydanticCustomError(
            "image_data_url", "send the base64 text alone, without a data: URL prefix (what follows 'base64,'); "
                              "the media type goes in media_type", {})
    if len(value) > MAX_IMAGE_BASE64_CHARS:
        raise PydanticCustomError(
            "image_too_large", "at most {max} characters of base64 allowed (MAX_IMAGE_BYTES = {bytes} bytes "
                               "decoded), got {length}",
            {"max": MAX_IMAGE_BASE64_CHARS, "bytes": MAX_IMAGE_BYTES, "length": len(value)})
    return value


Base64Image = Annotated[str, Field(min_length=1), AfterValidator(_check_base64_image)]
MediaType = Annotated[str, Field(pattern=MEDIA_TYPE_PATTERN)]


class _Input(BaseModel):
    """Requests: strict, closed. A misspelt option or a "1" for 1 is an error, not a guess."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Output(BaseModel):
    """What the worker emits: typed as strictly as a request, but unknown fields are ignored
    so that a client keeps working when a newer worker adds one."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


# --- Request -------------------------------------------------------------------


class FunctionCall(_Input):
    """The function an assistant message called, as OpenAI sends it: arguments is a JSON string."""

    name: ToolName
    arguments: Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)]


class MessageToolCall(_Input):
    """A tool call in the history: an assistant message's ``tool_calls[i]`` in OpenAI's shape."""

    id: ToolCallId
    type: Literal["function"] = "function"
    function: FunctionCall


class ImageData(_Input):
    """One image of a `prompt` request: the image file's bytes as base64 (PNG, JPEG, WebP, GIF's first
    frame, ... as Pillow reads them; its own bytes decide its format)."""

    data: Base64Image
    media_type: MediaType | None = Field(default=None, description="e.g. image/png; informational")


class TextContentPart(_Input):
    """A text part of a message's content."""

    type: Literal["text"]
    text: Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)]


class ImageContentPart(_Input):
    """An image part of a user message's content: an image, where the chat template puts one."""

    type: Literal["image"]
    data: Base64Image
    media_type: MediaType | None = Field(default=None, description="e.g. image/png; informational")


ContentPart = Annotated[TextContentPart | ImageContentPart, Field(discriminator="type")]
_CONTENT_TAGS = ("string", "parts")


def _content_kind(value: Any) -> str:
    return "parts" if isinstance(value, (list, tuple)) else "string"


MessageContent = Annotated[
    Annotated[Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)], Tag("string")]
    | Annotated[Annotated[list[ContentPart], Field(min_length=1, max_length=MAX_CONTENT_PARTS)], Tag("parts")],
    Discriminator(_content_kind),
]


class ChatMessage(_Input):
    """One chat turn; the worker renders the list with the model's chat template. An assistant
    message may carry the tool calls it made (its content may then be left out); a tool message
    answers one of them, named by tool_call_id. Content is a string, or a list of text and image
    parts (images in user messages only)."""

    role: Role
    content: MessageContent
    tool_calls: Annotated[list[MessageToolCall], Field(min_length=1, max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: ToolCallId | None = None
    name: Annotated[str, Field(min_length=1, max_length=MAX_TOOL_CALL_ID_CHARS)] | None = Field(
        default=None, description="the author's name; on a tool message the function's (some templates need it)")

    @model_validator(mode="before")
    @classmethod
    def _content_optional_with_calls(cls, data: Any) -> Any:
        """OpenAI's assistant message with tool_calls has content null or none: it is ""."""
        if isinstance(data, Mapping) and data.get("tool_calls") and data.get("content") is None:
            return {**data, "content": ""}
        return data

    @property
    def text(self) -> str:
        """The content's text: the string, or the text parts joined (as the gateway joins OpenAI's)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextContentPart))

    @property
    def image_parts(self) -> list[tuple[int, ImageContentPart]]:
        """(index in content, part) of the content's image parts."""
        if isinstance(self.content, str):
            return []
        return [(i, part) for i, part in enumerate(self.content) if isinstance(part, ImageContentPart)]

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> ChatMessage:
        if self.image_parts and self.role != "user":
            index = self.image_parts[0][0]
            raise PydanticCustomError("message_rules", "content[{index}]: image parts only in user messages, got "
                                                       "role {role}", {"index": index, "role": repr(self.role)})
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("message_rules", "tool_calls: only assistant messages carry them, got role "
                                                       "{role}", {"role": repr(self.role)})
        if self.tool_call_id is not None and self.role != "tool":
            raise PydanticCustomError("message_rules", "tool_call_id: only tool messages carry one (the id of the "
                                                       "call they answer), got role {role}", {"role": repr(self.role)})
        return self


class SamplingParams(_Input):
    """How tokens are picked. The default is greedy (temperature 0): a service should be
    deterministic unless a caller asks for randomness. Order of application (exllamav2's):
    token_bias and banned/allowed ids, penalties (repetition with its range and decay,
    frequency, presence, DRY), then (when sampling) temperature (unless temperature_last) with
    smoothing_factor, top_k, top_p, top_a, min_p, tfs, typical, mirostat, temperature_last or
    dynamic temperature, XTC, skew. docs/protocol.md says what each does."""

    temperature: float = Field(default=0.0, ge=0.0, le=MAX_TEMPERATURE, description="0 = greedy")
    top_k: int = Field(default=0, ge=0, le=MAX_TOP_K, description="0 = off; keep the k most likely tokens")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="1 = off; nucleus sampling mass")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="0 = off; drop tokens below min_p * max prob")
    top_a: float = Field(default=0.0, ge=0.0, le=1.0, description="0 = off; drop tokens below top_a * max prob squared")
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
                                      description="1 = off (HF/CTRL)")
    frequency_penalty: float = Field(default=0.0, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY, description="OpenAI's")
    presence_penalty: float = Field(default=0.0, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY, description="OpenAI's")
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED, description="same seed + same prompt -> same output")
    token_bias: Annotated[dict[TokenId, TokenBiasValue], Field(max_length=MAX_TOKEN_BIAS)] = Field(
        default_factory=dict, description="token id -> logit bias"
    )
    banned_token_ids: Annotated[list[TokenId], Field(max_length=MAX_BANNED_TOKEN_IDS)] = Field(default_factory=list)
    allowed_token_ids: Annotated[list[TokenId], Field(max_length=MAX_BANNED_TOKEN_IDS)] = Field(
        default_factory=list, description="only these tokens may be generated (empty = all)")
    repetition_penalty_range: int = Field(default=-1, ge=-1, le=MAX_CONTEXT_SPAN,
                                          description="-1 = the whole context; else the last N tokens")
    repetition_penalty_decay: int = Field(default=0, ge=0, le=MAX_CONTEXT_SPAN,
                                          description="tokens before the range over which the penalty fades out")
    dry_multiplier: float = Field(default=0.0, ge=0.0, le=MAX_DRY_MULTIPLIER,
                                  description="0 = off; DRY's penalty scale")
    dry_base: float = Field(default=1.75, ge=1.0, le=MAX_DRY_BASE,
                            description="DRY's penalty grows as dry_base ** (match - allowed)")
    dry_allowed_length: int = Field(default=2, ge=1, le=DRY_MAX_NGRAM - 1, description="longest repeat not penalised")
    dry_range: int = Field(default=0, ge=0, le=MAX_CONTEXT_SPAN, description="0 = the whole context; else the last N")
    dry_sequence_breakers: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MAX_DRY_SEQUENCE_BREAKER_CHARS)]],
        Field(max_length=MAX_DRY_SEQUENCE_BREAKERS),
    ] | None = Field(default=None, description="a token whose text holds one of these breaks a repeat; "
                                               "null = exllamav2's default (DRY_DEFAULT_SEQUENCE_BREAKERS)")
    smoothing_factor: float = Field(default=0.0, ge=0.0, le=MAX_SMOOTHING_FACTOR,
                                    description="0 = off; quadratic sampling")
    tfs: float = Field(default=1.0, gt=0.0, le=1.0, description="1 = off; tail-free sampling")
    typical: float = Field(default=1.0, gt=0.0, le=1.0, description="1 = off; locally typical sampling mass")
    mirostat: bool = Field(default=False, description="mirostat v2 (temperature > 0)")
    mirostat_tau: float = Field(default=1.5, ge=0.0, le=MAX_MIROSTAT_TAU,
                                description="mirostat's target surprise, in bits")
    mirostat_eta: float = Field(default=0.1, ge=0.0, le=MAX_MIROSTAT_ETA, description="mirostat's learning rate")
    temperature_last: bool = Field(default=False, description="apply temperature after the truncation samplers")
    min_temp: float = Field(default=0.0, ge=0.0, le=MAX_TEMPERATURE, description="dynamic temperature's low end")
    max_temp: float = Field(default=0.0, ge=0.0, le=MAX_TEMPERATURE,
                            description="dynamic temperature is on when max_temp > min_temp")
    temp_exponent: float = Field(default=1.0, gt=0.0, le=MAX_TEMP_EXPONENT,
                                 description="dynamic temperature's exponent")
    xtc_probability: float = Field(default=0.0, ge=0.0, le=1.0, description="0 = off; XTC's chance of excluding")
    xtc_threshold: float = Field(default=0.1, ge=0.0, le=1.0,
                                 description="XTC excludes top choices at least this likely")
    skew: float = Field(default=0.0, ge=-MAX_ABS_SKEW, le=MAX_ABS_SKEW,
                        description="0 = off; > 0 favours less likely tokens")

    @field_validator("temperature")
    @classmethod
    def _greedy_or_sampled(cls, temperature: float) -> float:
        if 0.0 < temperature < MIN_SAMPLED_TEMPERATURE:
            raise PydanticCustomError(
                "temperature_too_small",
                "must be 0 (greedy) or at least {min} (the logits are divided by it in fp32), got {value}",
                {"min": MIN_SAMPLED_TEMPERATURE, "value": temperature},
            )
        return temperature

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

    enabled: bool = Field(default=True, description="publish chunk events (started and the final event always are)")
    include_token_ids: bool = Field(default=False, description="put token ids in chunk and final events")
    coalesce_ms: int | None = Field(
        default=None, ge=0, le=MAX_COALESCE_MS,
        description="merge a sample's chunks and publish them at most this often (ms; 0: every step; unset: the "
                    "worker's GENQ_STREAM_COALESCE_MS); the first chunk and the final event go out at once")
    coalesce_tokens: int | None = Field(
        default=None, ge=0, le=MAX_COALESCE_TOKENS,
        description="also publish a sample's merged chunks once this many tokens wait (0: no token trigger; unset: "
                    "the worker's GENQ_STREAM_COALESCE_TOKENS)")


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
GrammarSyntax = Literal["json_schema", "regex", "choice", "lark", "gbnf"]
"""The formats of llguidance.grammar_from that a constraint becomes."""
_ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


def grammar_syntax(text: str) -> Literal["lark", "gbnf"]:
    """The syntax of a grammar given without one (vLLM's guided_grammar, the CLI's --grammar): GBNF
    defines its rules with `::=`, Lark with `:`."""
    return "gbnf" if "::=" in text else "lark"


def grammar_source(constraint: OutputConstraint) -> tuple[GrammarSyntax, str]:
    """The constraint as llguidance.grammar_from's (format, text): the one conversion of a wire
    constraint into a grammar, for the gateway's check and the worker's compilation alike (this
    module imports no llguidance). A JSON Schema asks for compact output (no whitespace between
    tokens: a model must not spend its tokens on blank space) unless it sets llguidance's own
    x-guidance options; json_object is the schema {"type": "object"}."""
    if isinstance(constraint, (JsonSchemaConstraint, JsonObjectConstraint)):
        schema = constraint.json_schema if isinstance(constraint, JsonSchemaConstraint) else _ANY_JSON_OBJECT
        if "x-guidance" not in schema:
            schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
        return "json_schema", json.dumps(schema, sort_keys=True)
    if isinstance(constraint, RegexConstraint):
        return "regex", constraint.pattern
    if isinstance(constraint, ChoiceConstraint):
        return "choice", json.dumps(constraint.choices)
    return constraint.syntax, constraint.grammar


class ToolFunction(_Input):
    """A function the model may call: OpenAI's ``tools[i].function``. parameters is the JSON Schema
    of its arguments (none: it takes no arguments); strict is accepted: a forced call's arguments
    always validate against the schema (docs/tools.md)."""

    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Input):
    """One of OpenAI's ``tools``: only functions exist."""

    type: Literal["function"]
    function: ToolFunction


class NamedFunction(_Input):
    name: ToolName


class NamedToolChoice(_Input):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class GenerationRequest(_Input):
    """The keyword arguments of a `genq.generate` task."""

    prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    input_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_INPUT_IDS)] | None = None
    max_new_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, ge=1, le=MAX_NEW_TOKENS)
    min_new_tokens: int = Field(default=0, ge=0, le=MAX_NEW_TOKENS, description="stop tokens are blocked until reached")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    stop: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] = Field(
        default_factory=list, description="stop strings; never included in the output"
    )
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] = Field(
        default_factory=list, description="extra stop tokens, besides the model's EOS ids"
    )
    ignore_eos: bool = Field(default=False,
                             description="do not stop on the model's EOS ids (stop_token_ids still stop)")
    add_bos: bool | None = Field(default=None, description="None = the tokenizer's default; prompt only")
    decode_special_tokens: bool = False
    identifier: Identifier | None = Field(default=None, description="names the channel and keys; None = the task id")
    adapter: Identifier | None = Field(default=None, description="the LoRA adapter to generate with, by the name the "
                                       "worker loaded it under (its card's `adapters`); None = the base model")
    priority: int | None = Field(default=None, ge=MIN_PRIORITY, le=MAX_PRIORITY, description="0 = highest")
    tenant: Identifier | None = Field(default=None, description="who the request counts against: fair share and usage "
                                      "are kept per tenant (the gateway sets it from the API key); None = the "
                                      "default tenant")
    deadline: float | None = Field(default=None, gt=0.0, le=MAX_DEADLINE, description="unix time, seconds")
    timeout_s: float | None = Field(default=None, gt=0.0, le=MAX_TIMEOUT_S, description="seconds from pick-up")
    stream: StreamOptions = Field(default_factory=StreamOptions)
    metadata: Metadata = Field(default_factory=dict, description="passed through to the result")
    chain_as: ChainAs | None = Field(default=None, description="as a Celery chain or chord child: how the parent's "
                                     "result text joins this request (chained_payload)")
    constraint: OutputConstraint | None = Field(default=None,
                                                description="what the output must match (docs/protocol.md)")
    logprobs: bool = Field(default=False,
                           description="each generated token's log-probability, in chunks and the result")
    top_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS, description="that many alternatives per token "
                                                                       "(implies logprobs)")
    prompt_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_TOP_LOGPROBS,
        description="each prompt token's log-probability given the tokens before it, with that many alternatives "
                    "(vLLM's prompt_logprobs; 0 = the token's own only), computed in the prefill; such a prompt is "
                    "not read from the prefix cache; in the result, and streamed on one chunk event")
    banned_strings: Annotated[list[StopString], Field(max_length=MAX_BANNED_STRINGS)] = Field(
        default_factory=list, description="text the output never contains (the engine rewinds; exllamav2's)")
    token_healing: bool = Field(default=False, description="regenerate the prompt's last token among those beginning "
                                                           "with its text (exllamav2's)")
    max_skips: int | None = Field(default=None, ge=0, le=MAX_SKIPS, description="times a request that does not fit "
                                  "the cache yet may be passed over by later ones; None = the worker's (16)")
    n: int = Field(default=1, ge=1, le=MAX_N, description="parallel samples of the prompt, which is computed once; "
                                                 "sample i is seeded seed + i, its chunks carry index i")
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = Field(
        default=None, description="functions the model may call (OpenAI's tools); messages only")
    tool_choice: ToolChoice | None = Field(
        default=None, description="none | auto | required | a named function; null = auto with tools")
    parallel_tool_calls: bool = Field(default=True, description="a forced call may be several calls")
    tool_format: ToolFormat | None = Field(
        default=None, description="the tool-call format the model writes; null = the worker's, read from its chat "
                                  "template")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="extra variables for the chat template (e.g. enable_thinking); messages only")
    add_generation_prompt: bool = Field(default=True, description="end the prompt with the assistant turn's opening")
    continue_final_message: bool = Field(
        default=False, description="render the last (assistant) message open, for the model to continue it; needs "
                                   "add_generation_prompt false")
    reasoning_format: ReasoningFormat | None = Field(
        default=None, description="how the model writes its thought (qwen3, deepseek_r1, none); null = the worker's, "
                                  "read from its chat template, for messages")
    images: Annotated[list[ImageData], Field(max_length=MAX_IMAGES)] = Field(
        default_factory=list, description="prompt only: the images, in the order of the model's image placeholders "
                                          "in the prompt (a chat's images are its messages' image parts)")

    def image_inputs(self) -> list[tuple[str, ImageData]]:
        """(field path, image) of every image the request carries, in prompt order: `images[i]`, or
        `messages[m].content[p]` for a chat's image parts."""
        if self.images:
            return [(f"images[{i}]", image) for i, image in enumerate(self.images)]
        return [(f"messages[{m}].content[{p}]", ImageData.model_construct(data=part.data, media_type=part.media_type))
                for m, message in enumerate(self.messages or ()) for p, part in message.image_parts]

    @field_validator("messages")
    @classmethod
    def _bound_total_message_chars(cls, messages: list[ChatMessage] | None) -> list[ChatMessage] | None:
        total = sum(len(m.text) + sum(len(call.function.arguments) for call in m.tool_calls or ())
                    for m in messages or ())
        if total > MAX_PROMPT_CHARS:
            raise PydanticCustomError(
                "messages_too_long",
                "at most {max} characters of content allowed in all messages together, got {total}",
                {"max": MAX_PROMPT_CHARS, "total": total},
            )
        return messages

    @field_validator("tools")
    @classmethod
    def _bound_tools(cls, tools: list[Tool] | None) -> list[Tool] | None:
        size = len(json.dumps([tool.model_dump(mode="json", exclude_none=True) for tool in tools or ()]))
        if size > MAX_TOOLS_CHARS:
            raise PydanticCustomError("tools_too_long", "at most {max} characters of JSON allowed in all tools "
                                                        "together, got {size}", {"max": MAX_TOOLS_CHARS, "size": size})
        return tools

    @field_validator("chat_template_kwargs")
    @classmethod
    def _bound_template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        if kwargs is None:
            return None
        reserved = sorted(set(kwargs) & set(RESERVED_TEMPLATE_VARIABLES))
        if reserved:
            raise PydanticCustomError("template_kwargs_reserved", "cannot set {names}: genq sets them itself",
                                      {"names": ", ".join(reserved)})
        try:
            size = len(json.dumps(kwargs))
        except (TypeError, ValueError):
            raise PydanticCustomError("template_kwargs_not_json", "must be a JSON object") from None
        if size > MAX_CHAT_TEMPLATE_KWARGS_CHARS:
            raise PydanticCustomError("template_kwargs_too_long", "at most {max} characters of JSON allowed, got "
                                      "{size}", {"max": MAX_CHAT_TEMPLATE_KWARGS_CHARS, "size": size})
        return kwargs

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


def chained_payload(kwargs: Mapping[str, Any], parents: tuple[Any, ...]) -> Mapping[str, Any]:
    """The task kwargs with the parent's result joined as `chain_as` says, for a task that Celery
    runs as a chain or chord child (it passes the parent's result as the one positional argument).
    ProtocolError when there is more than one, when chain_as is missing or does not fit the request,
    or when the parent's result holds no text; the parent itself is never failed for it."""
    if not parents or not isinstance(kwargs, Mapping):
        return kwargs
    if len(parents) > 1:
        raise ProtocolError([f"args: at most one positional argument (the parent's result in a chain), "
                             f"got {len(parents)}"])
    mode = kwargs.get("chain_as")
    if mode is None:
        raise ProtocolError([
            "chain_as: this task got its parent's result (it runs as a chain or chord child); set chain_as to "
            "'user', 'assistant' or 'prompt_suffix' to say how that text joins the request, or send an immutable "
            "signature (.si()) to ignore it"])
    if mode not in get_args(ChainAs):
        return kwargs  # parse_payload names the bad value
    text = _parent_text(parents[0])
    if mode == "prompt_suffix":
        if not isinstance(kwargs.get("prompt"), str):
            raise ProtocolError(["chain_as: 'prompt_suffix' appends to prompt, which this request lacks; use 'user' "
                                 "or 'assistant' with messages"])
        return {**kwargs, "prompt": kwargs["prompt"] + text}
    messages = kwargs.get("messages")
    if not isinstance(messages, list):
        raise ProtocolError([f"chain_as: {mode!r} appends a chat turn to messages, which this request lacks; use "
                             "'prompt_suffix' with prompt"])
    return {**kwargs, "messages": [*messages, {"role": mode, "content": text}]}


def _parent_text(parent: Any) -> str:
    """A parent's result as text: a genq result's `text`, a string as it is, or a chord header's
    (a group's) results in order, each so read, separated by a blank line. Celery flattens nested
    groups in a chord header; a list inside the list (a chord's result among a header's, or your
    task's list of lists) is refused, naming the item."""
    if isinstance(parent, list) and parent:
        texts = []
        for index, item in enumerate(parent):
            text = _one_text(item)
            if text is None:
                raise ProtocolError([f"chain: the parent's result[{index}] must be a genq result (an object with "
                                     f"text) or a string (a group's results are joined one level deep), got "
                                     f"{_json_type(item)}"])
            texts.append(text)
        return "\n\n".join(texts)
    text = _one_text(parent)
    if text is None:
        got = "an empty array" if isinstance(parent, list) else _json_type(parent)
        raise ProtocolError([f"chain: the parent's result must be a genq result (an object with text), a string or "
                             f"an array of those, got {got}"])
    return text


def _one_text(result: Any) -> str | None:
    if isinstance(result, str):
        return result
    if isinstance(result, Mapping) and isinstance(result.get("text"), str):
        return str(result["text"])
    return None


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
    if data.get("constraint") is not None:
        if data.get("banned_strings"):
            problems.append("constraint|banned_strings: give at most one of constraint and banned_strings (a "
                            "rewind would have to take back grammar state); express the ban in the grammar")
        if data.get("token_healing") is True:
            problems.append("constraint|token_healing: give at most one of constraint and token_healing (the "
                            "grammar decides the first token)")
    if data.get("tools") is not None:
        if data.get("messages") is None:
            problems.append("tools: need messages (a chat): the tools reach the model through its chat template")
        if data.get("constraint") is not None:
            problems.append("constraint|tools: give at most one of constraint and tools (a forced call is a "
                            "constraint of its own)")
        choice = data.get("tool_choice")
        names = _tool_names(data["tools"])
        if isinstance(choice, NamedToolChoice):
            choice = choice.model_dump()
        function = choice.get("function") if isinstance(choice, Mapping) else None
        wanted = function.get("name") if isinstance(function, Mapping) else None
        if isinstance(wanted, str) and names is not None and wanted not in names:
            problems.append(f"tool_choice.function.name: names no function of tools ({', '.join(names)}), got "
                            f"{_preview(wanted)}")
        if names is not None and len(set(names)) != len(names):
            problems.append(f"tools: function names must be unique, got {', '.join(names)}")
    elif data.get("tool_choice") not in (None, "none"):
        problems.append("tool_choice: needs tools")
    problems += _template_rule_problems(data)
    problems += _image_rule_problems(data)
    return problems


def _image_rule_problems(data: Mapping[str, Any]) -> list[str]:
    """Images: `images` with a prompt, image parts in a chat; at most MAX_IMAGES in all."""
    problems: list[str] = []
    images = data.get("images")
    if isinstance(images, list) and images and data.get("prompt") is None:
        problems.append("images: only with prompt (a chat's images are image parts of its messages' content; "
                        "input_ids carry none)")
    messages = data.get("messages")
    if isinstance(messages, list):
        count = 0
        for message in messages:
            content = message.content if isinstance(message, ChatMessage) else (
                message.get("content") if isinstance(message, Mapping) else None)
            if isinstance(content, list):
                count += sum(isinstance(part, ImageContentPart)
                             or (isinstance(part, Mapping) and part.get("type") == "image") for part in content)
        if count > MAX_IMAGES:
            problems.append(f"messages: at most {MAX_IMAGES} images allowed in all messages together (MAX_IMAGES), "
                            f"got {count}")
    return problems


def _template_rule_problems(data: Mapping[str, Any]) -> list[str]:
    """The rules of how messages are rendered (vLLM's): the options need messages, and a
    continued final message is an assistant's, with no generation prompt after it."""
    problems: list[str] = []
    chat = data.get("messages") is not None
    if data.get("chat_template_kwargs") is not None and not chat:
        problems.append("chat_template_kwargs: needs messages (a chat)")
    if data.get("add_generation_prompt") is False and not chat:
        problems.append("add_generation_prompt: needs messages (a chat)")
    if data.get("continue_final_message") is True:
        if data.get("add_generation_prompt", True) is not False:
            problems.append("continue_final_message|add_generation_prompt: continuing the final message needs "
                            "add_generation_prompt false (vLLM's rule)")
        messages = data.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        role = last.role if isinstance(last, ChatMessage) else last.get("role") if isinstance(last, Mapping) else None
        if not chat:
            problems.append("continue_final_message: needs messages (a chat)")
        elif role is not None and role != "assistant":
            problems.append(f"continue_final_message: the last message must be the assistant's to continue, got "
                            f"role {role!r}")
    return problems


def _tool_names(tools: object) -> list[str] | None:
    """The function names of validated tools or of raw ones (None when their shape is wrong)."""
    if not isinstance(tools, list):
        return None
    names = []
    for tool in tools:
        if isinstance(tool, Tool):
            names.append(tool.function.name)
            continue
        function = tool.get("function") if isinstance(tool, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            return None
        names.append(name)
    return names


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


def _without_content_tags(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """A message content's location without pydantic's union tags: `messages[0].content[3].data`,
    not `messages[0].content.parts[3].image.data`."""
    out: list[int | str] = []
    for part in loc:
        if len(out) >= 3 and out[-1] == "content" and out[-3] == "messages" and part in _CONTENT_TAGS:
            continue
        if (len(out) >= 4 and out[-2] == "content" and out[-4] == "messages" and isinstance(out[-1], int)
                and part in ("text", "image") and len(out) < len(loc) - 1):
            continue
        out.append(part)
    return tuple(out)


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
    models: dict[tuple[object, ...], type[BaseModel]] = {
        (): GenerationRequest, ("sampling",): SamplingParams, ("stream",): StreamOptions,
        ("messages", int): ChatMessage, ("messages", int, "tool_calls", int): MessageToolCall,
        ("messages", int, "tool_calls", int, "function"): FunctionCall, ("tools", int): Tool,
        ("tools", int, "function"): ToolFunction, ("images", int): ImageData,
    }
    model = models.get(shape)
    return list(model.model_fields) if model else None


def _describe(error: Mapping[str, Any]) -> str:
    """One "field.path: message" line; pydantic's wording, made to state limits and what was given."""
    loc: tuple[Any, ...] = _without_content_tags(error["loc"])
    kind, message, value = error["type"], error["msg"], error.get("input")
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

    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    cached_tokens: int = Field(default=0, ge=0)


class Timings(_Output):
    """Where the time went: waiting for the engine, computing the prompt, generating."""

    queued_s: float = Field(default=0.0, ge=0.0)
    prefill_s: float = Field(default=0.0, ge=0.0)
    generate_s: float = Field(default=0.0, ge=0.0)


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


class ToolCall(_Output):
    """A tool call read out of the output: arguments is the JSON text of the arguments object, as
    the model wrote it; the id is derived from the request's identifier and the call's index."""

    id: str
    name: str
    arguments: str


class Choice(_Output):
    """One of the n samples of a request with n > 1, on its final event and in its result."""

    index: int = Field(ge=0, lt=MAX_N)
    text: str
    token_ids: list[TokenId] | None = None
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason
    content: str | None = Field(default=None, description="with tools: the text outside the tool calls")
    tool_calls: list[ToolCall] | None = Field(default=None, description="with tools: the calls in the text")
    reasoning_content: str | None = Field(default=None, description="a thinking model's thought (then content is "
                                                                    "the text after it)")


class StreamEvent(_Output):
    """One message on a request's channel and replay stream (the same JSON on both).

    Per attempt: `started` (seq 0), `chunk`s, then exactly one terminal event whose text is the
    concatenation of that attempt's chunk texts. seq is contiguous from 0 within an attempt;
    attempt grows by one each time the task is redelivered. With n > 1 every chunk carries the
    `index` of its sample, the terminal event's `choices` hold each sample's whole text, and its
    top-level text is sample 0's (the concatenation of the chunks with index 0). A request with
    prompt_logprobs has them, with its prompt_token_ids, on one chunk per attempt: sample 0's first
    after the prefill (its text may be empty); the final event leaves them to the result."""

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
    index: int | None = Field(default=None, ge=0, lt=MAX_N)
    choices: list[Choice] | None = None
    prompt_token_ids: list[TokenId] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> StreamEvent:
        if self.index is not None and self.event != "chunk":
            raise PydanticCustomError("event_rules", "index: only chunk events carry one", {})
        if (self.prompt_token_ids is None) != (self.prompt_logprobs is None):
            raise PydanticCustomError("event_rules", "prompt_token_ids and prompt_logprobs: set together or not at all",
                                      {})
        if self.prompt_logprobs is not None:
            assert self.prompt_token_ids is not None
            if self.event != "chunk" or self.index not in (None, 0):
                raise PydanticCustomError("event_rules", "prompt_logprobs: only chunk events of sample 0 carry them",
                                          {})
            if len(self.prompt_logprobs) != len(self.prompt_token_ids):
                raise PydanticCustomError(
                    "event_rules", "prompt_logprobs: one per prompt_token_ids entry, got {got} for {tokens} tokens",
                    {"got": len(self.prompt_logprobs), "tokens": len(self.prompt_token_ids)})
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
    logprobs: list[TokenLogprob] | None = Field(default=None, description="per completion token, if requested")
    prompt_token_ids: list[TokenId] | None = Field(default=None, description="the prompt as the model read it, "
                                                   "with prompt_logprobs")
    prompt_logprobs: list[TokenLogprob | None] | None = Field(
        default=None, description="with prompt_logprobs: one per prompt token, the first null (nothing precedes it)")
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    metadata: Metadata = Field(default_factory=dict, description="the request's, unchanged")
    choices: list[Choice] | None = Field(default=None, description="n > 1: every sample, by index (the top-level "
                                                            "text, token_ids, logprobs and finish_reason are "
                                                            "choice 0's)")
    content: str | None = Field(default=None, description="with tools: choice 0's text outside its tool calls")
    tool_calls: list[ToolCall] | None = Field(default=None, description="with tools: choice 0's tool calls")
    reasoning_content: str | None = Field(default=None, description="choice 0's thought, from a thinking model")

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


def _check_path(value: str) -> str:
    if "\x00" in value:
        raise PydanticCustomError("path_nul", "a path holds no NUL character", {})
    return value


AdapterPath = Annotated[str, Field(min_length=1, max_length=MAX_ADAPTER_PATH_CHARS), AfterValidator(_check_path)]


class AdapterLoad(_Input):
    """Load a PEFT adapter directory under `name` on the workers consuming `queue`."""

    queue: Identifier
    name: Identifier
    path: AdapterPath = Field(description="the adapter directory on the worker's machine (not the sender's)")


class AdapterUnload(_Input):
    """Unload adapter `name` on the workers consuming `queue`: new requests for it are refused, queued
    and running ones finish."""

    queue: Identifier
    name: Identifier


class ControlMessage(_Output):
    """A message on the control channel: exactly one command, cancel (a request id), load_adapter or
    unload_adapter (issue 28)."""

    cancel: Identifier | None = None
    load_adapter: AdapterLoad | None = None
    unload_adapter: AdapterUnload | None = None

    @model_validator(mode="after")
    def _one_command(self) -> ControlMessage:
        given = [name for name in ("cancel", "load_adapter", "unload_adapter") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"a control message carries exactly one of cancel, load_adapter, unload_adapter; "
                             f"got {len(given)}")
        return self


# --- Redis names -----------------------------------------------------------------


def _name_part(value: object, what: str) -> str:
    if not isinstance(value, str) or not IDENTIFIER_RE.fullmatch(value):
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


def final_key(task_id: str, prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """A finished task's result as JSON, written with its final event and deleted once Celery has
    stored the result: what a redelivered message is answered with, and a status read between
    the two."""
    return f"{_name_part(prefix, 'prefix')}:final:{task_id}"


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
    return ControlMessage(cancel=_name_part(identifier, "identifier")).model_dump_json(exclude_none=True)


def load_adapter_message(queue: str, name: str, path: str) -> str:
    """The control-channel JSON that loads an adapter on a queue's workers (ProtocolError if invalid):
    {"load_adapter": {"queue": ..., "name": ..., "path": ...}}."""
    return _control_json({"load_adapter": {"queue": queue, "name": name, "path": path}})


def unload_adapter_message(queue: str, name: str) -> str:
    """The control-channel JSON that unloads an adapter on a queue's workers:
    {"unload_adapter": {"queue": ..., "name": ...}}."""
    return _control_json({"unload_adapter": {"queue": queue, "name": name}})


def _control_json(command: dict[str, Any]) -> str:
    try:
        return ControlMessage.model_validate(command).model_dump_json(exclude_none=True)
    except ValidationError as error:
        raise ProtocolError([_describe(each) for each in error.errors(include_url=False)]) from None
