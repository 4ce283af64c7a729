"""exllamav2's job API details (issue 12): a bare stop string is one stop
string, enqueue takes a list (all or nothing), clear_queue cancels every job,
the final result answers to exllamav2's eos_triggering_* names, and a draft
model refuses jobs with embeddings instead of crashing the step."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Embedding, FinishReason, Generator, Job, JobRejected, QueueFull, SamplerSettings


def drain(generator: Generator) -> dict[object, object]:
    finals = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.eos:
                finals[result.identifier] = result
    return finals


def test_a_bare_stop_string_is_one_stop_string_and_a_bare_int_one_stop_token():
    assert Job([5, 6], 4, stop_conditions="###").stop_strings == ("###",)
    job = Job([5, 6], 4, stop_conditions=7)
    assert job.stop_token_ids == frozenset({7}) and job.stop_strings == ()


def test_enqueue_takes_a_list_whole_or_not_at_all(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=1024, page_size=8, max_pending=8)
    serials = generator.enqueue([Job([5, 6, 7], 3, identifier=i) for i in range(3)])
    assert serials == [0, 1, 2] and generator.num_pending_jobs() == 3
    with pytest.raises(JobRejected, match="exceeds the model's max_seq_len"):
        generator.enqueue([Job([5], 2, identifier="ok"), Job([5] * 2000, 2, identifier="too long")])
    with pytest.raises(QueueFull, match="max_pending=8"):
        generator.enqueue([Job([5], 2) for _ in range(6)])
    assert generator.num_pending_jobs() == 3  # neither list left a job behind
    assert sorted(drain(generator)) == [0, 1, 2]


def test_clear_queue_cancels_waiting_and_running_jobs_and_frees_their_pages(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=1024, page_size=8, max_batch_size=2)
    generator.enqueue([Job([5, 6, 7, 8] * 3, 50, stop_conditions=[], identifier=i) for i in range(4)])
    generator.iterate()
    assert generator.num_active_jobs() == 2 and generator.num_pending_jobs() == 2
    assert generator.clear_queue() == 4
    finals = drain(generator)
    assert sorted(finals) == [0, 1, 2, 3]
    assert all(r.eos_reason is FinishReason.CANCELLED for r in finals.values())
    assert generator.pool.num_used == 0


def test_the_final_result_answers_to_exllamav2_names(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=1024, page_size=8)
    eos = generator.tokenizer.eos_token_id
    # Every token is a stop token: the first one generated ends the job.
    generator.enqueue(Job([5, 6, 7], 8, stop_conditions=list(range(generator.model.config.vocab_size)),
                          identifier="x"))
    result = drain(generator)["x"]
    token = result.completion_ids[-1]
    assert result.eos_reason is FinishReason.STOP_TOKEN
    assert result["eos_triggering_token_id"] == result.eos_token_id == token
    assert result["eos_triggering_token_str"] == generator.tokenizer.decode([token], skip_special_tokens=False)
    assert "eos_triggering_string" not in result and result.get("eos_triggering_string") is None
    assert eos is not None


def test_a_draft_model_refuses_jobs_with_embeddings_clearly(tiny_model_factory: Callable[..., Path]):
    path = tiny_model_factory("llama")
    generator = Generator.from_pretrained(path, cache_tokens=1024, page_size=8, draft_model_path=path)
    embedding = Embedding(torch.randn(2, generator.model.config.hidden_size))
    with pytest.raises(JobRejected, match="embeddings: not supported with a draft model"):
        generator.enqueue(Job([5, *embedding.token_ids, 6], 4, embeddings=[embedding]))
    generator.enqueue(Job([5, 6, 7], 4, identifier="plain"))
    assert list(drain(generator)) == ["plain"]


def admission_order(generator: Generator) -> list[object]:
    started = []
    while generator.num_remaining_jobs():
        started += [r.identifier for r in generator.iterate() if r.stage == "started"]
    return started


def test_waiting_jobs_are_admitted_by_priority_then_arrival(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=1024, page_size=8, max_batch_size=1)
    for identifier, priority in (("first", 5), ("b", 5), ("c", 9), ("urgent", 0), ("d", 5), ("urgent2", 0)):
        generator.enqueue(Job([5, 6, 7], 2, stop_conditions=[], identifier=identifier, priority=priority))
    assert admission_order(generator) == ["urgent", "urgent2", "first", "b", "d", "c"]


def test_a_job_s_own_max_skips_bounds_how_often_it_is_overtaken(llama_dir: Path):
    def order(max_skips: int | None) -> list[object]:
        # 4 pages of 8 tokens: the long job needs all of them, the short ones fit beside the running one.
        generator = Generator.from_pretrained(llama_dir, cache_tokens=32, page_size=8, max_skips=16)
        generator.enqueue(Job([5] * 10, 6, stop_conditions=[], identifier="running"))
        generator.iterate()
        generator.enqueue(Job([6] * 20, 4, stop_conditions=[], identifier="long", max_skips=max_skips))
        generator.enqueue([Job([7, 8], 2, stop_conditions=[], identifier=f"short{i}") for i in range(3)])
        return admission_order(generator)

    assert order(None).index("long") == 3  # the generator's 16: every short job overtakes it
    assert order(0) == ["long", "short0", "short1", "short2"]  # nothing overtakes it


def test_a_job_that_fails_in_a_step_fails_alone(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=1024, page_size=8)
    vocab = generator.model.config.vocab_size
    nothing_left = SamplerSettings(temperature=0.8, banned_token_ids=tuple(range(vocab)))
    generator.enqueue([Job([5, 6, 7], 6, stop_conditions=[], identifier="before"),
                       Job([5, 6, 8], 6, stop_conditions=[], identifier="broken", gen_settings=nothing_left, seed=1),
                       Job([5, 6, 9], 6, stop_conditions=[], identifier="after")])
    finals = drain(generator)
    assert finals["broken"].eos_reason is FinishReason.ERROR and "banned_token_ids" in finals["broken"]["error"]
    assert finals["before"].new_tokens == finals["after"].new_tokens == 6
    assert generator.pool.num_used == 0


def test_a_long_prompt_reports_prefill_progress_chunk_by_chunk(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=1024, page_size=8, max_chunk_size=16)
    generator.enqueue(Job(list(range(5, 55)), 2, stop_conditions=[], identifier="long"))
    stages = []
    while generator.num_remaining_jobs():
        stages += [(r.stage, r.get("curr_progress"), r.get("max_progress")) for r in generator.iterate()]
    assert stages[0][0] == "started"
    assert [s for s in stages if s[0] == "prefill"] == [("prefill", 16, 50), ("prefill", 32, 50), ("prefill", 48, 50)]
    assert stages[-1][0] == "eos"


def test_warmup_runs_a_step_of_each_kind_and_leaves_the_counters_at_zero(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=1024, page_size=8)
    assert generator.warmup() > 0
    stats = generator.stats
    assert (stats.steps, stats.generated_tokens, stats.computed_prompt_tokens, stats.active_jobs) == (0, 0, 0, 0)
    assert generator.pool.num_used == 0
    generator.enqueue(Job([5, 6, 7], 2, identifier="first"))
    assert list(drain(generator)) == ["first"]
    generator.enqueue(Job([5], 2, identifier="busy"))
    with pytest.raises(RuntimeError, match="idle"):
        generator.warmup()


def test_allowed_token_ids_hold_in_the_generator_s_persistent_sampler(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=1024, page_size=8)
    allowed = (11, 17, 23)
    generator.enqueue([
        Job([5, 6, 7], 12, stop_conditions=[], identifier="sampled", seed=3,
            gen_settings=SamplerSettings(temperature=1.0, allowed_token_ids=allowed, repetition_penalty=1.3)),
        Job([5, 6, 8], 12, stop_conditions=[], identifier="greedy",
            gen_settings=SamplerSettings(temperature=0.0, allowed_token_ids=allowed)),
        Job([5, 6, 9], 12, stop_conditions=[], identifier="free"),
    ])
    finals = drain(generator)
    for identifier in ("sampled", "greedy"):
        assert set(finals[identifier].completion_ids) <= set(allowed), identifier
    assert not set(finals["free"].completion_ids) <= set(allowed)


def test_top_a_holds_in_the_generator_s_persistent_sampler(llama_dir: Path):
    """Each token sampled under top_a is at least top_a x the peak probability squared (read from the
    job's own logprobs, which come from the distribution before truncation); without top_a, the same
    seeds sample tokens below that line, so the setting is what keeps them out."""
    def below_the_line(top_a: float) -> int:
        generator = Generator.from_pretrained(llama_dir, cache_tokens=4096, page_size=8)
        settings = SamplerSettings(temperature=0.7, top_a=top_a)
        generator.enqueue([Job([5 + i, 6, 7], 30, stop_conditions=[], identifier=i, seed=i, top_logprobs=1,
                               gen_settings=settings) for i in range(8)])
        count = 0
        for final in drain(generator).values():
            for lp in final.completion_logprobs:
                peak = math.exp(lp.top[0][1])
                count += math.exp(lp.logprob) < 0.5 * peak * peak - 1e-6
        return count

    assert below_the_line(0.5) == 0
    assert below_the_line(0.0) > 0
