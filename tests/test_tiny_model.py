"""The tiny model maker writes directories transformers loads as real checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from genq_dev.tiny_model import (
    FAMILIES,
    PRESETS,
    SPECIAL_TOKENS,
    count_parameters,
    make_tiny_model,
    model_config,
)

transformers = pytest.importorskip("transformers")

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One "test"-preset directory per family, shared by the whole module."""
    root = tmp_path_factory.mktemp("tiny-model-maker")
    return {family: make_tiny_model(root / family, family) for family in FAMILIES}


def _load(path: Path) -> tuple[torch.nn.Module, dict]:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_every_weight(tiny_dirs: dict[str, Path], family: str) -> None:
    model, info = _load(tiny_dirs[family])
    assert type(model).__name__ == ARCHITECTURES[family]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    checkpoint = _checkpoint(tiny_dirs[family])
    expected = set(model.state_dict())
    if model.config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    assert set(checkpoint) == expected
    state = model.state_dict()
    for name, tensor in checkpoint.items():
        assert torch.equal(state[name], tensor), name
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    assert count_parameters(_read(tiny_dirs[family] / "config.json")) == sum(unique.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_config_is_a_real_checkpoint_config(tiny_dirs: dict[str, Path], family: str) -> None:
    config = _read(tiny_dirs[family] / "config.json")
    assert config["architectures"] == [ARCHITECTURES[family]] and config["model_type"] == family
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "torch_dtype",
    ):
        assert key in config, key
    assert config["hidden_act"] == "silu" and config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] == family.startswith("qwen")
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA is exercised
    generation = _read(tiny_dirs[family] / "generation_config.json")
    assert generation["eos_token_id"] == [SPECIAL_TOKENS.index("</s>"), SPECIAL_TOKENS.index("<|im_end|>")]
    tok_config = _read(tiny_dirs[family] / "tokenizer_config.json")
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_config["add_bos_token"] == (family in ("llama", "mistral"))
    assert tok_config["chat_template"].startswith("{{- bos_token }}") == (family in ("llama", "mistral"))


def test_family_specific_weights(tiny_dirs: dict[str, Path]) -> None:
    qwen2 = _checkpoint(tiny_dirs["qwen2"])
    for proj in "qkv":
        bias = qwen2[f"model.layers.0.self_attn.{proj}_proj.bias"]
        assert bias.abs().mean() > 0.05  # present and clearly non-zero
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2
    qwen3 = _checkpoint(tiny_dirs["qwen3"])
    assert qwen3["model.layers.1.self_attn.q_norm.weight"].shape == (16,)
    assert not any(name.endswith(".bias") for name in qwen3)
    llama = _checkpoint(tiny_dirs["llama"])
    assert "lm_head.weight" in llama and "lm_head.weight" not in qwen2
    norm = llama["model.layers.0.input_layernorm.weight"]
    assert 0.9 < norm.mean() < 1.1 and norm.std() > 0.01


