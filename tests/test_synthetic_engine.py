"""The synthetic engine (engine/synthetic.py) on its own: its pacing (the waits it asks for, step by
step), its text (real word tokens, max_new_tokens and stop strings honoured), cancellation, and the
requests it refuses."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import EngineConfig, FinishReason, Job, JobRejected, QueueFull, Tokenizer
from engine.config import ModelConfig
from engine.synthetic import SyntheticGenerator


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


def synthetic(model_dir: Path, rate: float, waits: list[float] | None = None, step_s: float = 0.0,
              **options: object) -> SyntheticGenerator:
    wait = waits.append if waits is not None else time.sleep
    return SyntheticGenerator(Tokenizer.from_pretrained(model_dir), ModelConfig.from_dir(model_dir), rate,
                              EngineConfig().with_options(**options), wait=wait, step_s=step_s)


def run(generator: SyntheticGenerator) -> dict[str, list]:
    """identifier -> every result of its job, until none is left."""
    results: dict[str, list] = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            results.setdefault(result.identifier, []).append(result)
    return results


def test_each_step_waits_its_jobs_over_the_rate(model_dir: Path):
    waits: list[float] = []
    generator = synthetic(model_dir, 1000, waits)
    generator.enqueue([Job([1, 2, 3], 4, identifier="a"), Job([4], 2, identifier="b"), Job([5, 6], 3, identifier="c")])
    results = run(generator)
    # 3 jobs for two steps (b ends), 2 for one (c ends), then a alone: 9 tokens at 1,000 tokens/s.
    assert waits == pytest.approx([0.003, 0.003, 0.002, 0.001])
    assert sum(len(r.token_ids) for rs in results.values() for r in rs) == 9
    assert generator.forward_s == pytest.approx(0.009)


def test_the_batch_width_bounds_a_step(model_dir: Path):
    waits: list[float] = []
    generator = synthetic(model_dir, 500, waits, max_batch_size=2)
    generator.enqueue([Job([1], 3, identifier=str(i)) for i in range(3)])
    run(generator)
    # two jobs run 3 steps, then the third runs 3 alone
    assert waits == pytest.approx([0.004] * 3 + [0.002] * 3)


def test_a_step_floor_adds_to_every_step_whatever_its_batch(model_dir: Path):
    waits: list[float] = []
    generator = synthetic(model_dir, 1000, waits, step_s=0.015)
    generator.enqueue([Job([1], 2, identifier="a"), Job([2], 1, identifier="b")])
    run(generator)
    assert waits == pytest.approx([0.017, 0.016])
    assert generator.stats.forward_wait_s == pytest.approx(0.033)
    with pytest.raises(ValueError, match="step floor"):
        synthetic(model_dir, 1000, step_s=-1)


def test_a_real_wait_never_runs_faster_than_the_rate(model_dir: Path):
    """time.sleep never returns early, so the wall time bounds the rate from above whatever the load."""
    generator = synthetic(model_dir, 2000)
    started = time.perf_counter()
    generator.enqueue([Job([1], 50, identifier=str(i)) for i in range(4)])
    run(generator)
    assert time.perf_counter() - started >= 200 / 2000


def test_the_text_is_word_tokens_and_max_new_tokens_ends_it(model_dir: Path):
    generator = synthetic(model_dir, 100_000)
    tokenizer = generator.tokenizer
    generator.enqueue([Job([1, 2], 30, identifier="long"), Job([3], 7, identifier="short")])
    results = run(generator)
    final = results["long"][-1]
    assert [r.stage for r in results["long"]][0] == "started"
    assert final.eos and final.eos_reason is FinishReason.MAX_NEW_TOKENS and final.new_tokens == 30
    assert final.full_completion == "".join(r.text for r in results["long"])
    assert final.full_completion == tokenizer.decode(final.completion_ids)
    assert re.fullmatch(r"( [a-z]{3,}){30}", final.full_completion)
    short = results["short"][-1]
    assert short.new_tokens == 7 and final.full_completion.startswith(short.full_completion)


def test_a_stop_string_ends_the_text_before_it(model_dir: Path):
    generator = synthetic(model_dir, 100_000)
    generator.enqueue(Job([1], 20, identifier="free"))
    words = run(generator)["free"][-1].full_completion.split(" ")[1:]
    stop = f" {words[5]} {words[6]}"
    generator.enqueue(Job([1], 20, stop_conditions=[stop], identifier="stopped"))
    final = run(generator)["stopped"][-1]
    assert final.eos_reason is FinishReason.STOP_STRING and final.eos_string == stop
    assert final.full_completion == "".join(f" {w}" for w in words[:5])


def test_cancel_ends_a_running_job_with_its_tokens_so_far(model_dir: Path):
    generator = synthetic(model_dir, 100_000)
    job = Job([1], 100, identifier="x")
    generator.enqueue(job)
    generator.iterate()
    generator.iterate()
    assert generator.cancel(job)
    assert not generator.cancel(job)
    (final,) = generator.iterate()
    assert final.eos_reason is FinishReason.CANCELLED and final.new_tokens == 2
    assert generator.num_remaining_jobs() == 0 and generator.num_active_jobs() == 0


@pytest.mark.parametrize(("options", "field"), [({"logprobs": True}, "logprobs"),
                                                ({"banned_strings": ["x"]}, "banned_strings"),
                                                ({"token_healing": True}, "token_healing"),
                                                ({"adapter": "nope"}, "adapter")])
def test_what_it_cannot_produce_is_refused_naming_the_field(model_dir: Path, options: dict, field: str):
    generator = synthetic(model_dir, 1000)
    with pytest.raises(JobRejected, match=field):
        generator.enqueue(Job([1, 2], 4, **options))
    assert generator.num_remaining_jobs() == 0


def test_the_queue_and_the_rate_are_bounded(model_dir: Path):
    generator = synthetic(model_dir, 1000, max_pending=2)
    with pytest.raises(QueueFull, match="max_pending=2"):
        generator.enqueue([Job([1], 4) for _ in range(3)])
    with pytest.raises(ValueError, match="synthetic rate: 0 tokens/s"):
        synthetic(model_dir, 0)
