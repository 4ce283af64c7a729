"""Overlapped steps (the forward of step N+1 running while step N's text is
produced) give exactly the results of plain steps, one iterate() later."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine import Generator, Job, SamplerSettings


def jobs(vocab: int) -> list[Job]:
    rng = random.Random(5)
    sampled = SamplerSettings(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.2)
    out = []
    for i in range(12):
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(3, 40))]
        settings = sampled if i % 2 else SamplerSettings.greedy()
        # stop strings of one or two characters end some jobs early, mid-step
        stops: list[int | str] = ["e", "th"] if i % 3 == 0 else []
        out.append(Job(prompt, rng.randint(4, 20), min_new_tokens=i % 4, stop_conditions=stops,
                       gen_settings=settings, seed=i, identifier=i))
    return out


def finals(generator: Generator, cancel_at: dict[Any, int] | None = None) -> dict[Any, dict[str, Any]]:
    """Every job's final result; a job in cancel_at is cancelled once its results have brought that
    many tokens (as a client would, on what it was sent)."""
    cancel_at = cancel_at or {}
    for job in jobs(generator.model.config.vocab_size):
        generator.enqueue(job)
    out: dict[Any, dict[str, Any]] = {}
    texts: dict[Any, str] = {}
    seen: dict[Any, int] = {}
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            texts[r.identifier] = texts.get(r.identifier, "") + r.text
            seen[r.identifier] = seen.get(r.identifier, 0) + len(r.token_ids)
            if not r.eos and seen[r.identifier] >= cancel_at.get(r.identifier, 1 << 30):
                assert generator.cancel(r.job)
            if r.eos:
                out[r.identifier] = {k: v for k, v in r.as_dict().items()
                                     if k not in ("job",) and not k.startswith("time")}
    assert all(texts[i] == out[i]["full_completion"] for i in out)
    return out


@pytest.mark.parametrize("options", [{}, {"cache_tokens": 160}, {"use_ngram_draft": True}],
                         ids=["plain", "preempting", "ngram-speculation"])
def test_overlapped_steps_give_the_same_results(llama_dir: Path, options: dict):
    options = {"cache_tokens": 2048, **options}
    plain = finals(Generator.from_pretrained(llama_dir, page_size=8, max_chunk_size=64, **options))
    overlapped_generator = Generator.from_pretrained(llama_dir, page_size=8, max_chunk_size=64, overlap=True, **options)
    overlapped = finals(overlapped_generator)
    assert overlapped == plain
    assert {r["eos_reason"] for r in plain.values()} >= {"stop_string", "max_new_tokens"}
    assert overlapped_generator.pool.num_used == 0


def test_cancelled_jobs_end_with_what_was_streamed(llama_dir: Path):
    """With overlap a job's next tokens are drawn before its text is produced; a job cancelled on
    what it was sent ends with exactly that, as without overlap (the extra tokens are dropped)."""
    cancel_at = {0: 1, 1: 2, 2: 3, 5: 2, 7: 1}
    options = {"cache_tokens": 2048, "page_size": 8, "max_chunk_size": 64}
    plain_generator = Generator.from_pretrained(llama_dir, **options)
    plain = finals(plain_generator, cancel_at)
    overlapped_generator = Generator.from_pretrained(llama_dir, overlap=True, **options)
    overlapped = finals(overlapped_generator, cancel_at)
    assert overlapped == plain
    assert sum(r["eos_reason"] == "cancelled" for r in plain.values()) >= 3
    assert overlapped_generator.stats.generated_tokens == plain_generator.stats.generated_tokens
    assert overlapped_generator.pool.num_used == 0
