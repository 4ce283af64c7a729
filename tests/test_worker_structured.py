"""Constraints and logprobs through a real `genq worker`: a JSON-Schema-
constrained request returns JSON that validates, with per-token logprobs in
its chunk events that add up to the result's; a constraint that does not
compile fails its request naming it while the worker serves the others."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from producer.protocol import TASK_NAME, GenerationResult
from tests.service import chunk_text, replay
from worker.processes import WorkerProcess

QUEUE = "genq-structured"
SCHEMA = {"type": "object", "properties": {"label": {"type": "string", "enum": ["spam", "ham"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["label", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def worker(module_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker(QUEUE, "structured", cache_tokens=4096, concurrency=8)


def send(client: Celery, identifier: str, **request: object) -> AsyncResult:
    return client.send_task(TASK_NAME, kwargs={"prompt": f"classify {identifier}", "max_new_tokens": 40,
                                               "identifier": identifier, **request}, queue=QUEUE)


def test_a_json_schema_request_returns_valid_json_with_logprobs_in_chunks_and_result(
    worker: WorkerProcess, client: Celery, redis_client: redis.Redis
):
    handles = [send(client, f"json-{i}", constraint={"type": "json_schema", "json_schema": SCHEMA}, top_logprobs=3,
                    sampling={"temperature": 1.0, "seed": i}, stream={"include_token_ids": True})
               for i in range(6)]
    for i, handle in enumerate(handles):
        result = GenerationResult.from_dict(handle.get(timeout=120))
        jsonschema.validate(json.loads(result.text), SCHEMA)
        assert result.finish_reason == "stop" and result.logprobs is not None
        assert [lp.token_id for lp in result.logprobs] == result.token_ids
        # At most 3 alternatives: where the schema forces a token, the others are impossible, not listed.
        assert all(1 <= len(lp.top_logprobs) <= 3 and lp.top_logprobs[0].logprob >= lp.logprob - 1e-6
                   for lp in result.logprobs)
        assert any(len(lp.top_logprobs) == 1 for lp in result.logprobs)
        events = replay(redis_client, f"json-{i}")
        assert chunk_text(events) == result.text
        streamed = [lp for e in events if e.event == "chunk" for lp in e.logprobs or []]
        assert streamed == result.logprobs  # the final event carries none: stored once, in the result
        assert events[-1].logprobs is None


def test_a_constraint_that_does_not_compile_fails_naming_it_and_others_finish(
    worker: WorkerProcess, client: Celery, redis_client: redis.Redis
):
    bad = send(client, "bad-regex", constraint={"type": "regex", "pattern": "(unclosed"})
    good = send(client, "good-choice", constraint={"type": "choice", "choices": ["yes", "no"]})
    bad.get(timeout=60, propagate=False)
    assert bad.state == "FAILURE" and "constraint: regex" in str(bad.result)
    assert replay(redis_client, "bad-regex")[-1].error.startswith("constraint: regex")
    assert good.get(timeout=60)["text"] in ("yes", "no")
    assert worker.ping(client)


def test_a_request_that_fails_inside_a_step_fails_alone(worker: WorkerProcess, client: Celery,
                                                        redis_client: redis.Redis):
    """Nothing left to sample (every token banned) is that request's problem, not its batch's."""
    neighbours = [send(client, f"neighbour-{i}", max_new_tokens=30, ignore_eos=True) for i in range(3)]
    broken = send(client, "all-banned", sampling={"temperature": 0.7, "seed": 1, "banned_token_ids": list(range(512))})
    broken.get(timeout=60, propagate=False)
    assert broken.state == "FAILURE" and "nothing can be sampled" in str(broken.result), broken.result
    assert replay(redis_client, "all-banned")[-1].event == "error"
    for handle in neighbours:
        assert handle.get(timeout=60)["usage"]["completion_tokens"] == 30


def test_a_worker_started_with_ngram_speculation_reports_its_acceptance_rate(
    tiny_model_factory: Callable[..., Path], redis_url: str, client: Celery, tmp_path: Path
):
    model = tiny_model_factory("llama", max_position_embeddings=1024)
    queue = "genq-speculating"
    process = WorkerProcess(model, redis_url, queue, "speculating", tmp_path / "w.log",
                            {"cache_tokens": 4096, "page_size": 16, "concurrency": 4, "num_draft_tokens": 3,
                             "no_prefix_caching": True}, env={"GENQ_NGRAM_DRAFT": "true"})
    with process:
        process.wait_ready(client)
        looping = [7, 8, 9, 10] * 12
        result = client.send_task(TASK_NAME, kwargs={"input_ids": looping, "max_new_tokens": 40, "ignore_eos": True},
                                  queue=queue).get(timeout=60)
        assert result["usage"]["completion_tokens"] == 40
        stats = process.engine_stats(client)
        assert stats is not None and stats["drafted_tokens"] > 0
        assert stats["draft_acceptance_rate"] == round(stats["accepted_draft_tokens"] / stats["drafted_tokens"], 4)
        assert stats["prompt_tokens_cached"] == 0  # --no-prefix-caching


def test_a_grammar_past_an_llguidance_limit_fails_with_one_line_naming_it(
    worker: WorkerProcess, client: Celery, redis_client: redis.Redis
):
    """Issue 23 item 5: the limit trips as the grammar starts (its first token tried), not at the
    first sampled token with llguidance's parser dump."""
    wide = "start: " + " | ".join(f'"a{i}"' for i in range(3000))
    bad = send(client, "too-wide", constraint={"type": "grammar", "syntax": "lark", "grammar": wide})
    good = send(client, "good-choice-2", constraint={"type": "choice", "choices": ["yes", "no"]})
    bad.get(timeout=60, propagate=False)
    error = replay(redis_client, "too-wide")[-1].error or ""
    assert bad.state == "FAILURE" and error.startswith("constraint: lark: over llguidance's max_items_in_row limit "
                                                       "(2000)"), error
    assert "\n" not in error and len(error) <= 200
    assert good.get(timeout=60)["text"] in ("yes", "no")
