"""Image jobs in the engine (issue 27): generator.vision (engine/vision/images.py) turns decoded images into
keyed Embeddings (prepared, and encoded when the generator admits the job) and expand_image_placeholders
puts them in the prompt; greedy output equals transformers'
LlavaForConditionalGeneration.generate on a random-weight LLaVA directory (genq_dev/tiny_vlm.py), alone and
batched with text-only jobs, with and without prefix caching, through preemption. Equal images are encoded
once and share prompt pages; different images never do."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from engine import Generator, Job
from engine.vision.images import ImageEncoder, expand_image_placeholders
from genq_dev.tiny_vlm import make_tiny_vlm
from tests.engine_runs import run

PAGE_SIZE = 8
NEW_TOKENS = 8
Prompts = dict[str, tuple[list[int], list[Image.Image]]]
"""name -> (prompt ids with one placeholder per image, the images)"""


def make_images(count: int, seed: int = 0) -> list[Image.Image]:
    """Odd sizes and modes, so the processor resizes, crops and converts."""
    rng = np.random.default_rng(seed)
    shapes = [((45, 29, 3), "RGB"), ((32, 32, 4), "RGBA"), ((17, 61), "L"), ((40, 40, 3), "RGB")]
    return [Image.fromarray(rng.integers(0, 256, shapes[i % 4][0], dtype=np.uint8), shapes[i % 4][1])
            for i in range(count)]


def generator_for(path: Path, **options: Any) -> Generator:
    options = {"cache_tokens": 2048, "page_size": PAGE_SIZE, "max_chunk_size": 24, **options}
    return Generator.from_pretrained(path, **options)


def vision_of(generator: Generator) -> ImageEncoder:
    assert generator.vision is not None
    return generator.vision


def hf_generate(hf: Any, vision: ImageEncoder, ids: list[int], images: list[Image.Image]) -> list[int]:
    """transformers' greedy generate, EOS off, with the prompt's image tokens expanded as LlavaProcessor
    expands `<image>` (tokens_per_image each) and pixel_values from engine/vision/processing.py."""
    image_token = vision.image_token_id
    hf_ids = [t for token in ids for t in ([token] * vision.tokens_per_image if token == image_token else [token])]
    pixels = {"pixel_values": torch.from_numpy(np.stack([vision.processor.pixels(i) for i in images]))} if images \
        else {}
    with torch.inference_mode():
        out = hf.generate(input_ids=torch.tensor([hf_ids]), **pixels, max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=2)
    completion = out[0, len(hf_ids):].tolist()
    assert len(completion) == NEW_TOKENS
    return completion


def image_jobs(generator: Generator, prompts: Prompts) -> list[Job]:
    """One Job per prompt: its images prepared (generator.vision; the generator encodes them when it admits
    the job), the placeholders expanded."""
    vision = vision_of(generator)
    jobs = []
    for name, (ids, images) in prompts.items():
        embeddings = vision.prepare(images)
        jobs.append(Job(expand_image_placeholders(ids, embeddings, vision.image_token_id), NEW_TOKENS,
                        stop_conditions=[], embeddings=embeddings, identifier=name))
    return jobs


def llava_prompts(generator: Generator) -> Prompts:
    """One image, two images, text only: LLaVA prompts with one image token per image."""
    image = vision_of(generator).image_token_id
    pictures = make_images(3)
    return {"one": ([5, 6, 7, image, 8, 9, 10, 11], pictures[:1]),
            "two": ([12, image, 40, image, 13, 14], pictures[1:3]),
            "text": ([30, 31, 32, 33, 34], [])}


def assert_alone_and_batched(generator: Generator, prompts: Prompts, expected: dict[str, list[int]],
                             build: Callable[[Generator, Prompts], list[Job]]) -> None:
    """Each prompt's greedy tokens are `expected`, run one job at a time and all batched together."""
    alone = {}
    for name in prompts:
        alone |= run(generator, build(generator, {name: prompts[name]}))
    assert {name: alone[name].completion_ids for name in prompts} == expected
    batched = run(generator, build(generator, prompts))
    assert {name: batched[name].completion_ids for name in prompts} == expected


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_image_jobs_match_transformers_generate(llava_dir: Path, hf_llava: Any, prefix_caching: bool):
    generator = generator_for(llava_dir, prefix_caching=prefix_caching)
    prompts = llava_prompts(generator)
    vision = vision_of(generator)
    expected = {name: hf_generate(hf_llava, vision, ids, images) for name, (ids, images) in prompts.items()}
    assert_alone_and_batched(generator, prompts, expected, image_jobs)


