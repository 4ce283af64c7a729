"""Incremental detokenizer against the two tokenizer styles LLMs use.

Both tokenizers are built here with `tokenizers` (no downloads): a byte-level
BPE (GPT-2 / Llama-3 / Qwen style) whose small vocabulary splits emoji and CJK
characters into byte tokens, and a SentencePiece-style BPE with byte fallback
and the "▁" space marker (Llama-2 / Mistral style), whose decoder strips the
leading space of whatever it decodes first.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.detokenizer import MAX_HELD_TOKENS, WINDOW_TOKENS, IncrementalDetokenizer

FFFD = "\ufffd"

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! How are you today?",
    "Streaming text one token at a time is harder than it looks.",
    "我们今天去公园散步，天气很好。中文字符需要多个字节。",
    "日本語のテキストも少し含めます。",
    "Привет, мир! Как дела?",
    "Café, naïve, résumé: accents are two bytes in UTF-8.",
] * 20

# Emoji never occur in the corpus, so both tokenizers spell them with byte tokens.
CHAR_POOL = list("abcdefghij  ,.!?\n") + list("éüñß") + list("中文字天气") + list("Привет") + [
    "🎉", "😀", "👍🏽", "👨‍👩‍👧", "€", "ج",
]


def train_byte_level() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def train_sentencepiece_like() -> Tokenizer:
    """Llama-2's layout: <unk> <s> </s>, then the 256 byte tokens, then BPE pieces."""
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    draft = Tokenizer(models.BPE(unk_token="<unk>"))
    draft.pre_tokenizer = metaspace
    trainer = trainers.BpeTrainer(
        vocab_size=300, limit_alphabet=40, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    draft.train_from_iterator(CORPUS, trainer)
    trained = json.loads(draft.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{byte:02X}>": 3 + byte for byte in range(256)}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in trained["merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tokenizer.pre_tokenizer = metaspace
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tokenizer


class Adapter:
    """The engine-facing decode(ids, skip_special_tokens); records how many ids each call decodes."""

    def __init__(self, tokenizer: Tokenizer, specials: Sequence[str], invalid_byte: str,
                 garbles_broken_runs: bool) -> None:
        self.tokenizer = tokenizer
        # ByteFallback decodes a byte run holding a broken character as all U+FFFD, complete
        # characters included: a stream cannot match that (see the detokenizer's docstring).
        self.garbles_broken_runs = garbles_broken_runs
        self.special_ids = [tokenizer.token_to_id(token) for token in specials]
        self.invalid_byte_id = tokenizer.token_to_id(invalid_byte)
        self.decode_lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decode_lengths.append(len(ids))
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def byte_level() -> Adapter:
    # "ÿ" is the byte-level alphabet's spelling of byte 0xFF, never valid in UTF-8.
    return Adapter(train_byte_level(), ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "ÿ", False)


@pytest.fixture(scope="module")
def sentencepiece() -> Adapter:
    return Adapter(train_sentencepiece_like(), ["<s>", "</s>", "<unk>"], "<0xFF>", True)


@pytest.fixture(params=["byte_level", "sentencepiece"])
def tokenizer(request: pytest.FixtureRequest) -> Adapter:
    return request.getfixturevalue(request.param)


class PerTokenDetokenizer:
    """Wrong on purpose: decodes each token alone."""

    def __init__(self, tokenizer: Adapter, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens

    def add(self, token_ids: Sequence[int]) -> str:
        return "".join(self.tokenizer.decode([token], self.skip) for token in token_ids)

    def flush(self) -> str:
        return ""


class NoHoldDetokenizer:
    """Wrong on purpose: windowed with prompt context, but releases text ending in a broken character."""

    def __init__(self, tokenizer: Adapter, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids = list(prompt_ids[-5:])
        self.read = len(self.ids)

    def add(self, token_ids: Sequence[int]) -> str:
        prefix = self.tokenizer.decode(self.ids, self.skip)
        self.ids.extend(token_ids)
        text = self.tokenizer.decode(self.ids, self.skip)
        self.ids = self.ids[self.read :]
        self.read = len(self.ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        return ""


def expected_text(tokenizer: Adapter, prompt: list[int], generated: list[int], skip: bool) -> str:
    """What a streamer must produce: the prompt's continuation; decode(generated) without a prompt."""
    if not prompt:
        return tokenizer.decode(generated, skip)
    before = tokenizer.decode(prompt, skip)
    full = tokenizer.decode(prompt + generated, skip)
    assert full.startswith(before)
    return full[len(before) :]


def stream(detokenizer: object, steps: Sequence[Sequence[int]]) -> tuple[list[str], str]:
    return [detokenizer.add(step) for step in steps], detokenizer.flush()


def problems(cls: type, tokenizer: Adapter, prompt: list[int], generated: list[int], steps: list[list[int]],
             skip: bool) -> list[str]:
    """Ways a streamed decode differs from the contract (empty when it holds)."""
    chunks, tail = stream(cls(tokenizer, prompt, skip), steps)
    expected = expected_text(tokenizer, prompt, generated, skip)
    found = []
    if "".join(chunks) + tail != expected:
        found.append(f"concatenation {''.join(chunks) + tail!r} != {expected!r}")
    # Valid text (apart from an incomplete character at the very end) must never show U+FFFD before flush().
    if FFFD not in expected.rstrip(FFFD) and any(FFFD in chunk for chunk in chunks):
        found.append(f"broken character released in {chunks!r}")
    return found


def split_into_steps(rng: random.Random, ids: list[int], sizes: Sequence[int]) -> list[list[int]]:
    """Tokens grouped as one engine step accepts them (several when speculating)."""
    steps, i = [], 0
    while i < len(ids):
        size = rng.choice(sizes)
        steps.append(ids[i : i + size])
        i += size
    return steps


def random_case(rng: random.Random, tokenizer: Adapter,
                with_prompt: bool) -> tuple[list[int], list[int], list[list[int]]]:
    """Prompt, generated ids (random multilingual text, maybe cut mid-character, with special tokens
    sprinkled in, also mid-character) and a split into steps of 1-3 tokens, like speculative decoding accepts.
    For a tokenizer that garbles broken byte runs, cuts and special tokens fall on character boundaries."""
    prompt = []
    if with_prompt:
        words = "".join(rng.choices(CHAR_POOL, k=rng.randint(1, 12)))
        prompt = [rng.choice(tokenizer.special_ids)] + tokenizer.encode(words)
    generated = tokenizer.encode("".join(rng.choices(CHAR_POOL, k=rng.randint(1, 30))))
    places = list(range(len(generated) + 1))
    if tokenizer.garbles_broken_runs:
        places = [i for i in places if not tokenizer.tokenizer.decode(generated[:i]).endswith(FFFD)]
    if rng.random() < 0.3:
        generated = generated[: rng.choice([i for i in places if i > 0])]
        places = [i for i in places if i <= len(generated)]
    for place in sorted(rng.choices(places, k=rng.randint(0, 3)), reverse=True):
        generated.insert(place, rng.choice(tokenizer.special_ids))
    return prompt, generated, split_into_steps(rng, generated, [1, 1, 1, 2, 3])


def test_fixture_tokenizers_split_characters_and_drop_spaces(byte_level: Adapter, sentencepiece: Adapter) -> None:
    """The hard cases really occur: otherwise the tests below would prove nothing."""
    for tokenizer in (byte_level, sentencepiece):
        ids = tokenizer.encode("🎉")[-4:]
        assert tokenizer.decode(ids) == "🎉"
        assert all(FFFD in tokenizer.decode([token]) for token in ids)
    ids = sentencepiece.encode("Hello world again")
    assert "".join(sentencepiece.decode([token]) for token in ids) != sentencepiece.decode(ids)


@pytest.mark.parametrize("wrong", [PerTokenDetokenizer, NoHoldDetokenizer])
def test_checks_reject_wrong_implementations(wrong: type, tokenizer: Adapter) -> None:
    rng = random.Random(1)
    cases = [random_case(rng, tokenizer, with_prompt) for with_prompt in (False, True) for _ in range(30)]
    assert any(problems(wrong, tokenizer, *case, skip=True) for case in cases)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("with_prompt", [False, True])
def test_stream_equals_full_decode_for_random_text(tokenizer: Adapter, skip_special_tokens: bool,
                                                   with_prompt: bool) -> None:
    rng = random.Random(1234)
    for _ in range(150):
        prompt, generated, steps = random_case(rng, tokenizer, with_prompt)
        assert problems(IncrementalDetokenizer, tokenizer, prompt, generated, steps, skip_special_tokens) == []


def test_emoji_split_over_tokens_comes_out_in_one_chunk(tokenizer: Adapter) -> None:
    emoji_ids = tokenizer.encode("🎉")[-4:]  # its four byte tokens, without a "▁"
    generated = tokenizer.encode("Party") + emoji_ids + tokenizer.encode(" time")
    detokenizer = IncrementalDetokenizer(tokenizer)
    chunks = [detokenizer.add([token]) for token in generated]
    assert not any(FFFD in chunk for chunk in chunks)
    assert sum("🎉" in chunk for chunk in chunks) == 1
    start = len(tokenizer.encode("Party"))
    assert chunks[start : start + len(emoji_ids) - 1] == [""] * (len(emoji_ids) - 1)
    assert "🎉" in chunks[start + len(emoji_ids) - 1]
    assert detokenizer.flush() == ""
    assert detokenizer.text == "".join(chunks) == tokenizer.decode(generated)


def test_text_before_a_split_character_is_released_at_once(sentencepiece: Adapter) -> None:
    hello = sentencepiece.encode("Hello")
    emoji = sentencepiece.encode("🎉")[-4:]  # the four byte tokens, without a "▁"
    detokenizer = IncrementalDetokenizer(sentencepiece)
    assert detokenizer.add(hello + emoji[:1]) == "Hello"
    assert [detokenizer.add([token]) for token in emoji[1:]] == ["", "", "🎉"]


def test_sentencepiece_first_token_keeps_its_space_after_the_prompt(sentencepiece: Adapter) -> None:
    prompt = [sentencepiece.special_ids[0]] + sentencepiece.encode("Say hello:")
    generated = sentencepiece.encode("Hello world")
    assert sentencepiece.decode(generated).startswith("Hello")  # decoding alone drops the space
    with_context = IncrementalDetokenizer(sentencepiece, prompt)
    chunks = [with_context.add([token]) for token in generated]
    assert chunks[0].startswith(" Hello")
    assert "".join(chunks) + with_context.flush() == " Hello world"
    without_context = IncrementalDetokenizer(sentencepiece)
    assert "".join(without_context.add([token]) for token in generated) == "Hello world"


def test_context_reaches_past_special_tokens_at_the_prompt_end(sentencepiece: Adapter) -> None:
    prompt = sentencepiece.encode("Question") + [sentencepiece.special_ids[1]] * 8
    detokenizer = IncrementalDetokenizer(sentencepiece, prompt)
    assert detokenizer.add(sentencepiece.encode("Hello")) == " Hello"


def test_skipped_special_tokens_produce_no_text(tokenizer: Adapter) -> None:
    special = tokenizer.special_ids[0]
    skipping = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"))
    assert skipping.add([special]) == ""
    assert skipping.add(tokenizer.encode(" there")) == " there"
    keeping = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"), skip_special_tokens=False)
    assert keeping.add([special]) == tokenizer.decode([special], skip_special_tokens=False)


def test_incomplete_character_at_the_end_is_flushed_as_decode_renders_it(tokenizer: Adapter) -> None:
    generated = tokenizer.encode("ok ") + tokenizer.encode("😀")[-4:-1]
    detokenizer = IncrementalDetokenizer(tokenizer)
    chunks = [detokenizer.add([token]) for token in generated]
    assert not any(FFFD in chunk for chunk in chunks)
    tail = detokenizer.flush()
    assert tail.endswith(FFFD)
    assert "".join(chunks) + tail == tokenizer.decode(generated)
    assert detokenizer.flush() == ""


def test_sentencepiece_broken_byte_run_keeps_its_complete_characters(sentencepiece: Adapter) -> None:
    """decode() turns the whole byte run into U+FFFD; the stream already released its complete
    characters and renders only the two bytes of the unfinished emoji as U+FFFD."""
    generated = sentencepiece.encode("ok 👨\u200d👩") + sentencepiece.encode("👧")[-4:-2]
    assert sentencepiece.decode(generated) == "ok " + FFFD * 13
    detokenizer = IncrementalDetokenizer(sentencepiece)
    chunks = [detokenizer.add([token]) for token in generated]
    assert "".join(chunks) == "ok 👨\u200d👩"
    assert detokenizer.flush() == FFFD * 2


def test_invalid_bytes_are_released_and_keep_the_window_bounded(tokenizer: Adapter) -> None:
    generated = tokenizer.encode("ok") + [tokenizer.invalid_byte_id] * 50 + tokenizer.encode(" fine")
    tokenizer.decode_lengths.clear()
    detokenizer = IncrementalDetokenizer(tokenizer)
    chunks = [detokenizer.add([token]) for token in generated] + [detokenizer.flush()]
    decode_lengths = list(tokenizer.decode_lengths)
    assert "".join(chunks) == tokenizer.decode(generated)
    assert FFFD in "".join(chunks[:-10])  # garbage is not held until the end
    # Released garbage (up to MAX_HELD_TOKENS + 1 tokens) is the context for the next garbage held.
    assert max(decode_lengths) <= 2 * MAX_HELD_TOKENS + 2


def test_cost_per_step_does_not_grow_with_output_length(tokenizer: Adapter) -> None:
    """A long generation decodes only short windows, through emoji sequences, runs of special tokens
    and multi-token steps that end inside characters."""
    rng = random.Random(7)
    generated = tokenizer.encode("".join(rng.choices(CHAR_POOL + ["👨\u200d👩\u200d👧\u200d👦"] * 5, k=1500)))
    for _ in range(100):
        generated.insert(rng.randint(0, len(generated)), rng.choice(tokenizer.special_ids))
    generated += [tokenizer.special_ids[0]] * 200 + tokenizer.encode("end")
    steps = split_into_steps(rng, generated, [1, 2, 3, 4])
    prompt = tokenizer.encode("A prompt that is long enough to need only its tail " * 20)
    tokenizer.decode_lengths.clear()
    chunks, tail = stream(IncrementalDetokenizer(tokenizer, prompt), steps)
    decode_lengths = list(tokenizer.decode_lengths)
    assert "".join(chunks) + tail == expected_text(tokenizer, prompt, generated, True)
    assert len(generated) > 2000
    assert max(decode_lengths) <= WINDOW_TOKENS + MAX_HELD_TOKENS + 8
    assert sum(decode_lengths) <= 2 * WINDOW_TOKENS * len(steps)
