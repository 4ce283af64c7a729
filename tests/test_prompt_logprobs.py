"""Prompt log-probabilities (Job(prompt_logprobs=k)): computed in the prefill, chunk by chunk,
equal to log_softmax of transformers' logits on the same weights at the next prompt token, with
its top-k; never read from the prefix cache, never computed twice, shared by n samples."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import EngineOutput, Generator, Job, SamplerSettings, Stage
from engine.embeddings import Embedding
from engine.outputs import TokenLogprob
from tests.engine_runs import run

PAGE_SIZE = 8
ATOL = 1e-4


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


def hf_log_softmax(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is transformers' log-distribution of the token after ids[: i + 1]."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_matches_transformers(scored: list[TokenLogprob | None], prompt: list[int], reference: torch.Tensor,
                                k: int) -> None:
    """One entry per prompt token, the first None; entry i is reference[i - 1] at prompt[i], its
    alternatives reference[i - 1]'s top-k (ids may swap only where values tie within ATOL)."""
    assert len(scored) == len(prompt) and scored[0] is None
    for position in range(1, len(prompt)):
        entry = scored[position]
        assert entry is not None, f"prompt token {position} was not scored"
        expected = reference[position - 1]
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(expected[prompt[position]].item(), abs=ATOL)
        assert len(entry.top) == k
        top = expected.topk(k)
        values = torch.tensor([v for _, v in entry.top])
        torch.testing.assert_close(values, top.values, rtol=0, atol=ATOL)
        for (token, value), want_id in zip(entry.top, top.indices.tolist(), strict=True):
            assert token == want_id or abs(expected[token].item() - value) < ATOL


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prompt_logprobs_over_chunks_equal_transformers_and_the_prefill_runs_once(
        family: str, overlap: bool, tiny_model_factory: Callable[..., Path]):
    model_dir = tiny_model_factory(family)
    generator = Generator.from_pretrained(model_dir, cache_tokens=2048, page_size=PAGE_SIZE, max_chunk_size=8,
                                          overlap=overlap)
    prompt = tokens(1, 29)  # four chunks of 8, the last of 5
    progress: list[int] = []
    firsts: list[EngineOutput] = []
    serial = generator.enqueue(Job(prompt, 3, stop_conditions=[], prompt_logprobs=4))
    final = None
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            assert result.serial == serial
            if result.stage is Stage.PREFILL:
                progress.append(result.curr_progress or 0)
                assert result.prompt_logprobs is None
            if result.prompt_logprobs is not None:
                firsts.append(result)
            final = result if result.eos else final
    assert progress == [8, 16, 24]  # the prompt really was computed in several chunks
    assert final is not None and final.prompt_logprobs is not None
    assert firsts[0].token_ids == final.completion_ids[:1]  # the first result after the prefill carries them
    reference = hf_log_softmax(model_dir, prompt + (final.completion_ids or []))
    assert_matches_transformers(final.prompt_logprobs, prompt, reference, k=4)
    # the last prompt position's logits, scored nowhere, gave the first token (greedy): nothing ran twice
    assert final.completion_ids == reference[len(prompt) - 1:-1].argmax(-1).tolist()
    assert generator.stats.computed_prompt_tokens == len(prompt)
    assert generator.stats.steps == 4 + 2


def test_the_distribution_is_the_models_own_not_the_samplers(llama_dir: Path):
    """Temperature, penalties and a bias shape the draw, not the prompt's log-probabilities."""
    generator = Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=PAGE_SIZE, max_chunk_size=16)
    prompt = tokens(2, 21)
    settings = SamplerSettings(temperature=0.5, repetition_penalty=1.3, token_bias={prompt[5]: 5.0})
    final = run(generator, [Job(prompt, 2, stop_conditions=[], gen_settings=settings, seed=3, prompt_logprobs=2,
                                identifier="x")])["x"]
    assert final.prompt_logprobs is not None
    assert_matches_transformers(final.prompt_logprobs, prompt, hf_log_softmax(llama_dir, prompt), k=2)


