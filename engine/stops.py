"""Stop strings over streamed text, where a stop string may span several chunks.

Text that could still turn out to be the start of a stop string is held back
until it resolves, so a stop string never reaches the client even in part.
Only the held tail (shorter than the longest stop string) plus the new text is
searched on each feed, so the cost per chunk does not grow with the output; and
with nothing held, a chunk holding none of the stop strings' first characters
can neither contain nor begin one, so it passes after a single scan.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


class StopStringMatcher:
    """Finds the first stop string in a stream of text chunks.

    When several stop strings match, the one starting earliest wins and, on a
    tie, the longest: what is released is then the longest text that contains
    no stop string. After a match the matcher is finished and discards input.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        if isinstance(stop_strings, str):
            raise TypeError("stop_strings must be a sequence of strings, not one string")
        for index, stop in enumerate(stop_strings):
            if not isinstance(stop, str):
                raise TypeError(f"stop string at index {index} is {type(stop).__name__}, not str")
            if not stop:
                raise ValueError(f"stop string at index {index} is empty; an empty stop string would match everywhere")
        # Longest first, so that of two matches starting at the same place the longest is found first.
        self._stops = sorted(set(stop_strings), key=len, reverse=True)
        firsts = sorted({stop[0] for stop in self._stops})
        self._first_chars = re.compile("[" + "".join(re.escape(char) for char in firsts) + "]") if firsts else None
        self._held = ""
        self._finished = False

    @property
    def held(self) -> str:
        """Text received but not yet released: a possible beginning of a stop string."""
        return self._held

    @property
    def finished(self) -> bool:
        """True once a stop string has matched."""
        return self._finished

    def feed(self, text: str, can_stop: bool = True) -> tuple[str, str | None]:
        """Add a chunk; return (text safe to release now, the stop string that matched or None).

        On a match, the released text ends right before the stop string. With
        can_stop False (min_new_tokens not reached) full matches pass as ordinary
        text, but a trailing partial match is still held, since by the time it
        completes stopping may be allowed.
        """
        if self._finished:
            return "", None
        if not self._held and (self._first_chars is None or self._first_chars.search(text) is None):
            return text, None
        buffer = self._held + text
        if can_stop:
            start, stop = self._earliest_match(buffer)
            if stop is not None:
                self._held = ""
                self._finished = True
                return buffer[:start], stop
        keep = self._partial_match_length(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], None

    def flush(self) -> str:
        """Generation ended for another reason: the held text was never a stop string."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, buffer: str) -> tuple[int, str | None]:
        best_start, best_stop = len(buffer), None
        for stop in self._stops:
            # A match must start strictly before the best one so far; equal starts keep the longer one.
            start = buffer.find(stop, 0, best_start - 1 + len(stop))
            if start != -1:
                best_start, best_stop = start, stop
        return best_start, best_stop

    def _partial_match_length(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            first = stop[0]
            # Only suffixes shorter than the stop string and longer than the best so far matter.
            position = buffer.find(first, max(0, len(buffer) - len(stop) + 1), len(buffer) - longest)
            while position != -1:
                if stop.startswith(buffer[position:]):
                    longest = len(buffer) - position
                    break
                position = buffer.find(first, position + 1, len(buffer) - longest)
        return longest
