"""The worker's side of images without a service (issue 27): the model card's `images` read from
tiny LLaVA and Gemma 3 directories (genq_dev/tiny_vlm.py) loaded by the engine, and none for a text
model or a vision directory that loads text only. The refusals through a real worker are in
tests/test_gateway_images.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import Generator
from genq_dev.tiny_vlm import make_tiny_vlm
from producer.protocol import MAX_IMAGES
from worker.images import image_support


@pytest.mark.parametrize(("family", "overrides", "token_id", "tokens"), [
    ("llava", {}, -1, 16),  # (32 / 8)^2 patches; "default" drops CLIP's class token
    ("llava", {"vision_feature_select_strategy": "full"}, -1, 17),  # ... "full" keeps it
    # <start_of_image> (boi_token_index) marks it and becomes "\n\n", itself, mm_tokens_per_image soft
    # tokens, <end_of_image>, "\n\n" (Gemma3Processor's expansion)
    ("gemma3", {}, -3, 20),
], ids=["llava-default", "llava-full", "gemma3"])
def test_the_card_says_what_a_vision_model_takes(tmp_path: Path, family: str, overrides: dict[str, str],
                                                 token_id: int, tokens: int):
    path = make_tiny_vlm(tmp_path, family, **overrides)
    generator = Generator.from_pretrained(path, cache_tokens=256, page_size=16, max_seq_len=64)
    support = image_support(generator)
    vocab = generator.model.config.vocab_size
    assert support is not None
    assert support.placeholder == generator.tokenizer.backend.id_to_token(vocab + token_id)
    assert generator.tokenizer.encode(support.placeholder, add_special_tokens=False) == [vocab + token_id]
    assert (support.tokens_per_image, support.max_images) == (tokens, min(MAX_IMAGES, 64 // tokens))


def test_a_text_model_takes_no_images(llama_dir: Path):
    generator = Generator.from_pretrained(llama_dir, cache_tokens=256, page_size=16)
    assert image_support(generator) is None


def test_a_vision_directory_that_loads_text_only_takes_no_images(tmp_path: Path):
    path = make_tiny_vlm(tmp_path, "llava")
    (path / "preprocessor_config.json").unlink()
    generator = Generator.from_pretrained(path, cache_tokens=256, page_size=16)
    assert generator.vision is None and image_support(generator) is None
