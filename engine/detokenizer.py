"""Incremental, UTF-8-safe detokenization for streaming.

Decoding each token on its own is wrong twice over: byte-level BPE splits one
character's bytes over several tokens (each piece alone decodes to U+FFFD),
and SentencePiece decoders strip the leading space of whatever they decode
first, so "▁world" alone loses its space. Decoding the whole output every step
is right but costs O(generated length) per token.

This follows the prefix-offset / read-offset scheme of vLLM and Hugging Face
TGI: decode a short window of recent tokens whose first part (the prefix) has
already been released, and release what the window's text adds beyond the
prefix's text. The prefix gives every new token its left context, so the
decoder's start-of-text quirks only ever touch text that is already out.
While the window's text ends in U+FFFD a character is still incomplete: the
complete text before it is released and the rest is held until later tokens
finish the character. When steps keep ending inside characters, the read offset
moves to a character boundary between the held tokens instead, and bytes that
never complete are released as U+FFFD, so the window stays a few tokens long.

Fast path: for a byte-level BPE tokenizer (GPT-2, Llama-3, Qwen, SmolLM2) decode()
is the UTF-8 decoding, invalid bytes as U+FFFD, of the concatenated bytes of the
tokens, so the window's text is the released prefix's text plus the decoding of
the held bytes and the new ones. While the released text ends on a whole
character, the new bytes' decoding does not end in U+FFFD (an incomplete
character at their end is held; invalid bytes before it come out as U+FFFD, as
in the window's decoding) and fewer than
RESYNC_AFTER_TOKENS tokens are held, add() computes that from a per-token bytes
table and an incomplete-character byte buffer instead of calling the tokenizer,
and moves the window exactly as the general path would (same state, same
chunks); anything else takes the general path for that step. The table is built
once per tokenizer and checked against the tokenizer's own decode().
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol
from weakref import WeakKeyDictionary

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders

from engine.gguf_tokenizer import byte_alphabet
from engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded as left context for the first generated token (vLLM uses 5).
INITIAL_CONTEXT_TOKENS = 5
# How far back into the prompt to look for context that decodes to some text,
# past a run of skipped special tokens at the prompt's end.
MAX_CONTEXT_TOKENS = 32
# Once more released tokens than this sit in the window, it is cut back to those of the last step.
WINDOW_TOKENS = 8
# A character has at most 4 bytes. Held longer than that, the steps keep ending inside
# characters (emoji sequences, CJK, multi-token steps): look for a character boundary
# between the held tokens, so the window does not grow.
RESYNC_AFTER_TOKENS = 4
# With no character boundary in this many held tokens, the bytes are invalid, not split:
# release them as U+FFFD, as decode() renders them.
MAX_HELD_TOKENS = 16


class Decoder(Protocol):
    """The one tokenizer method needed; tokenizers.Tokenizer and HF tokenizers both have it."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class ByteTable(list[bytes]):
    """The bytes table, with each token's text where its bytes alone are whole characters (else None):
    add() releases such a token's text from it when nothing is held, without decoding."""

    def __init__(self, pieces: list[bytes]) -> None:
        super().__init__(pieces)
        self.texts = {token: text for token, text in enumerate(map(_whole_text, pieces)) if text is not None}


def _whole_text(piece: bytes) -> str | None:
    """The piece's text if it is non-empty, valid UTF-8 without U+FFFD (which the general path decides on)."""
    try:
        text = piece.decode()
    except UnicodeDecodeError:
        return None
    return text if text and REPLACEMENT_CHAR not in text else None


# tokenizer -> (its vocabulary size when the tables were built, skip_special_tokens -> table or None)
_TABLES: WeakKeyDictionary[object, tuple[int, dict[bool, list[bytes] | None]]] = WeakKeyDictionary()
# Random id sequences decode() must agree with the table on before the table is used.
_CHECK_SEQUENCES = 64


