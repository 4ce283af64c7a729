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
from engine.weights import load_model
from genq_dev.tiny_model import make_tiny_model


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


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, "Gemma3ForConditionalGeneration"),
        ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope_type='mrope'"),
        ({"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config.*'awq'"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "factor=None"),
    ],
    ids=["architecture", "rope-type", "activation", "partial-rotary", "quantization", "yarn-without-factor"],
)
def test_unsupported_config_fails_at_load_naming_field_and_value(
    llama_dir: Path, tmp_path: Path, changes: dict, message: str
):
    path = copy_model(llama_dir, tmp_path / "bad")
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        Generator.from_pretrained(path)


def test_gemma_activation_and_bidirectional_attention_are_refused():
    gemma = {"architectures": ["Gemma2ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "sliding_window": 8}
    assert ModelConfig.from_dict(gemma).hidden_act == "gelu_pytorch_tanh"
    with pytest.raises(UnsupportedArchitectureError, match="hidden_activation='relu'"):
        ModelConfig.from_dict({**gemma, "hidden_activation": "relu"})
    with pytest.raises(UnsupportedArchitectureError, match="use_bidirectional_attention=true"):
        ModelConfig.from_dict({**gemma, "use_bidirectional_attention": True})


def _classic(config_class: str, **kwargs: object) -> tuple[dict, object]:
    """A config.json in the pre-transformers-5 spelling, and transformers' reading of it."""
    import transformers

    hf = getattr(transformers, config_class)(**kwargs)
    raw = {"architectures": [config_class.replace("TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")],
           **kwargs}
    return raw, hf


@pytest.mark.parametrize(
    ("config_class", "kwargs"),
    [
        ("Gemma2Config", {"num_hidden_layers": 5, "sliding_window": 16}),
        ("Gemma3TextConfig", {"num_hidden_layers": 7, "sliding_window": 16, "sliding_window_pattern": 3}),
        ("Gemma3TextConfig", {"num_hidden_layers": 13, "sliding_window": 16}),
    ],
)
def test_sliding_and_global_layers_follow_transformers(config_class: str, kwargs: dict):
    """Without layer_types, each family's own alternation rule decides which layers slide."""
    raw, hf = _classic(config_class, vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       **kwargs)
    config = ModelConfig.from_dict(raw)
    expected = tuple(16 if t == "sliding_attention" else None for t in hf.layer_types)
    assert tuple(config.layer_window(i) for i in range(config.num_layers)) == expected
    assert None in expected and 16 in expected
    assert config.sliding_window is None  # not every layer slides, so no page may be dropped model-wide


def test_gemma3_classic_and_nested_rope_spellings_agree():
    """rope_theta / rope_local_base_freq / rope_scaling (classic) and transformers 5's
    rope_parameters nested by layer type give the same global and local RoPE."""
    import transformers

    kwargs = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_hidden_layers": 2, "head_dim": 16, "max_position_embeddings": 8192}
    classic = {"architectures": ["Gemma3ForCausalLM"], **kwargs, "rope_theta": 500000.0,
               "rope_local_base_freq": 20000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    nested = transformers.Gemma3TextConfig(**{k: v for k, v in classic.items() if k != "architectures"}).to_dict()
    assert "rope_parameters" in nested and "rope_scaling" not in nested
    nested["architectures"] = ["Gemma3ForCausalLM"]
    a, b = ModelConfig.from_dict(classic), ModelConfig.from_dict(nested)
    assert a.rope == b.rope and a.sliding_rope == b.sliding_rope
    assert (a.rope.theta, a.rope.rope_type, a.rope.factor) == (500000.0, "linear", 8.0)
    assert (a.sliding_rope.theta, a.sliding_rope.rope_type) == (20000.0, "default")


def test_moe_layers_follow_transformers():
    """Qwen3-MoE's decoder_sparse_step and mlp_only_layers pick the sparse layers
    exactly as transformers builds them; Mixtral's are all sparse."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    kwargs = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8,
              "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
              "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    hf = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**kwargs))
    config = ModelConfig.from_dict({"architectures": ["Qwen3MoeForCausalLM"], **kwargs})
    expected = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert [config.layer_is_moe(i) for i in range(6)] == expected == [False, True, False, False, False, True]


def test_missing_expert_tensor_is_named(hf_model_factory: Callable[..., Path], tmp_path: Path):
    from safetensors.torch import load_file, save_file

    path = copy_model(hf_model_factory("MixtralConfig", num_local_experts=4, num_experts_per_tok=2), tmp_path / "moe")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensors: model.layers.1.block_sparse_moe.experts.3.w3.weight"):
        load_model(path)
