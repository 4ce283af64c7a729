"""Rows for the engine's batched sampler built from plain Python values, for the sampling tests.

A RowSpec is one job's row: its settings, its seed and which of its tokens it draws (draw), the
prompt and output ids the penalties read, the stop tokens suppressed while min_new_tokens is not
reached. sample() and probabilities() run them through a fresh BatchSampler, the one the
generator samples with, so the tests check the engine's own sampling path.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.batch_sampler import BatchSampler
from engine.job import Job
from engine.sampler_settings import SamplerSettings
from engine.sampling_state import SampleRow, SamplingState
from engine.sequence import Sequence

CPU = torch.device("cpu")


@dataclass(frozen=True)
class RowSpec:
    settings: SamplerSettings
    seed: int = 0
    prompt: Seq[int] = ()
    output: Seq[int] = ()
    suppress: Seq[int] = ()
    draw: int | None = None  # the token index drawn; default: the next one after output
    pending: Seq[int] = ()  # draft tokens before this row's position (verify rows)


def row(settings: SamplerSettings, seed: int | None = 0, prompt: Seq[int] = (), output: Seq[int] = (),
        suppress: Seq[int] = (), draw: int | None = None, pending: Seq[int] = ()) -> RowSpec:
    return RowSpec(settings, seed or 0, tuple(prompt), tuple(output), tuple(suppress), draw, tuple(pending))


def sample_rows(specs: Seq[RowSpec], serial: int = 0) -> list[SampleRow]:
    """Each spec as the SampleRow of a job of its own (serials from `serial` on)."""
    rows = []
    for i, spec in enumerate(specs):
        # the job's prompt is never read by the sampler (the sequence's tokens are); it must not be empty
        job = Job([0], max(len(spec.output) + 2, 2), min_new_tokens=len(spec.output) + 1 if spec.suppress else 0,
                  stop_conditions=list(spec.suppress), gen_settings=spec.settings, seed=spec.seed)
        job.serial = serial + i
        tokens = [*spec.prompt, *spec.output]
        sequence = Sequence(job, serial + i, tokens, len(spec.prompt), 0.0, output_ids=list(spec.output))
        state = SamplingState(spec.seed, frozenset(spec.suppress))
        draw = len(spec.output) + len(spec.pending) if spec.draw is None else spec.draw
        rows.append(SampleRow(sequence, state, draw, tuple(spec.pending), commit=False))
    return rows


def sample(logits: torch.Tensor, specs: Seq[RowSpec]) -> torch.Tensor:
    """One token per row ([B] int64), -1 where nothing can be drawn (BatchSampler.sample)."""
    return BatchSampler(len(specs), logits.shape[1], CPU).sample(logits, sample_rows(specs))


def probabilities(logits: torch.Tensor, specs: Seq[RowSpec]) -> torch.Tensor:
    """The [B, V] distribution each row draws from (greedy rows: one-hot)."""
    return BatchSampler(len(specs), logits.shape[1], CPU).distribution(logits, sample_rows(specs))
