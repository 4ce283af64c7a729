"""Speculative decoding with n-gram drafts and draft models: verification replays the plain
path, so a job's tokens (greedy, or sampled for a seed) are exactly those it emits without
speculation, whatever the draft and whatever shares its batch; cache state rolled back."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import Constraint, Generator, Job, SamplerSettings
from engine.batch_sampler import BatchSampler
from engine.spec_decode import accept, ngram_draft, verify_rows
from tests.conftest import FAMILIES
from tests.engine_runs import run
from tests.sampler_rows import CPU, row, sample_rows

PAGE_SIZE = 8


def make(path: Path, **options: Any) -> Generator:
    return Generator.from_pretrained(path, **{"cache_tokens": 8192, "page_size": PAGE_SIZE, **options})




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


GENERATED = [1, 2, 3]  # the verified job's tokens so far: its verify rows draw tokens 3 and 4


def verified_first_tokens(logits: torch.Tensor, settings: SamplerSettings, drafts: list[list[int]]) -> Counter:
    """The first token each verified step emits, one job (seed i) per draft: the job's verify rows
    (spec_decode.verify_rows, position j after drafts[i][:j]) sampled in one batch, then accept()."""
    jobs = sample_rows([row(settings, seed=seed, prompt=[7], output=GENERATED) for seed in range(len(drafts))])
    rows = [r for job, draft in zip(jobs, drafts, strict=True) for r in verify_rows(job.sequence, job.state, draft)]
    assert [(r.draw, r.pending) for r in rows[:2]] == [(3, ()), (4, tuple(drafts[0][:1]))]
    batch = torch.cat([logits[: len(draft) + 1] for draft in drafts])
    sampler = BatchSampler(len(drafts), logits.shape[1], CPU)
    sampler.distribution(logits[:1].expand(len(jobs), -1), jobs)  # the jobs hold slots: they drew tokens before
    sampled = sampler.sample(batch, rows).tolist()
    counts, start = Counter(), 0
    for draft in drafts:
        counts[accept(draft, sampled[start : start + len(draft) + 1])[0]] += 1
        start += len(draft) + 1
    return counts


@pytest.mark.parametrize("draft_token", [0, 1, 3])
def test_verify_emits_tokens_from_the_target_distribution_whatever_the_draft(draft_token: int):
    """Against a one-hot draft: the first emitted token is distributed as p exactly (kept
    when the position's own draw equals it, else that draw), whichever token was drafted."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    target = torch.softmax(logits[0], dim=-1).tolist()
    settings = SamplerSettings(temperature=1.0)
    draws = 6000
    counts = verified_first_tokens(logits, settings, [[draft_token]] * draws)
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
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    target = torch.softmax(logits[0], dim=-1).tolist()
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    settings = SamplerSettings(temperature=1.0)
    draws = 6000
    # the drafts come from q (a draft model's distribution), drawn with a stream of the test's own
    drafted = torch.multinomial(q, draws, replacement=True, generator=torch.Generator().manual_seed(0)).tolist()
    counts = verified_first_tokens(logits, settings, [[d] for d in drafted])
    statistic = sum((counts[t] - draws * p) ** 2 / (draws * p) for t, p in enumerate(target))
    assert statistic < chi_square_critical(3)


INVARIANCE_SETTINGS = [
    SamplerSettings(temperature=0.8, top_p=0.9),
    SamplerSettings(top_k=20, repetition_penalty=1.2),
    SamplerSettings(min_p=0.05, presence_penalty=0.5),
    SamplerSettings(temperature=0.0, frequency_penalty=0.5),
]


def test_a_seeded_jobs_text_does_not_depend_on_its_batch_preemption_or_speculation(llama_dir: Path):
    """A seeded job's sampled tokens are identical whether it ran alone, beside 1 or 63 other
    jobs, after preemption, and with or without speculation (n-gram drafts and a draft model)."""
    prompts = repetitive_prompts()
    probes = [(i, settings, seed) for i, (settings, seed) in
              enumerate((s, seed) for s in INVARIANCE_SETTINGS for seed in (7, 2**40 + 3))]
    length = 24

    def probe_job(i: int, settings: SamplerSettings, seed: int) -> Job:
        return Job(prompts[i % len(prompts)], length, stop_conditions=[], gen_settings=settings, seed=seed,
                   identifier=("probe", i))

    def fillers(n: int) -> list[Job]:
        return [Job(prompts[(j + 3) % len(prompts)][: 6 + j % 9], length, stop_conditions=[],
                    gen_settings=INVARIANCE_SETTINGS[j % 4], seed=100 + j, identifier=("filler", j))
                for j in range(n)]

    def completions(finals: dict[Any, dict]) -> dict[int, list[int]]:
        return {key[1]: r["completion_ids"] for key, r in finals.items() if key[0] == "probe"}

    plain = make(llama_dir)
    alone: dict[int, list[int]] = {}
    for probe in probes:
        alone |= completions(run(plain, [probe_job(*probe)]))
    assert len(alone) == len(probes) and all(len(ids) == length for ids in alone.values())
    assert len({tuple(ids) for ids in alone.values()}) > len(probes) // 2  # the settings and seeds do differ

    beside_one: dict[int, list[int]] = {}
    for a, b in zip(probes[::2], probes[1::2], strict=True):
        beside_one |= completions(run(plain, [probe_job(*a), probe_job(*b)]))
    assert beside_one == alone

    def crowd() -> list[Job]:  # each probe beside 63 other jobs
        jobs = fillers(64 - len(probes))
        for k, probe in enumerate(probes):
            jobs.insert(7 * k, probe_job(*probe))
        return jobs

    assert completions(run(make(llama_dir), crowd())) == alone

    cramped = make(llama_dir, cache_tokens=40 * PAGE_SIZE)
    assert completions(run(cramped, crowd())) == alone
    assert cramped.stats.preemptions > 0

    speculative = {"ngram": {"use_ngram_draft": True}, "draft model": {"draft_model_path": llama_dir},
                   "ngram, preempted": {"use_ngram_draft": True, "cache_tokens": 40 * PAGE_SIZE}}
    for name, options in speculative.items():
        generator = make(llama_dir, max_speculative_batch=64, num_draft_tokens=3, **options)
        assert completions(run(generator, crowd())) == alone, name
        assert 0 < generator.stats.accepted_draft_tokens, name
        assert (generator.stats.preemptions > 0) == ("preempted" in name), name


@pytest.mark.parametrize("settings", [SamplerSettings(temperature=0.0, frequency_penalty=0.5),
                                      SamplerSettings(temperature=0.0, presence_penalty=0.5),
                                      SamplerSettings(temperature=0.0, repetition_penalty=1.2)])
def test_a_draft_models_earlier_draws_on_the_device_count_for_the_penalties_as_pending_tokens_do(
        settings: SamplerSettings):
    """A draft model's draws stay on the device until its whole draft is read back
    (spec_decode.Drafter._with_model): passed as `drafted` ([B, k], -1 for none), they penalise
    the next position as the same tokens given as a row's pending tokens do."""
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]]).expand(3, -1)  # one penalty on token 0 makes token 1 the best
    pending = [[0], [2, 0], []]

    def sampled(with_pending: bool, drafted: torch.Tensor | None) -> list[int]:
        specs = [row(settings, pending=p if with_pending else ()) for p in pending]
        return BatchSampler(3, 4, CPU).sample(logits, sample_rows(specs), drafted).tolist()

    assert sampled(True, None) == [1, 1, 0] and sampled(False, None) == [0, 0, 0]
    assert sampled(False, torch.tensor([[0, -1], [2, 0], [-1, -1]])) == [1, 1, 0]


