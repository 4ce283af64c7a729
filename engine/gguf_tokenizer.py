"""Rebuild a `tokenizers` tokenizer from the vocabulary a GGUF file embeds.

GGUF carries no tokenizer.json: llama.cpp stores the tokens, their types,
the BPE merges (or, for SentencePiece vocabularies, per-token scores) and the
special token ids as metadata. Two models cover the files people serve:

- `gpt2`: byte-level BPE (Llama 3, Qwen, SmolLM). The `tokenizer.ggml.pre`
  name selects the split regex the merges were learned with.
- `llama`: SentencePiece-style BPE over "▁"-joined words with byte fallback
  (Llama 1/2, Mistral). Files usually omit merges; they are rebuilt from the
  scores, best-scoring merged token first.

The result is meant to tokenize exactly as transformers' own GGUF loader does
(tests/test_gguf_tokenizer.py checks ids and chat rendering against it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from engine.errors import ModelLoadError
from engine.gguf_file import GGUFFile

# llama.cpp token types (llama_token_type).
CONTROL = 3
USER_DEFINED = 4

# tokenizer.ggml.pre -> the pre-tokenizer split of that vocabulary family;
# others get GPT-2's byte-level split (as transformers does).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}

SPIECE_SPACE = "\u2581"


@dataclass(frozen=True)
class GGUFTokenizerParts:
    """What engine.tokenizer.Tokenizer needs, read from one GGUF file."""

    backend: BackendTokenizer
    special_tokens: dict[str, str]
    add_bos_token: bool
    chat_template: str | None
    eos_token_ids: list[int]


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the spelling of byte-level vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def read_tokenizer(gguf: GGUFFile) -> GGUFTokenizerParts:
    """The tokenizer parts a GGUF file describes; ModelLoadError if it has none we can build."""
    kind = gguf.value("tokenizer.ggml.model", None)
    if kind is None:
        raise ModelLoadError(f"{gguf.path} embeds no tokenizer (no tokenizer.ggml.model metadata)")
    tokens = [str(t) for t in gguf.value("tokenizer.ggml.tokens")]
    types = [int(t) for t in gguf.value("tokenizer.ggml.token_type", [1] * len(tokens))]
    if len(types) != len(tokens):
        raise ModelLoadError(
            f"{gguf.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    if kind == "gpt2":
        backend, tokens = _byte_level(gguf, tokens)
    elif kind == "llama":
        backend = _sentencepiece(gguf, tokens)
    else:
        raise ModelLoadError(
            f"{gguf.path}: tokenizer.ggml.model={kind!r} is not supported (supported: gpt2, llama)"
        )
    _add_marked_tokens(backend, tokens, types, byte_level=kind == "gpt2")
    special_tokens = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = gguf.value(f"tokenizer.ggml.{key}_token_id", None)
        if token_id is None:
            continue
        if not 0 <= int(token_id) < len(tokens):
            raise ModelLoadError(
                f"{gguf.path}: tokenizer.ggml.{key}_token_id={token_id} is outside the {len(tokens)}-token vocabulary"
            )
        special_tokens[name] = tokens[int(token_id)]
    # llama.cpp prepends BOS to SentencePiece vocabularies unless told otherwise.
    add_bos = bool(gguf.value("tokenizer.ggml.add_bos_token", kind == "llama"))
    eos_ids = [
        int(i)
        for key in ("eos", "eot", "eom")
        if (i := gguf.value(f"tokenizer.ggml.{key}_token_id", None)) is not None
    ]
    return GGUFTokenizerParts(
        backend=backend,
        special_tokens=special_tokens,
        add_bos_token=add_bos,
        chat_template=gguf.value("tokenizer.chat_template", None),
        eos_token_ids=list(dict.fromkeys(eos_ids)),
    )


def _byte_level(gguf: GGUFFile, tokens: list[str]) -> tuple[BackendTokenizer, list[str]]:
    """Byte-level BPE; tokens spelled outside the byte alphabet are respelled byte by byte."""
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    tokens = [t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]
    merges = [_merge_pair(m, gguf) for m in gguf.value("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    split = PRE_TOKENIZER_SPLITS.get(gguf.value("tokenizer.ggml.pre", None))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend, tokens


def _merge_pair(merge: str, gguf: GGUFFile) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise ModelLoadError(f"{gguf.path}: tokenizer.ggml.merges holds {merge!r}, not two tokens separated by a space")
    return left, right


def _sentencepiece(gguf: GGUFFile, tokens: list[str]) -> BackendTokenizer:
    """SentencePiece-style BPE: words joined by "▁", unknown bytes as <0xNN> tokens."""
    file_merges = gguf.value("tokenizer.ggml.merges", None)
    if file_merges is not None:
        merges = [_merge_pair(m, gguf) for m in file_merges]
    else:
        scores = gguf.value("tokenizer.ggml.scores", None)
        if scores is None or len(scores) != len(tokens):
            raise ModelLoadError(
                f"{gguf.path}: a SentencePiece vocabulary needs tokenizer.ggml.merges or one "
                "tokenizer.ggml.scores entry per token"
            )
        merges = merges_from_scores(tokens, [float(s) for s in scores])
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    prefix_space = bool(gguf.value("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPIECE_SPACE, prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every way to split a token
    into two vocabulary tokens is a merge, ranked by the merged token's score
    (higher first); ties go to the longer left piece, then the longer right
    piece, then vocabulary order."""
    index = {token: i for i, token in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))
    candidates: list[tuple[float, str, str]] = []
    for token, score in score_of.items():
        splits = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in index and token[cut:] in index
        ]
        splits.sort(key=lambda pair: (index[pair[0]], index[pair[1]]))
        candidates.extend((score, left, right) for left, right in splits)
    candidates.sort(key=lambda c: (c[0], len(c[1]), len(c[2])), reverse=True)
    return [(left, right) for _, left, right in candidates]


def _add_marked_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int], byte_level: bool) -> None:
    """Control tokens become special added tokens and user-defined ones plain added
    tokens, so text mentioning them is never split into pieces. In a byte-level
    vocabulary a "control" token spelled outside the byte alphabet is a converter
    mislabel and stays an ordinary token."""
    spelled = set(byte_alphabet().values())
    control = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, types)
        if kind == CONTROL and (not byte_level or set(token) <= spelled)
    ]
    if control:
        backend.add_special_tokens(control)
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, types)
        if kind == USER_DEFINED
    ]
    if user_defined:
        backend.add_tokens(user_defined)
