"""Prefix dedup in the paged cache: shared pages, revived pages, eviction,
and outputs identical to running without it."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from engine import Generator, Job
from tests.engine_runs import run

PAGE_SIZE = 8


def make(path: Path, prefix_caching: bool = True, **options: Any) -> Generator:
    options.setdefault("cache_tokens", 4096)
    return Generator.from_pretrained(path, page_size=PAGE_SIZE, prefix_caching=prefix_caching, **options)




def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


def shared_prefix_jobs() -> list[Job]:
    system = tokens(0, 45)
    return [Job(system + tokens(100 + i, 6), 10, stop_conditions=[], identifier=i) for i in range(8)]


def test_shared_prefix_outputs_match_dedup_off_and_report_cached_tokens(llama_dir: Path):
    on, off = make(llama_dir), make(llama_dir, prefix_caching=False)
    with_cache = run(on, shared_prefix_jobs())
    without = run(off, shared_prefix_jobs())
    assert {i: r["completion_ids"] for i, r in with_cache.items()} == {
        i: r["completion_ids"] for i, r in without.items()
    }
    # 45 shared tokens = 5 full pages of 8; every job but the first admitted reuses them
    assert sorted(r["cached_tokens"] for r in with_cache.values()) == [0] + [40] * 7
    assert all(r["cached_tokens"] == 0 for r in without.values())
    assert on.stats.computed_prompt_tokens == off.stats.computed_prompt_tokens - 7 * 40
    assert on.stats.prefix_hit_rate == pytest.approx(280 / (280 + on.stats.computed_prompt_tokens))


def test_identical_prompts_admitted_in_the_same_step_share_pages(llama_dir: Path):
    generator = make(llama_dir)
    prompt = tokens(1, 30)
    a, b = Job(prompt, 5, stop_conditions=[], identifier="a"), Job(prompt, 5, stop_conditions=[], identifier="b")
    generator.enqueue(a)
    generator.enqueue(b)
    generator.iterate()
    seq_a, seq_b = generator._sequences[a.serial], generator._sequences[b.serial]
    shared = (30 - 1) // PAGE_SIZE
    assert seq_a.pages[:shared] == seq_b.pages[:shared]
    assert all(generator.pool.ref_counts[p] == 2 for p in seq_a.pages[:shared])
    finals = run(generator, [])
    assert finals["b"]["cached_tokens"] == shared * PAGE_SIZE
    assert finals["a"]["completion_ids"] == finals["b"]["completion_ids"]


def test_a_follow_up_turn_reuses_pages_filled_while_decoding(llama_dir: Path):
    generator, reference = make(llama_dir), make(llama_dir, prefix_caching=False)
    first_prompt = tokens(2, 20)
    first = run(generator, [Job(first_prompt, 30, stop_conditions=[], identifier=1)])[1]
    follow_up = first_prompt + first["completion_ids"] + tokens(3, 7)
    second = run(generator, [Job(follow_up, 12, stop_conditions=[], identifier=2)])[2]
    # 20 + 30 tokens, the last generated one never fed back: 49 computed -> 6 full pages
    assert second["cached_tokens"] == 6 * PAGE_SIZE
    expected = run(reference, [Job(follow_up, 12, stop_conditions=[], identifier=2)])[2]
    assert second["completion_ids"] == expected["completion_ids"]


def test_last_prompt_token_is_always_computed(llama_dir: Path):
    generator = make(llama_dir)
    prompt = tokens(4, 3 * PAGE_SIZE)
    run(generator, [Job(prompt, 4, stop_conditions=[], identifier=1)])
    again = run(generator, [Job(prompt, 4, stop_conditions=[], identifier=2)])[2]
    assert again["cached_tokens"] == 2 * PAGE_SIZE


def test_small_cache_evicts_parked_pages_and_outputs_stay_identical(llama_dir: Path):
    def workload() -> list[Job]:
        jobs = []
        for i in range(24):
            prefix = tokens(i % 4, 33)
            jobs.append(Job(prefix + tokens(200 + i, 5), 8, stop_conditions=[], identifier=i))
        return jobs

    small = make(llama_dir, cache_tokens=14 * PAGE_SIZE)
    got = run(small, workload())
    expected = run(make(llama_dir, prefix_caching=False), workload())
    assert {i: r["completion_ids"] for i, r in got.items()} == {i: r["completion_ids"] for i, r in expected.items()}
    assert small.stats.cached_prompt_tokens > 0
    assert small.pool.num_free == small.pool.num_pages


def test_shared_pages_are_never_freed_while_referenced(llama_dir: Path):
    generator = make(llama_dir, cache_tokens=60 * PAGE_SIZE, max_chunk_size=64)
    rng = random.Random(5)
    prefixes = [tokens(10 + i, 8 * rng.randint(1, 4) + 3) for i in range(3)]
    live: list[Job] = []
    for op in range(250):
        action = rng.random()
        if action < 0.4:
            job = Job(rng.choice(prefixes) + tokens(op, rng.randint(0, 5)), rng.randint(1, 20), stop_conditions=[])
            generator.enqueue(job)
            live.append(job)
        elif action < 0.55 and live:
            generator.cancel(live.pop(rng.randrange(len(live))))
        else:
            for result in generator.iterate():
                if result["eos"] and result["eos_reason"] != "cancelled":
                    live.remove(result["job"])
        holders = Counter(p for s in generator._sequences.values() for p in s.pages)
        assert generator.pool.ref_counts == [holders[p] for p in range(generator.pool.num_pages)]
        assert all(not generator.pool.is_parked(p) for p in holders)
    run(generator, [])
    assert all(count == 0 for count in generator.pool.ref_counts)
    assert generator.stats.cached_prompt_tokens > 0
