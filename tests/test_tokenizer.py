"""engine.tokenizer.Tokenizer agrees with transformers' AutoTokenizer on HF model directories."""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from engine.errors import ModelLoadError
from engine.tokenizer import Tokenizer
from genq_dev.tiny_model import FAMILIES, make_tiny_model

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\n\nand trailing newlines \n",
    "Numbers 12345 and 3.14159, dates 2024-05-17.",
    "café naïve Straße garçon ¿Dónde está?",
    unicodedata.normalize("NFD", "café déjà vu"),
    "今天天气很好，龘靐齉。東京は日本の首都です。",
    "emoji 🤖🚀 family 👨‍👩‍👧 flag 🇫🇷 crab 🦀",
    "<s>special</s> tokens <|im_start|>user\nhi<|im_end|><|pad|>",
    "",
]

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Say hi in French 🇫🇷"},
    {"role": "assistant", "content": "Salut !"},
]


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One "test"-preset directory per family; tests that edit files copy it first."""
    root = tmp_path_factory.mktemp("tokenizer-dirs")
    return {family: make_tiny_model(root / family, family, num_hidden_layers=1) for family in FAMILIES}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data), encoding="utf-8")


@pytest.mark.parametrize("family", FAMILIES)
def test_encode_decode_match_transformers(tokenizer_dirs: dict[str, Path], family: str) -> None:
    ours = Tokenizer.from_dir(tokenizer_dirs[family])
    reference = transformers.AutoTokenizer.from_pretrained(tokenizer_dirs[family])
    for text in TEXTS:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == reference.encode(text, add_special_tokens=add_special), (text, add_special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), (
                    text,
                    skip,
                )
    for token_id in range(ours.vocab_size):
        assert ours.id_to_token(token_id) == reference.convert_ids_to_tokens(token_id)


@pytest.mark.parametrize("family", FAMILIES)
def test_special_token_ids(tokenizer_dirs: dict[str, Path], family: str) -> None:
    ours = Tokenizer.from_dir(tokenizer_dirs[family])
    config = json.loads((tokenizer_dirs[family] / "config.json").read_text())
    eos, im_end = ours.token_to_id("</s>"), ours.token_to_id("<|im_end|>")
    assert ours.vocab_size == config["vocab_size"]
    assert ours.eos_token_id == eos and ours.eos_token_ids == [eos, im_end]
    assert ours.bos_token_id == ours.token_to_id("<s>") == config["bos_token_id"]
    assert ours.pad_token_id == ours.token_to_id("<|pad|>")
    assert ours.special_token_ids == frozenset(
        ours.token_to_id(t) for t in ("<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|pad|>")
    )
    wants_bos = family in ("llama", "mistral")
    assert ours.add_bos_token is wants_bos
    ids = ours.encode("hello")
    assert (ids[0] == ours.bos_token_id) is wants_bos and ids.count(ours.bos_token_id) == int(wants_bos)


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_matches_transformers(tokenizer_dirs: dict[str, Path], family: str) -> None:
    ours = Tokenizer.from_dir(tokenizer_dirs[family])
    reference = transformers.AutoTokenizer.from_pretrained(tokenizer_dirs[family])
    for generation_prompt in (True, False):
        text = ours.apply_chat_template(CONVERSATION, add_generation_prompt=generation_prompt)
        assert text == reference.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=generation_prompt
        )
        ids = ours.encode_chat(CONVERSATION, add_generation_prompt=generation_prompt)
        assert ids == reference.apply_chat_template(
            CONVERSATION, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
        )
        assert ids.count(ours.bos_token_id) == int(family in ("llama", "mistral"))
    assert text.endswith("<|im_start|>assistant\nSalut !<|im_end|>\n")


def test_multibyte_characters_split_across_tokens(tokenizer_dirs: dict[str, Path]) -> None:
    tokenizer = Tokenizer.from_dir(tokenizer_dirs["llama"])
    for char in ("龘", "🦀", "𝄞"):
        ids = tokenizer.encode(char, add_special_tokens=False)
        assert len(ids) >= 2, char
        pieces = [tokenizer.decode([i]) for i in ids]
        assert char not in pieces and any("\ufffd" in p for p in pieces)
        assert tokenizer.decode(ids) == char


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_malformed_config_names_the_file(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(tokenizer_dirs["llama"], tmp_path / "m")
    (path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json"):
        Tokenizer.from_dir(path)


def test_chat_without_template_names_the_field(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(tokenizer_dirs["qwen2"], tmp_path / "m")
    _edit_json(path / "tokenizer_config.json", chat_template=None)
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.chat_template is None
    with pytest.raises(ModelLoadError, match="chat_template"):
        tokenizer.encode_chat(CONVERSATION)


def test_named_template_list_uses_default(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(tokenizer_dirs["qwen3"], tmp_path / "m")
    templates = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"},
    ]
    _edit_json(path / "tokenizer_config.json", chat_template=templates)
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.apply_chat_template(CONVERSATION) == "[You are a terse assistant.][Say hi in French 🇫🇷][Salut !]"
    assert tokenizer.apply_chat_template(CONVERSATION) == transformers.AutoTokenizer.from_pretrained(
        path
    ).apply_chat_template(CONVERSATION, tokenize=False)


def test_chat_template_file_takes_precedence(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(tokenizer_dirs["qwen3"], tmp_path / "m")
    (path / "chat_template.jinja").write_text("{{ messages[-1]['content'] | tojson }}", encoding="utf-8")
    tokenizer = Tokenizer.from_dir(path)
    chat = [{"role": "user", "content": "<b>é</b> & co"}]
    assert tokenizer.apply_chat_template(chat) == '"<b>é</b> & co"'  # no HTML escaping, no \u escapes
    assert tokenizer.apply_chat_template(chat) == transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        chat, tokenize=False
    )


def test_template_errors_are_value_errors(tokenizer_dirs: dict[str, Path]) -> None:
    tokenizer = Tokenizer.from_dir(tokenizer_dirs["llama"])
    with pytest.raises(ValueError, match="Unknown role"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError, match="empty"):
        tokenizer.apply_chat_template([])


def test_dict_tokens_and_special_tokens_map(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(tokenizer_dirs["llama"], tmp_path / "m")
    _edit_json(
        path / "tokenizer_config.json",
        bos_token={"__type": "AddedToken", "content": "<s>", "special": True},
        eos_token=None,
        pad_token=None,
    )
    (path / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": {"content": "<|im_end|>"}, "pad_token": "<|pad|>"})
    )
    _edit_json(path / "generation_config.json", eos_token_id=1)
    tokenizer = Tokenizer.from_dir(path)
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.bos_token_id == tokenizer.token_to_id("<s>")
    assert tokenizer.eos_token_id == im_end and tokenizer.eos_token_ids == [im_end, 1]
    assert tokenizer.pad_token_id == tokenizer.token_to_id("<|pad|>")


def test_eos_without_generation_config(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(tokenizer_dirs["mistral"], tmp_path / "m")
    (path / "generation_config.json").unlink()
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.eos_token_ids == [tokenizer.token_to_id("</s>")]


@pytest.mark.parametrize(("family", "add_bos"), [("llama", False), ("llama", True), ("qwen2", True)])
def test_add_bos_token_overrides_post_processor(
    tokenizer_dirs: dict[str, Path], tmp_path: Path, family: str, add_bos: bool
) -> None:
    path = _copy(tokenizer_dirs[family], tmp_path / "m")
    _edit_json(path / "tokenizer_config.json", add_bos_token=add_bos)
    tokenizer = Tokenizer.from_dir(path)
    bos = tokenizer.bos_token_id
    assert tokenizer.add_bos_token is add_bos
    ids = tokenizer.encode("hello there")
    assert ids.count(bos) == int(add_bos) and (ids[0] == bos) is add_bos
    assert bos not in tokenizer.encode("hello there", add_special_tokens=False)
    # Never two BOS; a template without one (qwen2's) still gets one when the model wants it.
    chat = tokenizer.encode_chat(CONVERSATION)
    assert chat.count(bos) <= 1 and (chat[0] == bos or not add_bos)


def test_post_processor_decides_without_add_bos_token(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = _copy(tokenizer_dirs["llama"], tmp_path / "m")
    _edit_json(path / "tokenizer_config.json", add_bos_token=None)
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.add_bos_token is True
    assert tokenizer.encode("hi")[:2] != [tokenizer.bos_token_id] * 2
    assert tokenizer.encode("hi") == transformers.AutoTokenizer.from_pretrained(path).encode("hi")
