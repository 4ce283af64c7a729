"""Stop strings over streamed text: held back while they might match, never released once they do."""

from __future__ import annotations

import random

import pytest

from engine.stops import StopStringMatcher


def feed_all(matcher: StopStringMatcher, chunks: list[str], can_stop: bool = True) -> list[tuple[str, str | None]]:
    return [matcher.feed(chunk, can_stop) for chunk in chunks]


def test_text_before_a_stop_is_released_at_once() -> None:
    matcher = StopStringMatcher(["\n\nB"])
    assert matcher.feed("Hello wor") == ("Hello wor", None)
    assert matcher.feed("ld\n\nBy the way") == ("ld", "\n\nB")
    assert matcher.finished


def test_stop_spanning_three_feeds_is_held_and_never_released() -> None:
    matcher = StopStringMatcher(["\n\nB"])
    assert feed_all(matcher, ["Hello world\n", "\n", "By"]) == [("Hello world", None), ("", None), ("", "\n\nB")]
    assert matcher.held == ""
    assert matcher.flush() == ""


def test_partial_match_is_held_then_released_when_it_resolves_otherwise() -> None:
    matcher = StopStringMatcher(["\n\nB"])
    assert matcher.feed("a\n") == ("a", None)
    assert matcher.held == "\n"
    assert matcher.feed("\n") == ("", None)
    assert matcher.held == "\n\n"
    assert matcher.feed("A") == ("\n\nA", None)
    assert matcher.held == ""
    assert not matcher.finished


def test_false_start_followed_by_a_real_match() -> None:
    matcher = StopStringMatcher(["\n\nB"])
    assert matcher.feed("x\n\n") == ("x", None)
    assert matcher.feed("\nB") == ("\n", "\n\nB")


def test_earliest_match_wins_over_a_longer_later_one() -> None:
    assert StopStringMatcher(["world", "lo"]).feed("hello world") == ("hel", "lo")
    assert StopStringMatcher(["lo", "world"]).feed("hello world") == ("hel", "lo")


def test_equal_starts_pick_the_longest() -> None:
    assert StopStringMatcher(["ab", "abc"]).feed("xabcd") == ("x", "abc")
    assert StopStringMatcher(["abc", "ab"]).feed("xabcd") == ("x", "abc")


def test_earliest_start_wins_across_feeds() -> None:
    """"ab" held as a possible "abcd"; when both complete in one feed, the earlier start wins."""
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.feed("xab") == ("x", None)
    assert matcher.held == "ab"
    assert matcher.feed("cd") == ("", "abcd")


def test_can_stop_false_releases_full_matches_but_holds_a_partial_tail() -> None:
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("a\n\nb\n", can_stop=False) == ("a\n\nb", None)
    assert matcher.held == "\n"
    assert matcher.feed("\nc", can_stop=True) == ("", "\n\n")


def test_can_stop_false_keeps_the_prefix_of_a_longer_stop_inside_a_match() -> None:
    matcher = StopStringMatcher(["aa"])
    assert matcher.feed("xaa", can_stop=False) == ("xa", None)
    assert matcher.held == "a"


def test_flush_releases_held_text() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("42 </ans") == ("42 ", None)
    assert matcher.held == "</ans"
    assert matcher.flush() == "</ans"
    assert matcher.held == ""
    assert matcher.flush() == ""


def test_after_a_match_further_text_is_discarded() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go STOP now") == ("go ", "STOP")
    assert matcher.feed("more") == ("", None)
    assert matcher.flush() == ""


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher(["ok", ""])


def test_a_bare_string_is_rejected() -> None:
    with pytest.raises(TypeError, match="sequence of strings"):
        StopStringMatcher("\n\n")


def test_no_stop_strings_releases_everything() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.held == ""


def test_long_stream_without_a_stop_keeps_held_text_bounded() -> None:
    """Text full of near misses: the held tail never exceeds the longest stop string, nothing is lost."""
    stops = ["<|end|>", "\n\nUser:"]
    longest = max(map(len, stops))
    matcher = StopStringMatcher(stops)
    rng = random.Random(3)
    alphabet = list("<|end\n Usr") + ["<|en", "\n\nUse", "\n\nUser"]  # no ">" or ":": no stop can complete
    sent, released = [], []
    for _ in range(20000):
        chunk = "".join(rng.choices(alphabet, k=rng.randint(1, 3)))
        sent.append(chunk)
        text, stop = matcher.feed(chunk)
        assert stop is None
        released.append(text)
        assert len(matcher.held) < longest
    released.append(matcher.flush())
    assert "".join(released) == "".join(sent)


@pytest.mark.parametrize("seed", range(5))
def test_released_text_is_everything_before_the_first_stop_for_any_chunking(seed: int) -> None:
    """Stops that share no characters complete in order of their starts, so the result is chunking-independent."""
    stops = ["\n\n", "##", "END"]
    rng = random.Random(seed)
    for _ in range(200):
        text = "".join(rng.choices(list("ab \n#EDN"), k=rng.randint(0, 40)))
        starts = {stop: text.find(stop) for stop in stops if stop in text}
        cut = min(starts.values(), default=len(text))
        matcher = StopStringMatcher(stops)
        released, found, i = [], None, 0
        while i < len(text) and found is None:
            size = rng.randint(1, 5)
            chunk, found = matcher.feed(text[i : i + size])
            released.append(chunk)
            i += size
        if found is None:
            released.append(matcher.flush())
        assert "".join(released) == text[:cut]
        assert found == (min(starts, key=starts.get) if starts else None)


@pytest.mark.parametrize("seed", range(3))
def test_each_feed_releases_all_but_the_longest_tail_that_could_begin_a_stop(seed: int) -> None:
    """Feed by feed, against a naive reference; most chunks hold none of the stops' first characters,
    and a chunk without one may still complete (or break) a held partial match."""
    stops = ["</answer>", "###", "\n\nQ:"]
    rng = random.Random(seed)
    for _ in range(300):
        matcher = StopStringMatcher(stops)
        sent, released = "", ""
        for _ in range(rng.randint(1, 15)):
            pieces = ["abc ", "x", "</", "answer>", "#", "##", "\n", "Q:", "an"]
            chunk = "".join(rng.choices(pieces, k=rng.randint(1, 3)))
            sent += chunk
            text, stop = matcher.feed(chunk)
            released += text
            starts = [sent.find(s) for s in stops if s in sent]
            if starts:
                assert stop is not None and released == sent[: min(starts)]
                break
            tail = max((k for k in range(1, len(sent) + 1) for s in stops if s.startswith(sent[-k:]) and k < len(s)),
                       default=0)
            assert (stop, released, matcher.held) == (None, sent[: len(sent) - tail], sent[len(sent) - tail :])
