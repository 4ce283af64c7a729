"""The stacked adapter weights of the batched LoRA product (engine/lora/slots.py): each slot holds
exactly its adapter's A and B (zeros beyond its rank and on linears it does not target), a freed
slot is reused and cleared, widening the rank or the slot count keeps the slots already filled,
and a slot is freed when the registry offloads its adapter or the adapter is garbage collected."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Generator, Job
from engine.lora import LoraAdapter, LoraSlots, load_adapter
from engine.weights import load_model
from tests.engine_runs import run
from tests.lora_adapters import save_peft_adapter


@pytest.fixture(scope="module")
def base_and_adapters(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
                      ) -> tuple[Path, dict[str, Path]]:
    """Adapters of ranks 2, 8 and 4 on different projections, so ranks widen and linears are missing."""
    base = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("lora-slots")
    options = {"narrow": {"r": 2, "target_modules": ["q_proj", "down_proj"]},
               "wide": {"r": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj"]},
               "mid": {"r": 4, "target_modules": ["k_proj", "up_proj"]}}
    return base, {name: save_peft_adapter(base, root / name, seed, lora_alpha=8, **each)
                  for seed, (name, each) in enumerate(options.items())}


def loaded(base: Path, adapters: dict[str, Path]) -> dict[str, LoraAdapter]:
    config = load_model(base).config
    return {name: load_adapter(path, config, name, torch.float32, "cpu") for name, path in adapters.items()}


def assert_slot_holds(slots: LoraSlots, slot: int, adapter: LoraAdapter) -> None:
    for key in slots.a:
        a, b = adapter.weights.get(key, (torch.zeros(0, slots.a[key].shape[1]), torch.zeros(slots.b[key].shape[2], 0)))
        rank = a.shape[0]
        assert torch.equal(slots.a[key][slot, :, :rank], a.t()) and torch.equal(slots.b[key][slot, :rank], b.t()), key
        assert not slots.a[key][slot, :, rank:].any() and not slots.b[key][slot, rank:].any(), key
    assert set(adapter.weights) <= set(slots.a)


def test_slots_hold_each_adapter_exactly_across_widening_and_reuse(
        base_and_adapters: tuple[Path, dict[str, Path]]) -> None:
    adapters = loaded(*base_and_adapters)
    slots = LoraSlots()
    first = {name: slots.slot(adapter) for name, adapter in adapters.items()}
    assert sorted(first.values()) == [0, 1, 2] and slots.slot(adapters["wide"]) == first["wide"]
    for name, adapter in adapters.items():
        assert_slot_holds(slots, first[name], adapter)  # "narrow" kept its values when "wide" widened the ranks
    slots.release(adapters["wide"])
    assert len(slots) == 2
    again = load_adapter(base_and_adapters[1]["narrow"], load_model(base_and_adapters[0]).config, "again",
                         torch.float32, "cpu")
    assert slots.slot(again) == first["wide"]  # the freed slot, cleared of the wide adapter's linears
    assert_slot_holds(slots, first["wide"], again)
    extra = [load_adapter(base_and_adapters[1]["mid"], load_model(base_and_adapters[0]).config, f"x{i}",
                          torch.float32, "cpu") for i in range(3)]
    assert [slots.slot(each) for each in extra] == [3, 4, 5] and slots.capacity == 8
    for name in ("narrow", "mid"):
        assert_slot_holds(slots, first[name], adapters[name])  # kept when the slot count doubled


def test_a_garbage_collected_adapter_frees_its_slot(base_and_adapters: tuple[Path, dict[str, Path]]) -> None:
    adapters = loaded(*base_and_adapters)
    slots = LoraSlots()
    for adapter in adapters.values():
        slots.slot(adapter)
    del adapter
    adapters.pop("mid")
    gc.collect()
    assert len(slots) == 2


def test_an_offloaded_adapter_gives_up_its_slot(base_and_adapters: tuple[Path, dict[str, Path]]) -> None:
    base, paths = base_and_adapters
    made = Generator.from_pretrained(base, cache_tokens=1024, page_size=8)
    for name in ("narrow", "wide"):
        made.adapters.register(name, paths[name])
    run(made, [Job([5, 9, 23, 7], 4, stop_conditions=[], identifier=i, adapter=name)
               for i, name in enumerate(("narrow", "wide"))])
    slots = made.runner.builder.lora_slots
    assert len(slots) == 2, "a step of two adapters runs the batched product"
    made.adapters.max_loras = 2
    made.adapters.register("mid", paths["mid"])
    assert made.adapters.evictions == 1 and len(slots) == 1
