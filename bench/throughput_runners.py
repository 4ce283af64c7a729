"""The workload and the three ways of serving it: this engine, transformers'
padded static batches, transformers' continuous batching.

Every runner gets the same requests (greedy, EOS unreachable, each with its own
max_new_tokens) and returns a Trace: for each request its generated tokens and
the perf_counter time each token became available to the caller. All requests
arrive together at `Trace.start`, so TTFT is measured from there.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from engine import Generator, Job


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    prompt_len: tuple[int, int]
    new_tokens: tuple[int, int]
    seed: int = 0

    def settings(self) -> dict[str, Any]:
        """The workload as a results file's settings record it."""
        return {"num_requests": self.num_requests, "prompt_len_range": list(self.prompt_len),
                "max_new_tokens_range": list(self.new_tokens), "seed": self.seed}


@dataclass
class Trace:
    """What one system did with the workload. Times are time.perf_counter() seconds."""

    start: float
    end: float
    tokens: list[list[int]]
    token_times: list[list[float]]
    details: dict[str, Any] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)  # the completions' text, where the system reports it


def make_workload(spec: WorkloadSpec, vocab_size: int, special_ids: frozenset[int]) -> list[Request]:
    """Lengths first, then token ids, from one Random(seed): models with
    different vocabularies get the same request shapes."""
    rng = random.Random(spec.seed)
    shapes = [(rng.randint(*spec.prompt_len), rng.randint(*spec.new_tokens)) for _ in range(spec.num_requests)]
    allowed = [t for t in range(vocab_size) if t not in special_ids]
    return [Request([rng.choice(allowed) for _ in range(p)], n) for p, n in shapes]


def pages_needed(requests: Sequence[Request], page_size: int) -> int:
    """KV pages that hold every request at its full length at the same time."""
    return sum(math.ceil((len(r.prompt) + r.max_new_tokens) / page_size) for r in requests)


# -- this engine ------------------------------------------------------------


def run_engine(gen: Generator, requests: Sequence[Request]) -> Trace:
    """Enqueue everything, then iterate; a token's time is when iterate() hands it over."""
    tokens: list[list[int]] = [[] for _ in requests]
    times: list[list[float]] = [[] for _ in requests]
    texts = [""] * len(requests)
    before = gen.stats
    start = time.perf_counter()
    for i, request in enumerate(requests):
        gen.enqueue(Job(request.prompt, request.max_new_tokens, stop_conditions=[], identifier=i))
    while gen.num_remaining_jobs():
        results = gen.iterate()
        now = time.perf_counter()
        for result in results:
            if result["stage"] in ("streaming", "eos") and result["token_ids"]:
                i = result["identifier"]
                tokens[i].extend(result["token_ids"])
                times[i].extend([now] * len(result["token_ids"]))
            if result["eos"]:
                texts[result["identifier"]] = result["full_completion"]
    end = time.perf_counter()
    after = gen.stats
    details = {"steps": after.steps - before.steps, "preemptions": after.preemptions - before.preemptions}
    return Trace(start, end, tokens, times, details, texts)


# -- transformers, padded static batches -----------------------------------


