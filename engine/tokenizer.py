"""Tokenizer for a Hugging Face model directory as it is (or a GGUF file's
embedded vocabulary, see engine/gguf_tokenizer.py), on `tokenizers` alone.

Reads tokenizer.json plus the optional tokenizer_config.json,
special_tokens_map.json, generation_config.json and chat_template.jinja, and
reproduces what transformers' AutoTokenizer does with them (encode, decode,
chat templates) without depending on transformers at run time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import InitVar, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from chat_template import ChatTemplate, with_bos
from engine.errors import ModelLoadError
from engine.gguf_file import is_gguf, open_gguf
from engine.gguf_tokenizer import read_tokenizer

# The named special tokens transformers knows, each also a chat-template variable.
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path, required: bool = False) -> dict[str, Any]:
    """A JSON object from the model directory; {} when an optional file is absent."""
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path.name} not found in {path.parent} (required for the tokenizer)")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _token_content(value: Any, where: str) -> str | None:
    """A special token given as a string or as a serialized AddedToken ({"content": ...})."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ModelLoadError(f"{where} must be a string or an object with a 'content' string, got {value!r}")


def _as_id_list(value: Any, where: str) -> list[int]:
    """generation_config's eos_token_id: absent, one id, or a list of ids."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise ModelLoadError(f"{where} must be an integer or a list of integers, got {value!r}")
    return items


def _select_template(value: Any, where: str) -> str | None:
    """tokenizer_config's chat_template: a string or a list of {name, template}; the default wins."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named and isinstance(named["default"], str):
            return named["default"]
        raise ModelLoadError(f"{where} lists templates {sorted(map(str, named))} but none named 'default'")
    raise ModelLoadError(f"{where} must be a string or a list of {{name, template}} objects")


def _tool_use_template(value: Any) -> str | None:
    """The template named "tool_use" in a list of {name, template}, which transformers renders
    instead of the default when tools are given (Hermes 2 Pro ships one)."""
    if not isinstance(value, list):
        return None
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    template = named.get("tool_use")
    return template if isinstance(template, str) else None


@lru_cache(maxsize=4)
def _token_texts(tokenizer: Tokenizer) -> tuple[str, ...]:
    """Each token's text decoded alone, special tokens included (byte pieces come out as U+FFFD)."""
    ids = [[i] for i in range(tokenizer.vocab_size)]
    return tuple(tokenizer.backend.decode_batch(ids, skip_special_tokens=False))


@lru_cache(maxsize=64)
def _ids_containing(tokenizer: Tokenizer, pieces: tuple[str, ...], special: bool) -> tuple[int, ...]:
    found = {i for i, text in enumerate(_token_texts(tokenizer)) if any(piece in text for piece in pieces)}
    return tuple(sorted(found | tokenizer.special_token_ids if special else found))


