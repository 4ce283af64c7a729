"""Running jobs through a generator to their end, as engine tests need it."""

from __future__ import annotations

from typing import Any

from engine import EngineOutput, Generator, Job, Stage


def run_streamed(generator: Generator, job: Job) -> tuple[EngineOutput, list[str]]:
    """Enqueue the job, iterate until every job is done; its final result and its streamed texts."""
    serial = generator.enqueue(job)
    chunks: list[str] = []
    final = None
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.serial == serial and result.stage in (Stage.STREAMING, Stage.EOS):
                chunks.append(result.text)
                final = result if result.eos else final
    assert final is not None, "the job never ended"
    return final, chunks


def greedy_completions(generator: Generator, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Enqueue one job per prompt (no stop conditions), iterate until all are done; each
    prompt's completion ids, in prompt order."""
    for i, prompt in enumerate(prompts):
        generator.enqueue(Job(prompt, max_new_tokens, stop_conditions=[], identifier=i))
    completions: dict[int, list[int]] = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.eos:
                completions[result.identifier] = result.completion_ids or []
    return [completions[i] for i in range(len(prompts))]


def run(generator: Generator, jobs: list[Job]) -> dict[Any, EngineOutput]:
    """Enqueue the jobs, iterate until every job is done; each job's final result by identifier."""
    for job in jobs:
        generator.enqueue(job)
    finals: dict[Any, EngineOutput] = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.eos:
                finals[result.identifier] = result
    return finals
