"""The continuous-batching generator: enqueue jobs, call iterate() to advance
every active job by one scheduling step and one batched forward.

Results are EngineOutput objects (engine/outputs.py) that also read as
exllamav2's dynamic-generator dicts (result["text"], result.as_dict()):
- stage "started": the job was scheduled for the first time;
- stage "streaming": tokens produced this step; "text" is the newly released
  text (possibly "" while a stop string or a split character is held back);
- stage "eos": the final result of the job, carrying the step's last chunk
  plus eos_reason, full_completion, counts and timings.
Stop tokens count as generated tokens (token_ids, new_tokens) but never
appear in the text; stop strings never appear in the text either.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.banned_strings import MAX_REWINDS, BannedStringGuard
from engine.batch_sampler import BatchSampler, SampledLogprobs
from engine.cache import KVCache, PagePool
from engine.config import ModelConfig
from engine.constraints import ConstraintCompiler, check_constraint
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import JobRejected, QueueFull
from engine.job import Job
from engine.kv_manager import KVManager
from engine.model import CausalLM
from engine.model_runner import BatchRow, ModelRunner
from engine.outputs import EngineOutput, FinishReason, Stage, TokenLogprob
from engine.sampling import (
    SamplerSettings,
    SamplingRow,
    edited_logits,
    inputs_from_rows,
    sample,
    sampling_probs,
)
from engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.speculative import NgramDrafter, draw, verify
from engine.stops import StopStringMatcher
from engine.tokenizer import Tokenizer
from engine.weights import load_model

log = logging.getLogger(__name__)

Result = EngineOutput

DEFAULT_PAGE_SIZE = 16
DEFAULT_MAX_CHUNK_SIZE = 2048
DEFAULT_MAX_BATCH_SIZE = 256
DEFAULT_MAX_PENDING = 1024
DEFAULT_CPU_CACHE_BYTES = 1 << 30
CUDA_CACHE_FRACTION = 0.85


@dataclass(frozen=True)
class _Step:
    """A launched step: its forward/sampling work and which rows sample how."""

    work: Future[tuple[torch.Tensor, list[int], dict[int, TokenLogprob]]]
    plain: list[tuple[Sequence, int]]
    speculated: list[tuple[Sequence, int, list[int]]]
    draft_probs: dict[int, torch.Tensor]


class _Rewind(Exception):  # noqa: N818 - control flow, not an error
    """Raised while releasing a token's text: a banned string appeared; go back to generated token origin."""

    def __init__(self, origin: int) -> None:
        super().__init__(origin)
        self.origin = origin


