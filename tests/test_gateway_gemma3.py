"""Gemma 3 images through a real worker serving a tiny Gemma 3 directory (genq_dev/tiny_vlm.py) and the real
gateway, with the real `openai` SDK (issue 27). The directory gets a minimal Gemma-3-style chat template that
writes the image mark for each image part, as Gemma 3's own template writes `<start_of_image>`: the worker's
prompt for a chat equals transformers' Gemma3Processor.apply_chat_template with that template, and an image
sent as a data URL gets the text of transformers' greedy generate on those ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import transformers

from engine import Generator
from genq_dev.tiny_vlm import make_tiny_vlm
from image_input import decode_image
from producer.protocol import GenerationRequest
from tests.gateway_service import MODEL
from tests.test_gateway_images import assert_serves_text, b64, chat, data_url, image_part, png, refusal
from tests.test_gemma3_images import image_prompt
from tests.test_image_jobs import NEW_TOKENS, vision_of
from worker.jobs import encode_messages

BOI_ID_FROM_END = 3  # make_tiny_vlm's boi_token_index: vocab_size - 3 (the tiny vocabulary has no <start_of_image>)


def gemma3_template(boi: str) -> str:
    """Gemma 3's chat template, cut to what a chat of text and images uses: image parts become `boi`. Its
    turn marks are the tiny tokenizer's <|im_start|> / <|im_end|>: the tiny vocabulary's image soft token
    is the word "turn", which `<start_of_turn>` would spell."""
    return (
        "{{ bos_token }}{% for message in messages %}"
        "<|im_start|>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] | trim }}"
        "{% else %}{% for item in message['content'] %}"
        "{% if item['type'] == 'image' %}{{ '" + boi + "' }}"
        "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>model\n{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Overrides tests/gateway_service.py's: the module's worker serves a tiny Gemma 3 with a Gemma-3-style
    chat template."""
    path = make_tiny_vlm(tmp_path_factory.mktemp("gemma3"), "gemma3", text={"max_position_embeddings": 1024})
    vocab = json.loads((path / "config.json").read_text())["text_config"]["vocab_size"]
    tokens = {v: k for k, v in json.loads((path / "tokenizer.json").read_text())["model"]["vocab"].items()}
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = gemma3_template(tokens[vocab - BOI_ID_FROM_END])
    config_path.write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module")
def generator(model_dir: Path) -> Generator:
    """The engine in this process, for the image processing and the marks the worker uses."""
    return Generator.from_pretrained(model_dir, cache_tokens=512)


@pytest.fixture(scope="module")
def processor(model_dir: Path, generator: Generator) -> Any:
    """transformers' Gemma3Processor over the directory's tokenizer and the same chat template."""
    config = vision_of(generator).tower.config
    tokenizer = generator.tokenizer
    boi, soft, eoi = (tokenizer.id_to_token(i) for i in (config.boi_token_id, config.image_token_id,
                                                          config.eoi_token_id))
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), bos_token=tokenizer.bos_token,
        extra_special_tokens={"boi_token": boi, "image_token": soft, "eoi_token": eoi})
    return transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(**json.loads(
            (model_dir / "preprocessor_config.json").read_text())),
        tokenizer=hf_tokenizer, image_seq_length=config.tokens_per_image, chat_template=template)


def reference_ids(processor: Any, image: bytes) -> list[int]:
    """transformers' prompt ids for tests/test_gateway_images.py's chat with one image."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image", "image": decode_image(image)}]}]
    inputs = processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True,
                                           return_tensors="pt")
    return [int(i) for i in inputs["input_ids"][0]]


def transformers_greedy(hf: Any, generator: Generator, ids: list[int], image: bytes) -> list[int]:
    """NEW_TOKENS greedy tokens, each from a full forward of Gemma3ForConditionalGeneration (token_type_ids
    marking the image's soft tokens, pixels as engine/vision/processing.py gives them). Not `generate`: on this
    prompt, longer than the tiny model's 12-token sliding window, transformers' cached decoding departs from
    its own full forward at the fifth token (a 0.017 logit margin between its top two)."""
    vision = vision_of(generator)
    pixel_values = torch.from_numpy(vision.processor.pixels(decode_image(image))[None])
    tokens = list(ids)
    for _ in range(NEW_TOKENS):
        input_ids = torch.tensor([tokens])
        with torch.inference_mode():
            logits = hf(input_ids=input_ids, pixel_values=pixel_values,
                        token_type_ids=(input_ids == vision.image_token_id).long()).logits
        tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(ids):]


def test_the_worker_renders_an_image_chat_as_gemma3_processor_does(generator: Generator, processor: Any):
    request = GenerationRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image", "data": b64(png())}]}], "max_new_tokens": 1})
    ids = encode_messages(request, generator.tokenizer, image_prompt(generator))
    assert ids == reference_ids(processor, png())
    assert ids.count(vision_of(generator).image_token_id) == 16


def test_an_image_data_url_gets_transformers_greedy_text(oai: openai.OpenAI, generator: Generator, processor: Any,
                                                         model_dir: Path):
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = reference_ids(processor, png())
    expected = transformers_greedy(hf, generator, ids, png())
    reply = oai.chat.completions.create(model=MODEL, messages=chat(image_part(data_url(png()))),  # type: ignore[arg-type]
                                        max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), NEW_TOKENS)
    assert reply.choices[0].message.content == generator.tokenizer.decode(expected)


def test_a_broken_image_gets_a_400_and_the_worker_keeps_serving(oai: openai.OpenAI):
    body = refusal(oai, chat(image_part(data_url(b"%PDF-1.4 not an image"))))
    assert body["param"] == "messages[0].content[1]" and "not an image file" in body["message"], body
    assert_serves_text(oai)
