"""Running one job through a generator to its end, as engine tests need it."""

from __future__ import annotations

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
