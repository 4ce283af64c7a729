"""A step's leading plain decode rows reach the runner as their sequences alone (StepBatch.decoding),
without a BatchRow each: the forward's inputs built so equal those built from one BatchRow per
scheduled row, in a pure decode step and in one that also runs another job's prefill chunk."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch

from engine import Generator, Job
from engine.batch import ForwardBatch
from engine.model_runner import BatchRow
from engine.sequence import Sequence
from engine.step_batch import StepBatch


def _decoding_generator(llama_dir: Path) -> Generator:
    """Three jobs past their prefill, each decoding."""
    generator = Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=8, max_batch_size=8,
                                          max_chunk_size=16)
    for i in range(3):
        generator.enqueue(Job([5 + i] * (3 + 2 * i), 40, stop_conditions=[], identifier=i))
    while sum(r.stage == "streaming" for r in generator.iterate()) < 3:
        pass
    return generator


def _both_ways(generator: Generator) -> tuple[StepBatch, ForwardBatch, ForwardBatch]:
    """The next step's batch, its inputs from the batch, and its inputs from one BatchRow per row."""
    schedule = generator.scheduler.schedule()
    batch = StepBatch.build(schedule.scheduled, {}, generator._sampling)
    builder = generator.runner.builder
    return (batch, builder.build(batch.rows, decoding=batch.decoding),
            builder.build([BatchRow.scheduled(item) for item in schedule.scheduled]))


def _assert_same_inputs(built: ForwardBatch, expected: ForwardBatch) -> None:
    for name in (f.name for f in fields(ForwardBatch)):
        ours, theirs = getattr(built, name), getattr(expected, name)
        if isinstance(theirs, torch.Tensor):
            assert torch.equal(ours, theirs), name
        else:
            assert ours == theirs, name


def test_a_decode_step_builds_the_inputs_of_one_batch_row_per_job(llama_dir: Path):
    generator = _decoding_generator(llama_dir)
    batch, built, expected = _both_ways(generator)
    assert len(batch.decoding) == 3 and not batch.rows and not batch.sampled
    assert [row.draw for row in batch.samples] == [s.num_generated for s in batch.decoding]
    _assert_same_inputs(built, expected)


def test_decode_rows_before_a_prefill_chunk_build_the_same_inputs(llama_dir: Path):
    generator = _decoding_generator(llama_dir)
    generator.enqueue(Job(list(range(5, 125)), 4, stop_conditions=[], identifier="long"))
    generator.iterate()  # admitted: its prompt is computed 16 tokens a step, after the decodes
    batch, built, expected = _both_ways(generator)
    assert len(batch.decoding) == 3 and len(batch.rows) == 1 and batch.rows[0].sequence.job.identifier == "long"
    assert len(batch.rows[0].tokens) > 1 and not batch.sampled
    _assert_same_inputs(built, expected)


def test_persistent_decode_rows_match_the_general_build_across_joins_finishes_and_preemptions(llama_dir: Path):
    """The builder keeps the decode rows across steps (condensed when a job leaves, extended when one
    joins, rewritten where pages changed): at every step of a run with jobs joining, finishing at
    different lengths and preempted for pages, its inputs equal those of one BatchRow per row."""
    generator = Generator.from_pretrained(llama_dir, cache_tokens=96, page_size=8, max_batch_size=6,
                                          max_chunk_size=16)
    builder = generator.runner.builder
    build = builder.build
    compared: list[int] = []

    def checked(rows: list[BatchRow], adapters: bool = True, decoding: list[Sequence] = ()) -> ForwardBatch:
        built = build(rows, adapters, decoding=decoding)
        if decoding:
            plain = [BatchRow(s, s.num_computed, (s.token_ids[s.num_computed],), 1) for s in decoding]
            _assert_same_inputs(built, build([*plain, *rows], adapters))
            compared.append(len(decoding))
        return built

    builder.build = checked  # type: ignore[method-assign]
    for i in range(4):
        generator.enqueue(Job([5 + i] * (3 + i), 10 + 7 * i, stop_conditions=[], identifier=i))
    steps = 0
    while generator.num_remaining_jobs():
        generator.iterate()
        steps += 1
        if steps in (3, 9):  # newcomers join a batch that is decoding
            generator.enqueue([Job([9, 10 + steps], 12, stop_conditions=[], identifier=f"late-{steps}-{k}")
                               for k in range(2)])
    assert generator.scheduler.num_preemptions > 0
    assert len(compared) > 20 and max(compared) >= 4
