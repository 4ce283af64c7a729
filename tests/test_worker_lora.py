"""LoRA adapters through a real `genq worker` (issue 28, item 2): adapters given with --lora and
loaded or unloaded by control messages while requests stream, each answer equal to the engine
alone with the same adapter (greedy); the clear refusal of a request for an adapter the worker does
not serve; LRU eviction with max_loras=1; the model card's `adapters`; a bad adapter at start."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import redis

from engine import Generator, Job
from producer.client import GenerationError, GenerationHandle, GenqClient
from producer.model_card import WorkerCard, card_key
from tests.engine_runs import run
from tests.gateway_service import running_worker
from tests.lora_adapters import save_peft_adapter, truncate_adapter
from tests.service import plain_client
from worker.bootsteps import EXIT_MODEL_UNUSABLE
from worker.processes import WorkerProcess, wait_until

QUEUE, LRU_QUEUE = "genq-lora", "genq-lora-lru"
ENGINE_OPTIONS = {"cache_tokens": 16384, "page_size": 16}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["Once upon a time", "The quick brown fox", "In a hole in the ground", "It was a dark night"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def adapter_dirs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """a, b, c: PEFT's random adapters on every projection; broken: a truncated tensor file."""
    root = tmp_path_factory.mktemp("adapters")
    dirs = {name: save_peft_adapter(model_dir, root / name, seed, r=8, lora_alpha=16, target_modules=TARGETS)
            for seed, name in enumerate("abc")}
    dirs["broken"] = truncate_adapter(save_peft_adapter(model_dir, root / "broken", 9, r=4, target_modules=TARGETS))
    return dirs


@pytest.fixture(scope="module")
def expected(model_dir: Path, adapter_dirs: dict[str, Path]) -> Callable[[str, str | None, int], str]:
    """expected(prompt, adapter, max_new_tokens): the engine alone's greedy text (no stop at EOS)."""
    alone = Generator.from_pretrained(model_dir, **ENGINE_OPTIONS)
    for name in "abc":
        alone.adapters.register(name, adapter_dirs[name])
    tokenizer = alone.tokenizer

    def text(prompt: str, adapter: str | None, max_new_tokens: int) -> str:
        ids = tokenizer.encode(prompt, add_special_tokens=tokenizer.add_bos_token)
        final = run(alone, [Job(ids, max_new_tokens, stop_conditions=[], identifier=0, adapter=adapter)])[0]
        assert final.full_completion is not None
        return final.full_completion

    return text


@pytest.fixture(scope="module")
def workers(model_dir: Path, adapter_dirs: dict[str, Path], redis_url: str, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, WorkerProcess]]:
    """main: --lora a and b on QUEUE; lru: the same with max_loras=1 on LRU_QUEUE."""
    celery_client = plain_client(redis_url)
    loras = [f"{name}={adapter_dirs[name]}" for name in "ab"]
    with ExitStack() as stack:

        def start(queue: str, name: str, **options: Any) -> WorkerProcess:
            return stack.enter_context(running_worker(model_dir, redis_url, celery_client,
                                                      tmp_path_factory.mktemp(name), queue, name, concurrency=32,
                                                      lora=loras, **options))

        yield {"main": start(QUEUE, "lora-worker"), "lru": start(LRU_QUEUE, "lora-lru", max_loras=1)}


@pytest.fixture(scope="module")
def client(workers: dict[str, WorkerProcess], redis_url: str) -> Iterator[GenqClient]:
    with GenqClient(redis_url, queue=QUEUE) as made:
        yield made


def card(redis_client: redis.Redis, queue: str, worker: WorkerProcess) -> WorkerCard:
    key = card_key(queue, "genq")
    assert key is not None
    return WorkerCard.model_validate_json(redis_client.hget(key, worker.node))


