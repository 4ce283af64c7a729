"""A Gemma 3 image request through a real worker (issue 27): the worker expands `<start_of_image>` as
Gemma3Processor does and gets the engine's greedy text for it (the engine's own equality with
transformers is tests/test_gemma3_images.py); the card prices an image at what its placeholder
becomes."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import Generator, Job
from genq_dev.tiny_vlm import make_tiny_vlm
from image_input import decode_image
from producer.client import GenqClient
from tests.engine_runs import run
from tests.test_gateway_images import b64, png
from worker.images import image_support
from worker.processes import WorkerProcess


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Overrides tests/gateway_service.py's: the module's worker serves a tiny Gemma 3."""
    return make_tiny_vlm(tmp_path_factory.mktemp("gemma3"), "gemma3", text={"max_position_embeddings": 1024})


def engine_greedy(generator: Generator, prompt: str, image: bytes, max_new_tokens: int) -> tuple[list[int], int]:
    """The engine's greedy tokens (and prompt length) for `prompt` with `image` at its <start_of_image>."""
    vision = generator.vision
    assert vision is not None
    expand = vision.image_prompt(generator.tokenizer)
    assert expand is not None
    embeddings = vision.encode([[decode_image(image)]])[0]
    ids = generator.tokenizer.encode(expand.expand_text(prompt), add_special_tokens=generator.tokenizer.add_bos_token)
    job = Job(expand.place(ids, embeddings), max_new_tokens, embeddings=embeddings, stop_conditions=[],
              identifier="reference")
    return run(generator, [job])["reference"].completion_ids or [], len(job.input_ids)


def test_a_gemma3_image_request_gets_the_engine_s_greedy_tokens(worker: WorkerProcess, genq: GenqClient,
                                                                model_dir: Path):
    generator = Generator.from_pretrained(str(model_dir))
    support = image_support(generator)
    assert support is not None
    # "\n\n", <start_of_image>, 16 soft tokens, <end_of_image>, "\n\n"
    assert support.tokens_per_image == 20
    prompt = f"look {support.placeholder} and say"
    request = {"prompt": prompt, "images": [{"data": b64(png()), "media_type": "image/png"}], "max_new_tokens": 6,
               "ignore_eos": True, "sampling": {"temperature": 0}}
    result = genq.submit(request).result(timeout=60)
    expected, prompt_tokens = engine_greedy(generator, prompt, png(), 6)
    assert result.token_ids == expected
    assert result.usage.prompt_tokens == prompt_tokens
    assert genq.submit({"prompt": "Hello", "max_new_tokens": 2}).result(timeout=60).finish_reason == "length"
