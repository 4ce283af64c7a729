"""The continuous-batching generator: enqueue jobs, call iterate() to advance every active job by
one scheduling step and one batched forward.

A step reads as nano-vllm's and vLLM v1's do: schedule → propose drafts → forward → sample (plain
and verify rows in one batched draw) → process outputs → update the scheduler → apply the
decisions the output processor returned (finish, fail, rewind). With overlap, the text of a step's
tokens is produced while the next step's forward runs, so a token's result comes with the
following iterate().

Results are EngineOutput objects (engine/outputs.py) that also read as exllamav2's
dynamic-generator dicts: stage "started" (first scheduled), "prefill" (a chunked prompt's
progress), "streaming" (the step's new text, possibly "" while a stop string or a split
character is held back), "eos" (the final result: the step's last chunk plus eos_reason,
full_completion, counts and timings).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.admission import JobSetup, Limits, PreparingJobs, admit
from engine.batch_sampler import BatchSampler
from engine.cache import KVCache, PagePool
from engine.encoder_inputs import encode_step
from engine.engine_config import EngineConfig, resolve_limits
from engine.errors import QueueFull
from engine.job import Job
from engine.kv_manager import KVManager
from engine.loading import check_draft_pair, load_engine
from engine.lora import AdapterRegistry, LoraAdapter
from engine.model import CausalLM
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor, ProcessedStep, StepTokens
from engine.outputs import EngineOutput, FinishReason, Stage
from engine.sampler_settings import SamplerSettings
from engine.sampling_state import SamplingState
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.spec_decode import Drafter
from engine.stats import GeneratorStats, StepCounters, collect
from engine.step_batch import Launched, StepBatch, StepLauncher, take_tokens
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.vision.images import ImageEncoder

log = logging.getLogger(__name__)
PREPARE_POLL_S = 0.05
"""With nothing to run but grammars being started, iterate() waits this long at most for one."""


class Generator:
    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        draft_model: CausalLM | None = None,
        draft_cache: KVCache | None = None,
        **options: object,
    ) -> None:
        """config (engine/engine_config.py) holds every knob; options set single fields of it by name
        (max_batch_size=8, use_ngram_draft=True, ...), as exllamav2's keyword arguments do.

        Speculative decoding: pass draft_model + draft_cache (a smaller model of the same tokenizer;
        its cache has the same pages and page size, so the two share page tables) or
        use_ngram_draft=True."""
        self.config = config = (config or EngineConfig()).with_options(**options)
        scheduling, speculative = config.scheduler, config.speculative
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        self.device = cache.k.device
        self.page_size = cache.page_size
        limits = resolve_limits(scheduling, model.config.max_context_len, cache.num_pages, cache.page_size)
        self.max_seq_len, self.max_chunk_size = limits.max_seq_len, limits.max_chunk_size
        self.max_batch_size, self.max_pending = limits.max_batch_size, scheduling.max_pending
        check_draft_pair(model, cache, draft_model, draft_cache)
        self.draft_model, self.draft_cache = draft_model, draft_cache
        speculating = draft_model is not None or speculative.use_ngram_draft
        configs = [model.config] + ([draft_model.config] if draft_model is not None else [])
        windows = [c.sliding_window for c in configs]
        window = None if any(w is None for w in windows) else max(w for w in windows if w is not None)
        self.kv = KVManager(cache.num_pages, self.page_size, config.cache.prefix_caching, window)
        self.scheduler = Scheduler(self.kv, self.max_batch_size, self.max_chunk_size, scheduling.max_skips,
                                   speculative.num_draft_tokens if speculating else 0,
                                   speculative.max_speculative_batch, scheduling.tenant_weights,
                                   scheduling.newcomer_first)
        vocab = model.config.vocab_size
        self.sampler = BatchSampler(self.max_batch_size, vocab, self.device)
        self.runner = ModelRunner(model, cache, self.max_batch_size, self.max_seq_len, draft_model, draft_cache,
                                  config.cuda_graphs)
        self.drafter = Drafter(self.runner, self.sampler, vocab, speculative.use_ngram_draft, speculative.max_ngram,
                               speculative.num_draft_tokens)
        self.outputs = OutputProcessor(tokenizer)
        self.setup = JobSetup(tokenizer, vocab, config.constraints)
        self.limits = Limits(self.max_seq_len, vocab, model.config.hidden_size, self.page_size,
                             cache.num_pages if limits.whole_cache else None, draft_model is not None,
                             self.max_chunk_size)
        self._sequences: dict[int, Sequence] = {}
        self._sampling: dict[int, SamplingState] = {}
        self._preparing = PreparingJobs(self.setup)
        self._next_serial = 0
        self._undelivered: list[EngineOutput] = []
        self._appended: list[StepTokens] = []  # tokens whose text is still to be produced
        self.overlap = config.overlap
        self.launcher = StepLauncher(self.runner, self.sampler, config.overlap)
        self._seed_source = random.Random(config.seed)
        self.counters = StepCounters()
        self.vision: ImageEncoder | None = None  # a vision-language model's images -> Embeddings
        # LoRA adapters jobs may name (Job(adapter=...)): register / unregister between iterate() calls
        self.adapters = AdapterRegistry(model.config, model.embed_tokens.weight.dtype, self.device,
                                        held=self._held_adapters, slots=self.runner.builder.lora_slots)

    @property
    def pool(self) -> PagePool:
        return self.kv.pool

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype | str | None = None, config: EngineConfig | None = None,
                        progress: Callable[[int, int], None] | None = None,
                        draft_model_path: str | Path | None = None, mmproj: str | Path | None = None,
                        **options: object) -> Generator:
        """Load model + tokenizer from an HF directory or a .gguf file, and a draft model from
        draft_model_path, with paged caches sized by config.cache (engine/loading.py); options set
        single fields of config by name (cache_tokens=4096, max_batch_size=8, ...). A vision-language
        directory's image encoder becomes generator.vision, as does the tower of an mmproj GGUF (llama.cpp's
        vision file that goes with a text GGUF)."""
        config = (config or EngineConfig()).with_options(**options)
        loaded = load_engine(path, torch.device(device), dtype, config, progress, draft_model_path, mmproj=mmproj)
        generator = cls(loaded.model, loaded.cache, loaded.tokenizer, config, loaded.draft_model, loaded.draft_cache)
        generator.vision = loaded.vision
        return generator

    # -- the job API -----------------------------------------------------------------

    def _admitted(self, job: Job | Seq[Job]) -> list[Job]:
        """The jobs of one enqueue call, once they fit the pending queue and pass admission."""
        jobs = [job] if isinstance(job, Job) else list(job)
        waiting = self.num_pending_jobs()
        if waiting + len(jobs) > self.max_pending:
            raise QueueFull(f"{waiting} jobs already pending; {len(jobs)} more would exceed "
                            f"max_pending={self.max_pending}")
        for each in jobs:
            admit(each, self.limits)
        return jobs

    def enqueue(self, job: Job | Seq[Job]) -> int | list[int]:
        """Queue a job (or a list of jobs, in order: their serials); returns its serial. Raises
        JobRejected if it can never run here, QueueFull if max_pending jobs are already waiting,
        AdaptersBusy if its LoRA adapter finds every resident slot held (retry later). A list is
        checked whole first, so it is queued entirely or not at all."""
        jobs = self._admitted(job)
        holding: set[int] = set()
        adapters = []
        for each in jobs:
            adapters.append(adapter := self.adapters.resolve(each.adapter, holding))
            holding.add(id(adapter))
        serials = [self._enqueue(each, adapter) for each, adapter in zip(jobs, adapters, strict=True)]
        return serials[0] if isinstance(job, Job) else serials

    def _held_adapters(self) -> set[int]:
        """Ids of the LoRA adapters live jobs hold: the registry never offloads them."""
        return {id(s.adapter) for s in self._sequences.values() if s.adapter is not None}

    def _enqueue(self, job: Job, adapter: LoraAdapter | None) -> int:
        """Queue the job (with the LoRA adapter it names, held until it ends); a constrained one waits
        until its grammar has started on a compile thread (_admit_prepared), so a slow grammar never
        holds up the loop."""
        stop_ids = job.stop_token_ids if job.stop_token_ids is not None else frozenset(self.tokenizer.eos_token_ids)
        serial = job.serial = self._next_serial
        self._next_serial += 1
        seed = job.seed if job.seed is not None else self._seed_source.randrange(2**63)
        prompt = list(job.input_ids)
        healed = prompt.pop() if job.token_healing and len(prompt) > 1 and prompt[-1] not in job.embedding_rows \
            else None
        sequence = Sequence(job, serial, prompt, len(prompt), time.monotonic(), adapter=adapter)
        self.outputs.add(sequence, stop_ids, healed)
        self._sequences[serial] = sequence
        if job.constraint is not None:
            self._preparing.add(serial, job.constraint, seed, stop_ids)
        else:
            self._sampling[serial] = self.setup.sampling_state(seed, stop_ids, None, healed)
            self.scheduler.add(sequence)
        return serial

    def _admit_prepared(self) -> None:
        """Constrained jobs whose grammar has started join the scheduler, in the order they came;
        one whose grammar failed, or overran its compile budget, ends alone with the reason."""
        if not self._preparing:
            return
        for started in self._preparing.started(time.monotonic()):
            if started.state is None:
                self._end_now(started.serial, FinishReason.ERROR, started.error)
                continue
            self._sampling[started.serial] = started.state
            self.scheduler.add(self._sequences[started.serial])

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
        self.counters.reset()
        self.scheduler.num_preemptions = 0
        return time.monotonic() - started

    def cancel(self, job: Job | int) -> bool:
        """Stop a job now and free its pages; its final result (eos_reason FinishReason.CANCELLED)
        comes with the next iterate(). False if it was not active."""
        serial = job if isinstance(job, int) else job.serial
        return serial is not None and self._end_now(serial, FinishReason.CANCELLED)

    def clear_queue(self) -> int:
        """Cancel every job, waiting or running (as exllamav2's clear_queue); their final results
        (eos_reason cancelled) come with the next iterate(). Returns how many were cancelled."""
        serials = list(self._sequences)
        for serial in serials:
            self.cancel(serial)
        return len(serials)

    def num_remaining_jobs(self) -> int:
        return len(self._sequences) + len(self._undelivered)

    def num_active_jobs(self) -> int:
        return self.scheduler.num_running

    def num_pending_jobs(self) -> int:
        """Jobs waiting to run, constrained jobs whose grammar is still starting among them."""
        return len(self.scheduler.waiting) + len(self._preparing)

    @property
    def stats(self) -> GeneratorStats:
        compiler = self.setup.compiler
        return collect(self.scheduler, self.pool, self.page_size, self.counters,
                       compiler.times if compiler is not None else None)

    def generate(self, prompt: str | Seq[str], max_new_tokens: int = 128, min_new_tokens: int = 0,
                 gen_settings: SamplerSettings | None = None, stop_conditions: Seq[int | str] | None = None,
                 seed: int | None = None, add_bos: bool = True, decode_special_tokens: bool = False,
                 ) -> str | list[str]:
        """Blocking convenience: complete one prompt (-> str) or many (-> list[str], in order).
        Needs an otherwise idle generator."""
        if self.num_remaining_jobs():
            raise RuntimeError("generate() needs an idle generator; use enqueue()/iterate() alongside other jobs")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        jobs = [Job(self.tokenizer.encode(text, add_special_tokens=add_bos), max_new_tokens,
                    min_new_tokens=min_new_tokens, stop_conditions=stop_conditions, gen_settings=gen_settings,
                    seed=None if seed is None else seed + i, decode_special_tokens=decode_special_tokens)
                for i, text in enumerate(prompts)]
        self.enqueue(jobs)
        completions: dict[int, str] = {}
        while self.num_remaining_jobs():
            completions.update({r.serial: r.full_completion for r in self.iterate()
                                if r.eos and r.full_completion is not None})
        texts = [completions[job.serial] for job in jobs if job.serial is not None]
        return texts[0] if isinstance(prompt, str) else texts

    # -- the step --------------------------------------------------------------------

    def iterate(self) -> list[EngineOutput]:
        """One scheduling step and one batched forward; every result produced in it. Schedule →
        propose drafts, forward, sample or verify (_launch) → process outputs → take the tokens and
        update the scheduler (_complete) → apply the decisions (_apply). With overlap the outputs
        processed are the previous step's, while this one's forward runs."""
        self._admit_prepared()
        results, self._undelivered = self._undelivered, []
        schedule = self.scheduler.schedule()
        for sequence in schedule.preempted:
            self._release_rows(sequence.serial)
        schedule = self._encode_inputs(schedule)
        now = time.monotonic()
        for sequence in schedule.started:
            sequence.time_started = now
            self.counters.cached_prompt_tokens += sequence.cached_tokens
            results.append(self.outputs.output(sequence, Stage.STARTED))
        step = self._launch(schedule) if schedule.scheduled else None
        processed = self._process_appended() if self.overlap else None
        if step is not None:
            self._complete(schedule, step, processed.decided() if processed is not None else set())
        results += [self.outputs.prefill_progress(item.sequence) for item in schedule.scheduled
                    if not item.samples and item.sequence.serial in self._sequences]
        if processed is None:
            processed = self._process_appended()
        results += processed.outputs
        self._apply(processed)
        if step is None and not results and self._preparing:
            self._preparing.wait(PREPARE_POLL_S)
        return results

    def _encode_inputs(self, schedule: SchedulerOutput) -> SchedulerOutput:
        """Encode the images the step's prompt chunks need (engine/encoder_inputs.py); a job whose
        images fail ends alone with the error and leaves the step."""
        schedule, failed = encode_step(schedule)
        for serial, message in failed.items():
            self._end_now(serial, FinishReason.ERROR, message)
        return schedule

    def _launch(self, schedule: SchedulerOutput) -> Launched:
        """Propose drafts, then start the forward and the sampling of the step's batch (on the
        overlap thread, or here)."""
        self.counters.steps += 1
        drafts = self.drafter.propose(schedule.scheduled, self._sampling)
        batch = StepBatch.build(schedule.scheduled, drafts, self._sampling)
        self.counters.computed_prompt_tokens += batch.prompt_tokens
        return self.launcher.launch(batch)

    def _complete(self, schedule: SchedulerOutput, step: Launched, decided: set[int]) -> None:
        """Wait for the step, let each job take its tokens and update the scheduler. Jobs in
        decided (finished or rewound by text produced meanwhile) take nothing from this step."""
        drawn = step.work.result()
        self.outputs.score_prompts(drawn.prompts, step.batch.prompts_done)
        taken = take_tokens(step.batch, drawn, self._sampling, decided, self.sampler)
        self.counters.generated_tokens += taken.generated
        for serial, kept in taken.accepted.items():
            self.counters.drafted_tokens += taken.drafted[serial]
            self.counters.accepted_draft_tokens += kept
            self.outputs.count_drafts(serial, taken.drafted[serial], kept)
        self._appended += taken.appended
        self.scheduler.update_from_output(schedule, taken.accepted, taken.ended)
        for sequence in taken.ended:
            self._release_rows(sequence.serial)
        for serial, message in taken.failed.items():
            self._end_now(serial, FinishReason.ERROR, message)

    def _process_appended(self) -> ProcessedStep:
        appended, self._appended = self._appended, []
        return self.outputs.process(appended, time.monotonic())

    def _apply(self, processed: ProcessedStep) -> None:
        """Apply the output processor's decisions: finished jobs leave (tokens after a stop string
        are dropped), failed ones end with their error, rewound jobs go back to where a banned
        string began, with that token banned."""
        for finished in processed.finished:
            sequence = self._sequences.pop(finished.serial)
            self.counters.generated_tokens -= sequence.rewind(finished.keep)
            self.scheduler.remove(sequence)
            self._release_rows(finished.serial)
            del self._sampling[finished.serial]
        for failed in processed.failed:
            self._end_now(failed.serial, FinishReason.ERROR, failed.message)
        for rewind in processed.rewinds:
            rewound = self._sequences.get(rewind.serial)
            if rewound is None:
                continue  # cancelled meanwhile
            self._sampling[rewind.serial].ban(rewind.origin, rewound.output_ids[rewind.origin])
            self.counters.generated_tokens -= rewound.rewind(rewind.origin)
            self.outputs.rewind(rewound, rewind.origin)
            self._release_rows(rewind.serial)
            self.scheduler.requeue(rewound)

    def _end_now(self, serial: int, reason: FinishReason, error: str | None = None) -> bool:
        """End a job at once (cancelled, or failed inside a step) and free its pages; its final result
        comes with the next iterate(). False if it was not active."""
        sequence = self._sequences.pop(serial, None)
        if sequence is None:
            return False
        if error is not None:
            log.warning("job %r failed inside a step: %s", sequence.job.identifier, error)
        self._preparing.discard(serial)
        self.scheduler.remove(sequence)
        self._release_rows(serial)
        self._sampling.pop(serial, None)
        self._drop_unprocessed(sequence)
        self._undelivered.append(self.outputs.final(sequence, reason, error=error))
        return True

    def _drop_unprocessed(self, sequence: Sequence) -> None:
        """With overlap a job's last tokens may still wait for their text when it ends: they go (as
        vLLM drops a finished request's extra token), so its final result holds what was streamed."""
        pending = [entry for entry in self._appended if entry.sequence is sequence]
        if pending:
            self._appended = [entry for entry in self._appended if entry.sequence is not sequence]
            keep = len(sequence.output_ids) - sum(len(entry.tokens) for entry in pending)
            self.counters.generated_tokens -= sequence.rewind(keep)

    def _release_rows(self, serial: int) -> None:
        """A sequence left the running batch: free its sampler slot and table row."""
        self.sampler.release(serial)
        self.runner.release(serial)
