"""Banned strings: never in the output, enforced by rewinding and banning the token that began one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine import Constraint, EngineOutput, FinishReason, Generator, Job, JobRejected, SamplerSettings
from engine.banned_strings import BannedStringGuard
from tests.engine_runs import run_streamed


def test_the_guard_holds_whole_pieces_that_may_begin_a_banned_string() -> None:
    guard = BannedStringGuard(["cde"])
    assert guard.feed("ab", origin=0, sealed=1) == ("ab", None)
    assert guard.feed("xc", origin=1, sealed=2) == ("", None)  # "c" may begin "cde": the whole piece waits
    assert guard.held == "xc"
    assert guard.feed("d", origin=2, sealed=3) == ("", None)
    assert guard.feed("f", origin=3, sealed=4) == ("xcdf", None)  # resolved otherwise: released in order


def test_the_guard_names_the_token_where_the_banned_string_began() -> None:
    guard = BannedStringGuard(["cde", "zz"])
    guard.feed("ab", 0, 1)
    guard.feed("xc", 1, 2)
    assert guard.feed("de", 2, 3) == ("", 1)
    guard.rewind(1)
    assert guard.held == ""


def test_the_guard_keeps_a_piece_whose_token_may_still_give_text() -> None:
    """A piece from a token the detokenizer still holds (a split character) stays held, so a rewind
    to that token never repeats text a client already has."""
    guard = BannedStringGuard(["zz"])
    assert guard.feed("a", origin=0, sealed=0) == ("", None)
    assert guard.feed("b", origin=0, sealed=2) == ("ab", None)


def test_a_match_inside_one_piece_rewinds_to_that_piece_s_token() -> None:
    guard = BannedStringGuard(["bad"])
    guard.feed("ok ", 0, 1)
    assert guard.feed(" a bad one", 1, 2) == ("", 1)


def test_flush_releases_a_held_beginning() -> None:
    guard = BannedStringGuard(["cde"])
    guard.feed("abc", 0, 1)
    assert guard.flush() == "abc"


def greedy_text(generator: Generator, prompt: list[int], tokens: int, **job: object
                ) -> tuple[str, list[str], EngineOutput]:
    final, chunks = run_streamed(generator, Job(prompt, tokens, stop_conditions=[], **job))  # type: ignore[arg-type]
    return final.full_completion or "", chunks, final


def banned_span(text: str) -> str:
    """A stretch of the unbanned output, several characters long, to ban."""
    visible = text.strip()
    assert len(visible) >= 12, f"the tiny model's greedy output is too short to test with: {text!r}"
    start = text.index(visible) + len(visible) // 3
    return text[start : start + 6]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_banned_string_never_appears_and_the_text_before_it_is_kept(
    llama_dir: Path, overlap: bool, prefix_caching: bool
) -> None:
    generator = Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=8, overlap=overlap,
                                          prefix_caching=prefix_caching)
    prompt = list(range(5, 30))
    free, _, _ = greedy_text(generator, prompt, 40)
    banned = banned_span(free)
    text, chunks, final = greedy_text(generator, prompt, 40, banned_strings=[banned])
    assert banned not in text
    assert "".join(chunks) == text  # nothing streamed is ever taken back
    # greedy decoding is unchanged up to the token where the banned string began
    _, _, unbanned = greedy_text(generator, prompt, 40)
    longest_token = max(len(generator.tokenizer.decode([t])) for t in unbanned.completion_ids)
    kept = len(os.path.commonprefix([text, free]))
    assert free.index(banned) - longest_token <= kept < free.index(banned) + len(banned) - 1
    assert final.new_tokens == 40 and len(final.completion_ids) == 40
    # the rewind left the prefix cache sound: the same job without the ban gives the same text again
    again, _, _ = greedy_text(generator, prompt, 40)
    assert again == free


@pytest.mark.parametrize("overlap", [True, False])
def test_a_job_that_rewinds_too_often_fails_alone_naming_its_banned_strings(
    llama_dir: Path, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The output processor returns a Failed decision instead of a further rewind, and the step
    ends the job with that error."""
    generator = Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=8, overlap=overlap)
    prompt = list(range(5, 30))
    free, _, _ = greedy_text(generator, prompt, 40)
    banned = banned_span(free)
    monkeypatch.setattr("engine.output_processor.MAX_REWINDS", 0)
    _, chunks, final = greedy_text(generator, prompt, 40, banned_strings=[banned])
    assert final.eos_reason == FinishReason.ERROR
    assert final.error == f"banned_strings: still producing one of {[banned]!r} after 0 rewinds"
    assert banned not in "".join(chunks)


def test_speculative_decoding_gives_the_same_text_under_a_ban(llama_dir: Path) -> None:
    """Drafts are verified with the rewind's bans in place, so n-gram speculation changes nothing."""
    prompt = [7, 8, 9, 10] * 6
    plain = Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=8)
    speculative = Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=8, use_ngram_draft=True,
                                            num_draft_tokens=4)
    free, _, _ = greedy_text(plain, prompt, 48)
    banned = banned_span(free)
    expected, _, _ = greedy_text(plain, prompt, 48, banned_strings=[banned])
    text, chunks, _ = greedy_text(speculative, prompt, 48, banned_strings=[banned])
    assert banned not in text and "".join(chunks) == text
    assert text == expected
    assert speculative.stats.drafted_tokens > 0


def test_sampled_jobs_avoid_the_banned_string_and_stay_seeded(llama_dir: Path) -> None:
    generator = Generator.from_pretrained(llama_dir, cache_tokens=4096, page_size=8)
    settings = SamplerSettings(temperature=0.8, top_k=40)
    prompt = list(range(40, 60))
    free = [greedy_text(generator, prompt, 32, gen_settings=settings, seed=seed)[0] for seed in range(4)]
    banned = [banned_span(text)[:3] for text in free]
    for seed in range(4):
        text, chunks, final = greedy_text(generator, prompt, 32, gen_settings=settings, seed=seed,
                                          banned_strings=banned, logprobs=True)
        assert not any(b in text for b in banned)
        assert "".join(chunks) == text
        assert len(final.completion_ids) == len(final.completion_logprobs) == 32
        assert [p.token_id for p in final.completion_logprobs] == final.completion_ids
        again, _, _ = greedy_text(generator, prompt, 32, gen_settings=settings, seed=seed, banned_strings=banned)
        assert again == text


def test_banned_strings_with_a_constraint_are_refused(llama_dir: Path) -> None:
    generator = Generator.from_pretrained(llama_dir, cache_tokens=1024, page_size=8)
    with pytest.raises(JobRejected, match="banned_strings"):
        generator.enqueue(Job([1, 2, 3], 4, banned_strings=["x"], constraint=Constraint.regex("[a-z]+")))


def test_a_bare_banned_string_is_one_string_and_an_empty_one_is_refused() -> None:
    assert Job([1], 1, banned_strings="abc").banned_strings == ("abc",)
    with pytest.raises(ValueError, match=r"banned_strings\[1\]"):
        Job([1], 1, banned_strings=["a", ""])