def test_a_scored_prompt_skips_the_prefix_cache_and_leaves_its_batch_alone(llama_dir: Path):
    system = tokens(3, 27)
    plain = {name: system + tokens(10 + i, 5) for i, name in enumerate(["a", "c"])}
    scored_prompt = system + tokens(20, 6)

    def jobs(score: bool) -> list[Job]:
        return [Job(plain["a"], 6, stop_conditions=[], identifier="a"),
                Job(scored_prompt, 6, stop_conditions=[], identifier="b", prompt_logprobs=3 if score else None),
                Job(plain["c"], 6, stop_conditions=[], identifier="c")]

    generator = Generator.from_pretrained(llama_dir, cache_tokens=4096, page_size=PAGE_SIZE, max_chunk_size=64)
    warm = run(generator, jobs(False)[:1])  # the shared prefix is now in the cache
    finals = run(generator, jobs(True))
    alone = run(Generator.from_pretrained(llama_dir, cache_tokens=4096, page_size=PAGE_SIZE, prefix_caching=False),
                jobs(False))
    shared = (len(system) // PAGE_SIZE) * PAGE_SIZE
    assert warm["a"].cached_tokens == 0
    assert finals["a"].cached_tokens == finals["c"].cached_tokens == shared  # its neighbours still reuse it
    assert finals["b"].cached_tokens == 0  # the scored prompt computed every position
    assert finals["a"].prompt_logprobs is None and finals["c"].prompt_logprobs is None
    for name in "abc":
        assert finals[name].completion_ids == alone[name].completion_ids
    assert finals["b"].prompt_logprobs is not None
    assert_matches_transformers(finals["b"].prompt_logprobs, scored_prompt,
                                hf_log_softmax(llama_dir, scored_prompt), k=3)


def test_n_samples_score_their_shared_prompt_once(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=4096, page_size=PAGE_SIZE, max_chunk_size=64)
    prompt = tokens(4, 30)
    samples = Job(prompt, 4, stop_conditions=[], identifier="r", seed=1, prompt_logprobs=0,
                  gen_settings=SamplerSettings(temperature=1.0)).samples(3)
    finals = run(generator, samples)
    first = finals[("r", 0)].prompt_logprobs
    assert first is not None and all(entry is None or entry.top == () for entry in first)
    assert_matches_transformers(first, prompt, hf_log_softmax(llama_dir, prompt), k=0)
    assert finals[("r", 1)].prompt_logprobs is None and finals[("r", 2)].prompt_logprobs is None
    reused = (len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE  # samples 1 and 2 read sample 0's full pages
    assert generator.stats.computed_prompt_tokens == len(prompt) + 2 * (len(prompt) - reused)


def test_a_healed_prompt_token_is_scored_by_the_last_position_the_model_reads(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=PAGE_SIZE, max_chunk_size=8)
    prompt = tokens(5, 19)
    final = run(generator, [Job(prompt, 2, stop_conditions=[], token_healing=True, prompt_logprobs=1,
                                identifier="h")])["h"]
    assert final.prompt_logprobs is not None
    assert_matches_transformers(final.prompt_logprobs, prompt, hf_log_softmax(llama_dir, prompt), k=1)
    assert generator.stats.computed_prompt_tokens == len(prompt) - 1


def test_a_prefill_preempted_midway_still_scores_every_prompt_token(llama_dir: Path):
    """x decodes into the last free page while y's 60-token prompt is being scored: y is preempted
    mid-prefill and computed again from its start (no prefix cache), its scores rewritten alike."""
    generator = Generator.from_pretrained(llama_dir, cache_tokens=11 * PAGE_SIZE, page_size=PAGE_SIZE,
                                          max_chunk_size=16, max_batch_size=2)
    prompt = tokens(7, 60)
    generator.enqueue(Job(tokens(6, 23), 30, stop_conditions=[], identifier="x"))
    serial = generator.enqueue(Job(prompt, 4, stop_conditions=[], identifier="y", prompt_logprobs=2))
    progress: list[int] = []
    final = None
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.serial == serial and result.stage is Stage.PREFILL:
                progress.append(result.curr_progress or 0)
            final = result if result.serial == serial and result.eos else final
    restart = next(i for i in range(1, len(progress)) if progress[i] < progress[i - 1])
    assert progress[restart - 1] > 2 * PAGE_SIZE and generator.stats.preemptions == 1
    assert final is not None and final.prompt_logprobs is not None and final.cached_tokens == 0
    assert_matches_transformers(final.prompt_logprobs, prompt, hf_log_softmax(llama_dir, prompt), k=2)


def test_bad_prompt_logprobs_name_the_field_and_the_limit():
    for bad in (21, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"prompt_logprobs must be None or an integer in \[0, 20\]"):
            Job([1, 2, 3], 4, prompt_logprobs=bad)  # type: ignore[arg-type]
    embedding = Embedding(torch.zeros(2, 8))
    with pytest.raises(ValueError, match="prompt_logprobs: not supported with embeddings"):
        Job([1, *embedding.token_ids], 4, embeddings=[embedding], prompt_logprobs=1)
