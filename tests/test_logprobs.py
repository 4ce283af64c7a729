"""Token log-probabilities: a job's logprobs are log_softmax of the model's
logits (transformers' forward on the same weights is the reference) at its
temperature, its top_logprobs the true top-k; they line up with the token
ids in streaming and final results, also when a stop string takes tokens
back and with overlapped steps."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import Generator, Job, SamplerSettings
from engine.outputs import TokenLogprob


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(2, 30))] for _ in range(count)]


def collect(generator: Generator, jobs: list[Job]) -> dict[object, dict]:
    for job in jobs:
        generator.enqueue(job)
    out: dict[object, dict] = {}
    streamed: dict[object, list[TokenLogprob]] = {}
    streamed_ids: dict[object, list[int]] = {}
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if not r.job.logprobs:
                assert r.logprobs is None
            elif r.token_ids:
                assert r.logprobs is not None and len(r.logprobs) == len(r.token_ids)
                assert [lp.token_id for lp in r.logprobs] == r.token_ids
                streamed.setdefault(r.identifier, []).extend(r.logprobs)
                streamed_ids.setdefault(r.identifier, []).extend(r.token_ids)
            if r.eos:
                out[r.identifier] = {"ids": list(r.completion_ids), "logprobs": r.completion_logprobs,
                                     "text": r.full_completion, "reason": r.eos_reason}
    for identifier, final in out.items():
        if final["logprobs"] is None:
            continue
        assert streamed_ids.get(identifier, []) == final["ids"]
        assert streamed.get(identifier, []) == final["logprobs"]
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_log_softmax_of_transformers_logits_and_top_logprobs_the_true_top_k(
    temperature: float, tiny_model_factory: Callable[..., Path]
):
    model_dir = tiny_model_factory("llama")
    generator = Generator.from_pretrained(model_dir, cache_tokens=4096, page_size=8)
    settings = SamplerSettings(temperature=temperature) if temperature else SamplerSettings.greedy()
    jobs = [Job(prompt, 12, stop_conditions=[], gen_settings=settings, seed=i, identifier=i, top_logprobs=5)
            for i, prompt in enumerate(prompts(6))]
    finals = collect(generator, jobs)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for job in jobs:
        final = finals[job.identifier]
        ids = job.input_ids + final["ids"]
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, len(job.input_ids) - 1 : -1]
        reference = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        got = torch.tensor([lp.logprob for lp in final["logprobs"]])
        expected = reference.gather(1, torch.tensor(final["ids"])[:, None]).squeeze(1)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
        top = reference.topk(5, dim=-1)
        for position, lp in enumerate(final["logprobs"]):
            assert [t for t, _ in lp.top] == top.indices[position].tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), top.values[position], rtol=0,
                                       atol=1e-4)
        if not temperature:
            assert all(lp.top[0][0] == lp.token_id for lp in final["logprobs"])  # greedy took the best


def test_jobs_without_logprobs_get_none_and_logprobs_alone_get_no_alternatives(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=8)
    plain, chosen = prompts(2, seed=1)
    generator.enqueue(Job(plain, 4, stop_conditions=[], identifier="plain"))
    finals = collect(generator, [Job(chosen, 4, stop_conditions=[], identifier="chosen", logprobs=True)])
    assert finals["plain"]["logprobs"] is None
    assert len(finals["chosen"]["logprobs"]) == 4 and all(lp.top == () for lp in finals["chosen"]["logprobs"])
    with pytest.raises(ValueError, match="top_logprobs"):
        Job(plain, 4, top_logprobs=21)


@pytest.mark.parametrize("overlap", [False, True])
def test_logprobs_stay_aligned_when_a_stop_string_takes_tokens_back(llama_dir: Path, overlap: bool):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=4096, page_size=8, overlap=overlap,
                                          use_ngram_draft=True)
    jobs = [Job(prompt, 30, stop_conditions=["e", "th"], gen_settings=SamplerSettings(temperature=0.9), seed=i,
                identifier=i, top_logprobs=2) for i, prompt in enumerate(prompts(10, seed=2))]
    finals = collect(generator, jobs)
    assert any(final["reason"] == "stop_string" for final in finals.values())
    for final in finals.values():
        assert [lp.token_id for lp in final["logprobs"]] == final["ids"]


def test_speculated_tokens_get_the_logprobs_plain_decoding_gives_them(llama_dir: Path):
    """n-gram drafts emit several tokens per step; each keeps its own position's logprob."""
    looping = [[7, 8, 9, 10] * 6, [20, 21] * 10, [30, 31, 32] * 7]
    jobs = lambda: [Job(p, 24, stop_conditions=[], identifier=i, top_logprobs=3)  # noqa: E731
                    for i, p in enumerate(looping)]
    plain = collect(Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=8), jobs())
    speculating = Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=8, use_ngram_draft=True)
    drafted = collect(speculating, jobs())
    assert speculating.stats.accepted_draft_tokens > 0
    for identifier, final in plain.items():
        assert drafted[identifier]["ids"] == final["ids"]
        for ours, theirs in zip(drafted[identifier]["logprobs"], final["logprobs"], strict=True):
            assert ours.token_id == theirs.token_id and abs(ours.logprob - theirs.logprob) < 1e-4
            assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
