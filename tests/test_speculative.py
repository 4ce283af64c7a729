"""Speculative decoding with n-gram drafts: greedy output exactly as without
it, sampled output from the same distribution, cache state rolled back."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import Generator, Job, SamplerSettings
from engine.speculative import ngram_draft
from tests.conftest import FAMILIES

PAGE_SIZE = 8


def make(path: Path, **options: Any) -> Generator:
    return Generator.from_pretrained(path, cache_tokens=8192, page_size=PAGE_SIZE, **options)


def run(generator: Generator, jobs: list[Job]) -> dict[Any, dict]:
    for job in jobs:
        generator.enqueue(job)
    finals: dict[Any, dict] = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["eos"]:
                finals[result["identifier"]] = result
    return finals


def repetitive_prompts() -> list[list[int]]:
    rng = random.Random(3)
    prompts = []
    for i in range(6):
        pattern = [rng.randrange(5, 500) for _ in range(3 + i % 4)]
        prompts.append(pattern * (2 + i % 3) + pattern[:2])
    return prompts


def test_ngram_draft_follows_the_latest_longest_match():
    assert ngram_draft([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], max_ngram=3, num_draft=2) == [7, 1]
    assert ngram_draft([9, 9, 9, 9], max_ngram=4, num_draft=4) == [9, 9, 9, 9]
    assert ngram_draft([4, 1, 2, 1, 2], max_ngram=2, num_draft=5) == [1, 2, 1, 2, 1]
    assert ngram_draft([5, 6, 7, 8, 6], max_ngram=4, num_draft=3) == [7, 8, 6]
    assert ngram_draft([1, 2, 3], max_ngram=4, num_draft=3) == []
    assert ngram_draft([4, 4], max_ngram=2, num_draft=0) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_ngram_speculation_equals_plain_greedy(family: str, tiny_model_factory: Callable[..., Path]):
    path = tiny_model_factory(family)

    def jobs() -> list[Job]:
        return [Job(p, 40, stop_conditions=[], identifier=i) for i, p in enumerate(repetitive_prompts())]

    plain = run(make(path), jobs())
    speculative = make(path, use_ngram_draft=True, num_draft_tokens=4)
    drafted = run(speculative, jobs())
    assert {i: r["completion_ids"] for i, r in drafted.items()} == {i: r["completion_ids"] for i, r in plain.items()}
    assert speculative.stats.drafted_tokens > 0
    assert sum(r["accepted_draft_tokens"] for r in drafted.values()) == speculative.stats.accepted_draft_tokens
    assert speculative.pool.num_free == speculative.pool.num_pages


def test_speculation_honours_stop_conditions_and_max_new_tokens(llama_dir: Path):
    prompt = repetitive_prompts()[0]
    plain = run(make(llama_dir), [Job(prompt, 30, stop_conditions=[], identifier=0)])[0]
    text = plain["full_completion"]
    start = next(i for i in range(4, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    stop_token = plain["completion_ids"][12]
    for stops in ([text[start : start + 3]], [stop_token]):
        expected = run(make(llama_dir), [Job(prompt, 30, stop_conditions=stops, identifier=0)])[0]
        got = run(make(llama_dir, use_ngram_draft=True), [Job(prompt, 30, stop_conditions=stops, identifier=0)])[0]
        assert (got["full_completion"], got["eos_reason"], got["completion_ids"]) == (
            expected["full_completion"], expected["eos_reason"], expected["completion_ids"])
    capped = run(make(llama_dir, use_ngram_draft=True), [Job(prompt, 7, stop_conditions=[], identifier=0)])[0]
    assert capped["new_tokens"] == 7 and capped["completion_ids"] == plain["completion_ids"][:7]


def test_speculation_switches_off_for_large_batches(llama_dir: Path):
    generator = make(llama_dir, use_ngram_draft=True, max_speculative_batch=2)
    run(generator, [Job(p, 20, stop_conditions=[], identifier=i) for i, p in enumerate(repetitive_prompts())])
    assert generator.stats.drafted_tokens == 0


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.001 quantile of chi-square (Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def homogeneity_statistic(a: Counter, b: Counter, min_expected: float = 5.0) -> tuple[float, int]:
    """Two-sample chi-square over the categories, rare ones pooled together."""
    n_a, n_b = sum(a.values()), sum(b.values())
    common, rare = [], [0, 0]
    for token in set(a) | set(b):
        total = a[token] + b[token]
        if total * min(n_a, n_b) / (n_a + n_b) >= min_expected:
            common.append((a[token], b[token]))
        else:
            rare[0] += a[token]
            rare[1] += b[token]
    if sum(rare):
        common.append((rare[0], rare[1]))
    statistic = 0.0
    for count_a, count_b in common:
        total = count_a + count_b
        for observed, n in ((count_a, n_a), (count_b, n_b)):
            expected = total * n / (n_a + n_b)
            statistic += (observed - expected) ** 2 / expected
    return statistic, len(common) - 1


def test_sampled_tokens_keep_the_target_distribution_under_speculation(llama_dir: Path):
    # biasing the prompt's tokens makes samples revisit the prompt's pattern, so n-gram
    # drafts are proposed often and accepted only sometimes: both verify branches run
    prompt = repetitive_prompts()[1]
    settings = SamplerSettings(temperature=1.0, token_bias={token: 12.0 for token in set(prompt)})
    runs, length = 600, 8

    def positions(generator: Generator, seed_offset: int) -> list[Counter]:
        jobs = [Job(prompt, length, stop_conditions=[], gen_settings=settings, seed=seed_offset + i, identifier=i)
                for i in range(runs)]
        finals = run(generator, jobs)
        return [Counter(r["completion_ids"][k] for r in finals.values()) for k in range(length)]

    plain = positions(make(llama_dir), 0)
    speculative = make(llama_dir, use_ngram_draft=True, max_speculative_batch=runs)
    drafted = positions(speculative, 10**6)
    stats = speculative.stats
    assert 0 < stats.accepted_draft_tokens < stats.drafted_tokens
    for k in range(2, length):
        statistic, df = homogeneity_statistic(plain[k], drafted[k])
        assert df >= 2
        assert statistic < chi_square_critical(df), (k, statistic, df)


@pytest.mark.parametrize("draft_token", [0, 1, 3])
def test_verify_emits_tokens_from_the_target_distribution_whatever_the_draft(draft_token: int):
    """Rejection sampling against a one-hot draft: the first emitted token is
    distributed as p exactly (accepting the draft with p(d), else drawing from
    the residual), whichever token was drafted."""
    import torch

    from engine.sampling import SamplingRow
    from engine.speculative import verify

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    target = torch.softmax(logits[0], dim=-1).tolist()
    settings = SamplerSettings(temperature=1.0)
    draws = 6000
    counts = Counter()
    for seed in range(draws):
        generator = torch.Generator().manual_seed(seed)
        rows = [SamplingRow(settings, [], [], generator), SamplingRow(settings, [], [draft_token], generator)]
        counts[verify(logits, rows, [draft_token])[0]] += 1
    statistic = sum((counts[t] - draws * p) ** 2 / (draws * p) for t, p in enumerate(target))
    assert statistic < chi_square_critical(3)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_a_draft_model_equals_plain_greedy(
    family: str, tiny_model_factory: Callable[..., Path]
):
    path = tiny_model_factory(family)
    draft_path = tiny_model_factory(family, seed=7, num_hidden_layers=1)

    def jobs() -> list[Job]:
        return [Job(p, 24, stop_conditions=[], identifier=i) for i, p in enumerate(repetitive_prompts())]

    plain = run(make(path), jobs())
    for draft in (draft_path, path):
        speculative = make(path, draft_model_path=draft, num_draft_tokens=3)
        drafted = run(speculative, jobs())
        assert {i: r["completion_ids"] for i, r in drafted.items()} == {
            i: r["completion_ids"] for i, r in plain.items()
        }
        assert speculative.stats.drafted_tokens > 0
        assert speculative.pool.num_free == speculative.pool.num_pages
    # the main model as its own draft is the upper bound: every draft is accepted
    assert speculative.stats.accepted_draft_tokens == speculative.stats.drafted_tokens


def test_verify_with_a_draft_distribution_keeps_the_target_distribution():
    import torch

    from engine.sampling import SamplingRow
    from engine.speculative import verify

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    target = torch.softmax(logits[0], dim=-1).tolist()
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    settings = SamplerSettings(temperature=1.0)
    draws, counts = 6000, Counter()
    for seed in range(draws):
        generator = torch.Generator().manual_seed(seed)
        drafted = int(torch.multinomial(q[0], 1, generator=generator))
        rows = [SamplingRow(settings, [], [], generator), SamplingRow(settings, [], [drafted], generator)]
        counts[verify(logits, rows, [drafted], q)[0]] += 1
    statistic = sum((counts[t] - draws * p) ** 2 / (draws * p) for t, p in enumerate(target))
    assert statistic < chi_square_critical(3)
