"""Model configuration read from an HF model directory's config.json.

One dataclass covers every supported family; the family only switches a few
flags (qkv bias, q/k norm, tied embeddings, sliding window).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError, UnsupportedArchitectureError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    torch_dtype: str = "float32"

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{config_path} not found: a model directory needs config.json")
        return cls.from_dict(json.loads(config_path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architectures = raw.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES), None)
        if family is None:
            supported = ", ".join(ARCHITECTURES)
            raise UnsupportedArchitectureError(
                f"config.json architectures={architectures!r} is not supported; supported: {supported}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(f"hidden_act={raw['hidden_act']!r} is not supported (only 'silu')")
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        attention_bias = bool(raw.get("attention_bias", False))
        sliding_window = raw.get("sliding_window")
        if family in ("qwen2", "qwen3"):
            # Qwen's per-layer window (max_window_layers) is off in every released checkpoint.
            if raw.get("use_sliding_window", False):
                raise UnsupportedArchitectureError(f"{family} with use_sliding_window=true is not supported")
            sliding_window = None
        elif family == "llama":
            sliding_window = None
        return cls(
            family=family,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rope=_rope_config(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always carries q/k/v biases (its config has no attention_bias key).
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=sliding_window,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    """Read RoPE settings in both the classic (rope_theta + rope_scaling) and the
    transformers-5 (rope_parameters) spellings."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise UnsupportedArchitectureError(
            f"rope_scaling type {rope_type!r} is not supported (supported: default, llama3)"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged["factor"]),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
    )