def test_constrained_greedy_with_a_draft_model_equals_plain_constrained_greedy(tiny_model_factory: Callable[..., Path]):
    """Past its first position a draft model drafts without the grammar's mask (its draws are read
    back only at the end of the draft); the host cuts the draft where the grammar refuses it, and
    verification under the mask keeps the job's tokens those of plain decoding. (An array the jobs
    cannot complete within their tokens: a step whose verified tokens run past the grammar's end is
    another matter, docs/gpu.md.)"""
    path = tiny_model_factory("llama")
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 50}

    def jobs() -> list[Job]:
        return [Job(p, 40, constraint=Constraint.json_schema(schema), identifier=i)
                for i, p in enumerate(repetitive_prompts())]

    plain = run(make(path), jobs())
    speculative = make(path, draft_model_path=path, num_draft_tokens=3)
    drafted = run(speculative, jobs())
    assert {i: r["completion_ids"] for i, r in drafted.items()} == {i: r["completion_ids"] for i, r in plain.items()}
    assert speculative.stats.accepted_draft_tokens > 0


def test_a_verified_step_that_runs_past_the_grammar_s_end_ends_the_job_where_plain_decoding_does(
        tiny_model_factory: Callable[..., Path]):
    """A draft that ends where the grammar completes is followed by the bonus token (EOS, the only
    token the complete grammar allows): the job keeps the tokens up to the completion and ends
    "constraint_complete", as in plain decoding, not with that EOS appended."""
    path = tiny_model_factory("llama")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}

    def jobs() -> list[Job]:
        return [Job(p, 40, constraint=Constraint.json_schema(schema), identifier=i)
                for i, p in enumerate(repetitive_prompts())]

    plain = run(make(path), jobs())
    assert sum(r["eos_reason"] == "constraint_complete" for r in plain.values()) >= 4
    speculative = make(path, draft_model_path=path, num_draft_tokens=3)
    drafted = run(speculative, jobs())
    assert {i: (r["completion_ids"], r["eos_reason"]) for i, r in drafted.items()} == {
        i: (r["completion_ids"], r["eos_reason"]) for i, r in plain.items()}
