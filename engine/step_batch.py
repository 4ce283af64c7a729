"""A step's batch (the rows it runs and samples), its device work and read-back, and the tokens each
job takes from what was drawn: nano-vllm's ModelRunner.run and Scheduler.postprocess, vLLM v1's
InputBatch, ModelRunnerOutput and the accept part of Scheduler.update_from_output. The runner and
the scheduler below the step see only tokens and pages, so what reads a job's sampling state sits
here, above them."""

from __future__ import annotations

import threading
from collections.abc import Container
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain, repeat

import torch

from engine.batch import ForwardBatch
from engine.batch_sampler import BatchSampler
from engine.model_runner import BatchRow, ModelRunner
from engine.output_processor import StepTokens
from engine.outputs import TokenLogprob
from engine.prompt_logprobs import PromptChunk, ScoredPrompts
from engine.sampling_state import SampleRow, SamplingState, append_tokens, ends_with
from engine.scheduler import ScheduledSequence
from engine.sequence import Sequence
from engine.spec_decode import accept, verify_rows


@dataclass(slots=True)
class SampledJob:
    """A job whose rows sample in the step, after its leading plain decode rows (StepBatch.decoding,
    which need none): its rows start at `first`; draft: the tokens verified. Not frozen, as SampleRow."""

    sequence: Sequence
    first: int
    draft: Seq[int]


@dataclass(frozen=True)
class Drawn:
    """A step's read-back: one sampled id per sample row (-1: nothing could be drawn), the
    logprobs of the rows whose jobs asked for them, and the prompt log-probabilities its prefill
    chunks scored (serial -> first scored position, entries)."""

    tokens: list[int]
    logprobs: dict[int, TokenLogprob]
    prompts: dict[int, tuple[int, list[TokenLogprob]]]


@dataclass(frozen=True)
class StepBatch:
    """The forward's rows, the sampler's rows (plain and verify), the jobs they belong to, the
    prompt chunks being scored, and (when those chunks ask for more logits) which logits rows the
    sample rows take. decoding: the step's leading plain decode rows (one token, one sample row,
    no draft), first in the forward, the logits and the sample rows, as sequences alone: nothing is
    built per job for them but their SampleRow; rows and sampled: the rows and sampling jobs after
    them. prompt_tokens: prompt tokens the step computes (not served from the cache). prompts_done:
    the jobs whose prompt is scored whole once the step ran (their last chunk samples), so the
    step's completion does not look at every row for them."""

    decoding: list[Sequence]
    rows: list[BatchRow]
    samples: list[SampleRow]
    sampled: list[SampledJob]
    prompts: list[PromptChunk]
    sample_at: list[int] | None
    prompt_tokens: int
    prompts_done: list[Sequence]

    @classmethod
    def build(cls, scheduled: tuple[ScheduledSequence, ...], drafts: dict[int, list[int]],
              states: dict[int, SamplingState]) -> StepBatch:
        """The batch of the scheduled sequences, each sampling one row, or k + 1 verify rows for a
        draft of k tokens."""
        decoding: list[Sequence] = []
        rows: list[BatchRow] = []
        sampled: list[SampledJob] = []
        prompts: list[PromptChunk] = []
        prompts_done: list[Sequence] = []
        for item in scheduled:  # the leading plain decode rows (nearly every row of a decode step)
            sequence = item.sequence
            if (item.num_tokens != 1 or not item.samples or sequence.job.prompt_logprobs is not None
                    or (drafts and drafts.get(sequence.serial))):
                break
            decoding.append(sequence)
        samples = [states[sequence.serial].next_row(sequence) for sequence in decoding]
        prompt_tokens = sum(1 for sequence in decoding if sequence.num_computed < sequence.num_prompt_tokens)
        sample_at = list(range(len(decoding)))  # the logits row of each sample row
        logits_rows = len(decoding)
        for item in scheduled[len(decoding):]:
            sequence = item.sequence
            draft: Seq[int] = drafts.get(sequence.serial, ()) if drafts else ()
            row = BatchRow.scheduled(item, draft)
            rows.append(row)
            if sequence.scores_prompt:
                chunk = PromptChunk.of(sequence, row.start, item.num_tokens, logits_rows)
                if chunk is not None:
                    prompts.append(chunk)
                if item.samples:
                    prompts_done.append(sequence)
            logits_rows += row.num_logits
            if item.samples:
                sample_at += range(logits_rows - 1 - len(draft), logits_rows)
                sampled.append(SampledJob(sequence, len(samples), draft))
                state = states[sequence.serial]
                samples += verify_rows(sequence, state, draft) if draft else [state.next_row(sequence)]
            if sequence.num_computed < sequence.num_prompt_tokens:
                prompt_tokens += min(item.num_tokens, sequence.num_prompt_tokens - sequence.num_computed)
        picked = sample_at if logits_rows > len(sample_at) else None  # prompt rows besides the sample rows
        return cls(decoding, rows, samples, sampled, prompts, picked, prompt_tokens, prompts_done)

    @torch.inference_mode()
    def run(self, runner: ModelRunner, sampler: BatchSampler, inputs: ForwardBatch) -> Drawn:
        """The device work of a step (forward over its inputs, prompt scoring, sampling) and its one read-back."""
        logits = runner.forward(inputs)
        scored = ScoredPrompts.compute(logits, self.prompts) if self.prompts else None
        if self.sample_at is not None:
            logits = logits[torch.tensor(self.sample_at, dtype=torch.long).to(logits.device, non_blocking=True)]
        sampled = sampler.sample(logits, self.samples) if self.samples else None
        wanted = sampler.last_logprobs if sampled is not None else None
        if wanted is not None and sampled is not None:  # the tokens and their logprobs in one read-back
            tokens, logprobs = wanted.read_back(sampled)
        else:
            tokens, logprobs = (sampled.tolist() if sampled is not None else []), {}
        return Drawn(tokens, logprobs, scored.to_host() if scored is not None else {})


