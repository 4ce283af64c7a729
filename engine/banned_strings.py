"""Banned strings: text the model may not produce, enforced by rewinding (exllamav2's way).

A token-level ban cannot express "never write 'As an AI'": the string spans
several tokens, and each of them is harmless on its own. So the generator
holds back the text of every token that could be the start of a banned
string. If the held text turns out to contain one, the generator rewinds the
job to the token where that text began and bans that token at that position;
the job then samples again from there. Held text that can no longer become a
banned string is released. The output therefore never contains a banned
string, and the text a client has received is never taken back.

Holding is by whole token (a piece of text is the text one detokenizer call
released, and its origin is the first token that contributed to it), so a
rewind never discards text that was already released. A piece stays held
while a later piece could still come from the same token (the detokenizer is
holding an incomplete character), so a rewind to that token cannot repeat
released text either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: A job that rewinds this often without getting past its banned strings fails, naming them.
MAX_REWINDS = 256


@dataclass(frozen=True, slots=True)
class _Piece:
    origin: int  # index (among generated tokens) of the first token this text came from
    text: str


class BannedStringGuard:
    """Holds streamed text that could still become a banned string; finds the ones that do."""

    def __init__(self, banned: Sequence[str]) -> None:
        if isinstance(banned, str):
            raise TypeError("banned strings must be a sequence of strings, not one string")
        if not banned or any(not isinstance(s, str) or not s for s in banned):
            raise ValueError("banned strings must be non-empty strings")
        self._banned = tuple(sorted(set(banned), key=len, reverse=True))
        self._held: list[_Piece] = []

    @property
    def held(self) -> str:
        return "".join(piece.text for piece in self._held)

    def feed(self, text: str, origin: int, sealed: int) -> tuple[str, int | None]:
        """Add the text released by the tokens from `origin` on; sealed is the index of the first
        token the detokenizer still holds (no more text will come from tokens before it).
        Returns (text safe to pass on, None), or ("", t) when a banned string appeared: the job
        must rewind to generated token t and ban it there (what is held from t on is dropped)."""
        if text:
            self._held.append(_Piece(origin, text))
        buffer = self.held
        start = self._earliest_match(buffer)
        if start is not None:
            return "", self._origin_at(start)
        keep_from = len(buffer) - self._partial_match_length(buffer)
        released: list[str] = []
        offset = 0
        while self._held:
            piece = self._held[0]
            end = offset + len(piece.text)
            if end > keep_from or piece.origin >= sealed:
                break
            released.append(piece.text)
            offset = end
            self._held.pop(0)
        return "".join(released), None

    def rewind(self, origin: int) -> None:
        """The job went back to generated token `origin`: forget what came from it and after."""
        self._held = [piece for piece in self._held if piece.origin < origin]

    def flush(self) -> str:
        """Generation ended: what is held is only the beginning of a banned string, so it is released."""
        text = self.held
        self._held = []
        return text

    def _earliest_match(self, buffer: str) -> int | None:
        found = [start for start in (buffer.find(s) for s in self._banned) if start != -1]
        return min(found) if found else None

    def _origin_at(self, position: int) -> int:
        """The origin of the held piece containing character `position` of the held text."""
        offset = 0
        for piece in self._held:
            offset += len(piece.text)
            if position < offset:
                return piece.origin
        raise ValueError(f"position {position} is past the held text")

    def _partial_match_length(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of some banned string."""
        longest = 0
        for banned in self._banned:
            for length in range(min(len(banned) - 1, len(buffer)), longest, -1):
                if buffer.endswith(banned[:length]):
                    longest = length
                    break
        return longest
