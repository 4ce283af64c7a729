"""One job's numeric failure ends that job alone: its neighbours' tokens in the same steps are kept.

The poison is real input, not a patched engine: an embedding of infinities (what a broken vision
tower would hand over) makes that row's logits non-finite in the model's own forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import Embedding, FinishReason, Generator, Job, SamplerSettings
from engine.sampler_settings import SamplerSettingsError

BATCH = 32


def _neighbours(generator: Generator, sampled: bool) -> list[Job]:
    prompts = ["The quick brown fox", "Once upon a time", "In the beginning", "def main():"]
    jobs = []
    for i in range(BATCH - 1):
        settings = SamplerSettings(temperature=0.9, top_p=0.95, dry_multiplier=0.8) if sampled and i % 2 \
            else SamplerSettings.greedy()
        ids = generator.tokenizer.encode(prompts[i % len(prompts)] + f" {i}")
        jobs.append(Job(ids, 12, stop_conditions=[], gen_settings=settings, seed=100 + i, identifier=f"n{i}"))
    return jobs


def _run(generator: Generator, jobs: list[Job]) -> dict[str, tuple[FinishReason, str | None, list[int]]]:
    generator.enqueue(jobs)
    finals = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.eos:
                finals[result.identifier] = (result.eos_reason, result.error, result.completion_ids or [])
    return finals


@pytest.mark.parametrize("sampled", [False, True], ids=["all-greedy", "mixed"])
def test_a_poisoned_row_fails_alone_and_its_31_neighbours_are_untouched(llama_dir: Path, sampled: bool):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=8192, max_batch_size=BATCH)
    alone = _run(generator, _neighbours(generator, sampled))
    poison = Embedding(torch.full((2, generator.model.config.hidden_size), float("inf")))
    prompt = generator.tokenizer.encode("Describe the image:") + poison.token_ids
    poisoned = Job(prompt, 12, stop_conditions=[], embeddings=[poison], identifier="poisoned")
    jobs = _neighbours(generator, sampled)
    beside = _run(generator, [*jobs[:BATCH // 2], poisoned, *jobs[BATCH // 2:]])
    reason, error, _ = beside.pop("poisoned")
    assert reason is FinishReason.ERROR
    assert error is not None and "logits are NaN, +inf or all -inf" in error
    assert beside == alone
    assert all(reason is FinishReason.MAX_NEW_TOKENS for reason, _, _ in alone.values())


@pytest.mark.parametrize(("field", "value", "limit"), [
    ("dry_base", 1e308, "[1, 8]"),
    ("dry_multiplier", 1e300, "[0, 100]"),
    ("smoothing_factor", 1e300, "[0, 100]"),
    ("mirostat_tau", 1e300, "[0, 100]"),
    ("repetition_penalty", 1e-300, "[0.01, 100]"),
])
def test_settings_that_would_overflow_a_step_are_refused_naming_field_and_limit(field: str, value: float,
                                                                               limit: str):
    with pytest.raises(SamplerSettingsError, match=rf"{field} must be in \S*{limit[1:]}"):
        SamplerSettings(temperature=1.0, **{field: value})


def _wire_sampling_bounds() -> list[tuple[str, float]]:
    """(engine field, value) for both ends of every numeric wire sampling field the engine shares."""
    from producer import protocol

    engine_fields = set(SamplerSettings.__dataclass_fields__)
    ends = []
    for name, info in protocol.SamplingParams.model_fields.items():
        if name not in engine_fields:
            continue
        for bound in info.metadata:
            for attr in ("ge", "gt", "le", "lt"):
                value = getattr(bound, attr, None)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    ends.append((name, value + (1e-9 if attr == "gt" else -1e-9 if attr == "lt" else 0)))
    return ends


@pytest.mark.parametrize(("field", "value"), _wire_sampling_bounds())
def test_every_value_the_wire_accepts_the_engine_accepts(field: str, value: float):
    """The wire's limits (producer/protocol.py) lie within the engine's, so a valid task is never refused
    by the worker's engine for a sampling number."""
    kind = type(SamplerSettings.__dataclass_fields__[field].default)
    SamplerSettings(**{"temperature": 1.0, field: kind(value) if kind is int else float(value)})
