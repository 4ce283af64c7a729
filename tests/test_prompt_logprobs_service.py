"""prompt_logprobs through a real `genq worker`: the task's result carries the prompt's token ids
and one log-probability per prompt token (the first null), each with its text and alternatives,
as the engine alone computes them; n samples return the one prompt's; streamed, one chunk
carries them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery import Celery

from engine import Generator, Job, Tokenizer
from producer.client import GenqClient
from producer.protocol import TASK_NAME, GenerationResult
from tests.engine_runs import run
from worker.processes import WorkerProcess

QUEUE = "genq-prompt-logprobs"
ENGINE_OPTIONS = {"cache_tokens": 4096, "page_size": 16, "max_chunk_size": 16}
PROMPT = "the cat sat on the mat and then the dog came in and sat on the mat too"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def worker(model_dir: Path, redis_url: str, client: Celery,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    with WorkerProcess(model_dir, redis_url, QUEUE, "prompt-logprobs",
                       tmp_path_factory.mktemp("prompt-logprobs") / "w.log",
                       {**ENGINE_OPTIONS, "concurrency": 8}) as process:
        process.wait_ready(client)
        yield process


def send(client: Celery, identifier: str, **request: object) -> GenerationResult:
    handle = client.send_task(TASK_NAME, queue=QUEUE, kwargs={
        "prompt": PROMPT, "max_new_tokens": 6, "ignore_eos": True, "identifier": identifier, **request})
    return GenerationResult.from_dict(handle.get(timeout=120))


def test_a_task_returns_its_prompt_logprobs_as_the_engine_computes_them(
        worker: WorkerProcess, client: Celery, model_dir: Path):
    result = send(client, "scored", prompt_logprobs=2)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=tokenizer.add_bos_token)
    assert len(prompt) > ENGINE_OPTIONS["max_chunk_size"]  # scored over more than one prefill chunk
    assert result.prompt_token_ids == prompt
    assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(prompt)
    assert result.prompt_logprobs[0] is None
    engine = run(Generator.from_pretrained(model_dir, **ENGINE_OPTIONS),
                 [Job(prompt, 6, stop_conditions=[], identifier="alone", prompt_logprobs=2)])["alone"]
    assert engine.prompt_logprobs is not None
    for wire, ours in zip(result.prompt_logprobs[1:], engine.prompt_logprobs[1:], strict=True):
        assert wire is not None and ours is not None
        assert wire.token_id == ours.token_id and wire.logprob == pytest.approx(ours.logprob, abs=1e-5)
        assert wire.token == tokenizer.decode([wire.token_id], skip_special_tokens=False)
        assert [(t.token_id, t.token) for t in wire.top_logprobs] == [
            (t, tokenizer.decode([t], skip_special_tokens=False)) for t, _ in ours.top]
        assert [t.logprob for t in wire.top_logprobs] == pytest.approx([v for _, v in ours.top], abs=1e-5)
    assert result.token_ids == engine.completion_ids  # scoring the prompt leaves the completion alone

    plain = send(client, "plain")
    assert plain.prompt_token_ids is None and plain.prompt_logprobs is None
    assert plain.token_ids == result.token_ids


def test_n_samples_return_the_one_prompts_logprobs(worker: WorkerProcess, client: Celery):
    single = send(client, "single", prompt_logprobs=1)
    several = send(client, "several", prompt_logprobs=1, n=3, sampling={"temperature": 1.0, "seed": 4})
    assert several.choices is not None and len(several.choices) == 3
    assert several.prompt_token_ids == single.prompt_token_ids
    assert several.prompt_logprobs is not None and single.prompt_logprobs is not None
    assert several.prompt_logprobs[0] is None and single.prompt_logprobs[0] is None
    for theirs, ours in zip(several.prompt_logprobs[1:], single.prompt_logprobs[1:], strict=True):
        assert theirs is not None and ours is not None
        assert theirs.token_id == ours.token_id and theirs.logprob == pytest.approx(ours.logprob, abs=1e-5)
        assert [t.token_id for t in theirs.top_logprobs] == [t.token_id for t in ours.top_logprobs]


def test_a_streamed_request_gets_them_on_exactly_one_chunk_of_sample_0(worker: WorkerProcess, redis_url: str):
    with GenqClient(redis_url, queue=QUEUE) as genq:
        handle = genq.submit({"prompt": PROMPT, "max_new_tokens": 6, "ignore_eos": True, "prompt_logprobs": 1,
                              "n": 2, "sampling": {"temperature": 1.0, "seed": 3}}, identifier="streamed")
        events = list(handle.events(timeout=120))
        result = handle.result(timeout=60)
    carrying = [e for e in events if e.prompt_logprobs is not None]
    assert len(carrying) == 1 and (carrying[0].event, carrying[0].index) == ("chunk", 0)
    assert carrying[0].prompt_token_ids == result.prompt_token_ids
    assert carrying[0].prompt_logprobs == result.prompt_logprobs
    assert events[-1].event == "done" and events[-1].prompt_logprobs is None