@dataclass(frozen=True)
class GeneratorStats:
    active_jobs: int
    pending_jobs: int
    pages_total: int
    pages_used: int
    pages_free: int
    pages_cached: int
    page_size: int
    steps: int
    generated_tokens: int
    computed_prompt_tokens: int
    cached_prompt_tokens: int
    preemptions: int
    drafted_tokens: int
    accepted_draft_tokens: int
    constraint_masks: int = 0
    constraint_mask_s: float = 0.0  # computing constraint masks, on the mask thread
    constraint_mask_wait_s: float = 0.0  # of which the sampler waited for (on the step's critical path)

    @property
    def prefix_hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache instead of computed."""
        total = self.cached_prompt_tokens + self.computed_prompt_tokens
        return self.cached_prompt_tokens / total if total else 0.0


class Generator:
    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        tokenizer: Tokenizer,
        max_batch_size: int | None = None,
        max_seq_len: int | None = None,
        max_chunk_size: int | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
        max_skips: int = 16,
        prefix_caching: bool = True,
        draft_model: CausalLM | None = None,
        draft_cache: KVCache | None = None,
        num_draft_tokens: int = 4,
        use_ngram_draft: bool = False,
        max_ngram: int = 4,
        max_speculative_batch: int = 8,
        seed: int | None = None,
        overlap: bool = False,
        cuda_graphs: bool | None = None,
    ) -> None:
        """overlap: run each step's forward and sampling on a worker thread while
        this thread produces the previous step's text and results (see iterate).

        cuda_graphs: replay decode steps from CUDA graphs captured per batch-size
        bucket (engine/cuda_graphs.py); None = on for a CUDA device and a model
        whose decode forward a graph can replay. True on a CPU runs the same
        padded static buffers eagerly (what the tests check).

        Speculative decoding: pass draft_model + draft_cache (a smaller model
        of the same tokenizer; its cache has the same pages and page size, so
        the two share page tables) or use_ngram_draft=True. Either drafts up to
        num_draft_tokens per decoding job while at most max_speculative_batch
        jobs decode (beyond that, decoding is compute-bound and drafts cost more
        than they save)."""
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        self.device = cache.k.device
        self.page_size = cache.page_size
        capacity = cache.num_pages * cache.page_size
        self.max_seq_len = min(max_seq_len or model.config.max_context_len, capacity)
        self.max_chunk_size = max_chunk_size or DEFAULT_MAX_CHUNK_SIZE
        self.max_batch_size = max_batch_size or min(DEFAULT_MAX_BATCH_SIZE, self.max_chunk_size, cache.num_pages)
        if self.max_batch_size > self.max_chunk_size:
            raise ValueError(
                f"max_batch_size={self.max_batch_size} exceeds max_chunk_size={self.max_chunk_size}: "
                "every running job must be able to decode in each step"
            )
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        if draft_model is not None:
            draft_shape = None if draft_cache is None else (draft_cache.num_pages, draft_cache.page_size)
            if draft_shape != (cache.num_pages, cache.page_size):
                raise ValueError("draft_cache must have the main cache's number of pages and page size")
            if draft_model.config.vocab_size != model.config.vocab_size:
                raise ValueError(
                    f"draft model vocab_size {draft_model.config.vocab_size} != main model's {model.config.vocab_size}"
                )
        self.draft_model = draft_model
        self.draft_cache = draft_cache
        self.ngram_drafter = (
            NgramDrafter(max_ngram, num_draft_tokens, model.config.vocab_size) if use_ngram_draft else None
        )
        speculating = draft_model is not None or use_ngram_draft
        configs = [model.config] + ([draft_model.config] if draft_model is not None else [])
        self.kv = KVManager(cache.num_pages, self.page_size, prefix_caching, _releasable_window(configs))
        self.scheduler = Scheduler(
            self.kv, self.max_batch_size, self.max_chunk_size, max_skips,
            num_draft_tokens if speculating else 0, max_speculative_batch,
        )
        self.sampler = BatchSampler(self.max_batch_size, model.config.vocab_size, self.device)
        self.runner = ModelRunner(model, cache, self.max_batch_size, self.max_seq_len, draft_model, draft_cache,
                                  cuda_graphs)
        self._sequences: dict[int, Sequence] = {}
        self._next_serial = 0
        self._undelivered: list[Result] = []
        self.overlap = overlap
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="genq-forward") if overlap else None
        self._pending: list[tuple[Sequence, list[int]]] = []
        self._rewinds: dict[int, int] = {}  # serial -> generated token to go back to, after this step
        self._healing_masks: dict[int, torch.Tensor] = {}  # removed token -> the tokens that may replace it
        self._constraint_compiler: ConstraintCompiler | None = None
        self._seed_source = random.Random(seed)
        self._steps = 0
        self._generated_tokens = 0
        self._computed_prompt_tokens = 0
        self._cached_prompt_tokens = 0
        self._drafted_tokens = 0
        self._accepted_draft_tokens = 0

    @property
    def pool(self) -> PagePool:
        return self.kv.pool

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        cache_tokens: int | None = None,
        page_size: int | None = None,
        cache_memory: int | None = None,
        progress: Callable[[int, int], None] | None = None,
        draft_model_path: str | Path | None = None,
        cache_dtype: str = "auto",
        quantize: str | None = None,
        **generator_options: Any,
    ) -> Generator:
        """Load model + tokenizer from an HF directory or a .gguf file and size the paged cache
        from cache_tokens, else cache_memory bytes, else a device default
        (1 GiB on CPU, 85% of free memory on CUDA), never more than
        max_batch_size * max_seq_len tokens would use. draft_model_path loads a
        draft model for speculative decoding, with a cache of the same pages.
        cache_dtype stores K/V as the model's dtype ("auto") or quantized
        ("fp8", "q8", "q4"; kernels.KV_CACHE_DTYPES), for both caches; the same
        cache_memory then holds proportionally more tokens. quantize ("int8" or
        "int4") keeps the main model's linear layers weight-only quantized
        (engine/quantized_linear.py; a GGUF 4/8-bit file maps onto it directly)."""
        device = torch.device(device)
        tokenizer = Tokenizer.from_pretrained(path)
        model = load_model(path, device, dtype, progress, quantize)
        page_size = page_size or DEFAULT_PAGE_SIZE
        model_dtype = model.embed_tokens.weight.dtype
        per_token = KVCache.bytes_per_token(model.config, model_dtype, cache_dtype)
        if cache_tokens is None:
            if cache_memory is None:
                cache_memory = _default_cache_bytes(device)
            max_seq_len = generator_options.get("max_seq_len") or model.config.max_context_len
            max_batch = generator_options.get("max_batch_size") or DEFAULT_MAX_BATCH_SIZE
            cache_tokens = min(cache_memory // per_token, max_seq_len * max_batch)
        num_pages = max(1, -(-cache_tokens // page_size))
        cache = KVCache.allocate(model.config, num_pages, page_size, model_dtype, device, cache_dtype)
        if draft_model_path is not None:
            draft = load_model(draft_model_path, device, dtype)
            generator_options["draft_model"] = draft
            generator_options["draft_cache"] = KVCache.allocate(
                draft.config, num_pages, page_size, draft.embed_tokens.weight.dtype, device, cache_dtype
            )
        log.info(
            "loaded %s (%s, %s) with a %s KV cache of %d pages x %d tokens (%.1f MiB)",
            path, model.config.family, model_dtype, cache.cache_dtype, num_pages, page_size,
            num_pages * page_size * per_token / 2**20,
        )
        return cls(model, cache, tokenizer, **generator_options)

    # -- the job API -------------------------------------------------------

    def enqueue(self, job: Job | Seq[Job]) -> int | list[int]:
        """Queue a job (or a list of jobs, in order: their serials); returns its serial. Raises
        JobRejected if it can never run here, QueueFull if max_pending jobs are already waiting.
        A list is checked whole first, so it is queued entirely or not at all."""
        jobs = [job] if isinstance(job, Job) else list(job)
        waiting = len(self.scheduler.waiting)
        if waiting + len(jobs) > self.max_pending:
            raise QueueFull(f"{waiting} jobs already pending; {len(jobs)} more would exceed "
                            f"max_pending={self.max_pending}")
        grammars = [self._check(each) for each in jobs]
        serials = [self._enqueue(each, grammar) for each, grammar in zip(jobs, grammars, strict=True)]
        return serials[0] if isinstance(job, Job) else serials

    def warmup(self) -> float:
        """Run every code path of a step once before the first request (prefill, decode, greedy and
        sampled rows; on CUDA the kernels compile and the decode graphs are captured here), so the
        first real request does not pay for it. Needs an idle generator; leaves the counters at zero.
        Returns the seconds it took."""
        if self.num_remaining_jobs():
            raise RuntimeError("warmup() needs an idle generator")
        started = time.monotonic()
        prompt = [t % self.model.config.vocab_size for t in range(1, 2 * self.page_size + 2)]
        self.enqueue([Job(prompt, 3, stop_conditions=[], identifier="warmup-greedy"),
                      Job(prompt[:3], 3, stop_conditions=[], identifier="warmup-sampled", seed=0,
                          gen_settings=SamplerSettings(temperature=1.0, top_k=8, top_p=0.9))])
        while self.num_remaining_jobs():
            self.iterate()
        self._steps = self._generated_tokens = self._computed_prompt_tokens = self._cached_prompt_tokens = 0
        self._drafted_tokens = self._accepted_draft_tokens = 0
        self.scheduler.num_preemptions = 0
        return time.monotonic() - started

    def clear_queue(self) -> int:
        """Cancel every job, waiting or running (as exllamav2's clear_queue); their final results
        (eos_reason cancelled) come with the next iterate(). Returns how many were cancelled."""
        serials = list(self._sequences)
        for serial in serials:
            self.cancel(serial)
        return len(serials)

    def _check(self, job: Job) -> str | None:
        """JobRejected naming why the job can never run here; else its constraint's grammar, if any."""
        self._check_fits(job)
        self._check_settings(job.gen_settings)
        if job.token_healing and job.constraint is not None:
            raise JobRejected("token_healing: not supported with a constraint (the grammar decides the first "
                              "token); leave the prompt's last token to the grammar instead")
        if job.banned_strings and job.constraint is not None:
            raise JobRejected("banned_strings: not supported with a constraint (a rewind would have to take "
                              "back grammar state); express the ban in the grammar instead")
        return check_constraint(job.constraint) if job.constraint is not None else None

    def _enqueue(self, job: Job, grammar: str | None) -> int:
        """Queue a job _check() passed (grammar: what it returned)."""
        stop_ids = job.stop_token_ids
        if stop_ids is None:
            stop_ids = frozenset(self.tokenizer.eos_token_ids)
        constraint = self._constraints().start(grammar, stop_ids) if grammar is not None else None
        serial = self._next_serial
        self._next_serial += 1
        job.serial = serial
        seed = job.seed if job.seed is not None else self._seed_source.randrange(2**63)
        rng = None
        if not job.gen_settings.is_greedy:
            rng = torch.Generator(device="cpu")
            rng.manual_seed(seed)
        prompt = list(job.input_ids)
        healed = prompt.pop() if job.token_healing and len(prompt) > 1 and prompt[-1] not in job.embedding_rows \
            else None
        sequence = Sequence(
            job=job,
            serial=serial,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            stop_token_ids=stop_ids,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                [t for t in prompt if t not in job.embedding_rows],
                skip_special_tokens=not job.decode_special_tokens,
            ),
            stop_matcher=StopStringMatcher(job.stop_strings) if job.stop_strings else None,
            rng=rng,
            time_enqueued=time.monotonic(),
            seed=seed,
            constraint=constraint,
            banned_guard=BannedStringGuard(job.banned_strings) if job.banned_strings else None,
        )
        if healed is not None:
            self._heal(sequence, healed)
        self._sequences[serial] = sequence
        self.scheduler.add(sequence)
        return serial

    def _heal(self, sequence: Sequence, removed: int) -> None:
        """Token healing: the first token must begin with the removed token's vocabulary piece,
        and the text the removed token stood for is not emitted a second time."""
        job = sequence.job
        mask = self._healing_masks.get(removed)
        if mask is None:
            piece = self.tokenizer.id_to_token(removed) or ""
            vocab = self.model.config.vocab_size
            ids = [t for t in range(vocab) if (self.tokenizer.id_to_token(t) or "").startswith(piece)]
            mask = self._healing_masks[removed] = torch.zeros(vocab, dtype=torch.bool)
            mask[ids] = True
        context = IncrementalDetokenizer(self.tokenizer, [t for t in sequence.token_ids if t not in job.embedding_rows],
                                         skip_special_tokens=not job.decode_special_tokens)
        sequence.heal_mask = mask
        sequence.heal_prefix = context.add([removed]) + context.flush()
        sequence.heal_pending = len(sequence.heal_prefix)

    def _constraints(self) -> ConstraintCompiler:
        """The tokenizer's grammar compiler, built on the first constrained job (about a second)."""
        if self._constraint_compiler is None:
            self._constraint_compiler = ConstraintCompiler(self.tokenizer.backend.to_str(),
                                                           self.model.config.vocab_size, self.tokenizer.eos_token_id)
        return self._constraint_compiler

    def _check_settings(self, settings: SamplerSettings) -> None:
        try:
            settings.validate(self.model.config.vocab_size)
        except ValueError as error:
            raise JobRejected(f"gen_settings: {error}") from error

    def cancel(self, job: Job | int) -> bool:
        """Stop a job now and free its pages; its final result (eos_reason
        FinishReason.CANCELLED) comes with the next iterate(). False if it was not active."""
        serial = job if isinstance(job, int) else job.serial
        return serial is not None and self._end_now(serial, FinishReason.CANCELLED)

    def num_remaining_jobs(self) -> int:
        return len(self._sequences) + len(self._undelivered)

    def num_active_jobs(self) -> int:
        return self.scheduler.num_running

    def num_pending_jobs(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def stats(self) -> GeneratorStats:
        return GeneratorStats(
            active_jobs=self.scheduler.num_running,
            pending_jobs=len(self.scheduler.waiting),
            pages_total=self.pool.num_pages,
            pages_used=self.pool.num_used,
            pages_free=self.pool.num_free,
            pages_cached=self.pool.num_cached,
            page_size=self.page_size,
            steps=self._steps,
            generated_tokens=self._generated_tokens,
            computed_prompt_tokens=self._computed_prompt_tokens,
            cached_prompt_tokens=self._cached_prompt_tokens,
            preemptions=self.scheduler.num_preemptions,
            drafted_tokens=self._drafted_tokens,
            accepted_draft_tokens=self._accepted_draft_tokens,
            **self._mask_stats(),
        )

    def _mask_stats(self) -> dict[str, Any]:
        times = self._constraint_compiler.times if self._constraint_compiler is not None else None
        if times is None:
            return {}
        return {"constraint_masks": times.masks, "constraint_mask_s": times.computed_s,
                "constraint_mask_wait_s": times.waited_s}

    def iterate(self) -> list[Result]:
        """One scheduling step and one batched forward; returns every result
        produced (started / streaming / eos) in this step. With overlap, the
        text of the tokens a step samples (detokenizing, stop strings, results)
        is produced while the next step's forward runs, so a token's result
        comes with the following iterate()."""
        results, self._undelivered = self._undelivered, []
        schedule = self.scheduler.schedule()
        for sequence in schedule.preempted:
            self._release_rows(sequence.serial)
        now = time.monotonic()
        for sequence in schedule.started:
            sequence.time_started = now
            self._cached_prompt_tokens += sequence.cached_tokens
            results.append(self._result(sequence, Stage.STARTED))
        step = self._launch(schedule) if schedule.scheduled else None
        late: list[Sequence] = []
        if self.overlap:
            results += self._emit_pending(late)
        ended = self._complete(schedule, step) if step is not None else []
        results += self._prefill_progress(schedule)
        if not self.overlap:
            results += self._emit_pending(late)
        for sequence in late:
            self.scheduler.remove(sequence)
        for sequence in ended + late:
            self._release_rows(sequence.serial)
        for serial, origin in self._rewinds.items():
            self._rewind(serial, origin)
        self._rewinds.clear()
        return results

    def _prefill_progress(self, schedule: SchedulerOutput) -> list[Result]:
        """exllamav2's prefill stage: for each prompt computed only in part so far (chunked), how far."""
        results = []
        for item in schedule.scheduled:
            sequence = item.sequence
            if not item.samples and sequence.serial in self._sequences:
                result = self._result(sequence, Stage.PREFILL)
                result.curr_progress = min(sequence.num_computed, sequence.num_prompt_tokens)
                result.max_progress = sequence.num_prompt_tokens
                results.append(result)
        return results

    def _launch(self, schedule: SchedulerOutput) -> _Step:
        """Draft, then start the forward and the sampling of the plain rows
        (on the overlap thread, or here)."""
        self._steps += 1
        # a stateful sampler (mirostat's mu moves with each token) cannot verify drafts in one pass:
        # such jobs decode one token a step, without drafts
        drafts, draft_probs = self._fill_drafts([item for item in schedule.scheduled
                                                 if item.draft_room and not item.sequence.job.gen_settings.stateful])
        rows: list[BatchRow] = []
        plain: list[tuple[Sequence, int]] = []
        speculated: list[tuple[Sequence, int, list[int]]] = []
        row = 0
        for item in schedule.scheduled:
            sequence = item.sequence
            draft = drafts.get(sequence.serial, []) if drafts else []
            rows.append(self._row(item, draft))
            if item.samples and draft:
                speculated.append((sequence, row, draft))
                row += 1 + len(draft)
            elif item.samples:
                plain.append((sequence, row))
                row += 1
            if sequence.num_computed < sequence.num_prompt_tokens:
                self._computed_prompt_tokens += min(item.num_tokens, sequence.num_prompt_tokens - sequence.num_computed)
        if self._executor is None:
            work: Future[tuple[torch.Tensor, list[int], dict[int, TokenLogprob]]] = Future()
            work.set_result(self._forward_and_sample(rows, plain))
        else:
            work = self._executor.submit(self._forward_and_sample, rows, plain)
        return _Step(work, plain, speculated, draft_probs)

    @torch.inference_mode()
    def _forward_and_sample(self, rows: list[BatchRow], plain: list[tuple[Sequence, int]]
                            ) -> tuple[torch.Tensor, list[int], dict[int, TokenLogprob]]:
        """The device work of a step and its read-back: the plain rows' sampled ids (and the
        log-probabilities of the rows whose jobs asked for them), by index into plain."""
        logits = self.runner.forward(rows)
        if not plain:
            return logits, [], {}
        rows_logits = logits if len(plain) == logits.shape[0] else logits[[r for _, r in plain]]
        sequences = [s for s, _ in plain]
        tokens = self.sampler.sample(rows_logits, sequences).tolist()
        sampled = self.sampler.last_logprobs
        return logits, tokens, sampled.to_host([tokens[row] for row in sampled.rows]) if sampled is not None else {}

    def _complete(self, schedule: SchedulerOutput, step: _Step) -> list[Sequence]:
        """Wait for the step, verify drafts, append the tokens and update the
        scheduler; returns the sequences a stop token or max_new_tokens ended."""
        logits, tokens, logprobs = step.work.result()
        failed: dict[int, str] = {}  # serial -> why: this job fails alone, its batch neighbours go on
        for row, token in enumerate(tokens) if tokens and min(tokens) < 0 else ():
            if token < 0:
                try:
                    self.sampler.raise_for_row(row)
                except ValueError as error:
                    failed[step.plain[row][0].serial] = str(error)
        emitted = [(s, [t]) for (s, _), t in zip(step.plain, tokens) if s.serial not in failed]
        for i, logprob in logprobs.items():
            step.plain[i][0].logprobs.append(logprob)
        accepted: dict[int, int] = {}
        speculated_logprobs: dict[int, list[TokenLogprob]] = {}
        for sequence, row, draft in step.speculated:
            rows_logits = logits[row : row + 1 + len(draft)]
            try:
                if sequence.constraint is not None:  # each verify position sampled under its own mask
                    allowed = sequence.constraint.draft_masks(draft).to(rows_logits.device)
                    rows_logits = rows_logits.masked_fill(~allowed, -math.inf)
                verified = self._verify(sequence, rows_logits, draft, step.draft_probs.get(sequence.serial))
                if sequence.job.logprobs:
                    speculated_logprobs[sequence.serial] = self._verify_logprobs(sequence, rows_logits, draft,
                                                                                 verified)
            except (ValueError, RuntimeError) as error:
                failed[sequence.serial] = str(error)
                continue
            self.sampler.record(sequence, verified)
            accepted[sequence.serial] = len(verified) - 1
            emitted.append((sequence, verified))
        ended: list[Sequence] = []
        for sequence, new in emitted:
            if sequence.serial not in self._sequences or sequence.serial in self._rewinds:
                continue  # a stop string ended it, or a banned string takes it back, while this step ran
            try:
                kept, done = self._append_tokens(sequence, new)
            except RuntimeError as error:  # a constraint refusing what was sampled: this job's fault alone
                failed[sequence.serial] = str(error)
                continue
            if sequence.serial in speculated_logprobs:
                sequence.logprobs.extend(speculated_logprobs[sequence.serial][: len(kept)])
            self._pending.append((sequence, kept))
            if done:
                ended.append(sequence)
        self.scheduler.update_from_output(schedule, accepted, ended)
        for serial, message in failed.items():
            self._end_now(serial, FinishReason.ERROR, message)
        return ended

    def _end_now(self, serial: int, reason: FinishReason, error: str | None = None) -> bool:
        """End a job at once (cancelled, or failed inside a step) and free its pages; its final result
        comes with the next iterate(). False if it was not active."""
        sequence = self._sequences.pop(serial, None)
        if sequence is None:
            return False
        if error is not None:
            log.warning("job %r failed inside a step: %s", sequence.job.identifier, error)
        self.scheduler.remove(sequence)
        self._release_rows(serial)
        result = self._final_result(sequence, "", [], reason)
        result.error = error
        self._undelivered.append(result)
        return True

    def _emit_pending(self, finished: list[Sequence]) -> list[Result]:
        """The text and results of the tokens appended last; sequences a stop
        string ended go to finished (still to be removed from the scheduler)."""
        pending, self._pending = self._pending, []
        now = time.monotonic()
        results = []
        for sequence, tokens in pending:
            if sequence.serial not in self._sequences:
                continue  # cancelled meanwhile
            result = self._emit(sequence, tokens, now)
            results.append(result)
            if result.eos and result.eos_reason is FinishReason.STOP_STRING:
                finished.append(sequence)
        return results

    def _fill_drafts(
        self, items: list[ScheduledSequence]
    ) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """Draft tokens into the room the scheduler left: serial -> draft ids,
        and the draft model's distributions for sampled jobs (verify needs q)."""
        if not items:
            return {}, {}
        if self.ngram_drafter is not None:
            drafts = {item.sequence.serial: self.ngram_drafter(item.sequence)[: item.draft_room] for item in items}
            probs: dict[int, torch.Tensor] = {}
        elif self.draft_model is not None and self.draft_cache is not None:
            drafts, probs = self._draft_with_model(items)
        else:
            return {}, {}
        for item in items:  # a constrained job's draft stops where its grammar would refuse it
            constraint = item.sequence.constraint
            serial = item.sequence.serial
            if constraint is not None and drafts.get(serial):
                drafts[serial] = constraint.valid_prefix(drafts[serial])
                if serial in probs:
                    probs[serial] = probs[serial][: len(drafts[serial])]
        return drafts, probs

    @torch.inference_mode()
    def _draft_with_model(self, items: list[ScheduledSequence]) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """Run the draft model autoregressively, one batched forward per draft
        position, over the sequences' own pages in the draft cache."""
        drafts: dict[int, list[int]] = {item.sequence.serial: [] for item in items}
        probs: dict[int, list[torch.Tensor]] = {item.sequence.serial: [] for item in items}
        for step in range(max(item.draft_room for item in items)):
            active = [item.sequence for item in items if item.draft_room > step]
            logits = self.runner.draft_forward([
                BatchRow(s, len(s.token_ids) - 1 + step, [drafts[s.serial][-1] if step else s.token_ids[-1]], 1)
                for s in active
            ])
            rows = [self._sampling_row(s, drafts[s.serial]) for s in active]
            greedy = [row.settings.is_greedy for row in rows]
            q = sampling_probs(logits, rows)
            tokens = sample(logits, rows).tolist() if all(greedy) else None
            for i, sequence in enumerate(active):
                if greedy[i]:
                    token = int(q[i].argmax()) if tokens is None else tokens[i]
                else:
                    probs[sequence.serial].append(q[i])
                    token = draw(q[i], sequence.rng)
                drafts[sequence.serial].append(token)
        return drafts, {serial: torch.stack(q) for serial, q in probs.items() if q}

    def _verify(
        self, sequence: Sequence, logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None
    ) -> list[int]:
        """Check a sequence's draft against the main model: the tokens to emit."""
        rows = [self._sampling_row(sequence, draft[:i]) for i in range(len(draft) + 1)]
        tokens = verify(logits, rows, draft, draft_probs)
        accepted = len(tokens) - 1
        sequence.accepted_draft_tokens += accepted
        sequence.rejected_draft_tokens += len(draft) - accepted
        self._accepted_draft_tokens += accepted
        self._drafted_tokens += len(draft)
        return tokens

    def _verify_logprobs(self, sequence: Sequence, logits: torch.Tensor, draft: list[int], verified: list[int]
                         ) -> list[TokenLogprob]:
        """The logprobs of a speculated step's emitted tokens, each from its own verify position,
        as the batched sampler computes them for plain rows (edited logits at the job's temperature)."""
        n = len(verified)
        rows = [self._sampling_row(sequence, draft[:i]) for i in range(n)]
        x, _ = edited_logits(logits[:n], inputs_from_rows(logits[:n], rows))
        temperature = torch.full((n,), sequence.job.gen_settings.temperature, device=x.device)
        ids = torch.tensor(verified, device=x.device)
        by_row = SampledLogprobs.compute(x, temperature, ids, list(range(n)), [sequence.job.top_logprobs] * n)
        return list(by_row.to_host(verified).values())

    def generate(
        self,
        prompt: str | Seq[str],
        max_new_tokens: int = 128,
        min_new_tokens: int = 0,
        gen_settings: SamplerSettings | None = None,
        stop_conditions: Seq[int | str] | None = None,
        seed: int | None = None,
        add_bos: bool = True,
        decode_special_tokens: bool = False,
    ) -> str | list[str]:
        """Blocking convenience: complete one prompt (-> str) or many
        (-> list[str], in order). Needs an otherwise idle generator."""
        if self.num_remaining_jobs():
            raise RuntimeError("generate() needs an idle generator; use enqueue()/iterate() alongside other jobs")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        jobs = [
            Job(
                self.tokenizer.encode(text, add_special_tokens=add_bos),
                max_new_tokens,
                min_new_tokens=min_new_tokens,
                stop_conditions=stop_conditions,
                gen_settings=gen_settings,
                seed=None if seed is None else seed + i,
                decode_special_tokens=decode_special_tokens,
            )
            for i, text in enumerate(prompts)
        ]
        completions: dict[int, str] = {}
        for job in jobs:
            self.enqueue(job)
        while self.num_remaining_jobs():
            for result in self.iterate():
                if result.eos and result.full_completion is not None:
                    completions[result.serial] = result.full_completion
        texts = [completions[job.serial] for job in jobs if job.serial is not None]
        return texts[0] if isinstance(prompt, str) else texts

    # -- internals ---------------------------------------------------------

    def _check_fits(self, job: Job) -> None:
        total = len(job.input_ids) + job.max_new_tokens
        if total > self.max_seq_len:
            limit = f"max_seq_len={self.max_seq_len}"
            if self.max_seq_len == self.pool.num_pages * self.page_size:
                limit += f" (the whole KV cache: {self.pool.num_pages} pages x {self.page_size} tokens)"
            raise JobRejected(
                f"prompt ({len(job.input_ids)} tokens) + max_new_tokens ({job.max_new_tokens}) = {total} "
                f"exceeds {limit}"
            )
        vocab = self.model.config.vocab_size
        bad = next((t for t in job.input_ids if not 0 <= t < vocab and t not in job.embedding_rows), None)
        if bad is not None:
            raise JobRejected(f"input_ids contains token id {bad}, outside the vocabulary [0, {vocab})")
        if job.embeddings and self.draft_model is not None:
            raise JobRejected("embeddings: not supported with a draft model (it has no rows for the embedding "
                              "tokens); use n-gram drafts (use_ngram_draft=True) or no speculation")
        hidden = self.model.config.hidden_size
        for embedding in job.embeddings:
            if embedding.vectors.shape[1] != hidden:
                raise JobRejected(
                    f"embeddings: vectors of width {embedding.vectors.shape[1]}, the model's hidden_size is {hidden}"
                )

    @staticmethod
    def _row(item: ScheduledSequence, draft: list[int]) -> BatchRow:
        sequence = item.sequence
        start = sequence.num_computed
        if item.num_tokens == 1 and not draft:
            return BatchRow(sequence, start, (sequence.token_ids[start],), 1 if item.samples else 0)
        tokens = sequence.token_ids[start : start + item.num_tokens]
        if draft:
            tokens += draft
        return BatchRow(sequence, start, tokens, 1 + len(draft) if item.samples else 0)

    def _release_rows(self, serial: int) -> None:
        """A sequence left the running batch: free its sampler slot and table row."""
        self.sampler.release(serial)
        self.runner.release(serial)

    def _sampling_row(self, sequence: Sequence, pending: list[int] | None = None) -> SamplingRow:
        """Sampling inputs for the sequence's next token, as if `pending`
        (accepted draft tokens) had already been appended."""
        job = sequence.job
        pending = pending or []
        generated = sequence.num_generated + len(pending)
        suppress = tuple(sequence.stop_token_ids) if generated < job.min_new_tokens else ()
        banned = sequence.banned_at.get(generated) if sequence.banned_at else None
        if banned:
            suppress += tuple(banned)
        return SamplingRow(
            settings=job.gen_settings,
            prompt_ids=job.input_ids,
            output_ids=sequence.output_ids + pending if pending else sequence.output_ids,
            generator=sequence.rng,
            suppress_ids=suppress,
        )

    def _append_tokens(self, sequence: Sequence, tokens: list[int]) -> tuple[list[int], bool]:
        """Append a step's tokens up to the first stop token (once min_new_tokens
        allows stopping) or max_new_tokens; True if one of those ended the job.
        Stop strings need the text: _emit finds them."""
        job = sequence.job
        kept, done = tokens, False
        for i, token in enumerate(tokens):
            sequence.append(token)
            self._generated_tokens += 1
            generated = sequence.num_generated
            stopped = token in sequence.stop_token_ids and generated >= job.min_new_tokens
            if generated >= job.max_new_tokens or stopped:
                kept, done = tokens[: i + 1], True
                break
        constraint = sequence.constraint
        if constraint is not None:
            constraint.consume(kept)  # and computes the next mask now, before the next forward
            if constraint.complete and not done:
                sequence.constraint_done_at = sequence.num_generated
                done = True
        return kept, done

    def _emit(self, sequence: Sequence, tokens: list[int], now: float) -> Result:
        """Release the text of tokens _append_tokens appended; the first stop
        condition finishes the job, and tokens after a stop string are taken back."""
        if sequence.time_first_token is None:
            sequence.time_first_token = now
        texts: list[str] = []
        before = sequence.num_generated - len(tokens)
        for i, token in enumerate(tokens):
            try:
                finished = self._release_token(sequence, token, before + i + 1, texts)
            except _Rewind as rewind:
                return self._rewinding(sequence, "".join(texts), tokens, before, rewind.origin)
            if finished is not None:
                reason, trigger = finished
                extra = len(tokens) - i - 1
                if extra:
                    del sequence.token_ids[-extra:], sequence.output_ids[-extra:], sequence.logprobs[-extra:]
                    self._generated_tokens -= extra
                return self._finish(sequence, "".join(texts), tokens[: i + 1], reason, trigger)
        text = "".join(texts)
        sequence.completion.append(text)
        return self._result(sequence, Stage.STREAMING, text, tokens)

    def _release_token(self, sequence: Sequence, token: int, generated: int, texts: list[str]
                       ) -> tuple[FinishReason, int | str | None] | None:
        """Release one appended token's text (generated: the job's token count
        up to it); (eos_reason, trigger) if it ends the job. Raises _Rewind when
        the text completes a banned string."""
        job = sequence.job
        can_stop = generated >= job.min_new_tokens
        if token in sequence.stop_token_ids and can_stop:
            texts.append(self._release_end(sequence, generated - 1, can_stop=True)[0])
            return FinishReason.STOP_TOKEN, token
        detokenizer = sequence.detokenizer
        if sequence.banned_guard is None and not sequence.heal_pending:  # the text goes to the stop matcher alone
            text, stop_string = self._match_stops(sequence, detokenizer.add((token,)), can_stop)
        else:
            origin = generated - 1 - detokenizer.num_held
            text = detokenizer.add((token,))
            text, stop_string = self._release(sequence, text, can_stop, origin, generated - detokenizer.num_held)
        texts.append(text)
        if stop_string is not None:
            return FinishReason.STOP_STRING, stop_string
        if generated == sequence.constraint_done_at:
            texts.append(self._release_end(sequence, generated, can_stop=False)[0])
            return FinishReason.CONSTRAINT_COMPLETE, None
        if generated >= job.max_new_tokens:
            tail, stop_string = self._release_end(sequence, generated, can_stop)
            texts.append(tail)
            if stop_string is not None:
                return FinishReason.STOP_STRING, stop_string
            return FinishReason.MAX_NEW_TOKENS, None
        return None

    def _release_end(self, sequence: Sequence, generated: int, can_stop: bool) -> tuple[str, str | None]:
        """Generation ends after `generated` tokens: release all that is held (detokenizer,
        banned-string guard, stop matcher); a stop string the held text completes still counts
        when can_stop."""
        detokenizer = sequence.detokenizer
        origin = generated - detokenizer.num_held
        text, stop_string = self._release(sequence, detokenizer.flush(), can_stop, origin, generated)
        if stop_string is None and sequence.banned_guard is not None:
            held, stop_string = self._match_stops(sequence, sequence.banned_guard.flush(), can_stop)
            text += held
        if stop_string is None and sequence.stop_matcher is not None:
            text += sequence.stop_matcher.flush()
        return text, stop_string

    def _release(self, sequence: Sequence, text: str, can_stop: bool, origin: int, sealed: int
                 ) -> tuple[str, str | None]:
        """Pass detokenized text (from generated token `origin` on; tokens before `sealed` give no
        more) through the banned-string guard, then the stop-string matcher."""
        if sequence.heal_pending and text:
            dropped = min(sequence.heal_pending, len(text))
            text, sequence.heal_pending = text[dropped:], sequence.heal_pending - dropped
        guard = sequence.banned_guard
        if guard is not None:
            text, rewind_to = guard.feed(text, origin, sealed)
            if rewind_to is not None:
                raise _Rewind(rewind_to)
        return self._match_stops(sequence, text, can_stop)

    @staticmethod
    def _match_stops(sequence: Sequence, text: str, can_stop: bool) -> tuple[str, str | None]:
        if sequence.stop_matcher is None:
            return text, None
        return sequence.stop_matcher.feed(text, can_stop)

    def _rewinding(self, sequence: Sequence, text: str, tokens: list[int], before: int, origin: int) -> Result:
        """The streaming result of a step whose text completed a banned string: the text released
        before it and the step's tokens that stay; the rewind itself happens after the step."""
        self._rewinds[sequence.serial] = origin
        sequence.completion.append(text)
        kept = tokens[: max(0, origin - before)]
        result = self._result(sequence, Stage.STREAMING, text, kept)
        if sequence.job.logprobs:
            result.logprobs = sequence.logprobs[before : before + len(kept)]
        return result

    def _rewind(self, serial: int, origin: int) -> None:
        """Take a job back to generated token `origin`, ban that token there, and queue it to go on
        from there (its kept prefix comes back from the prefix cache)."""
        sequence = self._sequences.get(serial)
        if sequence is None or sequence.banned_guard is None:
            return  # cancelled meanwhile
        sequence.rewinds += 1
        if sequence.rewinds > MAX_REWINDS:
            self._end_now(serial, FinishReason.ERROR,
                          f"banned_strings: still producing one of {list(sequence.job.banned_strings)!r} after "
                          f"{MAX_REWINDS} rewinds")
            return
        token = sequence.output_ids[origin]
        self._generated_tokens -= sequence.rewind(origin)
        bans = {position: ids for position, ids in sequence.banned_at.items() if position < origin}
        bans[origin] = sequence.banned_at.get(origin, frozenset()) | {token}
        sequence.banned_at = bans
        sequence.banned_guard.rewind(origin)
        if origin == 0:
            sequence.heal_pending = len(sequence.heal_prefix)
        job = sequence.job
        sequence.detokenizer = IncrementalDetokenizer(
            self.tokenizer, [t for t in sequence.token_ids if t not in job.embedding_rows],
            skip_special_tokens=not job.decode_special_tokens,
        )
        self._release_rows(serial)
        self.scheduler.requeue(sequence)

    def _finish(self, sequence: Sequence, text: str, token_ids: list[int], reason: FinishReason,
                trigger: int | str | None) -> EngineOutput:
        sequence.completion.append(text)
        self._sequences.pop(sequence.serial, None)
        result = self._final_result(sequence, text, token_ids, reason)
        if isinstance(trigger, int):
            result.eos_token_id = trigger
            result.eos_token_str = self.tokenizer.decode([trigger], skip_special_tokens=False)
        elif isinstance(trigger, str):
            result.eos_string = trigger
        return result

    @staticmethod
    def _result(sequence: Sequence, stage: Stage, text: str = "", token_ids: list[int] | None = None) -> EngineOutput:
        token_ids = token_ids or []
        job = sequence.job
        return EngineOutput(job, sequence.serial, job.identifier, stage, False, text, token_ids,
                            None if not job.logprobs else _step_logprobs(sequence, token_ids))

    def _final_result(self, sequence: Sequence, text: str, token_ids: list[int], reason: FinishReason
                      ) -> EngineOutput:
        now = time.monotonic()
        started = sequence.time_started if sequence.time_started is not None else now
        first = sequence.time_first_token if sequence.time_first_token is not None else now
        return EngineOutput(
            sequence.job, sequence.serial, sequence.job.identifier, Stage.EOS, True, text, token_ids,
            logprobs=_step_logprobs(sequence, token_ids),
            eos_reason=reason,
            full_completion="".join(sequence.completion),
            completion_ids=list(sequence.output_ids),
            completion_logprobs=list(sequence.logprobs) if sequence.job.logprobs else None,
            new_tokens=sequence.num_generated,
            prompt_tokens=sequence.num_prompt_tokens,
            cached_tokens=sequence.cached_tokens,
            accepted_draft_tokens=sequence.accepted_draft_tokens,
            rejected_draft_tokens=sequence.rejected_draft_tokens,
            time_enqueued=started - sequence.time_enqueued,
            time_prefill=first - started,
            time_generate=now - first,
        )


def _step_logprobs(sequence: Sequence, token_ids: list[int]) -> list[TokenLogprob] | None:
    """The logprobs of a result's tokens (the last ones appended), for jobs that asked."""
    if not sequence.job.logprobs:
        return None
    return sequence.logprobs[len(sequence.logprobs) - len(token_ids):] if token_ids else []


def _releasable_window(configs: Seq[ModelConfig]) -> int | None:
    """The sliding window past which no model on the shared pages reads, or
    None when some model attends globally."""
    windows = [config.sliding_window for config in configs]
    if any(window is None for window in windows):
        return None
    return max(w for w in windows if w is not None)


def _default_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_CACHE_FRACTION)
    return DEFAULT_CPU_CACHE_BYTES
