"""A synthetic engine for measuring the service's own limits: a Generator whose forward is a paced
wait instead of a model.

With it a worker streams real text at a set rate (tokens/s over the whole batch, e.g. the 5,000 to
10,000 an H100 decodes for an 8B model), so that the worker's loop, Redis, the gateway and the
clients can be measured at GPU token rates on any machine (bench/service_ceiling.py). It is a
benchmark and test tool only (`genq worker --synthetic-rate`, GENQ_SYNTHETIC_RATE), never a default.

What is real: the model directory's tokenizer and config (no weights are read), admission
(engine/admission.py), and the text path of the engine, the output processor
(engine/output_processor.py: detokenizer, stop strings, max_new_tokens), so every EngineOutput is
the one the real engine would make for these tokens. What is not: each step gives every running job
one token, the next word of a fixed cycle of the vocabulary's ordinary word tokens (a job's k-th
token is word k mod the cycle's length, so every job writes the same text), and the step lasts jobs / rate
seconds, plus a fixed floor when one is set (`step_s`: a GPU decode step's weight reads, which every step
pays whatever its batch), waited with the GIL released as a GPU forward is; prompts cost nothing and KV pages are not
modelled. Requests the synthetic engine cannot honour (constraints, logprobs, banned strings, token
healing, images, LoRA adapters) are refused at enqueue, naming the field.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from engine.admission import Limits
from engine.config import ModelConfig
from engine.engine_config import EngineConfig, resolve_limits
from engine.errors import JobRejected
from engine.generator import Generator
from engine.job import Job
from engine.kv_manager import KVManager
from engine.lora import AdapterRegistry
from engine.model import CausalLM
from engine.output_processor import OutputProcessor, StepTokens
from engine.outputs import EngineOutput, FinishReason, Stage
from engine.sequence import Sequence
from engine.stats import GeneratorStats, StepCounters
from engine.tokenizer import Tokenizer

WORD_CYCLE = 64
"""Word tokens the synthetic jobs cycle through."""
WORD_RE = re.compile(r" [a-z]{3,}")
"""An ordinary word token: one space, then lowercase letters (decodes alike alone and in any text)."""
SYNTHETIC_CACHE_TOKENS = 1 << 20
"""The page pool the stats report when no cache size is set: nothing is allocated."""


def word_tokens(tokenizer: Tokenizer, vocab_size: int, count: int = WORD_CYCLE) -> list[int]:
    """The first `count` ids of the vocabulary whose token reads as one ordinary word."""
    words: list[int] = []
    for token_id in range(vocab_size):
        if WORD_RE.fullmatch(tokenizer.decode([token_id], skip_special_tokens=False)):
            words.append(token_id)
            if len(words) == count:
                return words
    if not words:
        raise ValueError("synthetic engine: the tokenizer has no ordinary word tokens ( [a-z]{3,}) to generate")
    return words


class SyntheticGenerator(Generator):
    """The worker's side of the Generator API (enqueue, iterate, cancel, counts, stats) with a
    paced wait for a forward. `wait(seconds)` is the forward's wait (time.sleep releases the GIL;
    the pacing test passes a recorder). A subclass, so the worker takes it where it takes a
    Generator; Generator.__init__ is not called: it builds the model's runner, sampler and
    scheduler, none of which run here, and this class sets every attribute the worker reads."""

    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig, rate: float,
                 config: EngineConfig | None = None, wait: Callable[[float], None] = time.sleep,
                 step_s: float = 0.0) -> None:
        if rate <= 0:
            raise ValueError(f"synthetic rate: {rate} tokens/s must be above 0")
        if step_s < 0:
            raise ValueError(f"synthetic step floor: {step_s} s must not be negative")
        self.config = config = config or EngineConfig()
        self.rate, self.wait, self.step_s = rate, wait, step_s
        self.tokenizer = tokenizer
        with torch.device("meta"):  # the config's model, with no memory: what the card and the tasks read
            self.model = CausalLM(model_config)
        self.device = torch.device("cpu")
        self.page_size = config.cache.page_size
        num_pages = max(1, (config.cache.cache_tokens or SYNTHETIC_CACHE_TOKENS) // self.page_size)
        limits = resolve_limits(config.scheduler, model_config.max_context_len, num_pages, self.page_size)
        self.max_seq_len, self.max_chunk_size = limits.max_seq_len, limits.max_chunk_size
        self.max_batch_size, self.max_pending = limits.max_batch_size, config.scheduler.max_pending
        self.kv = KVManager(num_pages, self.page_size, prefix_caching=False)
        self.limits = Limits(self.max_seq_len, model_config.vocab_size, model_config.hidden_size, self.page_size,
                             None, False, self.max_chunk_size)
        self.outputs = OutputProcessor(tokenizer)
        self.counters = StepCounters()
        self.vision = None
        self.overlap = False
        self.adapters = AdapterRegistry(model_config, torch.float32, self.device)
        self.words = word_tokens(tokenizer, model_config.vocab_size)
        self.forward_s = 0.0  # the paced waits asked for so far: the engine's own time
        self._next_serial = 0
        self._sequences: dict[int, Sequence] = {}
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._undelivered: list[EngineOutput] = []

    @classmethod
    def from_model_dir(cls, path: str | Path, rate: float, config: EngineConfig | None = None, step_s: float = 0.0
                       ) -> SyntheticGenerator:
        """The tokenizer and config of an HF model directory (its weights are never read)."""
        if not Path(path).is_dir():
            raise ValueError(f"synthetic engine: {path} is not an HF model directory (its tokenizer and "
                             "config.json are what it reads)")
        return cls(Tokenizer.from_pretrained(path), ModelConfig.from_dir(path), rate, config, step_s=step_s)

    # -- the job API -----------------------------------------------------------------

    def enqueue(self, job: Job | Seq[Job]) -> int | list[int]:
        jobs = self._admitted(job)
        for each in jobs:
            _check_synthesizable(each)
            self.adapters.resolve(each.adapter)
        serials = [self._add(each) for each in jobs]
        return serials[0] if isinstance(job, Job) else serials

    def _add(self, job: Job) -> int:
        stop_ids = job.stop_token_ids if job.stop_token_ids is not None else frozenset(self.tokenizer.eos_token_ids)
        serial = job.serial = self._next_serial
        self._next_serial += 1
        sequence = Sequence(job, serial, list(job.input_ids), len(job.input_ids), time.monotonic())
        self.outputs.add(sequence, stop_ids, None)
        self._sequences[serial] = sequence
        self._waiting.append(sequence)
        return serial

    def warmup(self) -> float:
        """Nothing to compile or capture."""
        return 0.0

    def cancel(self, job: Job | int) -> bool:
        serial = job if isinstance(job, int) else job.serial
        sequence = self._sequences.pop(serial, None) if serial is not None else None
        if sequence is None:
            return False
        for queue in (self._waiting, self._running):
            if sequence in queue:
                queue.remove(sequence)
        self._undelivered.append(self.outputs.final(sequence, FinishReason.CANCELLED))
        return True

    def num_remaining_jobs(self) -> int:
        return len(self._sequences) + len(self._undelivered)

    def num_active_jobs(self) -> int:
        return len(self._running)

    def num_pending_jobs(self) -> int:
        return len(self._waiting)

    @property
    def stats(self) -> GeneratorStats:
        pool = self.kv.pool
        return GeneratorStats(
            active_jobs=len(self._running), pending_jobs=len(self._waiting), pages_total=pool.num_pages,
            pages_used=0, pages_free=pool.num_pages, pages_cached=0, page_size=self.page_size,
            steps=self.counters.steps, generated_tokens=self.counters.generated_tokens,
            computed_prompt_tokens=self.counters.computed_prompt_tokens, cached_prompt_tokens=0, preemptions=0,
            drafted_tokens=0, accepted_draft_tokens=0, forward_wait_s=self.forward_s)

    # -- the step --------------------------------------------------------------------

    def iterate(self) -> list[EngineOutput]:
        """Start waiting jobs up to max_batch_size, wait step_s + jobs / rate seconds, then give every
        running job its next word token; the results, as the real engine's."""
        results, self._undelivered = self._undelivered, []
        now = time.monotonic()
        while self._waiting and len(self._running) < self.max_batch_size:
            sequence = self._waiting.popleft()
            sequence.time_started = now
            self.counters.computed_prompt_tokens += sequence.num_prompt_tokens
            self._running.append(sequence)
            results.append(self.outputs.output(sequence, Stage.STARTED))
        if not self._running:
            return results
        duration = self.step_s + len(self._running) / self.rate
        self.wait(duration)
        self.forward_s += duration
        self.counters.steps += 1
        appended = []
        for sequence in self._running:
            token = self.words[sequence.num_generated % len(self.words)]
            sequence.append(token)
            appended.append(StepTokens(sequence, [token]))
        self.counters.generated_tokens += len(appended)
        processed = self.outputs.process(appended, time.monotonic())
        for finished in processed.finished:
            sequence = self._sequences.pop(finished.serial)
            sequence.rewind(finished.keep)
            self._running.remove(sequence)
        return results + processed.outputs


def _check_synthesizable(job: Job) -> None:
    """JobRejected naming what the synthetic engine cannot produce."""
    refused = {"constraint": job.constraint is not None, "logprobs": bool(job.logprobs),
               "prompt_logprobs": job.prompt_logprobs is not None, "banned_strings": bool(job.banned_strings),
               "token_healing": job.token_healing, "images": bool(job.embedding_rows)}
    for name, asked in refused.items():
        if asked:
            raise JobRejected(f"{name}: not produced by the synthetic engine (GENQ_SYNTHETIC_RATE, a benchmark tool)")