@dataclass(frozen=True)
class Launched:
    """A launched step: its batch, and the future of its forward and sampling."""

    work: Future[Drawn]
    batch: StepBatch


class StepLauncher:
    """Where a step's device work runs: here, or with overlap on a worker thread, so that the step's
    caller produces the previous step's text while this one's forward and sampling run (as vLLM's
    output processing runs beside the next forward)."""

    def __init__(self, runner: ModelRunner, sampler: BatchSampler, overlap: bool) -> None:
        self.runner, self.sampler = runner, sampler
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="genq-forward") if overlap else None

    def launch(self, batch: StepBatch) -> Launched:
        """The forward's inputs are built here, on the step's thread: with overlap the worker thread
        then only waits for the device and samples, and does not queue for the GIL behind the text
        of the previous step before its forward can start."""
        inputs = self.runner.builder.build(batch.rows, decoding=batch.decoding)
        if self._executor is not None:
            started = threading.Event()

            def run() -> Drawn:
                started.set()
                return batch.run(self.runner, self.sampler, inputs)

            launched = Launched(self._executor.submit(run), batch)
            # Hand the GIL to the worker until its forward is under way: otherwise it waits for the
            # interpreter's switch interval (5 ms) while the caller produces the previous step's text.
            started.wait()
            return launched
        work: Future[Drawn] = Future()
        work.set_result(batch.run(self.runner, self.sampler, inputs))
        return Launched(work, batch)


@dataclass
class Taken:
    """What the jobs took from a step: the tokens appended (their text still to be produced), per
    verified job the draft tokens it verified and kept, the jobs that ended with a stop token,
    max_new_tokens or their grammar, and the jobs that failed (serial -> why)."""

    appended: list[StepTokens] = field(default_factory=list)
    drafted: dict[int, int] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)
    ended: list[Sequence] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    generated: int = 0


def take_tokens(batch: StepBatch, drawn: Drawn, states: dict[int, SamplingState], decided: Container[int],
                sampler: BatchSampler) -> Taken:
    """Verify each sampling job's draft against what its rows drew and append the tokens it keeps. A
    job that left meanwhile (no sampling state) or in decided (finished or rewound by text produced
    meanwhile) takes nothing; a row with nothing to draw, or a grammar refusing what was drawn,
    fails its job alone, its batch neighbours go on."""
    tokens, logprobs = drawn.tokens, drawn.logprobs
    taken = Taken()
    appended, ended = taken.appended, taken.ended
    plain = 0  # tokens the one-token path appended
    jobs = chain(zip(batch.decoding, range(len(batch.decoding)), repeat(())),
                 ((job.sequence, job.first, job.draft) for job in batch.sampled))
    for sequence, first, draft in jobs:
        serial = sequence.serial
        state = states.get(serial)
        if state is None or serial in decided:
            continue
        token = tokens[first]
        if not draft and state.constraint is None and not logprobs and token >= 0:
            # append_tokens for one plain token without its loop and grammar: nearly every job of a
            # decode step
            sequence.append(token)
            plain += 1
            appended.append(StepTokens(sequence, [token]))
            if ends_with(sequence, state, token, sequence.num_generated):
                ended.append(sequence)
            continue
        emitted = accept(draft, tokens[first : first + len(draft) + 1]) if draft else [tokens[first]]
        if emitted[-1] < 0:
            taken.failed[serial] = _row_error(sampler, first + len(emitted) - 1)
            continue
        if draft:
            taken.drafted[serial], taken.accepted[serial] = len(draft), len(emitted) - 1
            sampler.record(serial, emitted)
        try:
            kept, done, complete = append_tokens(sequence, state, emitted)
        except RuntimeError as error:  # a constraint refusing what was sampled
            taken.failed[serial] = str(error)
            continue
        taken.generated += len(kept)
        kept_logprobs = [logprobs[r] for r in range(first, first + len(kept)) if r in logprobs] if logprobs else ()
        taken.appended.append(StepTokens(sequence, kept, kept_logprobs, complete))
        if done:
            taken.ended.append(sequence)
    taken.generated += plain
    return taken


def _row_error(sampler: BatchSampler, row: int) -> str:
    """Why the sampler's row had nothing to draw."""
    try:
        sampler.raise_for_row(row)
    except ValueError as error:
        return str(error)
    raise AssertionError("raise_for_row() always raises")
