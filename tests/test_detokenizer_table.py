"""The detokenizer's bytes-table fast path against its general path, chunk by chunk.

The general path decodes a window with the tokenizer (tests/test_detokenizer.py checks it
against full decodes); the fast path must release exactly the same chunks and hold exactly
the same tokens. Streams mix ordinary text with what breaks naive byte decoding: characters
split over tokens and steps, chains of tokens that each end inside a character, invalid
bytes, a real U+FFFD, special tokens between the bytes of a character, ids the tokenizer
does not know, and prompts that end inside a character.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from test_detokenizer import CHAR_POOL, train_byte_level, train_sentencepiece_like
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

import engine.detokenizer
from engine.detokenizer import IncrementalDetokenizer, byte_table
from engine.gguf_tokenizer import byte_alphabet
from engine.tokenizer import Tokenizer

FFFD = "\ufffd"
TEXT_POOL = [*CHAR_POOL, "\ufffd", "👨\u200d👩\u200d👧\u200d👦", "ok ", " the", "🎉🎉"]


class GeneralPath:
    """The same tokenizer behind a wrapper the table is never built for: the general path only."""

    def __init__(self, tokenizer: BackendTokenizer | Tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def backend_of(tokenizer: BackendTokenizer | Tokenizer) -> BackendTokenizer:
    return tokenizer.backend if isinstance(tokenizer, Tokenizer) else tokenizer


def spelled(backend: BackendTokenizer, data: bytes, rng: random.Random | None = None) -> list[int]:
    """Tokens spelling data (but bytes the vocabulary lacks): one per byte, or (with rng) pieces cut
    at random places, each one token where the vocabulary has it (so tokens may end inside
    characters), else one per byte."""
    alphabet = byte_alphabet()
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 8)))) if rng else []
    ids: list[int] = []
    for start, end in zip([0, *cuts], [*cuts, len(data)]) if rng else [(i, i + 1) for i in range(len(data))]:
        token = backend.token_to_id("".join(alphabet[byte] for byte in data[start:end]))
        ids += [token] if token is not None else [backend.token_to_id(alphabet[byte]) for byte in data[start:end]]
    return [token for token in ids if token is not None]  # a vocabulary may lack a byte or two


def random_ids(rng: random.Random, backend: BackendTokenizer, length: int) -> list[int]:
    """Pieces of the hard cases, joined."""
    size = backend.get_vocab_size(with_added_tokens=True)
    specials = sorted(backend.get_added_tokens_decoder())
    ids: list[int] = []
    while len(ids) < length:
        kind = rng.random()
        if kind < 0.45:
            ids += backend.encode("".join(rng.choices(TEXT_POOL, k=rng.randint(1, 6))), add_special_tokens=False).ids
        elif kind < 0.6:  # a character's bytes one token each, possibly cut short
            data = rng.choice(["é", "中", "🎉", "👍🏽", "€"]).encode()
            ids += spelled(backend, data[: rng.randint(1, len(data))])
        elif kind < 0.7:  # multi-byte text cut anywhere: tokens that end inside characters
            ids += spelled(backend, "".join(rng.choices(["中", "🎉", "é", "ab", "文字"], k=8)).encode(), rng)
        elif kind < 0.8:
            ids.append(rng.randrange(size))
        elif kind < 0.9:
            ids.append(rng.choice(specials))
        elif kind < 0.95:
            # a stray byte, or a run of them long enough that the general path gives up holding it
            ids += spelled(backend, bytes([rng.choice([0x80, 0xBF, 0xC3, 0xE2, 0xF0, 0xFF])]) * rng.choice([1, 1, 20]))
        else:
            ids.append(size + rng.randrange(3))  # an id the tokenizer does not know
    return ids[:length]


def steps_of(rng: random.Random, ids: list[int]) -> list[list[int]]:
    steps, i = [], 0
    while i < len(ids):
        size = rng.choice([1, 1, 1, 1, 2, 3, 4])
        steps.append(ids[i : i + size])
        i += size
    return steps


def differences(tokenizer: BackendTokenizer | Tokenizer, prompt: list[int], steps: list[list[int]],
                skip: bool) -> list[str]:
    """Where the fast detokenizer's chunks or held counts differ from the general path's."""
    fast = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    general = IncrementalDetokenizer(GeneralPath(tokenizer), prompt, skip_special_tokens=skip)
    found = []
    for i, step in enumerate(steps):
        got, want = fast.add(step), general.add(step)
        if (got, fast.num_held) != (want, general.num_held):
            found.append(f"step {i} {step}: {got!r} held {fast.num_held}, want {want!r} held {general.num_held}")
    got, want = fast.flush(), general.flush()
    if got != want or fast.text != general.text:
        found.append(f"flush {got!r} != {want!r}")
    return found


@pytest.fixture(scope="module")
def trained() -> BackendTokenizer:
    tokenizer = train_byte_level()
    # an added token that is not special, and a special one whose text is not ASCII
    tokenizer.add_tokens([AddedToken("<tool>", special=False)])
    tokenizer.add_special_tokens([AddedToken("<|fin é|>", special=True)])
    return tokenizer


@pytest.fixture(scope="module")
def tiny(llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_gguf)


@pytest.fixture(params=["trained", "tiny", "smollm2"])
def tokenizer(request: pytest.FixtureRequest) -> BackendTokenizer | Tokenizer:
    return request.getfixturevalue(request.param)


def test_byte_level_tokenizers_get_a_table_others_do_not(trained: BackendTokenizer, tiny: Tokenizer) -> None:
    assert byte_table(trained, True) is not None and byte_table(tiny, False) is not None
    assert byte_table(train_sentencepiece_like(), True) is None  # ByteFallback + Strip: not a concatenation
    assert byte_table(GeneralPath(tiny), True) is None  # a wrapper may decode as it likes


def test_table_spells_each_token_as_decode_does(trained: BackendTokenizer) -> None:
    table = byte_table(trained, True)
    assert table is not None
    emoji = trained.encode("🎉", add_special_tokens=False).ids
    assert b"".join(table[t] for t in emoji) == "🎉".encode()
    assert table[trained.token_to_id("<|im_start|>")] == b""
    assert byte_table(trained, False)[trained.token_to_id("<|im_start|>")] == b"<|im_start|>"
    assert table[trained.token_to_id("<tool>")] == b"<tool>"  # not special: never skipped


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("prompt_kind", ["none", "text", "mid_character", "specials"])
def test_fast_path_releases_the_general_paths_chunks(tokenizer: BackendTokenizer | Tokenizer, skip: bool,
                                                     prompt_kind: str) -> None:
    backend = backend_of(tokenizer)
    rng = random.Random(f"{prompt_kind}{skip}")
    special = min(backend.get_added_tokens_decoder())
    for _ in range(60):
        prompt = {
            "none": [],
            "text": backend.encode("".join(rng.choices(TEXT_POOL, k=5)), add_special_tokens=False).ids,
            "mid_character": backend.encode("a prompt", add_special_tokens=False).ids + spelled(backend, b"\xe4\xb8"),
            "specials": backend.encode("Q", add_special_tokens=False).ids + [special] * 3,
        }[prompt_kind]
        steps = steps_of(rng, random_ids(rng, backend, rng.randint(1, 60)))
        assert differences(tokenizer, prompt, steps, skip) == []


def test_long_clean_text_stays_on_the_fast_path(tiny: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a bytes table the tokenizer is never called, not even to decode a cut window."""
    calls: list[int] = []
    decode = Tokenizer.decode

    def counting(self: Tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        calls.append(len(ids))
        return decode(self, ids, skip_special_tokens)

    ids = tiny.encode("Streaming text, one token at a time: café, 中文, 🎉 and more. " * 20, add_special_tokens=False)
    monkeypatch.setattr(Tokenizer, "decode", counting)
    detokenizer = IncrementalDetokenizer(tiny, tiny.encode("Hi"))
    calls.clear()
    chunks = [detokenizer.add([token]) for token in ids]
    assert "".join(chunks) + detokenizer.flush() == decode(tiny, ids)
    assert calls == []


@pytest.mark.parametrize("corrupt", [
    lambda table: table[:256] + [b"x" + piece for piece in table[256:]],  # a wrong piece
    lambda table: [piece.decode("latin-1").encode() for piece in table],  # the alphabet not mapped back
])
def test_comparison_catches_a_wrong_table(trained: BackendTokenizer, monkeypatch: pytest.MonkeyPatch,
                                          corrupt: Callable[[list[bytes]], list[bytes]]) -> None:
    tables = {skip: corrupt(byte_table(trained, skip)) for skip in (True, False)}
    monkeypatch.setattr(engine.detokenizer, "byte_table",
                        lambda tokenizer, skip: tables[skip] if tokenizer is trained else None)
    rng = random.Random(3)
    cases = [steps_of(rng, random_ids(rng, trained, 40)) for _ in range(20)]
    assert any(differences(trained, [], steps, True) for steps in cases)
