"""Admission: the checks that refuse a job at enqueue (each naming the field and the limit:
JobRejected), and the sampling state an admitted job starts with. A constrained job's grammar is
started on the compile threads (PreparingJobs.add), never on the engine loop: it can take seconds."""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from engine.constraint_spec import Constraint
from engine.constraints import ConstraintCompiler, ConstraintState
from engine.engine_config import ConstraintBudget
from engine.errors import JobRejected
from engine.job import Job
from engine.sampler_settings import SamplerSettingsError
from engine.sampling_state import SamplingState
from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class Limits:
    """What a job must fit: the context (max_seq_len; whole_cache_pages set when that is the whole
    KV cache, to say so), the vocabulary, the hidden width embeddings must have, whether a draft
    model runs (it has no rows for embedding tokens), and the prefill chunk a bidirectional span
    must fit in whole (engine/scheduler.py)."""

    max_seq_len: int
    vocab_size: int
    hidden_size: int
    page_size: int
    whole_cache_pages: int | None
    draft_model: bool
    max_chunk_size: int


COMPILE_THREADS = 2
"""Grammars started at once, each on its own thread (llguidance releases the GIL while it works)."""
COMPILE_NICENESS = 10
"""The compile threads' CPU niceness (Linux: per thread): a grammar's start yields the CPU to the
engine loop and the forward's threads instead of competing with them for the cores."""


def _lower_priority() -> None:
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)


def admit(job: Job, limits: Limits) -> None:
    """JobRejected naming why the job can never run here. Its constraint is checked as it starts
    (PreparingJobs.add), off the engine loop."""
    _check_fits(job, limits)
    try:
        job.gen_settings.validate(limits.vocab_size)
    except SamplerSettingsError as error:
        raise JobRejected(f"gen_settings: {error}") from error
    if job.token_healing and job.constraint is not None:
        raise JobRejected("token_healing: not supported with a constraint (the grammar decides the first "
                          "token); leave the prompt's last token to the grammar instead")
    if job.banned_strings and job.constraint is not None:
        raise JobRejected("banned_strings: not supported with a constraint (a rewind would have to take "
                          "back grammar state); express the ban in the grammar instead")


def _check_fits(job: Job, limits: Limits) -> None:
    total = len(job.input_ids) + job.max_new_tokens
    if total > limits.max_seq_len:
        limit = f"max_seq_len={limits.max_seq_len}"
        if limits.whole_cache_pages is not None:
            limit += f" (the whole KV cache: {limits.whole_cache_pages} pages x {limits.page_size} tokens)"
        raise JobRejected(f"input_ids: {len(job.input_ids)} tokens + max_new_tokens ({job.max_new_tokens}) = "
                          f"{total} exceeds the model's {limit}")
    vocab = limits.vocab_size
    for name, ids in (("input_ids", (t for t in job.input_ids if t not in job.embedding_rows)),
                      ("stop_conditions", sorted(job.stop_token_ids or ()))):
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise JobRejected(f"{name} contains token id {bad}, outside the vocabulary [0, {vocab})")
    if job.embeddings and limits.draft_model:
        raise JobRejected("embeddings: not supported with a draft model (it has no rows for the embedding "
                          "tokens); use n-gram drafts (use_ngram_draft=True) or no speculation")
    longest = max((end - start for start, end in job.bidirectional_spans), default=0)
    if longest > limits.max_chunk_size:
        raise JobRejected(f"embeddings: an image of {longest} tokens attends to itself both ways and runs in one "
                          f"prefill chunk, longer than the engine's max_chunk_size={limits.max_chunk_size}")
    for embedding in job.embeddings:
        if embedding.width != limits.hidden_size:
            raise JobRejected(f"embeddings: vectors of width {embedding.width}, the model's "
                              f"hidden_size is {limits.hidden_size}")