@dataclass(eq=False)
class Tokenizer:
    """Encode/decode/chat for one model; build it with Tokenizer.from_dir().

    special_tokens maps the named tokens (bos_token, eos_token, ...) to their
    text. add_bos_override None means "whatever tokenizer.json's post-processor
    does"; True/False overrides it without ever adding BOS twice.
    """

    backend: BackendTokenizer
    special_tokens: dict[str, str] = field(default_factory=dict)
    extra_special_tokens: Sequence[str] = ()
    add_bos_override: InitVar[bool | None] = None
    chat_template: str | None = None
    tool_chat_template: str | None = None
    generation_eos_token_ids: Sequence[int] = ()
    source: str = "tokenizer"

    add_bos_token: bool = field(init=False)
    vocab_size: int = field(init=False)
    bos_token_id: int | None = field(init=False)
    eos_token_id: int | None = field(init=False)
    pad_token_id: int | None = field(init=False)
    eos_token_ids: list[int] = field(init=False)
    special_token_ids: frozenset[int] = field(init=False)
    _post_processor_adds_bos: bool = field(init=False, repr=False)

    def __post_init__(self, add_bos_override: bool | None) -> None:
        # Silent truncation or padding configured in tokenizer.json would corrupt prompts.
        self.backend.no_truncation()
        self.backend.no_padding()
        # Like transformers: named special tokens that are not yet added tokens become
        # special added tokens (matched in text, skipped on decode).
        added = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        wanted = dict.fromkeys([*self.special_tokens.values(), *self.extra_special_tokens])
        missing = [t for t in wanted if t not in added]
        if missing:
            self.backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._named_id("bos_token")
        self.eos_token_id = self._named_id("eos_token")
        self.pad_token_id = self._named_id("pad_token")
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids = list(dict.fromkeys([*eos, *self.generation_eos_token_ids]))
        self.special_token_ids = frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)
        self._post_processor_adds_bos = self._probe_post_processor_bos()
        self.add_bos_token = self._post_processor_adds_bos if add_bos_override is None else add_bos_override

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer files of an HF model directory; only tokenizer.json is required."""
        root = Path(path)
        if not root.is_dir():
            raise ModelLoadError(f"tokenizer directory {root} does not exist")
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"tokenizer.json not found in {root}; only fast (tokenizers) tokenizers are supported")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises bare Exception on malformed files
            raise ModelLoadError(f"cannot load {tokenizer_file}: {exc}") from exc
        config = _read_json(root / "tokenizer_config.json")
        token_map = _read_json(root / "special_tokens_map.json")
        generation = _read_json(root / "generation_config.json")
        special_tokens: dict[str, str] = {}
        for name in NAMED_TOKENS:
            file, value = ("tokenizer_config.json", config.get(name))
            if value is None:
                file, value = ("special_tokens_map.json", token_map.get(name))
            content = _token_content(value, f"{file} {name}")
            if content is not None:
                special_tokens[name] = content
        # A list (additional_special_tokens) or, in newer configs, a dict of model-specific names.
        extras = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extras = list(extras.values()) if isinstance(extras, dict) else extras
        extra_special_tokens = [
            content
            for i, token in enumerate(extras if isinstance(extras, list) else [])
            if (content := _token_content(token, f"tokenizer_config.json extra_special_tokens[{i}]"))
        ]
        add_bos = config.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise ModelLoadError(f"tokenizer_config.json add_bos_token must be true or false, got {add_bos!r}")
        template_file = root / "chat_template.jinja"
        template: str | None
        tool_template: str | None = None
        if template_file.is_file():
            # Newer checkpoints store the template on its own; it then takes precedence.
            template = template_file.read_text(encoding="utf-8")
        else:
            template = _select_template(config.get("chat_template"), "tokenizer_config.json chat_template")
            tool_template = _tool_use_template(config.get("chat_template"))
        return cls(
            backend=backend,
            special_tokens=special_tokens,
            extra_special_tokens=extra_special_tokens,
            add_bos_override=add_bos,
            chat_template=template,
            tool_chat_template=tool_template,
            generation_eos_token_ids=_as_id_list(generation.get("eos_token_id"), "generation_config.json eos_token_id"),
            source=str(root),
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer a GGUF file embeds (vocabulary, special tokens, chat template)."""
        parts = read_tokenizer(open_gguf(path))
        return cls(
            backend=parts.backend,
            special_tokens=parts.special_tokens,
            add_bos_override=parts.add_bos_token,
            chat_template=parts.chat_template,
            generation_eos_token_ids=parts.eos_token_ids,
            source=str(path),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """from_gguf for a .gguf file, from_dir for an HF model directory."""
        return cls.from_gguf(path) if is_gguf(path) else cls.from_dir(path)

    @property
    def chat(self) -> ChatTemplate:
        """The chat templates with the special tokens they see: what renders a chat, torch-free
        (the gateway renders with the same from the model card)."""
        return ChatTemplate.of(self.chat_template, self.tool_chat_template, self.special_tokens)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    def _probe_post_processor_bos(self) -> bool:
        """Whether tokenizer.json's post-processor itself prepends BOS."""
        if self.bos_token_id is None:
            return False
        with_special = self.backend.encode("a", add_special_tokens=True).ids
        plain = self.backend.encode("a", add_special_tokens=False).ids
        return with_special[:1] == [self.bos_token_id] and plain[:1] != [self.bos_token_id]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; special tokens written in the text are recognized."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.bos_token_id is not None:
            if self.add_bos_token and not self._post_processor_adds_bos:
                ids.insert(0, self.bos_token_id)
            elif not self.add_bos_token and self._post_processor_adds_bos and ids[:1] == [self.bos_token_id]:
                ids.pop(0)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ids; incomplete UTF-8 sequences come out as U+FFFD."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def ids_containing(self, pieces: Iterable[str], special: bool = False) -> tuple[int, ...]:
        """The token ids whose text, decoded alone, holds one of pieces (with special, every special
        token too), as exllamav2 finds DRY's sequence breakers and the tokens XTC spares. The first
        call decodes the vocabulary (about a second for 150k tokens); answers are cached."""
        return _ids_containing(self, tuple(sorted(set(pieces))), special)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render a conversation exactly as transformers' apply_chat_template(tokenize=False) would:
        ChatTemplate.render (chat_template/), whose signature names the template's inputs (tools,
        documents; other template_kwargs such as Qwen3's enable_thinking reach the template too)."""
        if not self.chat_template:
            raise ModelLoadError(
                f"{self.source} has no chat template: tokenizer_config.json has no 'chat_template' field "
                "and there is no chat_template.jinja; send a plain prompt instead"
            )
        return self.chat.render(messages, add_generation_prompt, **template_kwargs)

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        """Render and encode a conversation, with exactly one BOS when the model wants one.

        Templates usually write BOS themselves, so the text is encoded without
        special tokens and BOS is prepended only where the template left it out.
        """
        return self.encode_rendered(self.apply_chat_template(messages, add_generation_prompt, **template_kwargs))

    def encode_rendered(self, text: str) -> list[int]:
        """Encode a rendered conversation (encode_chat's, or one cut to continue its last message)."""
        return with_bos(self.encode(text, add_special_tokens=False), self.add_bos_token, self.bos_token_id)