def test_the_same_image_is_encoded_once_and_shares_pages(llava_dir: Path):
    generator = generator_for(llava_dir)
    vision = vision_of(generator)
    calls: list[int] = []
    forward = vision.tower.forward

    def counted(pixel_values: torch.Tensor) -> torch.Tensor:
        calls.append(pixel_values.shape[0])
        return forward(pixel_values)

    vision.tower.forward = counted  # type: ignore[method-assign]
    picture, other = make_images(2, seed=3)
    twin = picture.copy()
    first, second, third = vision.encode([[picture], [twin], [other]])
    assert calls == [2]  # one tower batch, one row per distinct image
    assert first[0].token_ids == second[0].token_ids != third[0].token_ids
    image = vision.image_token_id
    # 8 text tokens (one full page) before the image's 16 rows, 3 after: 27 tokens, 3 full pages
    prompt = [19, 20, 21, 22, 23, 24, 25, 26, image, 27, 28, 29]

    def job(embeddings: list[Any], name: str) -> Job:
        ids = prompt
        return Job(expand_image_placeholders(ids, embeddings, image), 4, stop_conditions=[], embeddings=embeddings,
                   identifier=name)

    run(generator, [job(first, "a")])
    assert run(generator, [job(second, "b")])["b"]["cached_tokens"] == 24  # every full page, past the image
    # a later encode of the same image (another step) has the same key, so the same ids and pages
    (again,), = vision.encode([[picture.copy()]])
    assert calls == [2, 1] and again.token_ids == first[0].token_ids
    assert run(generator, [job([again], "c")])["c"]["cached_tokens"] == 24
    # a text-identical prompt with a different image: only the page before the image is cached
    assert run(generator, [job(third, "d")])["d"]["cached_tokens"] == PAGE_SIZE
    assert vision.images_encoded == 3 and vision.tower_batches == 2


def preempted_and_not(model_dir: Path, small_cache: int,
                      build: Callable[[Generator, list[Image.Image]], list[Job]]) -> None:
    """Six image jobs (24 new tokens each) on a cache of small_cache tokens, which preempts some, end
    as they do on a large cache, which preempts none; every page is free afterwards."""
    def outputs(cache_tokens: int) -> tuple[dict[str, list[int]], int]:
        generator = generator_for(model_dir, cache_tokens=cache_tokens, max_chunk_size=64)
        jobs = build(generator, make_images(6, seed=5))
        for job in jobs:
            job.max_new_tokens = 24
        results = run(generator, jobs)
        assert generator.pool.num_free == generator.pool.num_pages
        return {name: result.completion_ids for name, result in results.items()}, generator.stats.preemptions

    small, preemptions = outputs(small_cache)
    large, no_preemptions = outputs(2048)
    assert preemptions > 0 and no_preemptions == 0
    assert small == large


def test_preemption_keeps_the_images(llava_dir: Path):
    """A cache too small for every image job at once preempts some; they recompute their prompt, images
    included, and end as they do on a large cache."""
    def build(generator: Generator, pictures: list[Image.Image]) -> list[Job]:
        image = vision_of(generator).image_token_id
        return image_jobs(generator, {f"job{i}": ([5 + i, 6, image, 7, 8 + i], [pictures[i]]) for i in range(6)})

    preempted_and_not(llava_dir, 12 * PAGE_SIZE, build)


def test_placeholder_count_must_equal_the_image_count(llava_dir: Path):
    generator = generator_for(llava_dir, cache_tokens=256)
    vision = vision_of(generator)
    (embedding,), = vision.encode([make_images(1)])
    image = vision.image_token_id
    assert expand_image_placeholders([1, image, 2], [embedding], image) == [1, *embedding.token_ids, 2]
    with pytest.raises(ValueError, match="2 image tokens .* for 1 images"):
        expand_image_placeholders([image, 1, image], [embedding], image)
    with pytest.raises(ValueError, match="0 image tokens .* for 1 images"):
        expand_image_placeholders([1, 2], [embedding], image)


def test_a_text_model_has_no_vision_and_gemma3_has_its_tower(tiny_model_factory: Callable[..., Path],
                                                              tmp_path: Path):
    assert Generator.from_pretrained(tiny_model_factory("llama"), cache_tokens=64, page_size=PAGE_SIZE).vision is None
    gemma = vision_of(generator_for(make_tiny_vlm(tmp_path, "gemma3"), cache_tokens=64))
    (embedding,), = gemma.encode([make_images(1)])
    assert (gemma.tokens_per_image, len(embedding)) == (16, 16)


def test_a_vlm_directory_without_its_image_processor_runs_text_only(llava_dir: Path, tmp_path: Path):
    bare = tmp_path / "bare"
    shutil.copytree(llava_dir, bare)
    (bare / "preprocessor_config.json").unlink()
    generator = generator_for(bare, cache_tokens=256)
    assert generator.vision is None
    assert run(generator, [Job([5, 6, 7], 3, stop_conditions=[], identifier=0)])[0].completion_ids
