"""n parallel samples of one prompt: child jobs with their own seeds that share one prefill."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import Generator, Job, SamplerSettings

SETTINGS = SamplerSettings(temperature=1.0, top_k=50)


def completions(generator: Generator, jobs: list[Job]) -> dict[object, list[int]]:
    generator.enqueue(jobs)
    out: dict[object, list[int]] = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.eos:
                out[result.identifier] = list(result.completion_ids)
    return out


def test_samples_share_the_prompt_s_pages_and_each_draws_with_its_own_seed(llama_dir: Path) -> None:
    prompt = list(range(3, 43))  # 40 tokens: 4 full pages of 8 that the samples share, then the last page
    generator = Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=8)
    job = Job(prompt, 12, stop_conditions=[], gen_settings=SETTINGS, seed=7, identifier="q")
    together = completions(generator, job.samples(4))
    assert set(together) == {("q", i) for i in range(4)}
    stats = generator.stats
    assert stats.computed_prompt_tokens == 40 + 3 * 8  # the shared pages are computed once
    assert stats.cached_prompt_tokens == 3 * 32
    alone = {}
    for i in range(4):  # each sample is exactly the job run alone with its seed
        alone.update(completions(Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=8),
                                 [Job(prompt, 12, stop_conditions=[], gen_settings=SETTINGS, seed=7 + i,
                                      identifier=("q", i))]))
    assert together == alone
    assert len({tuple(ids) for ids in together.values()}) == 4


def test_samples_needs_a_positive_count() -> None:
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        Job([1, 2], 4).samples(0)
