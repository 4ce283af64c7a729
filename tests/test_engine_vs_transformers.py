"""The engine against Hugging Face transformers on the same random weights:
greedy tokens identical, last-position logits within 1e-4 (fp32).

Two sources of weights: the project's tiny model maker (the first four
families, written without transformers), and transformers' own random init
for the other families and the RoPE scalings (tests/conftest.py:hf_model_factory).

Dynamic NTK and LongRoPE change frequencies with the sequence length; the
engine rotates each token by its own position (see engine/rope.py), which is
what transformers does when fed one token per forward. Their variants use a
small max_position_embeddings / original_max_position_embeddings (32) so most
prompts cross it, and compare against transformers fed token by token
("incremental"); the other variants compare against one full forward.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import Generator, Job
from engine.batch import ForwardBatch
from engine.cache import KVCache
from engine.lora import LoraBatch
from engine.weights import load_model
from tests.conftest import FAMILIES

PAGE_SIZE = 8


@dataclass(frozen=True)
class Variant:
    """A model to test: tiny-maker `family` with config overrides, or (config_class
    set) a transformers-initialised checkpoint of that config class."""

    name: str
    family: str = ""
    overrides: dict = field(default_factory=dict)
    config_class: str = ""
    incremental: bool = False  # compare against transformers fed one token per forward


_LONG = 32  # the trained length the length-dependent RoPE variants scale beyond
_PAIRS = 6  # Phi-3 variant: head_dim 16 * partial_rotary_factor 0.75 / 2 rotary pairs

VARIANTS = [Variant(family, family) for family in FAMILIES] + [
    Variant("mistral-sliding-window", "mistral", {"sliding_window": 12}),
    Variant("llama-rope-linear", config_class="LlamaConfig",
            overrides={"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    Variant("llama-rope-dynamic-ntk", config_class="LlamaConfig", incremental=True,
            overrides={"max_position_embeddings": _LONG,
                       "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}}),
    Variant("qwen3-rope-yarn", config_class="Qwen3Config",
            overrides={"max_position_embeddings": 4 * _LONG,
                       "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                           "original_max_position_embeddings": _LONG}}),
    Variant("phi3-longrope-partial-rotary-sliding", config_class="Phi3Config", incremental=True,
            overrides={"max_position_embeddings": 4 * _LONG, "original_max_position_embeddings": _LONG,
                       "sliding_window": 20,
                       "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.75,
                                           "short_factor": [1.0 + 0.1 * i for i in range(_PAIRS)],
                                           "long_factor": [2.0 + 3.0 * i for i in range(_PAIRS)]}}),
    # Gemma ties its embeddings in every release, but tied, transformers' random init makes
    # every token predict itself (the sqrt(hidden)-scaled embedding dominates the residual
    # stream), so greedy output would be a constant; the tied path is the Qwen variants'.
    Variant("gemma2", config_class="Gemma2Config",
            overrides={"tie_word_embeddings": False, "sliding_window": 12, "query_pre_attn_scalar": 24,
                       "attn_logit_softcapping": 3.0,
                       "final_logit_softcapping": 4.0}),
    Variant("gemma3", config_class="Gemma3TextConfig",
            overrides={"tie_word_embeddings": False, "num_hidden_layers": 3,
                       "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                       "sliding_window": 12, "query_pre_attn_scalar": 24, "final_logit_softcapping": 4.0,
                       "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    Variant("mixtral", config_class="MixtralConfig", overrides={"num_local_experts": 4, "num_experts_per_tok": 2}),
    Variant("qwen3-moe", config_class="Qwen3MoeConfig",
            overrides={"num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                       "norm_topk_prob": False, "mlp_only_layers": [1]}),
]


def model_dir(variant: Variant, tiny: Callable[..., Path], hf: Callable[..., Path]) -> Path:
    if variant.config_class:
        return hf(variant.config_class, **variant.overrides)
    return tiny(variant.family, **variant.overrides)


def hf_last_logits(model: torch.nn.Module, tokens: list[int], incremental: bool) -> torch.Tensor:
    """transformers' next-token logits after `tokens`: one forward, or one token per forward."""
    if not incremental:
        return model(torch.tensor([tokens])).logits[0, -1]
    out = None
    for token in tokens:
        past = out.past_key_values if out is not None else None
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
    return out.logits[0, -1]


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, incremental: bool = False) -> list[int]:
    """Greedy decoding with transformers' own forward and KV cache, EOS ignored."""
    if incremental:
        out = None
        for token in prompt:
            past = out.past_key_values if out is not None else None
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
    else:
        out = model(torch.tensor([prompt]), use_cache=True)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


def prompt_lengths(rng: random.Random) -> list[int]:
    fixed = [1, PAGE_SIZE, PAGE_SIZE + 1, 2 * PAGE_SIZE, 2 * PAGE_SIZE + 1, 3]
    return fixed + [rng.randint(2, 90) for _ in range(24 - len(fixed))]


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_concurrent_greedy_matches_transformers_one_by_one(
    variant: Variant, tiny_model_factory: Callable[..., Path], hf_model_factory: Callable[..., Path]
):
    path = model_dir(variant, tiny_model_factory, hf_model_factory)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = Generator.from_pretrained(path, cache_tokens=4096, page_size=PAGE_SIZE, max_chunk_size=96)
    vocab = generator.model.config.vocab_size
    rng = random.Random(variant.family or variant.name)
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
            expected = hf_greedy(hf, prompt, max_new, variant.incremental)
            assert completions[i] == expected, f"prompt {i} ({len(prompt)} tokens) differs"


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_mixed_batch_logits_match_transformers(
    variant: Variant, tiny_model_factory: Callable[..., Path], hf_model_factory: Callable[..., Path]
):
    """One forward holding decode rows and prefill chunks over scattered pages
    gives each row's last-position logits as transformers' full forward does."""
    path = model_dir(variant, tiny_model_factory, hf_model_factory)
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
            expected = hf_last_logits(hf, tokens, variant.incremental)
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=0)


def run_forward(
    model: torch.nn.Module,
    cache: KVCache,
    seqs: list[list[int]],
    tables: list[list[int]],
    starts: list[int],
    ends: list[int],
    lora: LoraBatch | None = None,
) -> torch.Tensor:
    """The model's logits at each row's last position; lora: the rows' adapters (tests/test_lora.py)."""
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
        lora=lora,
    )
    model.bind_cache(cache)
    return model(batch)


INCREMENTAL = [v for v in VARIANTS if v.incremental]


@pytest.mark.parametrize("variant", INCREMENTAL, ids=[v.name for v in INCREMENTAL])
def test_length_dependent_rope_matches_one_forward_within_trained_length(
    variant: Variant, tiny_model_factory: Callable[..., Path], hf_model_factory: Callable[..., Path]
):
    """Within the trained length, dynamic NTK and LongRoPE are well defined in
    transformers: its one-forward logits equal the engine's."""
    path = model_dir(variant, tiny_model_factory, hf_model_factory)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_model(path)
    cache = KVCache.allocate(model.config, 64, PAGE_SIZE, torch.float32, "cpu")
    rng = random.Random(1)
    lengths = [3, PAGE_SIZE + 1, _LONG - 1, _LONG]
    seqs = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in lengths]
    pages = iter(range(64))
    tables = [[next(pages) for _ in range(-(-n // PAGE_SIZE))] for n in lengths]
    with torch.inference_mode():
        logits = run_forward(model, cache, seqs, tables, [0] * len(seqs), lengths)
        for row, tokens in enumerate(seqs):
            expected = hf(torch.tensor([tokens])).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=0)