def byte_table(tokenizer: object, skip_special_tokens: bool) -> list[bytes] | None:
    """Each token id's bytes as decode() concatenates them (skipped special tokens: none), or None
    when decode() is not a plain byte-level decoding (another decoder, a wrapper of its own) or the
    table disagrees with decode() on any single token or on random sequences."""
    if isinstance(tokenizer, Tokenizer) and type(tokenizer).decode is Tokenizer.decode:
        backend = tokenizer.backend
    elif isinstance(tokenizer, BackendTokenizer):
        backend = tokenizer
    else:
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    built, tables = _TABLES.get(tokenizer, (None, {}))
    if built != size:
        tables = {}
        _TABLES[tokenizer] = (size, tables)
    if skip_special_tokens not in tables:
        tables[skip_special_tokens] = _build_table(backend, size, skip_special_tokens)
    return tables[skip_special_tokens]


def _build_table(backend: BackendTokenizer, size: int, skip_special_tokens: bool) -> list[bytes] | None:
    if not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    alphabet = {char: byte for byte, char in byte_alphabet().items()}
    to_bytes = {ord(char): byte for char, byte in alphabet.items()}  # str.translate, then latin-1: the bytes
    pieces: list[str | None] = [None] * size
    for vocab_piece, i in backend.get_vocab(with_added_tokens=False).items():
        if i < size:
            pieces[i] = vocab_piece
    added = backend.get_added_tokens_decoder()
    singles = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=skip_special_tokens)
    table = []
    for i, piece in enumerate(pieces):
        if i in added:
            # decode() renders an added token as its text between separately decoded byte runs, which is
            # the decoding of the concatenation as long as that text is valid, non-empty UTF-8 (or skipped).
            text = singles[i]
            skipped = skip_special_tokens and added[i].special
            if (skipped and text) or (not skipped and (not text or REPLACEMENT_CHAR in text)):
                return None
            table.append(text.encode())
        elif piece is None:
            table.append(b"")
        elif alphabet.keys() >= set(piece):
            table.append(piece.translate(to_bytes).encode("latin-1"))
        else:
            table.append(piece.encode())  # as the ByteLevel decoder does with a token outside its alphabet
    if [piece.decode(errors="replace") for piece in table] != singles:
        return None
    rng = random.Random(size)
    sequences = [[rng.randrange(size) for _ in range(rng.randint(2, 12))] for _ in range(_CHECK_SEQUENCES)]
    decoded = backend.decode_batch(sequences, skip_special_tokens=skip_special_tokens)
    if any(b"".join(table[t] for t in ids).decode(errors="replace") != text for ids, text in zip(sequences, decoded)):
        return None
    return ByteTable(table)


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text chunks that never end in a broken character.

    With no prompt ids, the concatenation of every add() chunk and flush() equals
    tokenizer.decode(generated_ids). With prompt ids, a few of them are decoded as
    context and the output is the continuation of the prompt's text, i.e.
    decode(prompt + generated) minus decode(prompt); this differs from
    decode(generated_ids) only where a SentencePiece decoder would strip the first
    generated token's leading space, which belongs in a continuation.

    One deviation, on output that is not valid UTF-8 only: the ByteFallback decoder
    (Llama-2 style) turns a whole run of byte tokens into U+FFFD, one per byte, when
    any byte in it is broken, including characters of the run that were complete.
    A stream has released those characters already; it keeps them and renders
    only the broken bytes as U+FFFD.
    """

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The bytes table (module docstring), if the tokenizer has one: decoding without calling it.
        self._table = byte_table(tokenizer, skip_special_tokens)
        self._texts: dict[int, str] = self._table.texts if isinstance(self._table, ByteTable) else {}
        self._window, self._prefix_text = self._initial_context(prompt_ids)
        # window[:read] is released and decodes to prefix_text; window[read:] is held.
        self._read = len(self._window)
        # Text of the held tokens already released: the complete characters before a split one.
        self._ahead = ""
        # Start of the last released step's tokens: where the window may be cut without losing context.
        self._cut = 0
        self._chunks: list[str] = []
        # Whether the fast path (module docstring) applies now, and the held tokens' bytes past
        # the complete characters already released.
        self._fast = False
        self._pending = b""
        self._check_fast()

    @property
    def text(self) -> str:
        """Everything released so far."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def num_held(self) -> int:
        """Tokens added whose text is not fully released yet (an incomplete character)."""
        return len(self._window) - self._read

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the text they complete (may be "")."""
        if not token_ids:
            return ""
        if self._fast and not self._pending and len(token_ids) == 1:
            # nothing held and a token of whole characters: _add_from_table's result, without decoding
            chunk = self._texts.get(token_ids[0])
            if chunk is not None:
                window = self._window
                window.append(int(token_ids[0]))
                self._advance(len(window), self._prefix_text + chunk, chunk)
                self._chunks.append(chunk)
                return chunk
        if self._fast and len(self._window) - self._read < RESYNC_AFTER_TOKENS:
            chunk = self._add_from_table(token_ids)
            if chunk is not None:
                if chunk:
                    self._chunks.append(chunk)
                return chunk
        chunk = self._add_decoding(token_ids)
        self._check_fast()
        return self._emit(chunk)

    def flush(self) -> str:
        """At the end of generation, release what is held; an incomplete character
        comes out as U+FFFD here, as tokenizer.decode() renders it."""
        if self._read == len(self._window):
            return ""
        chunk = self._commit(self._decode(self._window))
        self._check_fast()
        return self._emit(chunk)

    def _add_decoding(self, token_ids: Sequence[int]) -> str:
        """add() by decoding the window with the tokenizer: the general path."""
        held_before = len(self._window) - self._read
        self._window.extend(int(token) for token in token_ids)
        text = self._decode(self._window)
        if not text.endswith(REPLACEMENT_CHAR):
            return self._commit(text)
        chunk = self._release_complete_part(text)
        if held_before >= RESYNC_AFTER_TOKENS:
            resynced = self._resync()
            if resynced is not None:
                chunk += resynced
            elif held_before >= MAX_HELD_TOKENS:
                chunk += self._commit(text)
        return chunk

    def _add_from_table(self, token_ids: Sequence[int]) -> str | None:
        """add() without decoding the window, or None (nothing changed) when the fast path does
        not apply to these tokens. The window's text is prefix_text + ahead + the decoding of
        pending + the new bytes: prefix_text ends on a whole character, and ahead is the
        complete part of the held tokens, pending the rest of their bytes."""
        table = self._table
        assert table is not None
        if len(token_ids) == 1:
            token = int(token_ids[0])
            if not 0 <= token < len(table):
                return None
            ids = [token]
            data = self._pending + table[token]
        else:
            ids = [int(token) for token in token_ids]
            if not all(0 <= token < len(table) for token in ids):
                return None
            data = self._pending + b"".join([table[token] for token in ids])
        try:
            chunk, pending = data.decode(), b""
        except UnicodeDecodeError as error:
            if error.end == len(data) and error.reason == "unexpected end of data":
                # an incomplete character at the very end is held
                chunk, pending = data[: error.start].decode(), data[error.start :]
            else:
                # invalid bytes come out as U+FFFD, as the window's decoding renders them (prefix_text
                # ends on a whole character, so the window's text is prefix_text + ahead + this)
                chunk, pending = data.decode(errors="replace"), b""
        if chunk.endswith(REPLACEMENT_CHAR):
            return None  # the general path holds text ending in U+FFFD: let it decide
        self._window += ids
        self._pending = pending
        if pending:  # as _release_complete_part: the complete text is released, the tokens stay held
            self._ahead += chunk
            return chunk
        added, self._ahead = self._ahead + chunk, ""
        if added:  # as _commit with text = prefix_text + added (a window cut checks the fast path again)
            self._advance(len(self._window), self._prefix_text + added)
        elif self._prefix_text:
            del self._window[self._read :]
        else:
            self._read = len(self._window)
        return chunk

    def _check_fast(self) -> None:
        """The fast path applies from a state with nothing held and a released text that ends
        on a whole character (an incomplete one would end in U+FFFD)."""
        self._fast = (self._table is not None and self._read == len(self._window) and not self._ahead
                      and not self._prefix_text.endswith(REPLACEMENT_CHAR))
        self._pending = b""

    def _decode(self, ids: Sequence[int]) -> str:
        """decode(ids); from the bytes table when there is one (the same text, without the call)."""
        table = self._table
        if table is not None and ids and min(ids) >= 0:
            try:
                return b"".join([table[token] for token in ids]).decode(errors="replace")
            except IndexError:
                pass
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _initial_context(self, prompt_ids: Sequence[int]) -> tuple[list[int], str]:
        """The last few prompt tokens, starting and ending on whole characters and decoding
        to some text; none if the prompt ends mid-character (then generated text stands alone)."""
        tail = [int(token) for token in prompt_ids[-MAX_CONTEXT_TOKENS:]]
        n = len(tail)
        nearest = range(max(0, n - INITIAL_CONTEXT_TOKENS), n)
        further = range(n - INITIAL_CONTEXT_TOKENS - 1, -1, -1)
        for start in [*nearest, *further]:
            context = tail[start:]
            text = self._decode(context)
            if text and not text.startswith(REPLACEMENT_CHAR) and not text.endswith(REPLACEMENT_CHAR):
                return context, text
        # A prompt tail with no visible text (special tokens, a lone "▁") still shapes what follows.
        if tail and not self._decode(tail):
            return tail, ""
        return [], ""

    def _release_complete_part(self, text: str) -> str:
        """The window ends inside a character: release the complete text before it, keep holding the tokens."""
        released = self._prefix_text + self._ahead
        complete = text.rstrip(REPLACEMENT_CHAR)
        if len(complete) <= len(released) or not complete.startswith(released):
            return ""
        chunk = complete[len(released) :]
        self._ahead += chunk
        return chunk

    def _resync(self) -> str | None:
        """Move the read offset to the last held token boundary that ends on a whole character;
        return the text this releases, or None if there is no such boundary."""
        released = self._prefix_text + self._ahead
        for end in range(len(self._window) - 1, self._read, -1):
            candidate = self._decode(self._window[:end])
            if not candidate or candidate.endswith(REPLACEMENT_CHAR):
                continue
            if candidate.startswith(released):
                chunk, self._ahead = candidate[len(released) :], ""
            elif released.startswith(candidate):
                chunk, self._ahead = "", released[len(candidate) :]
            else:
                continue
            self._advance(end, candidate)
            return chunk
        return None

    def _commit(self, text: str) -> str:
        """Release everything the window adds to the released text and move the read offset to its end."""
        released = self._prefix_text + self._ahead
        if text.startswith(released):
            chunk = text[len(released) :]
        else:
            # A ByteFallback run turned to U+FFFD after part of it was released: render only the held tokens.
            held = self._decode(self._window[self._read :])
            chunk = held[len(self._ahead) :] if held.startswith(self._ahead) else held
        self._ahead = ""
        if len(text) > len(self._prefix_text):
            self._advance(len(self._window), text)
        elif self._prefix_text:
            # Tokens that add no text after visible context are skipped special tokens,
            # which decode() filters out anyway: dropping them keeps the window bounded.
            del self._window[self._read :]
        else:
            # Nothing visible yet: keep them, a SentencePiece "▁" here still matters to what follows.
            self._read = len(self._window)
        return chunk

    def _advance(self, read: int, prefix_text: str, step_text: str | None = None) -> None:
        """Mark window[:read] released; cut the window back once it holds more than WINDOW_TOKENS released
        tokens. step_text: the decoding of window[old read:read] (the tokens the cut keeps), when known."""
        self._cut, self._read, self._prefix_text = self._read, read, prefix_text
        if self._read > WINDOW_TOKENS and self._cut:
            del self._window[: self._cut]
            self._read -= self._cut
            self._cut = 0
            self._prefix_text = step_text if step_text is not None else self._decode(self._window[: self._read])
            # The cut window's prefix may start inside a character and so end in U+FFFD.
            self._check_fast()

    def _emit(self, chunk: str) -> str:
        if chunk:
            self._chunks.append(chunk)
        return chunk