def request(prompt: str, adapter: str | None, max_new_tokens: int = 24, **more: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_new_tokens": max_new_tokens, "ignore_eos": True, "adapter": adapter, **more}


def logged(worker: WorkerProcess, text: str) -> str | None:
    """The worker's first log line holding `text`, if any yet."""
    return next((line for line in worker.log_path.read_text().splitlines() if text in line), None)


def texts(handles: list[GenerationHandle]) -> list[str]:
    return [handle.result(timeout=300).text for handle in handles]


def test_two_adapters_and_the_base_model_in_one_burst_each_equal_the_engine_alone(
        client: GenqClient, workers: dict[str, WorkerProcess], redis_client: redis.Redis,
        expected: Callable[[str, str | None, int], str]) -> None:
    asked = [(prompt, adapter) for prompt in PROMPTS for adapter in ("a", "b", None)]
    handles = client.submit_many([request(prompt, adapter) for prompt, adapter in asked])
    wanted = [expected(prompt, adapter, 24) for prompt, adapter in asked]
    assert texts(handles) == wanted
    assert all(len({wanted[i], wanted[i + 1], wanted[i + 2]}) == 3 for i in range(0, len(wanted), 3))
    assert card(redis_client, QUEUE, workers["main"]).adapters == ["a", "b"]


def test_loading_and_unloading_while_requests_stream_loses_nothing_and_mixes_nothing(
        client: GenqClient, workers: dict[str, WorkerProcess], redis_client: redis.Redis,
        adapter_dirs: dict[str, Path], expected: Callable[[str, str | None, int], str]) -> None:
    worker = workers["main"]
    streaming = [(prompt, adapter) for prompt in PROMPTS for adapter in ("a", "b")]
    handles = client.submit_many([request(prompt, adapter, 160) for prompt, adapter in streaming])
    for handle in handles:  # every one admitted (and holding its adapter) before b goes
        next(event for event in handle.events(timeout=120) if event.event == "chunk")
    client.unload_adapter("b")
    client.load_adapter("c", str(adapter_dirs["c"]))
    client.load_adapter("broken", str(adapter_dirs["broken"]))
    wait_until(lambda: card(redis_client, QUEUE, worker).adapters == ["a", "c"], 60, "the card to show a and c")
    more = [(prompt, adapter) for prompt in PROMPTS for adapter in ("c", "a", None)]
    later = client.submit_many([request(prompt, adapter) for prompt, adapter in more])
    assert texts(handles) == [expected(prompt, adapter, 160) for prompt, adapter in streaming]
    assert texts(later) == [expected(prompt, adapter, 24) for prompt, adapter in more]
    for name in ("b", "nope"):
        with pytest.raises(GenerationError, match=f"adapter '{name}' is not registered \\(registered: a, c\\)"):
            client.submit(request(PROMPTS[0], name)).result(timeout=60)
    line = wait_until(lambda: logged(worker, "LoRA adapter 'broken' not loaded: "), 60, "the refused load in the log")
    assert "ERROR worker.loop" in line and "truncated or not a safetensors file" in line
    client.unload_adapter("c")
    client.load_adapter("b", str(adapter_dirs["b"]))
    wait_until(lambda: card(redis_client, QUEUE, worker).adapters == ["a", "b"], 60, "the card to show a and b")


def test_lru_eviction_with_one_slot_keeps_answers_right_and_the_card_lists_both(
        workers: dict[str, WorkerProcess], redis_url: str, redis_client: redis.Redis,
        expected: Callable[[str, str | None, int], str]) -> None:
    worker = workers["lru"]
    asked = [(prompt, adapter) for prompt in PROMPTS for adapter in ("a", "b", "a", None, "b")]
    with GenqClient(redis_url, queue=LRU_QUEUE) as lru_client:
        handles = lru_client.submit_many([request(prompt, adapter) for prompt, adapter in asked])
        assert texts(handles) == [expected(prompt, adapter, 24) for prompt, adapter in asked]
    stats = worker.engine_stats(plain_client(redis_url))
    assert stats is not None and stats["lora_adapters"] == 2 and stats["lora_resident"] == 1
    assert stats["lora_evictions"] >= 2 and stats["adapter_slot_waits"] >= 1  # b waited while a's requests ran
    assert card(redis_client, LRU_QUEUE, worker).adapters == ["a", "b"]


def test_a_bad_adapter_at_start_stops_the_worker_naming_it_and_its_problem(
        model_dir: Path, adapter_dirs: dict[str, Path], redis_url: str, tmp_path: Path) -> None:
    process = WorkerProcess(model_dir, redis_url, "genq-lora-bad", "lora-bad", tmp_path / "worker.log",
                            {**ENGINE_OPTIONS, "lora": [f"a={adapter_dirs['a']}", f"broken={adapter_dirs['broken']}"]})
    assert process.start().wait(120) == EXIT_MODEL_UNUSABLE
    log = process.log_path.read_text()
    line = next(line for line in log.splitlines() if "CRITICAL" in line)
    assert "CRITICAL worker.bootsteps: cannot load LoRA adapter 'broken': " in line, log
    assert "truncated or not a safetensors file" in line and "Traceback" not in log, log
