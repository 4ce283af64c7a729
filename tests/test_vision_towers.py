"""Vision towers and projectors (engine/vision/) against transformers' get_image_features, on random-weight
LLaVA (CLIP over Llama) and Gemma 3 (SigLIP) directories that transformers saved (genq_dev/tiny_vlm.py);
images go through engine/vision/processing.py first. Also the language model of those directories in the
engine: text-only greedy output, and LLaVA's with images placed as Embeddings, equal to transformers'."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file

from engine import Embedding, Generator, Job
from engine.config import ModelConfig
from engine.errors import ModelLoadError, UnsupportedArchitectureError
from engine.vision.checkpoint import language_model_name, vision_name
from engine.vision.config import VisionLanguageConfig
from engine.vision.loading import load_vision_tower
from engine.vision.processing import image_processor_from_config
from genq_dev.tiny_vlm import make_tiny_vlm
from tests.engine_runs import greedy_completions, run

# max |ours - transformers'| of the image features; the tower runs the same torch ops in float32
TOLERANCE = 1e-5
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llava-default": ("llava", {}),
    "llava-full": ("llava", {"vision_feature_select_strategy": "full"}),
    "llava-two-layers": ("llava", {"vision_feature_layer": [0, -1]}),
    "gemma3": ("gemma3", {}),
}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(variant: str) -> Path:
        if variant not in made:
            family, overrides = VARIANTS[variant]
            made[variant] = make_tiny_vlm(tmp_path_factory.mktemp(variant), family, **overrides)
        return made[variant]

    return make


def hf_vlm(path: Path) -> Any:
    return transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def images() -> list[Image.Image]:
    """Odd sizes and modes, so the processor resizes, crops and converts."""
    rng = np.random.default_rng(0)
    shapes = [((45, 29, 3), "RGB"), ((32, 32, 4), "RGBA"), ((17, 61), "L")]
    return [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode) for shape, mode in shapes]


def pixels(path: Path, batch: list[Image.Image]) -> torch.Tensor:
    processor = image_processor_from_config(json.loads((path / "preprocessor_config.json").read_text()))
    return torch.from_numpy(np.stack([processor.pixels(image) for image in batch]))


def hf_features(model: Any, pixel_values: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        features = model.get_image_features(pixel_values=pixel_values).pooler_output
    return torch.stack(list(features)) if isinstance(features, (list, tuple)) else features


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_image_features_equal_transformers(variant: str, vlm_dir: Callable[[str], Path]):
    path = vlm_dir(variant)
    tower = load_vision_tower(path)
    pixel_values = pixels(path, images())
    expected = hf_features(hf_vlm(path), pixel_values)
    got = tower(pixel_values)
    assert got.shape == expected.shape == (3, tower.tokens_per_image, tower.config.text_hidden_size)
    assert expected.abs().max() > 1.0  # the random weights reach the output
    assert (got - expected).abs().max().item() <= TOLERANCE
    # images never see each other: one alone gives its rows of the batch
    assert (tower(pixel_values[1:2]) - got[1:2]).abs().max().item() <= TOLERANCE


def test_tokens_per_image_and_layers_run(vlm_dir: Callable[[str], Path]):
    default, full, gemma = (load_vision_tower(vlm_dir(v)) for v in ("llava-default", "llava-full", "gemma3"))
    assert (default.tokens_per_image, full.tokens_per_image, gemma.tokens_per_image) == (16, 17, 16)
    # LLaVA reads layer -2 of 2: the last layer is never built
    assert len(default.vision.encoder.layers) == 1 and len(gemma.vision.encoder.layers) == 2


def test_nested_checkpoint_names_load_the_same(vlm_dir: Callable[[str], Path], tmp_path: Path):
    """transformers >= 4.52 checkpoints spell the names model.language_model.* / model.vision_tower.vision_model.*
    / model.multi_modal_projector.* / lm_head.*; they load to the same tower and text model."""
    path = vlm_dir("llava-default")
    nested = tmp_path / "nested"
    shutil.copytree(path, nested)
    renames = [("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
               ("vision_tower.", "model.vision_tower.vision_model."),
               ("multi_modal_projector.", "model.multi_modal_projector.")]
    tensors = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        old, new = next((o, n) for o, n in renames if name.startswith(o))
        tensors[new + name.removeprefix(old)] = tensor
    save_file(tensors, nested / "model.safetensors", metadata={"format": "pt"})
    pixel_values = pixels(path, images())
    assert torch.equal(load_vision_tower(nested)(pixel_values), load_vision_tower(path)(pixel_values))
    prompt = [[5, 17, 33, 99, 250, 7]]
    first, second = (Generator.from_pretrained(p, cache_tokens=256, page_size=8) for p in (path, nested))
    assert greedy_completions(first, prompt, 6) == greedy_completions(second, prompt, 6)


def test_checkpoint_name_mapping():
    assert vision_name("model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight") == \
        "vision.encoder.layers.0.mlp.fc1.weight"
    assert vision_name("vision_tower.embeddings.patch_embedding.weight") == "vision.embeddings.patch_embedding.weight"
    assert vision_name("multi_modal_projector.linear_1.bias") == "projector.linear_1.bias"
    assert vision_name("language_model.model.norm.weight") is None
    assert language_model_name("model.language_model.layers.0.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert language_model_name("language_model.lm_head.weight") == "lm_head.weight"
    assert language_model_name("lm_head.weight") == "lm_head.weight"
    assert language_model_name("model.vision_tower.vision_model.post_layernorm.bias") is None


def hf_greedy(model: Any, ids: list[int], steps: int, pixel_values: torch.Tensor | None = None) -> list[int]:
    """Greedy decoding with transformers' VLM forward and KV cache, EOS ignored."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), pixel_values=pixel_values, use_cache=True)
        generated: list[int] = []
        for _ in range(steps):
            token = int(out.logits[0, -1].argmax())
            generated.append(token)
            out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return generated


