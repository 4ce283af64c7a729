"""Every engine knob, in one frozen record grouped as vLLM groups them (cache,
scheduler, speculation).

The worker's settings build an EngineConfig (worker/settings.py), the
generator reads it, and `Generator(model, cache, tokenizer, max_batch_size=8)`
keeps exllamav2's flat keyword style by mapping each keyword onto the group
that owns the field of that name: the field names here are the only list.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Literal

CacheDtype = Literal["auto", "fp8", "q8", "q4", "k8v4"]
Quantization = Literal["int8", "int4"]

DEFAULT_PAGE_SIZE = 16
DEFAULT_MAX_CHUNK_SIZE = 2048
DEFAULT_MAX_BATCH_SIZE = 256
DEFAULT_MAX_PENDING = 1024
DEFAULT_CPU_CACHE_BYTES = 1 << 30
GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: how big, how its pages are cut and stored, whether prompts share them.
    Size: cache_tokens, else cache_memory bytes, else 1 GiB on CPU; on CUDA what is left of
    gpu_memory_utilization of the GPU after the weights and a step's reserve (engine/memory_plan.py)."""

    page_size: int = DEFAULT_PAGE_SIZE
    cache_tokens: int | None = None
    cache_memory: int | None = None
    cache_dtype: CacheDtype = "auto"
    prefix_caching: bool = True
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION


@dataclass(frozen=True)
class SchedulerConfig:
    """How many jobs and tokens a step may hold (None: from the model and the cache). tenant_weights:
    each named tenant's weight in fair admission (engine/fair_share.py; others weigh 1).
    newcomer_first: a tenant with nothing running (or a class more urgent than every running job)
    gets its prefill in a step of its own, ahead of the running jobs (engine/scheduler.py)."""

    max_batch_size: int | None = None
    max_seq_len: int | None = None
    max_chunk_size: int | None = None
    max_pending: int = DEFAULT_MAX_PENDING
    max_skips: int = 16
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    newcomer_first: bool = True


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: n-gram (prompt-lookup) drafts, or a draft model given to the
    generator. Drafts are proposed only while at most max_speculative_batch jobs decode:
    beyond that the forward is compute-bound and drafts cost more than they save."""

    use_ngram_draft: bool = False
    num_draft_tokens: int = 4
    max_ngram: int = 4
    max_speculative_batch: int = 8


@dataclass(frozen=True)
class ConstraintBudget:
    """What starting one job's grammar may cost: compile_timeout_s of wall time from the moment
    its compile thread takes it up (the job then fails alone, naming this limit) and at most
    max_grammar_size symbols (llguidance's LLParserLimits.max_grammar_size; its other limits
    keep llguidance's defaults and are checked as the grammar starts)."""

    compile_timeout_s: float = 10.0
    max_grammar_size: int = 500_000


@dataclass(frozen=True)
class EngineConfig:
    """overlap: run each step's forward and sampling on a worker thread while the previous
    step's text is produced. cuda_graphs: replay decode steps from CUDA graphs (None: on for
    a CUDA device whose model a graph can replay). seed: the seed source of unseeded jobs.
    cpu_int8: run the projections as int8 dynamic-quantized matmuls on CPU (engine/int8_dynamic.py):
    faster, but greedy outputs no longer match transformers' fp32, so off by default."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    constraints: ConstraintBudget = field(default_factory=ConstraintBudget)
    quantize: Quantization | None = None
    cpu_int8: bool = False
    seed: int | None = None
    overlap: bool = False
    cuda_graphs: bool | None = None

    def with_options(self, **options: Any) -> EngineConfig:
        """A copy with flat keyword options applied, each to the group that has a field of that name;
        None means "the default" (every field that may be None defaults to None)."""
        owners = option_names()
        groups: dict[str, dict[str, Any]] = {}
        for name, value in options.items():
            if name not in owners:
                raise TypeError(f"unknown engine option {name!r}; known: {sorted(owners)}")
            if value is not None:
                groups.setdefault(owners[name], {})[name] = value
        top = groups.pop("", {})
        replaced = {group: replace(getattr(self, group), **values) for group, values in groups.items()}
        return replace(self, **replaced, **top)


@dataclass(frozen=True)
class ResolvedLimits:
    """The scheduler's limits resolved against a model's context and a cache's size."""

    max_seq_len: int
    max_chunk_size: int
    max_batch_size: int
    whole_cache: bool  # max_seq_len is the whole KV cache (errors say so)


def resolve_limits(scheduler: SchedulerConfig, max_context_len: int, num_pages: int, page_size: int
                   ) -> ResolvedLimits:
    """None fields from the model and the cache; ValueError naming an impossible combination."""
    capacity = num_pages * page_size
    max_seq_len = min(scheduler.max_seq_len or max_context_len, capacity)
    max_chunk_size = scheduler.max_chunk_size or DEFAULT_MAX_CHUNK_SIZE
    max_batch_size = scheduler.max_batch_size or min(DEFAULT_MAX_BATCH_SIZE, max_chunk_size, num_pages)
    if max_batch_size > max_chunk_size:
        raise ValueError(f"max_batch_size={max_batch_size} exceeds max_chunk_size={max_chunk_size}: "
                         "every running job must be able to decode in each step")
    if scheduler.max_pending < 1:
        raise ValueError(f"max_pending must be >= 1, got {scheduler.max_pending}")
    return ResolvedLimits(max_seq_len, max_chunk_size, max_batch_size, max_seq_len == capacity)


def option_names() -> dict[str, str]:
    """Every flat option name -> the group that owns it ("" for EngineConfig's own fields); a group
    is a field of EngineConfig whose default is a dataclass."""
    names: dict[str, str] = {}
    for top in fields(EngineConfig):
        group = top.default_factory
        names.update({f.name: top.name for f in fields(group)} if is_dataclass(group) else {top.name: ""})
    return names
