"""Gemma 3 image jobs in the engine (issue 27): an image's tokens attend to each other both ways in
prefill (transformers' token_type_ids mask), so greedy output equals Gemma3ForConditionalGeneration.generate
on a random-weight directory (genq_dev/tiny_vlm.py) for one and two images, alone and batched with a
text-only job, prefix caching on and off, with a chunk size that would split an image, through preemption.
The prompt's `<start_of_image>` expands as Gemma3Processor's text expansion does, and the reference
attention's span mask is transformers' mask."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from engine import Generator, Job, JobRejected
from engine.embeddings import Embedding
from engine.vision.images import ImagePrompt
from kernels.reference import paged_attention
from tests.engine_runs import run
from tests.test_image_jobs import (
    NEW_TOKENS,
    PAGE_SIZE,
    assert_alone_and_batched,
    generator_for,
    make_images,
    preempted_and_not,
    vision_of,
)


def image_prompt(generator: Generator) -> ImagePrompt:
    prompt = vision_of(generator).image_prompt(generator.tokenizer)
    assert prompt is not None
    return prompt


def prompt_ids(generator: Generator, text: str) -> list[int]:
    """The text with each `<start_of_image>` expanded as Gemma3Processor does, tokenized."""
    return generator.tokenizer.encode(image_prompt(generator).expand_text(text), add_special_tokens=False)


def hf_generate(hf: Any, generator: Generator, ids: list[int], images: list[Image.Image]) -> list[int]:
    """transformers' greedy generate, EOS off, with token_type_ids marking the image soft tokens (as the
    processor returns them) and pixel_values from engine/vision/processing.py."""
    vision = vision_of(generator)
    inputs: dict[str, torch.Tensor] = {"input_ids": torch.tensor([ids])}
    if images:
        inputs["pixel_values"] = torch.from_numpy(np.stack([vision.processor.pixels(i) for i in images]))
        inputs["token_type_ids"] = (inputs["input_ids"] == vision.image_token_id).long()
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=2)
    completion = out[0, len(ids):].tolist()
    assert len(completion) == NEW_TOKENS
    return completion


def gemma3_jobs(generator: Generator, prompts: dict[str, tuple[list[int], list[Image.Image]]]) -> list[Job]:
    vision = vision_of(generator)
    names = list(prompts)
    encoded = vision.encode([prompts[name][1] for name in names])
    expand = image_prompt(generator)
    return [Job(expand.place(prompts[name][0], embeddings) if embeddings else prompts[name][0], NEW_TOKENS,
                stop_conditions=[], embeddings=embeddings, identifier=name)
            for name, embeddings in zip(names, encoded, strict=True)]


def sample_prompts(generator: Generator) -> dict[str, tuple[list[int], list[Image.Image]]]:
    """One image after 10 text tokens (a 24-token chunk would end inside it), two images, text only."""
    pictures = make_images(3)
    boi = boi_text(generator)
    return {"one": (prompt_ids(generator, f"a b c d e f g h i j {boi} describe it"), pictures[:1]),
            "two": (prompt_ids(generator, f"compare {boi}\nwith{boi} now"), pictures[1:3]),
            "text": (prompt_ids(generator, "just some words here"), [])}


def boi_text(generator: Generator) -> str:
    return image_prompt(generator).placeholder


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_gemma3_image_jobs_match_transformers_generate(gemma3_dir: Path, hf_gemma3: Any, prefix_caching: bool):
    generator = generator_for(gemma3_dir, prefix_caching=prefix_caching)  # max_chunk_size 24
    prompts = sample_prompts(generator)
    soft = vision_of(generator).image_token_id
    assert prompts["one"][0].index(soft) < 24 < prompts["one"][0].index(soft) + 16  # a chunk would split it
    expected = {name: hf_generate(hf_gemma3, generator, ids, images) for name, (ids, images) in prompts.items()}
    assert_alone_and_batched(generator, prompts, expected, gemma3_jobs)


def test_causal_attention_over_the_image_would_differ(gemma3_dir: Path, hf_gemma3: Any):
    """The check above has teeth: the same image embeddings marked causal give other tokens."""
    generator = generator_for(gemma3_dir)
    ids, images = sample_prompts(generator)["one"]
    (embedding,), = vision_of(generator).encode([images])
    causal = Embedding(embedding.vectors)
    job = Job(image_prompt(generator).place(ids, [causal]), NEW_TOKENS,
              stop_conditions=[], embeddings=[causal], identifier="causal")
    assert run(generator, [job])["causal"].completion_ids != hf_generate(hf_gemma3, generator, ids, images)


def test_chunks_and_prefix_hits_never_split_an_image(gemma3_dir: Path):
    generator = generator_for(gemma3_dir)
    ids, images = sample_prompts(generator)["one"]
    (job,) = gemma3_jobs(generator, {"a": (ids, images)})
    ((start, end),) = job.bidirectional_spans
    assert end - start == 16 and start % PAGE_SIZE and end % PAGE_SIZE  # the image crosses page boundaries
    chunks: list[tuple[int, int]] = []
    schedule = generator.scheduler.schedule

    def recorded() -> Any:
        output = schedule()
        chunks.extend((item.sequence.num_computed, item.num_tokens) for item in output.scheduled)
        return output

    generator.scheduler.schedule = recorded  # type: ignore[method-assign]
    first = run(generator, [job])["a"]
    assert chunks[0] == (0, start)  # the first chunk ends before the image, the second holds it whole
    assert chunks[1][0] == start and chunks[1][1] >= end - start
    (again,) = gemma3_jobs(generator, {"b": (ids, images)})
    second = run(generator, [again])["b"]
    assert second["cached_tokens"] == 32 >= end  # whole pages past the image: the image is reused whole
    assert second.completion_ids == first.completion_ids
    # a prompt that ends just after the image: its longest usable hit (3 pages) would end inside it
    short = prompt_ids(generator, f"a b c d e f g h i j {boi_text(generator)}")
    (cut,) = gemma3_jobs(generator, {"c": (short, images)})
    assert cut.bidirectional_spans == ((start, end),) and (len(short) - 1) // PAGE_SIZE * PAGE_SIZE == 24
    run(generator, [cut])
    (cut_again,) = gemma3_jobs(generator, {"d": (short, images)})
    assert run(generator, [cut_again])["d"]["cached_tokens"] == PAGE_SIZE  # the last page boundary before it


def test_preemption_keeps_gemma3_images(gemma3_dir: Path):
    def build(generator: Generator, pictures: list[Image.Image]) -> list[Job]:
        boi = boi_text(generator)
        return gemma3_jobs(generator, {f"job{i}": (prompt_ids(generator, f"x{i} y {boi} z{i}"), [pictures[i]])
                                       for i in range(6)})

    preempted_and_not(gemma3_dir, 16 * PAGE_SIZE, build)


def test_an_image_longer_than_a_chunk_is_refused(gemma3_dir: Path):
    generator = generator_for(gemma3_dir, max_chunk_size=12, max_batch_size=4)
    ids, images = sample_prompts(generator)["one"]
    (job,) = gemma3_jobs(generator, {"a": (ids, images)})
    with pytest.raises(JobRejected, match="max_chunk_size=12"):
        generator.enqueue(job)


def test_prompt_ids_and_pixels_are_gemma3_processors(gemma3_dir: Path):
    """transformers' Gemma3Processor over the directory's tokenizer (its image tokens named as the released
    tokenizer names them) gives the prompt ids the worker encodes, token_type_ids on exactly the spans the
    job attends both ways, and the pixel values engine/vision/processing.py gives (pan-and-scan off)."""
    generator = generator_for(gemma3_dir, cache_tokens=256)
    tokenizer, vision = generator.tokenizer, vision_of(generator)
    config = vision.tower.config
    boi, soft, eoi = (tokenizer.id_to_token(i) for i in (config.boi_token_id, config.image_token_id,
                                                          config.eoi_token_id))
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(gemma3_dir / "tokenizer.json"),
        extra_special_tokens={"boi_token": boi, "image_token": soft, "eoi_token": eoi})
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(**json.loads(
            (gemma3_dir / "preprocessor_config.json").read_text())),
        tokenizer=hf_tokenizer, image_seq_length=config.tokens_per_image)
    text = f"hello\n{boi}\nworld{boi} end\n\n"
    images = make_images(2, seed=7)
    hf = processor(text=[text], images=[images], return_tensors="pt")
    ids = generator.tokenizer.encode(image_prompt(generator).expand_text(text))
    assert hf["input_ids"][0].tolist() == ids
    (embeddings,) = vision.encode([images])
    expand = image_prompt(generator)
    job = Job(expand.place(ids, embeddings), 1, embeddings=embeddings)
    # a token prompt's placeholder tokens expand into the processor's sequence, token by token
    sequence = tokenizer.encode(expand.expand_text(boi), add_special_tokens=False)
    assert sequence == hf_tokenizer(processor.full_image_sequence, add_special_tokens=False)["input_ids"]
    assert expand.expand_tokens([5, config.boi_token_id, 6], tokenizer) == [5, *sequence, 6]
    marked = torch.zeros(len(ids), dtype=torch.long)
    for start, end in job.bidirectional_spans:
        marked[start:end] = 1
    assert torch.equal(hf["token_type_ids"][0], marked)
    ours = np.stack([vision.processor.pixels(image) for image in images])
    assert np.abs(hf["pixel_values"].numpy() - ours).max() <= 1e-6


@pytest.mark.parametrize("window", [None, 3], ids=["global", "sliding"])
def test_reference_attention_over_spans_is_transformers_mask(window: int | None):
    """kernels' reference paged attention with bidirectional spans equals dense attention under
    transformers' mask: AND(sliding window, OR(causal, same span)), for a prefill chunk and for a short
    (batched) row, over pages in shuffled order."""
    torch.manual_seed(0)
    page_size, heads, kv_heads, dim = 4, 4, 2, 8
    lengths, spans = [21, 9], [((3, 9), (12, 17)), ((2, 7),)]
    num_pages = sum(-(-n // page_size) for n in lengths) + 2
    k_cache = torch.randn(kv_heads, num_pages, page_size, dim)
    v_cache = torch.randn(kv_heads, num_pages, page_size, dim)
    order = torch.randperm(num_pages)
    tables = torch.zeros(2, 8, dtype=torch.int32)
    tables[0, :6] = order[:6]
    tables[1, :3] = order[6:9]
    q = torch.randn(sum(lengths), heads, dim)
    out = paged_attention(q, k_cache, v_cache, tables, torch.tensor([0, 21, 30], dtype=torch.int32),
                          torch.tensor(lengths, dtype=torch.int32), 0.3, window, None, None, None, spans)
    start = 0
    for b, n in enumerate(lengths):
        keys = k_cache[:, tables[b].long()].reshape(kv_heads, -1, dim)[:, :n].repeat_interleave(heads // kv_heads, 0)
        values = v_cache[:, tables[b].long()].reshape(kv_heads, -1, dim)[:, :n].repeat_interleave(heads // kv_heads, 0)
        position = torch.arange(n)
        group = torch.full((n,), -1)
        for index, (first, end) in enumerate(spans[b]):
            group[first:end] = index
        mask = (position[None, :] <= position[:, None]) | ((group[:, None] == group[None, :]) & (group[:, None] >= 0))
        if window is not None:
            mask &= position[None, :] > position[:, None] - window
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1), keys, values, attn_mask=mask, scale=0.3).transpose(0, 1)
        torch.testing.assert_close(out[start : start + n], expected)
        start += n
