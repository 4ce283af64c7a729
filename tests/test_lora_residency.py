"""The adapter registry's bound on resident adapters (issue 28, max_loras): least-recently-used
eviction to host memory keeps every answer equal to an unbounded generator's, an adapter a live job
holds is never evicted (a job for another one gets AdaptersBusy until it ends), and the residency
accounting is right on a CPU engine, where the move itself is a no-op."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import AdaptersBusy, Generator, Job
from tests.engine_runs import run
from tests.lora_adapters import save_peft_adapter

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
PROMPTS = [[5, 9, 23, 7, 41, 3], [11, 2, 64, 8], [30, 31, 32, 33, 34, 35, 36]]


@pytest.fixture(scope="module")
def base_and_adapters(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
                      ) -> tuple[Path, dict[str, Path]]:
    base = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("lora-residency")
    return base, {name: save_peft_adapter(base, root / name, seed, r=8, lora_alpha=16, target_modules=TARGETS)
                  for seed, name in enumerate(("a", "b"))}


def generator(base: Path, adapters: dict[str, Path], max_loras: int | None) -> Generator:
    made = Generator.from_pretrained(base, cache_tokens=1024, page_size=8)
    made.adapters.max_loras = max_loras
    for name, path in adapters.items():
        made.adapters.register(name, path)
    return made


def completions(made: Generator, adapter: str | None) -> list[list[int]]:
    jobs = [Job(prompt, 12, stop_conditions=[], identifier=i, adapter=adapter) for i, prompt in enumerate(PROMPTS)]
    finals = run(made, jobs)
    return [finals[i].completion_ids or [] for i in range(len(PROMPTS))]


def test_lru_eviction_with_one_slot_keeps_answers_equal_to_an_unbounded_generator(
        base_and_adapters: tuple[Path, dict[str, Path]]) -> None:
    base, adapters = base_and_adapters
    unbounded, bounded = generator(base, adapters, None), generator(base, adapters, 1)
    assert bounded.adapters.resident() == ["b"] and bounded.adapters.evictions == 1  # b's register evicted a
    expected = {name: completions(unbounded, name) for name in ("a", "b")}
    assert expected["a"] != expected["b"] != completions(unbounded, None)  # the adapters change the output
    for turn, name in enumerate(["a", "b", "a", "b"]):
        assert completions(bounded, name) == expected[name]
        assert bounded.adapters.resident() == [name] and bounded.adapters.evictions == 2 + turn
    assert unbounded.adapters.resident() == ["a", "b"] and unbounded.adapters.evictions == 0


def test_an_adapter_a_live_job_holds_is_never_evicted_the_other_waits(
        base_and_adapters: tuple[Path, dict[str, Path]]) -> None:
    base, adapters = base_and_adapters
    bounded = generator(base, adapters, 1)
    bounded.enqueue(Job(PROMPTS[0], 12, stop_conditions=[], identifier="b-job", adapter="b"))
    with pytest.raises(AdaptersBusy, match="adapter 'a' waits for a resident slot: all max_loras=1"):
        bounded.enqueue(Job(PROMPTS[0], 12, stop_conditions=[], adapter="a"))
    assert bounded.adapters.resident() == ["b"] and bounded.num_remaining_jobs() == 1
    bounded.adapters.register("a2", adapters["a"])  # registered meanwhile: kept in host memory, b stays
    assert bounded.adapters.resident() == ["b"] and bounded.adapters.names() == ["a", "a2", "b"]
    bounded.enqueue(Job(PROMPTS[1], 12, stop_conditions=[], identifier="base"))  # the base model needs no slot
    run(bounded, [])
    expected = completions(generator(base, adapters, None), "a")
    assert completions(bounded, "a") == expected and completions(bounded, "a2") == expected
    assert bounded.adapters.resident() == ["a2"]


def test_offload_and_load_to_move_every_tensor(base_and_adapters: tuple[Path, dict[str, Path]]) -> None:
    base, adapters = base_and_adapters
    adapter = generator(base, adapters, None).adapters.resolve("a")
    assert adapter is not None
    before = {key: (a.clone(), b.clone()) for key, (a, b) in adapter.weights.items()}
    adapter.load_to(torch.device("meta"))
    assert adapter.device.type == "meta" and all(t.is_meta for pair in adapter.weights.values() for t in pair)
    adapter.weights.update(before)
    adapter.offload()
    assert adapter.device.type == "cpu"
    assert all(torch.equal(adapter.weights[key][i], before[key][i]) for key in before for i in (0, 1))
