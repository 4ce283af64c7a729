"""The model card: what a worker tells producers about the model it serves, so they can refuse a
request the worker would refuse before it is queued, and read its tool calls as it writes them.

A worker that answers a streamed OpenAI request only after the gateway has sent HTTP 200 can
report a prompt longer than the context, or a token id outside the vocabulary, only as an error
event inside the stream. With the card, the gateway (torch-free) checks these limits itself and
answers 400 before anything is queued; the worker still checks everything, for producers that
bypass the gateway.

Two Redis keys per queue (one queue per model is the intended deployment, so the queue names
the model; docs/protocol.md, section 4):

- `{prefix}:card:{queue}`: a hash, one field per worker node (its Celery hostname), each value a
  `WorkerCard` JSON. Workers of one model may differ (GENQ_CACHE_TOKENS, the device) in the
  context they can serve, so each worker keeps its own entry and a reader takes the most any
  live worker allows: a request some worker can take is valid.
- `{prefix}:tokenizer:{digest}`: the tokenizer as `tokenizers` JSON (Tokenizer.to_str()), named
  by its SHA-256, so workers of one model share one copy and readers fetch it once per digest.
- `{prefix}:chat_template:{digest}`: the model's chat templates and the special tokens they see
  (chat_template.ChatTemplate as JSON), named so too; only for a model with a chat template. With
  it and the tokenizer the gateway renders and encodes a chat as the worker does (POST /tokenize).

Each worker rewrites its entry with a fresh `heartbeat_at` every 5 s and refreshes the keys'
expiry (CARD_TTL_S); readers ignore entries older than CARD_TTL_S, so a worker that died stops
counting within that time, and a deployment that is gone leaves nothing behind.

CARD_VERSION changes only when a reader of the previous version would misread a card. A new
field with a default that means "not said" (bos_token_id, chat_template_digest: null from older
workers) keeps the version: older readers ignore it, newer ones treat null as not published.
`images` (issue 27) keeps it too: null means the model takes no images, which is true of every
older worker (none ran a vision tower). `adapters` (issue 28) keeps it too: an older worker's card
has none, and it serves none.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from chat_template import ChatTemplate
from producer.protocol import IDENTIFIER_RE, MAX_IMAGES, Identifier
from producer.reasoning import ReasoningFormat
from producer.tool_calls import ToolFormat

CARD_VERSION = 1
CARD_TTL_S = 60
"""Entries older than this are ignored, and both keys expire this long after the last heartbeat.
Generous against clock skew between worker and gateway hosts: a skew beyond it makes entries
look stale, and the gateway then skips its checks (the worker still makes them)."""
MAX_CARD_ADAPTERS = 1024
"""Adapter names one card may list: a card with more is malformed (and ignored)."""


class ImageSupport(BaseModel):
    """What a vision-language worker tells producers about images (the card's `images`)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    placeholder: str = Field(min_length=1, description="the prompt text that marks an image in a `prompt` request, "
                                                       "once per image (LLaVA's <image>, Gemma 3's <start_of_image>)")
    tokens_per_image: Annotated[int, Field(ge=1)] = Field(description="prompt tokens one image becomes")
    max_images: Annotated[int, Field(ge=0, le=MAX_IMAGES)] = Field(
        description="images one request may carry: MAX_IMAGES, or fewer when the context holds fewer images")


class WorkerCard(BaseModel):
    """One worker's entry in `{prefix}:card:{queue}`."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    version: int = Field(default=CARD_VERSION, description="the card format; readers skip versions they do not know")
    model: str = Field(description="the model the worker loaded, as configured (GENQ_MODEL)")
    vocab_size: Annotated[int, Field(ge=1)] = Field(description="token ids the worker accepts: [0, vocab_size)")
    max_seq_len: Annotated[int, Field(ge=1)] = Field(
        description="the longest sequence the worker serves: prompt tokens + max_new_tokens must fit")
    add_bos: bool = Field(description="whether a `prompt` gets BOS when the request's add_bos is null")
    bos_correction: Annotated[int, Field(ge=-1, le=1)] = Field(
        description="tokens the worker's encode adds to (1) or removes from (-1) what the tokenizer JSON's own "
                    "encode(text, add_special_tokens=True) gives, to apply its add_bos setting")
    chat_template: bool = Field(description="whether the model has a chat template (`messages` are accepted)")
    tool_format: ToolFormat | None = Field(default=None, description="the format the model writes tool calls in "
                                                                    "(docs/tools.md); null from older workers")
    reasoning_format: ReasoningFormat | None = Field(default=None, description="how the model writes its thought "
                                                    "(producer/reasoning.py); null from older workers")
    tokenizer_digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the tokenizer JSON")
    bos_token_id: int | None = Field(default=None, description="the BOS token's id, which the worker's encode "
                                                               "prepends (bos_correction 1, or a chat whose template "
                                                               "left it out); null without one or from older workers")
    chat_template_digest: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{64}$",
        description="SHA-256 of the chat template JSON; null without a chat template or from older workers")
    images: ImageSupport | None = Field(default=None, description="null: the model takes no images (and every "
                                                                  "older worker's card)")
    adapters: Annotated[list[Identifier], Field(max_length=MAX_CARD_ADAPTERS)] = Field(
        default_factory=list, description="the LoRA adapters the worker serves, by name, sorted (a request names one "
                                          "in `adapter`); [] from workers without adapters and older workers")
    heartbeat_at: float = Field(description="unix time of the worker's last refresh")


def card_key(queue: str, prefix: str) -> str | None:
    """The hash of the cards of the workers serving `queue`; None when the queue or prefix cannot
    name a Redis key (they must follow the identifier rule): then no card is published or read."""
    if not (IDENTIFIER_RE.fullmatch(queue) and IDENTIFIER_RE.fullmatch(prefix)):
        return None
    return f"{prefix}:card:{queue}"


def tokenizer_key(digest: str, prefix: str) -> str:
    """The tokenizer JSON whose SHA-256 is `digest` (a card's tokenizer_digest; used only where
    card_key accepted the prefix)."""
    return f"{prefix}:tokenizer:{digest}"


def chat_template_key(digest: str, prefix: str) -> str:
    """The chat template JSON whose SHA-256 is `digest` (a card's chat_template_digest)."""
    return f"{prefix}:chat_template:{digest}"


CHAT_TEMPLATE_JSON: TypeAdapter[ChatTemplate] = TypeAdapter(ChatTemplate)
"""The chat template key's value: ChatTemplate's fields as a JSON object."""
