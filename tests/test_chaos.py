"""Chaos: short tasks through real workers while workers are SIGKILLed, Redis
is killed -9 (append-only file on) and restarted gracefully, and poison
messages are interleaved, and hostile-but-valid requests mixed in. Nothing
may be lost or finish twice, and every well-formed task gets its prompt's
text (issue 14, issue 17, issue 23). The `make chaos` runs also drive a
200-line OpenAI batch through a gateway that is SIGKILLed and restarted twice
on the way: it must complete with every line answered once, with its
prompt's text (issue 29). The default run is a small one, without the batch;
`make chaos` runs 1,000 tasks: once with one Redis fault of each kind, once
with eight of each, and once with 5% hostile requests."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from producer.protocol import GenerationRequest
from tests.chaos import HOSTILE, ChaosFigures, ChaosPlan, run_chaos


def check(figures: ChaosFigures) -> None:
    print("chaos figures:", json.dumps(figures.summary()))
    assert figures.unexpected_worker_exits == []
    assert figures.lost == [] and figures.wrong_results == [] and figures.wrong_hostile_outcomes == []
    assert figures.duplicated_final_results == [] and figures.bad_streams == []
    assert figures.worker_kills and figures.redis_crashes and figures.redis_restarts and figures.poison_messages


def check_batch(figures: ChaosFigures, plan: ChaosPlan) -> None:
    """The batch completed through the gateway kills, every line answered once with its prompt's text."""
    assert figures.batch is not None
    assert figures.gateway_kills == figures.batch.gateway_kills_mid_batch == plan.gateway_kills > 0
    assert (figures.batch.status, figures.batch.completed, figures.batch.failed) == ("completed", plan.batch_lines, 0)
    assert figures.batch.lost == [] and figures.batch.repeated == [] and figures.batch.wrong_answers == []


def full_run(tiny_model_factory: Callable[..., Path], tmp_path: Path, plan: ChaosPlan) -> ChaosFigures:
    """One `make chaos` run of `plan` with its batch, checked; its figures for the test's own checks."""
    figures = run_chaos(tiny_model_factory("llama", max_position_embeddings=1024), tmp_path, plan)
    check(figures)
    check_batch(figures, plan)
    return figures


@pytest.mark.parametrize("kwargs", [h.request for h in HOSTILE], ids=range(len(HOSTILE)))
def test_the_hostile_requests_are_valid(kwargs: dict):
    """Hostile but valid: the protocol accepts each, so only the service's isolation stands in their way."""
    GenerationRequest.parse_payload({**kwargs, "prompt": "x"})


@pytest.mark.slow
def test_small_chaos_run_loses_nothing_and_finishes_nothing_twice(tiny_model_factory: Callable[..., Path],
                                                                 tmp_path: Path):
    model = tiny_model_factory("llama", max_position_embeddings=1024)
    plan = ChaosPlan(tasks=150, worker_kills=1, visibility_timeout_s=20, watchdog_after_s=30, timeout_s=300,
                     hostile_every=15, batch_lines=0)
    figures = run_chaos(model, tmp_path, plan)
    check(figures)
    assert figures.hostile_requests == 10 > len(HOSTILE)  # every kind at least once


@pytest.mark.chaos
def test_full_chaos_run_of_1000_tasks(tiny_model_factory: Callable[..., Path], tmp_path: Path):
    full_run(tiny_model_factory, tmp_path, ChaosPlan())


@pytest.mark.chaos
def test_chaos_run_through_repeated_redis_restarts(tiny_model_factory: Callable[..., Path], tmp_path: Path):
    """Issue 17's reproductions restarted Redis eight times each way; so does this run."""
    full_run(tiny_model_factory, tmp_path, ChaosPlan(redis_crashes=8, redis_restarts=8))


@pytest.mark.chaos
def test_chaos_run_with_five_percent_hostile_requests(tiny_model_factory: Callable[..., Path], tmp_path: Path):
    """Issue 23: the 1,000-task run with one hostile-but-valid request per 20 well-formed ones."""
    assert full_run(tiny_model_factory, tmp_path, ChaosPlan(hostile_every=20)).hostile_requests == 50
