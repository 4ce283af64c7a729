"""The engine against Hugging Face transformers on the same random weights:
greedy tokens identical, last-position logits within 1e-4 (fp32)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import Generator, Job
from engine.batch import ForwardBatch
from engine.cache import KVCache
from engine.weights import load_model
from tests.conftest import FAMILIES

PAGE_SIZE = 8


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with transformers' own forward and KV cache, EOS ignored."""
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


def prompt_lengths(rng: random.Random) -> list[int]:
    fixed = [1, PAGE_SIZE, PAGE_SIZE + 1, 2 * PAGE_SIZE, 2 * PAGE_SIZE + 1, 3]
    return fixed + [rng.randint(2, 90) for _ in range(24 - len(fixed))]


VARIANTS = [(family, {}) for family in FAMILIES] + [("mistral", {"sliding_window": 12})]


@pytest.mark.parametrize(("family", "overrides"), VARIANTS, ids=[*FAMILIES, "mistral-sliding-window"])
def test_concurrent_greedy_matches_transformers_one_by_one(
    family: str, overrides: dict, tiny_model_factory: Callable[..., Path]
):
    path = tiny_model_factory(family, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = Generator.from_pretrained(path, cache_tokens=4096, page_size=PAGE_SIZE, max_chunk_size=96)
    vocab = generator.model.config.vocab_size
    rng = random.Random(family)
    requests = [
        ([rng.randrange(vocab) for _ in range(n)], rng.randint(4, 14)) for n in prompt_lengths(rng)
    ]
    first_wave, second_wave = requests[:12], requests[12:]
    completions: dict[int, list[int]] = {}
    for i, (prompt, max_new) in enumerate(first_wave):
        generator.enqueue(Job(prompt, max_new, stop_conditions=[], identifier=i))
    step = 0
    while generator.num_remaining_jobs() or second_wave:
        if step % 2 == 1 and second_wave:
            # join between iterate() calls while the first wave is mid-generation
            prompt, max_new = second_wave.pop(0)
            generator.enqueue(Job(prompt, max_new, stop_conditions=[], identifier=len(requests) - len(second_wave) - 1))
        for result in generator.iterate():
            if result["eos"]:
                completions[result["identifier"]] = result["completion_ids"]
        step += 1
    assert generator.stats.active_jobs == 0
    with torch.inference_mode():
        for i, (prompt, max_new) in enumerate(requests):
            assert completions[i] == hf_greedy(hf, prompt, max_new), f"prompt {i} ({len(prompt)} tokens) differs"


@pytest.mark.parametrize(("family", "overrides"), VARIANTS, ids=[*FAMILIES, "mistral-sliding-window"])
def test_mixed_batch_logits_match_transformers(family: str, overrides: dict, tiny_model_factory: Callable[..., Path]):
    """One forward holding decode rows and prefill chunks over scattered pages
    gives each row's last-position logits as transformers' full forward does."""
    path = tiny_model_factory(family, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_model(path)
    config = model.config
    cache = KVCache.allocate(config, 64, PAGE_SIZE, torch.float32, "cpu")
    rng = random.Random(0)
    pages = list(range(64))
    rng.shuffle(pages)
    lengths = [1, PAGE_SIZE, PAGE_SIZE + 1, 23, 40]
    seqs = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in lengths]
    tables = [[pages.pop() for _ in range(-(-n // PAGE_SIZE))] for n in lengths]
    # the first forward computes each sequence except its last (up to) 3 tokens; the second is mixed
    done = [max(0, n - rng.choice([1, 3])) for n in lengths]
    with torch.inference_mode():
        run_forward(model, cache, seqs, tables, [0] * len(seqs), done)
        logits = run_forward(model, cache, seqs, tables, done, lengths)
        for row, tokens in enumerate(seqs):
            expected = hf(torch.tensor([tokens])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=0)


def run_forward(
    model: torch.nn.Module,
    cache: KVCache,
    seqs: list[list[int]],
    tables: list[list[int]],
    starts: list[int],
    ends: list[int],
) -> torch.Tensor:
    rows = [i for i in range(len(seqs)) if ends[i] > starts[i]]
    ids, positions, slots, cu, logits_at = [], [], [], [0], []
    for i in rows:
        for pos in range(starts[i], ends[i]):
            ids.append(seqs[i][pos])
            positions.append(pos)
            slots.append(tables[i][pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
        cu.append(cu[-1] + ends[i] - starts[i])
        logits_at.append(cu[-1] - 1)
    width = max(len(tables[i]) for i in rows)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(positions),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor([ends[i] for i in rows], dtype=torch.int32),
        page_table=torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in rows], dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        logits_indices=torch.tensor(logits_at),
    )
    return model(batch, cache.k, cache.v)
