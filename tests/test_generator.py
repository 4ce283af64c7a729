"""Generator behaviour: result stages, cancellation, page accounting,
preemption, admission limits, stops, min/max tokens and seeds."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine import Generator, Job, JobRejected, QueueFull, SamplerSettings

PAGE_SIZE = 8


def make_generator(path: Path, **options: Any) -> Generator:
    options.setdefault("cache_tokens", 2048)
    options.setdefault("page_size", PAGE_SIZE)
    return Generator.from_pretrained(path, **options)


def run_all(generator: Generator) -> dict[Any, list[dict]]:
    """Drain the generator; results grouped by job identifier, in order."""
    by_job: dict[Any, list[dict]] = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            by_job.setdefault(result["identifier"], []).append(result)
    return by_job


def final(results: list[dict]) -> dict:
    assert results[-1]["eos"]
    return results[-1]


def prompt(generator: Generator, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, generator.model.config.vocab_size) for _ in range(length)]


def test_results_go_started_then_streaming_then_one_eos_with_every_field(llama_dir: Path):
    generator = make_generator(llama_dir)
    generator.enqueue(Job(prompt(generator, 20, 0), 12, stop_conditions=[], identifier="a"))
    results = run_all(generator)["a"]
    assert [r["stage"] for r in results] == ["started"] + ["streaming"] * 11 + ["eos"]
    last = final(results)
    assert last["eos_reason"] == "max_new_tokens"
    assert last["new_tokens"] == 12 and last["prompt_tokens"] == 20 and last["cached_tokens"] == 0
    assert "".join(r["text"] for r in results) == last["full_completion"]
    assert [t for r in results for t in r["token_ids"]] == last["completion_ids"]
    assert all(last[k] >= 0 for k in ("time_enqueued", "time_prefill", "time_generate"))
    assert last["serial"] == 0 and last["job"].identifier == "a"


def test_chunked_prefill_spreads_a_prompt_over_steps_and_keeps_output(llama_dir: Path):
    ids = prompt(make_generator(llama_dir), 60, 1)
    outputs = []
    for chunk in (16, 2048):
        generator = make_generator(llama_dir, max_chunk_size=chunk, max_batch_size=4)
        generator.enqueue(Job(ids, 8, stop_conditions=[], identifier=0))
        steps_before_first_token = 0
        while not generator.stats.generated_tokens:
            generator.iterate()
            steps_before_first_token += 1
        assert steps_before_first_token == -(-60 // chunk)
        outputs.append(final(run_all(generator)[0])["completion_ids"])
    assert outputs[0] == outputs[1]


def test_cancel_frees_all_pages_at_once_and_reports_cancelled(llama_dir: Path):
    generator = make_generator(llama_dir)
    start_free = generator.pool.num_free
    jobs = [Job(prompt(generator, 30, i), 40, stop_conditions=[], identifier=i) for i in range(3)]
    for job in jobs:
        generator.enqueue(job)
    for _ in range(5):
        generator.iterate()
    victim = generator._sequences[jobs[1].serial]
    held = len(victim.pages)
    assert held > 0
    free_before = generator.pool.num_free
    assert generator.cancel(jobs[1])
    assert generator.pool.num_free == free_before + held
    results = run_all(generator)
    assert final(results[1])["eos_reason"] == "cancelled"
    assert final(results[0])["new_tokens"] == 40 and final(results[2])["new_tokens"] == 40
    assert generator.pool.num_free == start_free
    assert not generator.cancel(jobs[1])


def test_no_page_leaks_after_200_random_enqueue_cancel_finish_operations(llama_dir: Path):
    generator = make_generator(llama_dir, cache_tokens=40 * PAGE_SIZE, max_chunk_size=64)
    start_free = generator.pool.num_free
    rng = random.Random(7)
    live: list[Job] = []
    finished = cancelled = 0
    for op in range(200):
        action = rng.random()
        if action < 0.4:
            job = Job(prompt(generator, rng.randint(1, 40), op), rng.randint(1, 30), stop_conditions=[])
            generator.enqueue(job)
            live.append(job)
        elif action < 0.6 and live:
            cancelled += generator.cancel(live.pop(rng.randrange(len(live))))
        else:
            for result in generator.iterate():
                if result["eos"] and result["eos_reason"] != "cancelled":
                    live.remove(result["job"])
                    finished += 1
    run_all(generator)
    assert finished > 20 and cancelled > 10
    assert generator.pool.num_free == start_free
    assert all(count == 0 for count in generator.pool.ref_counts)


def test_cache_too_small_for_all_jobs_preempts_and_still_matches_large_cache(llama_dir: Path):
    requests = [(prompt(make_generator(llama_dir), 10 + 3 * i, i), 24) for i in range(10)]

    def outputs(cache_tokens: int) -> tuple[dict[int, list[int]], int]:
        generator = make_generator(llama_dir, cache_tokens=cache_tokens)
        for i, (ids, max_new) in enumerate(requests):
            generator.enqueue(Job(ids, max_new, stop_conditions=[], identifier=i))
        results = run_all(generator)
        assert generator.pool.num_free == generator.pool.num_pages
        return {i: final(r)["completion_ids"] for i, r in results.items()}, generator.stats.preemptions

    small, preemptions = outputs(12 * PAGE_SIZE)
    large, no_preemptions = outputs(4096)
    assert preemptions > 0 and no_preemptions == 0
    assert small == large


def test_waiting_job_is_overtaken_at_most_max_skips_times(llama_dir: Path):
    generator = make_generator(llama_dir, cache_tokens=20 * PAGE_SIZE, max_skips=3)
    hog = Job(prompt(generator, 100, 0), 30, stop_conditions=[], identifier="hog")
    generator.enqueue(hog)
    generator.iterate()
    big = Job(prompt(generator, 90, 1), 10, stop_conditions=[], identifier="big")
    generator.enqueue(big)
    admitted_before_big = 0
    started: list[Any] = []
    for i in range(200):
        if "big" in started:
            break
        generator.enqueue(Job(prompt(generator, 4, 100 + i), 2, stop_conditions=[], identifier=i))
        started += [r["identifier"] for r in generator.iterate() if r["stage"] == "started"]
    admitted_before_big = started.index("big")
    assert "big" in started
    assert 1 <= admitted_before_big <= 3


def test_jobs_that_can_never_run_are_rejected_at_enqueue(llama_dir: Path):
    generator = make_generator(llama_dir, cache_tokens=8 * PAGE_SIZE)
    with pytest.raises(JobRejected,
                       match=r"= 70 exceeds the model's max_seq_len=64 \(the whole KV cache: 8 pages x 8 tokens\)"):
        generator.enqueue(Job([5] * 60, 10))
    with pytest.raises(JobRejected, match="max_seq_len"):
        make_generator(llama_dir, max_seq_len=32).enqueue(Job([5] * 30, 10))
    with pytest.raises(JobRejected, match="outside the vocabulary"):
        generator.enqueue(Job([5, 10**6], 4))
    with pytest.raises(JobRejected, match="banned_token_ids"):
        generator.enqueue(Job([5], 4, gen_settings=SamplerSettings(top_k=2, banned_token_ids=(10**6,))))


def test_enqueue_beyond_max_pending_raises_queue_full(llama_dir: Path):
    generator = make_generator(llama_dir, max_pending=2)
    generator.enqueue(Job([5, 6], 4))
    generator.enqueue(Job([5, 6], 4))
    with pytest.raises(QueueFull, match="max_pending=2"):
        generator.enqueue(Job([5, 6], 4))
    generator.iterate()
    generator.enqueue(Job([5, 6], 4))


def test_stop_string_spanning_tokens_is_held_back_and_never_emitted(llama_dir: Path):
    generator = make_generator(llama_dir)
    ids = prompt(generator, 12, 3)
    generator.enqueue(Job(ids, 40, stop_conditions=[], identifier="free"))
    chunks = [r["text"] for r in run_all(generator)["free"] if r["stage"] != "started"]
    # a stop string that starts inside one chunk and ends two chunks later
    i = next(i for i in range(5, len(chunks) - 3) if len(chunks[i]) >= 2 and chunks[i + 1] and chunks[i + 2]
             and "\ufffd" not in "".join(chunks[i : i + 3]))
    stop = chunks[i][1:] + chunks[i + 1] + chunks[i + 2][:1]
    full = "".join(chunks)
    generator.enqueue(Job(ids, 40, stop_conditions=[stop], identifier="stopped"))
    results = run_all(generator)["stopped"]
    last = final(results)
    assert last["eos_reason"] == "stop_string" and last["eos_string"] == stop
    assert last["full_completion"] == full[: full.index(stop)]
    assert "".join(r["text"] for r in results) == last["full_completion"]
    assert all(stop not in r["text"] for r in results)


def test_stop_token_ends_the_job_and_min_new_tokens_blocks_it(llama_dir: Path):
    generator = make_generator(llama_dir)
    ids = prompt(generator, 12, 4)
    generator.enqueue(Job(ids, 20, stop_conditions=[], identifier="free"))
    free = final(run_all(generator)["free"])["completion_ids"]
    first = free[0]
    generator.enqueue(Job(ids, 20, stop_conditions=[first], identifier="stop"))
    stopped = final(run_all(generator)["stop"])
    assert stopped["eos_reason"] == "stop_token" and stopped["eos_token_id"] == first
    assert stopped["new_tokens"] == 1 and stopped["full_completion"] == ""
    generator.enqueue(Job(ids, 20, min_new_tokens=5, stop_conditions=[first], identifier="min"))
    held = final(run_all(generator)["min"])
    assert held["new_tokens"] >= 5
    assert first not in held["completion_ids"][:5]


def test_max_new_tokens_is_exact_and_default_stops_on_model_eos(llama_dir: Path):
    generator = make_generator(llama_dir)
    for n in (1, 7):
        generator.enqueue(Job(prompt(generator, 5, n), n, stop_conditions=[], identifier=n))
    results = run_all(generator)
    assert final(results[1])["new_tokens"] == 1 and final(results[7])["new_tokens"] == 7
    eos_ids = generator.tokenizer.eos_token_ids
    assert len(eos_ids) == 2
    biased = SamplerSettings(temperature=0, token_bias={eos_ids[1]: 1000.0})
    generator.enqueue(Job(prompt(generator, 5, 0), 10, gen_settings=biased, identifier="eos"))
    last = final(run_all(generator)["eos"])
    assert last["eos_reason"] == "stop_token" and last["eos_token_id"] == eos_ids[1]


def test_same_seed_same_output_and_different_seeds_differ(llama_dir: Path):
    generator = make_generator(llama_dir)
    settings = SamplerSettings(temperature=1.5)
    ids = prompt(generator, 10, 5)

    def sampled(seed: int) -> list[int]:
        generator.enqueue(Job(ids, 24, stop_conditions=[], gen_settings=settings, seed=seed, identifier=seed))
        return final(run_all(generator)[seed])["completion_ids"]

    first = sampled(11)
    assert sampled(11) == first
    assert sampled(12) != first


def test_generate_one_and_many_prompts(llama_dir: Path):
    generator = make_generator(llama_dir)
    one = generator.generate("Once upon a time", max_new_tokens=6, stop_conditions=[])
    many = generator.generate(["Once upon a time", "The weather"], max_new_tokens=6, stop_conditions=[])
    assert isinstance(one, str) and many[0] == one
    generator.enqueue(Job([5, 6], 3))
    with pytest.raises(RuntimeError, match="idle generator"):
        generator.generate("busy")


def test_decode_special_tokens_controls_whether_special_tokens_reach_the_text(llama_dir: Path):
    generator = make_generator(llama_dir)
    im_start = generator.tokenizer.token_to_id("<|im_start|>")
    forced = SamplerSettings(temperature=0, token_bias={im_start: 1000.0})
    texts = {}
    for decode in (False, True):
        generator.enqueue(Job([5, 6, 7], 3, gen_settings=forced, stop_conditions=[], identifier=decode,
                              decode_special_tokens=decode))
        texts[decode] = final(run_all(generator)[decode])["full_completion"]
    assert texts[True] == "<|im_start|>" * 3
    assert texts[False] == ""


def test_cache_is_sized_from_tokens_or_from_a_memory_budget(llama_dir: Path):
    by_tokens = Generator.from_pretrained(llama_dir, cache_tokens=100, page_size=8)
    assert by_tokens.pool.num_pages == 13
    per_page = by_tokens.cache.k[:, :, 0].numel() * 2 * by_tokens.cache.k.element_size()
    by_memory = Generator.from_pretrained(llama_dir, cache_memory=20 * per_page + 1, page_size=8)
    assert by_memory.pool.num_pages == 20
