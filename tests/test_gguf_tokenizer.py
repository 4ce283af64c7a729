"""Tokenizers rebuilt from GGUF metadata against transformers' own GGUF loader
(AutoTokenizer.from_pretrained(dir, gguf_file=...)): token ids, decoding and
chat rendering on a multilingual corpus, for both vocabulary models llama.cpp
writes: byte-level BPE (`gpt2`) and SentencePiece-style BPE (`llama`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from engine.gguf_tokenizer import merges_from_scores
from engine.tokenizer import Tokenizer
from tests.gguf_files import finish, write_gguf
from tests.test_tokenizer import TEXTS

CORPUS = [
    *TEXTS,
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Mixed: Привет мир, مرحبا بالعالم, γειά σου κόσμε, 서울은 한국의 수도입니다",
    "runs:     of\t\t\tspaces\n\n\n\n   ",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Wie geht's? 🙂"},
    {"role": "assistant", "content": "Gut, danke."},
    {"role": "user", "content": "東京はどこ?"},
]
SPM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}{% else %}<<SYS>>{{ m['content'] }}"
    "<</SYS>>{% endif %}{% endfor %}"
)


def assert_same_as_transformers(file: Path) -> None:
    ours = Tokenizer.from_gguf(file)
    reference = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    special = [t for t in (ours.bos_token, ours.eos_token) if t]
    texts = [*CORPUS, f"{special[0]}text with {special[-1]} special tokens inside"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == reference(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == reference(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
    rendered = ours.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert rendered == reference.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    expected_ids = reference.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_dict=False)
    assert ours.encode_chat(CONVERSATION) == list(expected_ids)
    assert ours.bos_token_id == reference.bos_token_id and ours.eos_token_id == reference.eos_token_id


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_byte_level_bpe_matches_transformers(family: str, tiny_model_factory: Callable[..., Path], tmp_path: Path):
    """The tiny models' byte-level vocabularies, split as Llama 3 (llama-bpe) and Qwen2 do."""
    source = tiny_model_factory(family, rope_scaling=None)
    assert_same_as_transformers(write_gguf(source, tmp_path / f"{family}.gguf"))


def test_real_byte_level_vocabulary_matches_transformers(smollm2_gguf: Path):
    assert_same_as_transformers(smollm2_gguf)


def _train_sentencepiece_vocab() -> list[str]:
    """A small "▁"-word BPE vocabulary learned from the corpus, alphabet first, then merges in order."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    text = [line for line in CORPUS if line.strip()] * 4 + ["the theory of the thing, then there"] * 8
    backend.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    return [token for token, _ in sorted(backend.get_vocab().items(), key=lambda item: item[1])]


def write_sentencepiece_gguf(path: Path) -> Path:
    """A llama-architecture GGUF whose vocabulary is SentencePiece-style, stored as
    llama.cpp stores one: <unk>, <s>, </s>, the 256 <0xNN> byte tokens, then the
    pieces with descending scores, and no merges."""
    learned = _train_sentencepiece_vocab()
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *learned]
    types = [2, 3, 3, *([6] * 256), *([1] * len(learned))]
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(learned))]
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    writer.add_chat_template(SPM_TEMPLATE)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    finish(writer)
    return path


def test_sentencepiece_vocabulary_matches_transformers(tmp_path: Path):
    file = write_sentencepiece_gguf(tmp_path / "spm.gguf")
    assert_same_as_transformers(file)
    tokenizer = Tokenizer.from_gguf(file)
    # Characters the vocabulary lacks fall back to their UTF-8 bytes, and decode back whole.
    ids = tokenizer.encode("東京 🦒")
    assert tokenizer.id_to_token(ids[-1]).startswith("<0x") and tokenizer.decode(ids) == "東京 🦒"
    assert ids[0] == tokenizer.bos_token_id


def test_merges_from_scores_rank_by_the_merged_token():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -1.0, -0.5, -2.0]
    # "bc" outranks "ab" (higher score); "abc" splits as a+bc and ab+c, longer left piece first.
    assert merges_from_scores(tokens, scores) == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]
