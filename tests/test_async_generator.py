"""The asyncio wrapper (exllamav2's DynamicGeneratorAsync / JobAsync): jobs
stream their results to `async for`, equal to the plain generator's; the event
loop keeps running while a step runs (iterate() is never on the loop);
cancellation, refusals and close() reach the jobs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine import AsyncGenerator, FinishReason, Generator, Job, JobRejected


def jobs() -> list[Job]:
    return [Job([5 + i, 6, 7, 8] * (i + 1), 12, stop_conditions=[], identifier=i) for i in range(4)]


def test_async_jobs_stream_what_the_plain_generator_gives_and_the_loop_keeps_running(llama_dir: Path):
    plain: dict[int, list[int]] = {}
    generator = Generator.from_pretrained(llama_dir, cache_tokens=1024, page_size=8)
    for job in jobs():
        generator.enqueue(job)
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            plain.setdefault(r.identifier, []).extend(r.token_ids)

    generator = Generator.from_pretrained(llama_dir, cache_tokens=1024, page_size=8)
    in_step = {"now": False, "ticks_during_steps": 0}
    iterate = generator.iterate

    def timed_iterate():  # marks when a step is running, wherever it runs
        in_step["now"] = True
        try:
            return iterate()
        finally:
            in_step["now"] = False

    generator.iterate = timed_iterate  # type: ignore[method-assign]

    async def ticker(stop: asyncio.Event) -> None:
        while not stop.is_set():
            in_step["ticks_during_steps"] += in_step["now"]
            await asyncio.sleep(0)

    async def consume(agen: AsyncGenerator, job: Job) -> tuple[list[int], list[str]]:
        ids, stages = [], []
        async for result in agen.submit(job):
            ids.extend(result.token_ids)
            stages.append(result.stage)
        return ids, stages

    async def scenario() -> dict[int, tuple[list[int], list[str]]]:
        agen = AsyncGenerator(generator)
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(stop))
        outcomes = await asyncio.gather(*(consume(agen, job) for job in jobs()))
        stop.set()
        await tick
        await agen.close()
        return dict(enumerate(outcomes))

    outcomes = asyncio.run(scenario())
    assert {i: ids for i, (ids, _) in outcomes.items()} == plain
    assert all(stages[0] == "started" and stages[-1] == "eos" for _, stages in outcomes.values())
    assert in_step["ticks_during_steps"] > 0  # the loop ran while iterate() was running: not on the loop


def test_cancel_refusal_and_close_reach_the_jobs(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=1024, page_size=8)

    async def scenario() -> None:
        agen = AsyncGenerator(generator)
        long = agen.submit(Job([5, 6, 7], 500, stop_conditions=[], identifier="long"))
        results = []
        async for result in long:
            results.append(result)
            if len(results) == 3:
                await long.cancel()
        assert results[-1].eos_reason is FinishReason.CANCELLED
        refused = agen.submit(Job([5] * 2000, 4, identifier="too long"))
        with pytest.raises(JobRejected, match="max_seq_len"):
            async for _ in refused:
                pass
        pending = agen.submit(Job([5, 6], 500, stop_conditions=[], identifier="pending"))
        await agen.close()
        last = [r async for r in pending][-1]
        assert last.eos_reason is FinishReason.CANCELLED
        assert generator.num_remaining_jobs() == 0 and generator.pool.num_used == 0

    asyncio.run(scenario())
