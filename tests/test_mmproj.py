"""A vision-language model as llama.cpp ships it (issue 27): a text GGUF plus its mmproj GGUF
(engine/vision/mmproj.py), written from a random-weight LLaVA directory (tests/gguf_mmproj_files.py).
Greedy output with images equals transformers' LlavaForConditionalGeneration.generate on the original
directory; the pixels equal transformers' CLIPImageProcessor's; the card advertises images; a bad mmproj
is refused naming the problem."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from celery import Celery

from engine import Job
from engine.errors import ModelLoadError
from engine.vision.images import expand_image_placeholders
from genq_dev.tiny_vlm import make_tiny_vlm
from image_input import decode_image
from producer.client import GenqClient
from tests.engine_runs import run
from tests.gateway_service import running_worker
from tests.gguf_mmproj_files import write_llava_gguf
from tests.test_gateway_images import b64, png
from tests.test_image_jobs import (
    assert_alone_and_batched,
    generator_for,
    hf_generate,
    image_jobs,
    llava_prompts,
    make_images,
    vision_of,
)
from tests.test_vision_towers import TOLERANCE, hf_features
from worker.cli import build_parser
from worker.images import image_support
from worker.settings import Settings


@pytest.fixture(scope="module")
def llava_gguf(tiny_vlm: Callable[[str], tuple[Path, Any]], tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[Path, Path]:
    """conftest's tiny LLaVA (llava_dir) as a text GGUF and its mmproj."""
    return write_llava_gguf(tiny_vlm("llava")[0], tmp_path_factory.mktemp("gguf"))


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_gguf_with_mmproj_matches_transformers_generate(llava_gguf: tuple[Path, Path], hf_llava: Any,
                                                        prefix_caching: bool):
    text, mmproj = llava_gguf
    generator = generator_for(text, mmproj=mmproj, prefix_caching=prefix_caching)
    prompts = llava_prompts(generator)
    vision = vision_of(generator)
    expected = {name: hf_generate(hf_llava, vision, ids, images) for name, (ids, images) in prompts.items()}
    assert_alone_and_batched(generator, prompts, expected, image_jobs)


def test_mmproj_image_features_equal_transformers(llava_gguf: tuple[Path, Path], hf_llava: Any):
    """The tower and projector from the mmproj give get_image_features' rows (its layer -2 of the full tower)."""
    text, mmproj = llava_gguf
    vision = vision_of(generator_for(text, mmproj=mmproj, cache_tokens=64))
    pixel_values = torch.from_numpy(np.stack([vision.processor.pixels(image) for image in make_images(3)]))
    expected = hf_features(hf_llava, pixel_values)
    got = vision.tower(pixel_values)
    assert got.shape == expected.shape == (3, 16, 64)
    assert expected.abs().max() > 1.0  # the random weights reach the output
    assert (got - expected).abs().max().item() <= TOLERANCE


def test_mmproj_pixels_equal_the_directorys_clip_image_processor(llava_dir: Path, llava_gguf: tuple[Path, Path]):
    text, mmproj = llava_gguf
    processor = vision_of(generator_for(text, mmproj=mmproj, cache_tokens=64)).processor
    reference = transformers.CLIPImageProcessor.from_pretrained(llava_dir)
    images = make_images(4, seed=7)
    expected = reference(images, return_tensors="np")["pixel_values"]
    got = np.stack([processor.pixels(image) for image in images])
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


def test_the_card_advertises_images_for_a_gguf_with_its_mmproj(llava_gguf: tuple[Path, Path]):
    text, mmproj = llava_gguf
    support = image_support(generator_for(text, mmproj=mmproj, cache_tokens=64))
    assert support is not None
    assert (support.placeholder, support.tokens_per_image) == ("<image>", 16)
    assert image_support(generator_for(text, cache_tokens=64)) is None


def test_an_mmproj_of_another_projector_type_is_refused(llava_dir: Path, llava_gguf: tuple[Path, Path],
                                                        tmp_path: Path):
    text, _ = llava_gguf
    _, ldp = write_llava_gguf(llava_dir, tmp_path, projector_type="ldp")
    with pytest.raises(ModelLoadError, match="projector type 'ldp' is not supported"):
        generator_for(text, mmproj=ldp, cache_tokens=64)


def test_an_mmproj_for_another_embedding_width_is_refused(llava_gguf: tuple[Path, Path], tmp_path: Path):
    text, _ = llava_gguf
    narrow = make_tiny_vlm(tmp_path / "narrow", "llava", text={"hidden_size": 32, "head_dim": 8})
    _, mmproj = write_llava_gguf(narrow, tmp_path / "narrow-gguf")
    with pytest.raises(ModelLoadError, match="projector writes 32-wide embeddings, the text model's embedding "
                                             "width is 64"):
        generator_for(text, mmproj=mmproj, cache_tokens=64)


def test_a_text_gguf_is_not_an_mmproj(llava_gguf: tuple[Path, Path]):
    text, _ = llava_gguf
    with pytest.raises(ModelLoadError, match="is not an mmproj file with a vision encoder"):
        generator_for(text, mmproj=text, cache_tokens=64)


def test_the_worker_takes_the_mmproj_from_its_option_or_environment(monkeypatch: pytest.MonkeyPatch):
    assert build_parser().parse_args(["worker", "--model", "m.gguf", "--mmproj", "p.gguf"]).mmproj == "p.gguf"
    monkeypatch.setenv("GENQ_MMPROJ", "q.gguf")
    assert Settings(model="m.gguf").mmproj == "q.gguf"


def test_a_worker_serves_images_with_the_mmproj(llava_gguf: tuple[Path, Path], redis_url: str, celery_client: Celery,
                                                tmp_path: Path):
    """`genq worker --model text.gguf --mmproj mmproj.gguf`: its card takes images and an image request gets
    the engine's greedy tokens."""
    text, mmproj = llava_gguf
    image = png()
    generator = generator_for(text, mmproj=mmproj)
    vision = vision_of(generator)
    prompt = generator.tokenizer.encode("<image> describe", add_special_tokens=generator.tokenizer.add_bos_token)
    assert prompt.count(vision.image_token_id) == 1
    embeddings = vision.prepare([decode_image(image)])
    job = Job(expand_image_placeholders(prompt, embeddings, vision.image_token_id), 6, stop_conditions=[],
              embeddings=embeddings, identifier="reference")
    expected = run(generator, [job])["reference"].completion_ids
    queue = "genq-mmproj"
    with running_worker(text, redis_url, celery_client, tmp_path, queue, "mmproj-worker", mmproj=str(mmproj)), \
            GenqClient(redis_url, queue=queue) as genq:
        result = genq.submit({"prompt": "<image> describe", "images": [{"data": b64(image)}], "max_new_tokens": 6,
                              "ignore_eos": True, "sampling": {"temperature": 0}}).result(timeout=60)
    assert result.token_ids == expected
