"""The stacked adapter weights of the batched LoRA product (engine/lora/slots.py): each slot holds
exactly its adapter's A and B (zeros beyond its rank and on linears it does not target), a freed
slot is reused and cleared, widening the rank or the slot count keeps the slots already filled,
and a slot is freed when the registry offloads its adapter or the adapter is garbage collected."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Generator, Job
from engine.lora import LoraAdapter, LoraBatch, LoraSlots, load_adapter
from engine.weights import load_model
from kernels.lora import lora_add_reference
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
    """Each slice's columns of A^T and its B^T hold the adapter's A rows and its B block of that
    slice (no zero block of the placed B), zeros beyond its rank and where it targets nothing."""
    for key, linear in slots.linears.items():
        a, b = adapter.weights.get(key, (None, None))
        mine = {target.index: target for target in adapter.slices.get(key, ())}
        rows = dict(zip(mine, itertools.accumulate((t.rank for t in mine.values()), initial=0), strict=False))
        for index, part in linear.slices.items():
            got_a = linear.a[slot, :, part.column : part.column + part.rank]
            target = mine.get(index)
            if target is None:
                assert not got_a.any() and not part.b[slot].any(), (key, index)
                continue
            assert a is not None and b is not None
            row = rows[index]
            assert part.start == target.start and part.b.shape[2] == target.width, (key, index)
            assert torch.equal(got_a[:, : target.rank], a[row : row + target.rank].t()), (key, index)
            block = b[target.start : target.start + target.width, row : row + target.rank]
            assert torch.equal(part.b[slot, : target.rank], block.t()), (key, index)
            assert not got_a[:, target.rank :].any() and not part.b[slot, target.rank :].any(), (key, index)
        assert linear.a.shape[2] == sum(part.rank for part in linear.slices.values()), key
    assert set(adapter.weights) <= set(slots.linears)
    assert all(set(slots.linears[key].slices) >= {t.index for t in targets} for key, targets in adapter.slices.items())


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


@pytest.mark.parametrize(("rows", "qkv_slices"), [
    ([("narrow", 3), (None, 2), ("mid", 1), ("narrow", 2), ("mid", 3)], {0, 1}),
    ([("mid", 5)], {1}),
], ids=["mixed", "one-adapter-every-row"])
def test_batched_product_over_slices_equals_each_adapters_own(base_and_adapters: tuple[Path, dict[str, Path]],
                                                              rows: list[tuple[str | None, int]],
                                                              qkv_slices: set[int]) -> None:
    """Every linear's delta over the stacked slots, expanded per output slice, equals each adapter's
    product with its placed B: where the slotted adapters leave a slice untargeted (v of qkv: q from
    "narrow", k from "mid"), padded groups, and one adapter running every row (no gather, no scatter)."""
    adapters = loaded(*base_and_adapters)
    slots = LoraSlots()
    chosen = [(adapters[name] if name else None, count) for name, count in rows]
    lora = LoraBatch.build(chosen, torch.device("cpu"), slots)
    assert lora is not None and lora.segments is not None
    assert (lora.segments.gather is None) == (len(rows) == 1)
    assert set(slots.linears[(0, "qkv_proj")].slices) == qkv_slices, "v is no slotted adapter's target"
    total = sum(count for _, count in rows)
    rng = torch.Generator().manual_seed(3)
    for key, linear in slots.linears.items():
        x = torch.randn(total, linear.a.shape[1], generator=rng)
        width = next(a.weights[key][1].shape[0] for a in adapters.values() if key in a.weights)
        base_out = torch.randn(total, width, generator=rng)
        got = base_out.clone()
        lora.add(got, x, *key)
        want = base_out.clone()
        offset = 0
        for adapter, count in chosen:
            if adapter is not None and key in adapter.weights:
                a, b = adapter.weights[key]
                lora_add_reference(want, x, a, b, torch.arange(offset, offset + count))
            offset += count
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_kept_selection_of_slots_never_outlives_a_refilled_slot(
        base_and_adapters: tuple[Path, dict[str, Path]]) -> None:
    """The stacked weights of a step's slots are kept for the next step; slots out of order are
    copies, so freeing and refilling one of them must give the next step the new adapter's."""
    adapters = loaded(*base_and_adapters)
    slots = LoraSlots()
    assert (slots.slot(adapters["narrow"]), slots.slot(adapters["wide"])) == (0, 1)
    key = (0, "qkv_proj")
    first = slots.weights((1, 0))
    assert slots.weights((1, 0)) is first, "kept while the slots stay the same"
    slots.release(adapters["wide"])
    assert slots.slot(adapters["mid"]) == 1
    a_t = slots.weights((1, 0))[key][0]
    mid_a, _ = adapters["mid"].weights[key]
    k_slice = slots.linears[key].slices[1]
    assert torch.equal(a_t[0, :, k_slice.column : k_slice.column + mid_a.shape[0]], mid_a.t())
    assert not a_t[0, :, : slots.linears[key].slices[0].rank].any(), "no trace of the wide adapter's q"
