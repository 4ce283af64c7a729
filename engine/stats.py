"""The generator's counters, and the snapshot of them and of the cache that `Generator.stats` gives."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from engine.cache import PagePool
from engine.constraints import MaskTimes
from engine.scheduler import Scheduler


@dataclass
class StepCounters:
    """Counted as steps run; warmup() resets them."""

    steps: int = 0
    generated_tokens: int = 0
    computed_prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0

    def reset(self) -> None:
        for counter in fields(self):
            setattr(self, counter.name, 0)


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
    forward_wait_s: float = 0.0  # the synthetic engine's paced waits, its forward (engine/synthetic.py); 0 otherwise

    @property
    def prefix_hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache instead of computed."""
        total = self.cached_prompt_tokens + self.computed_prompt_tokens
        return self.cached_prompt_tokens / total if total else 0.0


def collect(scheduler: Scheduler, pool: PagePool, page_size: int, counters: StepCounters, masks: MaskTimes | None
            ) -> GeneratorStats:
    """A snapshot of the generator's counters and of its cache."""
    times = masks if masks is not None else MaskTimes()
    return GeneratorStats(
        active_jobs=scheduler.num_running, pending_jobs=len(scheduler.waiting), pages_total=pool.num_pages,
        pages_used=pool.num_used, pages_free=pool.num_free, pages_cached=pool.num_cached,
        page_size=page_size, preemptions=scheduler.num_preemptions, **asdict(counters),
        constraint_masks=times.masks, constraint_mask_s=times.computed_s, constraint_mask_wait_s=times.waited_s)
