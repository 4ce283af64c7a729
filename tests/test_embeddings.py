"""Embeddings in place of token embeddings (the multimodal path), checked
against transformers' inputs_embeds on the same weights, and their part in
the prefix cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import Embedding, Generator, Job, JobRejected
from tests.conftest import FAMILIES
from tests.engine_runs import run

PAGE_SIZE = 8




def hf_greedy_with_embeddings(model, ids: list[int], embedding: Embedding, steps: int) -> list[int]:
    embed = model.get_input_embeddings()
    rows = [i for i, t in enumerate(ids) if t in embedding.token_ids]
    safe = torch.tensor([[0 if i in rows else t for i, t in enumerate(ids)]])
    inputs = embed(safe)
    inputs[0, rows] = embedding.vectors
    out = model(inputs_embeds=inputs, use_cache=True)
    generated = []
    for _ in range(steps):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


@pytest.mark.parametrize("family", FAMILIES)
def test_embeddings_replace_token_embeddings_like_transformers_inputs_embeds(
    family: str, tiny_model_factory: Callable[..., Path]
):
    path = tiny_model_factory(family)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = Generator.from_pretrained(path, cache_tokens=1024, page_size=PAGE_SIZE, max_chunk_size=16)
    torch.manual_seed(0)
    embedding = Embedding(torch.randn(5, generator.model.config.hidden_size))
    ids = [11, 12, 13, 14, 15, 16, 17, 18, 19, *embedding.token_ids, 21, 22, 23, 24, 25, 26]
    result = run(generator, [Job(ids, 10, stop_conditions=[], embeddings=[embedding], identifier=0)])[0]
    with torch.inference_mode():
        assert result["completion_ids"] == hf_greedy_with_embeddings(hf, ids, embedding, 10)


def test_the_same_embedding_reuses_pages_and_a_different_one_never_does(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=PAGE_SIZE)
    hidden = generator.model.config.hidden_size
    torch.manual_seed(1)
    vectors = torch.randn(12, hidden)
    first = Embedding(vectors)
    text = list(range(30, 38))

    def job(embedding: Embedding, name: str) -> Job:
        return Job(text + embedding.token_ids + [40, 41, 42], 4, stop_conditions=[], embeddings=[embedding],
                   identifier=name)

    run(generator, [job(first, "a")])
    again = run(generator, [job(first, "b")])["b"]
    assert again["cached_tokens"] == 16  # 8 text + 12 embedding rows + 3 text = 23 tokens: 2 full pages
    twin = run(generator, [job(Embedding(vectors.clone()), "c")])["c"]
    assert twin["cached_tokens"] == 8  # only the text page before it


def test_embedding_errors_are_clear(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=256, page_size=PAGE_SIZE)
    wrong_width = Embedding(torch.randn(2, generator.model.config.hidden_size + 1))
    with pytest.raises(JobRejected, match="hidden_size"):
        generator.enqueue(Job([5, *wrong_width.token_ids], 2, embeddings=[wrong_width]))
    unused = Embedding(torch.randn(2, generator.model.config.hidden_size))
    with pytest.raises(ValueError, match="reserved ids"):
        Job([5, 6], 2, embeddings=[unused])
    with pytest.raises(JobRejected, match="outside the vocabulary"):
        generator.enqueue(Job([5, *unused.token_ids], 2))


def test_keyed_embeddings_share_ids_and_pages_by_key(llama_dir: Path, monkeypatch: pytest.MonkeyPatch):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=PAGE_SIZE)
    hidden = generator.model.config.hidden_size
    torch.manual_seed(2)
    vectors, other = torch.randn(12, hidden), torch.randn(12, hidden)
    text = list(range(30, 38))

    def job(embedding: Embedding, name: str) -> Job:
        return Job(text + embedding.token_ids + [40, 41, 42], 4, stop_conditions=[], embeddings=[embedding],
                   identifier=name)

    first = Embedding(vectors, key="test-image-a")
    twin = Embedding(vectors.clone(), key="test-image-a")
    assert twin.token_ids == first.token_ids and Embedding(other, key="test-image-b").first_id != first.first_id
    run(generator, [job(first, "a")])
    assert run(generator, [job(twin, "b")])["b"]["cached_tokens"] == 16  # both full pages, the image's too
    assert run(generator, [job(Embedding(other, key="test-image-b"), "c")])["c"]["cached_tokens"] == 8
    with pytest.raises(ValueError, match="already names 12 rows, not 3"):
        Embedding(vectors[:3], key="test-image-a")
    # a forgotten key takes fresh ids: sharing with older jobs is lost, ids are never reused
    monkeypatch.setattr("engine.embeddings.MAX_KEYS", 1)
    Embedding(other, key="test-image-c")
    again = Embedding(vectors, key="test-image-a")
    assert again.first_id > first.first_id
    assert run(generator, [job(again, "d")])["d"]["cached_tokens"] == 8