@pytest.mark.parametrize("variant", ["llava-default", "gemma3"])
def test_language_model_of_a_vlm_directory_matches_transformers_text_only(
    variant: str, vlm_dir: Callable[[str], Path]
):
    path = vlm_dir(variant)
    generator = Generator.from_pretrained(path, cache_tokens=1024, page_size=8, max_chunk_size=16)
    config = generator.model.config
    assert config.vision_language == transformers.AutoConfig.from_pretrained(path).architectures[0]
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(5, config.vocab_size - 3, n)] for n in (3, 9, 20)]
    hf = hf_vlm(path)
    expected = [hf_greedy(hf, prompt, 10) for prompt in prompts]
    assert greedy_completions(generator, prompts, 10) == expected


def test_llava_image_jobs_match_transformers(vlm_dir: Callable[[str], Path]):
    """The tower's rows as Embeddings in the prompt: greedy output equals transformers' with pixel_values,
    one and two images per prompt, batched with a text-only job. (LLaVA attends causally over image
    tokens; Gemma 3 does not, see engine/vision/__init__.py.)"""
    path = vlm_dir("llava-default")
    hf, tower = hf_vlm(path), load_vision_tower(path)
    image_token = hf.config.image_token_id
    pixel_values = pixels(path, images())
    features = tower(pixel_values)
    generator = Generator.from_pretrained(path, cache_tokens=2048, page_size=8, max_chunk_size=24)
    embeddings = [Embedding(rows) for rows in features]
    # name -> (prompt pieces: token lists and image indices, in order)
    prompts: dict[str, list[list[int] | int]] = {"one": [[5, 6, 7], 0, [8, 9, 10, 11]],
                                                 "two": [[12], 1, [40], 2, [13, 14]]}
    jobs, expected = [], {}
    for name, pieces in prompts.items():
        ids: list[int] = []
        hf_ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                ids += embeddings[piece].token_ids
                hf_ids += [image_token] * len(embeddings[piece])
            else:
                ids += piece
                hf_ids += piece
        shown = [p for p in pieces if isinstance(p, int)]
        jobs.append(Job(ids, 8, stop_conditions=[], embeddings=[embeddings[i] for i in shown], identifier=name))
        expected[name] = hf_greedy(hf, hf_ids, 8, pixel_values[shown])
    text_only = [30, 31, 32, 33]
    jobs.append(Job(text_only, 8, stop_conditions=[], identifier="text"))
    expected["text"] = hf_greedy(hf, text_only, 8)
    results = run(generator, jobs)
    assert {name: results[name].completion_ids for name in expected} == expected


def test_config_refusals_name_the_field(vlm_dir: Callable[[str], Path]):
    raw = json.loads((vlm_dir("gemma3") / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="mm_tokens_per_image=15"):
        VisionLanguageConfig.from_dict({**raw, "mm_tokens_per_image": 15})
    with pytest.raises(UnsupportedArchitectureError, match="model_type='pixtral'"):
        VisionLanguageConfig.from_dict({**raw, "vision_config": {"model_type": "pixtral"}})
    llava = json.loads((vlm_dir("llava-default") / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="vision_feature_layer=5"):
        VisionLanguageConfig.from_dict({**llava, "vision_feature_layer": 5})
    with pytest.raises(UnsupportedArchitectureError, match="model_type='vicuna'"):
        ModelConfig.from_dict({**llava, "text_config": {**llava["text_config"], "model_type": "vicuna"}})


def test_missing_vision_tensor_is_named(vlm_dir: Callable[[str], Path], tmp_path: Path):
    path = vlm_dir("gemma3")
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    tensors = load_file(path / "model.safetensors")
    del tensors["multi_modal_projector.mm_soft_emb_norm.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="projector.mm_soft_emb_norm.weight"):
        load_vision_tower(broken)


# Shaped like llava-hf/llava-1.5-7b-hf's config.json: its text_config leaves the Llama-7B shapes to
# LlamaConfig's defaults, its vision_config CLIP's activation and norm epsilon.
LLAVA_15 = {
    "architectures": ["LlavaForConditionalGeneration"], "image_token_index": 32000, "model_type": "llava",
    "pad_token_id": 32001, "projector_hidden_act": "gelu", "tie_word_embeddings": False, "torch_dtype": "float16",
    "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "model_type": "llama",
                    "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064},
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}


def test_sparse_released_configs_take_transformers_defaults():
    reference = transformers.LlavaConfig(**json.loads(json.dumps(LLAVA_15)))
    text, vision = reference.text_config, reference.vision_config
    ours = ModelConfig.from_dict(LLAVA_15)
    assert (ours.family, ours.vocab_size, ours.hidden_size, ours.intermediate_size, ours.num_layers,
            ours.num_heads, ours.num_kv_heads, ours.rms_norm_eps, ours.max_position_embeddings,
            ours.tie_word_embeddings, ours.torch_dtype) == (
        "llama", text.vocab_size, text.hidden_size, text.intermediate_size, text.num_hidden_layers,
        text.num_attention_heads, text.num_key_value_heads, text.rms_norm_eps, text.max_position_embeddings,
        reference.tie_word_embeddings, "float16")
    tower = VisionLanguageConfig.from_dict(LLAVA_15)
    encoder = tower.encoder
    assert (encoder.hidden_act, encoder.layer_norm_eps, encoder.hidden_size, encoder.num_layers) == (
        vision.hidden_act, vision.layer_norm_eps, vision.hidden_size, vision.num_hidden_layers)
    assert (tower.tokens_per_image, tower.layers_needed, tower.text_hidden_size) == (576, 23, 4096)
