"""Loading HF model directories: families, sharding, dtypes, tied embeddings, clear errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Generator, ModelLoadError, UnsupportedArchitectureError
from engine.config import ModelConfig
from engine.tiny_model import make_tiny_model
from engine.weights import load_model


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def greedy(path: Path, **options: object) -> str:
    generator = Generator.from_pretrained(path, cache_tokens=512, page_size=8, **options)
    return generator.generate("Once upon a time", max_new_tokens=10, stop_conditions=[])


def test_sharded_checkpoint_with_index_loads_like_a_single_file(tmp_path: Path):
    single = make_tiny_model(tmp_path / "one", "llama", seed=3)
    sharded = make_tiny_model(tmp_path / "two", "llama", seed=3, num_shards=3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    assert greedy(single) == greedy(sharded)


def test_tied_embeddings_share_one_tensor(tiny_model_factory: Callable[..., Path]):
    model = load_model(tiny_model_factory("qwen2"))
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    untied = load_model(tiny_model_factory("llama"))
    assert untied.lm_head.weight.data_ptr() != untied.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_and_cache(llama_dir: Path, dtype: torch.dtype):
    generator = Generator.from_pretrained(llama_dir, dtype=dtype, cache_tokens=256, page_size=8)
    assert generator.model.embed_tokens.weight.dtype == dtype and generator.cache.k.dtype == dtype
    text = generator.generate("Once upon a time", max_new_tokens=5, stop_conditions=[])
    assert isinstance(text, str)


def test_dtype_defaults_to_config_torch_dtype(tmp_path: Path):
    path = make_tiny_model(tmp_path / "bf16", "qwen3", dtype="bfloat16")
    assert load_model(path).embed_tokens.weight.dtype == torch.bfloat16


def test_llama3_rope_scaling_and_transformers5_rope_parameters_are_read(llama_dir: Path):
    raw = json.loads((llama_dir / "config.json").read_text())
    classic = ModelConfig.from_dict(raw)
    assert classic.rope.rope_type == "llama3" and classic.rope.factor == 8.0
    scaling = raw.pop("rope_scaling")
    raw["rope_parameters"] = {**scaling, "rope_theta": raw.pop("rope_theta")}
    assert ModelConfig.from_dict(raw).rope == classic.rope


def test_unsupported_architecture_is_named(llama_dir: Path, tmp_path: Path):
    path = copy_model(llama_dir, tmp_path / "gpt2")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        Generator.from_pretrained(path)


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        ("config.json", "config.json not found"),
        ("tokenizer.json", "tokenizer.json"),
        ("model.safetensors", "no model.safetensors"),
    ],
)
def test_missing_file_is_named(llama_dir: Path, tmp_path: Path, missing: str, message: str):
    path = copy_model(llama_dir, tmp_path / "broken")
    (path / missing).unlink()
    with pytest.raises(ModelLoadError, match=message):
        Generator.from_pretrained(path)


def test_missing_shard_and_missing_tensor_are_named(tmp_path: Path):
    sharded = make_tiny_model(tmp_path / "sharded", "mistral", num_shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load_model(sharded)
    deep = make_tiny_model(tmp_path / "deep", "mistral")
    config = json.loads((deep / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (deep / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"lacks \d+ tensors: model.layers.2"):
        load_model(deep)