class _StepClock(BaseStreamer):
    """Timestamps every decoding step of generate(): put() receives the prompt
    once, then each step's new tokens as soon as they are selected."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def _left_pad(prompts: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def unreachable_eos_config(vocab_size: int, pad_id: int, max_new_tokens: int) -> GenerationConfig:
    """Greedy with an EOS id the model cannot emit (its logits stop at vocab_size - 1).
    eos_token_id=None does not work: generate() fills it from the model's
    generation_config. min_new_tokens would work but changes the logits."""
    return GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=vocab_size, pad_token_id=pad_id
    )


def run_hf_padded(
    model: PreTrainedModel, requests: Sequence[Request], batch_size: int, sort_by_length: bool, pad_id: int
) -> Trace:
    """Static batches in request order (or by ascending prompt length), one
    generate() each, left-padded, running to the longest max_new_tokens of
    the batch; a request keeps only its own first max_new_tokens tokens."""
    vocab_size = model.config.vocab_size
    order = list(range(len(requests)))
    if sort_by_length:
        order.sort(key=lambda i: len(requests[i].prompt))
    tokens: list[list[int]] = [[] for _ in requests]
    times: list[list[float]] = [[] for _ in requests]
    computed = 0
    start = time.perf_counter()
    for first in range(0, len(order), batch_size):
        rows = order[first:first + batch_size]
        ids, mask = _left_pad([requests[i].prompt for i in rows], pad_id)
        steps = max(requests[i].max_new_tokens for i in rows)
        clock = _StepClock()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=unreachable_eos_config(vocab_size, pad_id, steps),
                streamer=clock,
            )
        generated = out[:, ids.shape[1]:]
        if generated.shape[1] != steps or len(clock.times) != steps:
            raise RuntimeError(
                f"generate() stopped early: {generated.shape[1]} tokens, {len(clock.times)} steps, expected {steps}"
            )
        for row, i in enumerate(rows):
            n = requests[i].max_new_tokens
            tokens[i] = generated[row, :n].tolist()
            times[i] = clock.times[:n]
        computed += len(rows) * (ids.shape[1] + steps)
    end = time.perf_counter()
    details = {"batch_size": batch_size, "sorted_by_prompt_length": sort_by_length, "computed_positions": computed}
    return Trace(start, end, tokens, times, details)


# -- transformers, continuous batching -------------------------------------


class _DropPsutilNotice(logging.Filter):
    """transformers logs at ERROR level, on every manager start, that it cannot
    size memory on CPU without psutil; the cache is sized explicitly here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "psutil" not in record.getMessage()


def quiet_cb_logger() -> None:
    logging.getLogger("ContinuousBatchingLogger").addFilter(_DropPsutilNotice())


def cb_config(requests: Sequence[Request], page_size: int, max_batch_tokens: int) -> ContinuousBatchingConfig:
    """Sized like the engine's cache: every request fits at full length at once,
    same page size, same per-step token budget, all requests in one batch.
    No CUDA graphs, no compile, no async double-buffering (CPU), no flash
    switch, no prefix sharing (random prompts share nothing), no safety margin
    (the engine keeps none either; with it, the last 15% of the exactly-sized
    cache would hold back admissions)."""
    return ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=pages_needed(requests, page_size),
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=len(requests),
        max_blocks_per_request=0,
        allow_block_sharing=False,
        use_async_batching=False,
        use_cuda_graph=False,
        auto_switch_to_flash=False,
        safety_margin=0.0,
        scheduler_type="fifo",
    )


def run_hf_cb(
    model: PreTrainedModel, requests: Sequence[Request], config: ContinuousBatchingConfig, pad_id: int
) -> Trace:
    """The manager behind model.generate_batch(), used directly because
    generate_batch() takes one max_new_tokens for all requests. Token times are
    the manager's own record_timestamps (perf_counter when each token is
    appended in its generation thread)."""
    generation_config = unreachable_eos_config(model.config.vocab_size, pad_id, max(r.max_new_tokens for r in requests))
    outputs: dict[str, Any] = {}
    with model.continuous_batching_context_manager(
        generation_config=generation_config, continuous_batching_config=config, block=True, timeout=60
    ) as manager:
        start = time.perf_counter()
        ids = [
            manager.add_request(
                r.prompt, request_id=f"r{i}", max_new_tokens=r.max_new_tokens, record_timestamps=True, eos_token_id=-1
            )
            for i, r in enumerate(requests)
        ]
        while len(outputs) < len(ids):
            output = manager.get_result(timeout=1.0)
            if output is None:
                if not manager.is_running():
                    raise RuntimeError(f"the generation thread stopped with {len(outputs)}/{len(ids)} requests done")
                continue
            if output.is_finished():
                outputs[output.request_id] = output
        end = time.perf_counter()
    errors = {rid: out.error for rid, out in outputs.items() if out.error is not None}
    if errors:
        raise RuntimeError(f"requests failed: {errors}")
    ordered = [outputs[rid] for rid in ids]
    details = {
        "num_blocks": config.num_blocks,
        "page_size": config.page_size,
        "max_batch_tokens": config.max_batch_tokens,
        "max_requests_per_batch": config.max_requests_per_batch,
        "attn_implementation": model.config._attn_implementation,
    }
    tokens = [list(o.generated_tokens) for o in ordered]
    return Trace(start, end, tokens, [list(o.timestamps) for o in ordered], details)
