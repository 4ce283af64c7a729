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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

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
        self._window, self._prefix_text = self._initial_context(prompt_ids)
        # window[:read] is released and decodes to prefix_text; window[read:] is held.
        self._read = len(self._window)
        # Text of the held tokens already released: the complete characters before a split one.
        self._ahead = ""
        # Start of the last released step's tokens: where the window may be cut without losing context.
        self._cut = 0
        self._chunks: list[str] = []

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
        held_before = len(self._window) - self._read
        self._window.extend(int(token) for token in token_ids)
        text = self._decode(self._window)
        if not text.endswith(REPLACEMENT_CHAR):
            return self._emit(self._commit(text))
        chunk = self._release_complete_part(text)
        if held_before >= RESYNC_AFTER_TOKENS:
            resynced = self._resync()
            if resynced is not None:
                chunk += resynced
            elif held_before >= MAX_HELD_TOKENS:
                chunk += self._commit(text)
        return self._emit(chunk)

    def flush(self) -> str:
        """At the end of generation, release what is held; an incomplete character
        comes out as U+FFFD here, as tokenizer.decode() renders it."""
        if self._read == len(self._window):
            return ""
        return self._emit(self._commit(self._decode(self._window)))

    def _decode(self, ids: Sequence[int]) -> str:
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

    def _advance(self, read: int, prefix_text: str) -> None:
        """Mark window[:read] released; cut the window back once it holds more than WINDOW_TOKENS released tokens."""
        self._cut, self._read, self._prefix_text = self._read, read, prefix_text
        if self._read > WINDOW_TOKENS and self._cut:
            del self._window[: self._cut]
            self._read -= self._cut
            self._cut = 0
            self._prefix_text = self._decode(self._window[: self._read])

    def _emit(self, chunk: str) -> str:
        if chunk:
            self._chunks.append(chunk)
        return chunk