def test_llama3_rope_scaling_changes_some_frequencies(tiny_dirs: dict[str, Path]) -> None:
    config = _read(tiny_dirs["llama"] / "config.json")
    assert config["rope_scaling"]["rope_type"] == "llama3"
    model, _ = _load(tiny_dirs["llama"])
    scaled = model.model.rotary_emb.inv_freq
    head_dim = config["head_dim"]
    plain = 1.0 / config["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ratio = plain / scaled
    unchanged = torch.isclose(ratio, torch.tensor(1.0))
    divided = torch.isclose(ratio, torch.tensor(config["rope_scaling"]["factor"]))
    assert unchanged.any() and divided.any() and (~unchanged & ~divided).any()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_have_clear_top1_margins(tiny_dirs: dict[str, Path], family: str) -> None:
    model, _ = _load(tiny_dirs[family])
    ids = torch.randint(
        len(SPECIAL_TOKENS), model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logits = model(ids).logits
    top2 = logits.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    assert logits.std(dim=-1).mean() > 2.0  # far from uniform
    assert margin.median() > 0.3
    assert (margin < 1e-3).float().mean() < 0.02


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_is_not_one_repeated_token(tiny_dirs: dict[str, Path], family: str) -> None:
    model, _ = _load(tiny_dirs[family])
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dirs[family])
    prompt = tokenizer("The quick brown fox", return_tensors="pt")
    out = model.generate(
        **prompt, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id
    )
    new = out[0, prompt["input_ids"].shape[1] :].tolist()
    assert len(new) == 32 and len(set(new)) >= 8


def test_sharded_checkpoint_has_a_complete_index(tmp_path: Path) -> None:
    sharded = make_tiny_model(tmp_path / "sharded", "qwen2", num_shards=2)
    single = make_tiny_model(tmp_path / "single", "qwen2")
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = _read(sharded / "model.safetensors.index.json")
    stored = {}
    for name in files:
        with safe_open(str(sharded / name), framework="pt") as f:
            stored.update(dict.fromkeys(f.keys(), name))
    assert index["weight_map"] == stored
    tensors = _checkpoint(sharded)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert set(tensors) == set(_checkpoint(single))
    assert all(torch.equal(tensors[n], t) for n, t in _checkpoint(single).items())
    _, info = _load(sharded)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", "llama", seed=3)
    b = make_tiny_model(tmp_path / "b", "llama", seed=3)
    c = make_tiny_model(tmp_path / "c", "llama", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints(tmp_path: Path, dtype: str) -> None:
    path = make_tiny_model(tmp_path / dtype, "mistral", dtype=dtype)
    assert _read(path / "config.json")["torch_dtype"] == dtype
    assert {t.dtype for t in _checkpoint(path).values()} == {getattr(torch, dtype)}


def test_remaking_into_a_directory_replaces_the_old_shards(tmp_path: Path) -> None:
    make_tiny_model(tmp_path, "llama", num_shards=3)
    make_tiny_model(tmp_path, "llama")
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_tokenizer_vocabulary_matches_the_embedding(tmp_path: Path) -> None:
    # 3000 tokens is beyond what the corpus alone supports, so filler kicks in.
    path = make_tiny_model(tmp_path, "qwen3", vocab_size=3000, num_hidden_layers=1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == 3000 == _read(path / "config.json")["vocab_size"]
    assert _checkpoint(path)["model.embed_tokens.weight"].shape == (3000, 64)


def test_preset_sizes() -> None:
    assert count_parameters(model_config("llama", "test")) < 200_000
    assert 4_000_000 <= count_parameters(model_config("llama", "tiny")) <= 6_000_000
    for family in FAMILIES:
        assert 30_000_000 <= count_parameters(model_config(family, "small")) <= 60_000_000
    assert PRESETS["small"]["vocab_size"] >= 4096
    assert 150_000_000 <= count_parameters(model_config("llama", "medium")) <= 250_000_000


def test_overrides_reach_config_and_weights(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, "llama", tie_word_embeddings=True, num_hidden_layers=3, hidden_size=32)
    config = _read(path / "config.json")
    assert config["head_dim"] == 8  # follows the overridden hidden size
    _, info = _load(path)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert "lm_head.weight" not in _checkpoint(path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"family": "gpt2"}, "unknown family"),
        ({"preset": "huge"}, "unknown preset"),
        ({"dtype": "int8"}, "unsupported dtype"),
        ({"vocab_size": 100}, "vocab_size"),
        ({"num_shards": 10_000}, "num_shards"),
    ],
)
def test_bad_arguments_are_rejected(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_tiny_model(tmp_path, **kwargs)


def test_module_does_not_import_transformers() -> None:
    code = (
        "import sys, importlib.util\n"
        "spec = importlib.util.spec_from_file_location('tm', sys.argv[1])\n"
        "module = sys.modules['tm'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert 'transformers' not in sys.modules, 'tiny_model imported transformers'\n"
    )
    source = Path(__file__).resolve().parents[1] / "genq_dev" / "tiny_model.py"
    subprocess.run([sys.executable, "-c", code, str(source)], check=True)