@dataclass
class Preparing:
    """A constrained job whose grammar is being started on a compile thread (future: the job's
    sampling state); started: when the thread took it up (None while it waits for one), which its
    compile budget counts from."""

    future: Future[SamplingState] = field(init=False)
    started: float | None = None


@dataclass(frozen=True, slots=True)
class Started:
    """A constrained job whose grammar start ended: its sampling state, or why it failed."""

    serial: int
    state: SamplingState | None
    error: str | None = None


class PreparingJobs:
    """Constrained jobs whose grammar is being started, in the order they came: the step polls
    them, so a slow grammar never holds up the engine loop."""

    def __init__(self, setup: JobSetup) -> None:
        self.setup = setup
        self._jobs: dict[int, Preparing] = {}
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="genq-grammar", initializer=_lower_priority)

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, serial: int, constraint: Constraint, seed: int, stop_ids: frozenset[int]) -> None:
        """Start the job's grammar on a compile thread; started() hands over its sampling state."""
        preparing = self._jobs[serial] = Preparing()
        setup, budget = self.setup, self.setup.budget

        def start() -> SamplingState:
            preparing.started = time.monotonic()
            grammar = setup.grammar_compiler().start(constraint, stop_ids, budget)
            return setup.sampling_state(seed, stop_ids, grammar, None)

        preparing.future = self._pool.submit(start)

    def discard(self, serial: int) -> None:
        self._jobs.pop(serial, None)

    def started(self, now: float) -> list[Started]:
        """The jobs whose grammar started, failed or overran its compile budget (they leave)."""
        budget = self.setup.budget
        out: list[Started] = []
        for serial, preparing in list(self._jobs.items()):
            if preparing.future.done():
                del self._jobs[serial]
                try:
                    out.append(Started(serial, preparing.future.result()))
                except Exception as error:  # noqa: BLE001 - a grammar that cannot start fails its job alone
                    out.append(Started(serial, None, str(error) if isinstance(error, JobRejected)
                                       else f"constraint: {error}"))
            elif preparing.started is not None and now - preparing.started > budget.compile_timeout_s:
                del self._jobs[serial]
                out.append(Started(serial, None, f"constraint: the grammar took longer than "
                                                 f"{budget.compile_timeout_s:g} s to compile (compile_timeout_s)"))
        return out

    def wait(self, timeout: float) -> None:
        """Block until one grammar start ends, at most timeout seconds."""
        wait([p.future for p in self._jobs.values()], timeout, FIRST_COMPLETED)


class JobSetup:
    """What an admitted job's sampling starts from: the tokenizer's grammar compiler (built on a
    compile thread for the first constrained job, about a second: PreparingJobs) and token
    healing's mask. budget bounds each grammar's start."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, budget: ConstraintBudget) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.budget = budget
        self.compiler: ConstraintCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._healing_masks: dict[int, torch.Tensor] = {}  # removed token -> the tokens that may replace it

    def sampling_state(self, seed: int, stop_ids: frozenset[int], constraint: ConstraintState | None,
                       healed: int | None) -> SamplingState:
        heal_mask = self._healing_mask(healed) if healed is not None else None
        return SamplingState(seed, stop_ids, constraint, heal_mask=heal_mask)

    def grammar_compiler(self) -> ConstraintCompiler:
        """The tokenizer's grammar compiler, built by the first compile thread that needs it."""
        with self._compiler_lock:
            if self.compiler is None:
                self.compiler = ConstraintCompiler(self.tokenizer.backend.to_str(), self.vocab_size,
                                                   self.tokenizer.eos_token_id)
            return self.compiler

    def _healing_mask(self, removed: int) -> torch.Tensor:
        """Token healing: the first token must begin with the removed token's vocabulary piece."""
        mask = self._healing_masks.get(removed)
        if mask is None:
            piece = self.tokenizer.id_to_token(removed) or ""
            mask = self._healing_masks[removed] = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[[t for t in range(self.vocab_size) if (self.tokenizer.id_to_token(t) or "").startswith(piece)]] = True
        return mask
