"""Model configuration read from an HF model directory's config.json.

One dataclass covers every supported family; the family only switches a few
traits (qkv bias, q/k norm, Gemma's norms and soft-capping, per-layer sliding
windows and RoPE, mixture-of-experts MLPs). from_dict is the one place that
understands Hugging Face's config.json (other loaders, such as GGUF, translate
their metadata into that dict), and it refuses at load time, naming the field
and its value, anything the model code would otherwise silently get wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError, UnsupportedArchitectureError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}

# Vision-language checkpoints whose language model the engine serves (their vision towers are
# engine/vision/): wrapper architecture -> {text_config model_type: the text model's architecture}.
VISION_LANGUAGE_ARCHITECTURES = {
    "LlavaForConditionalGeneration": {
        "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"},
    "Gemma3ForConditionalGeneration": {"gemma3_text": "Gemma3ForCausalLM"},
}
# transformers' config-class defaults for the text_config keys released VLM configs leave out
# (llava-1.5's text_config omits the Llama-7B shapes; Gemma 3's omits its vocabulary)
_TEXT_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "gemma3_text": {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6},
}
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_GEMMA = ("gemma2", "gemma3")
_SLIDING, _FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class RopeConfig:
    """One rotary embedding. attention_factor is already resolved (YaRN's and
    LongRoPE's scale on cos/sin, 1.0 otherwise)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # dynamic NTK rescales past this length (the config's max_position_embeddings)
    max_position_embeddings: int = 4096

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading dims of each head rotate (all but a partial-rotary tail)."""
        dim = int(head_dim * self.partial_rotary_factor)
        return 2 * len(range(0, dim, 2))


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
    # a window every layer uses (None when any layer attends globally)
    sliding_window: int | None = None
    torch_dtype: str = "float32"
    hidden_act: str = "silu"
    # per-layer windows when layers differ (Gemma's sliding/global alternation); () = sliding_window everywhere
    layer_windows: tuple[int | None, ...] = ()
    # the RoPE of sliding-window layers when it differs from `rope` (Gemma 3's local base)
    sliding_rope: RopeConfig | None = None
    # softmax scale of q.k; None means head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_scale: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Gemma: RMSNorm scales by (1 + weight), computed in fp32 before the cast
    norm_unit_offset: bool = False
    # Gemma: norms on the attention and MLP outputs too, and one before the MLP
    sandwich_norms: bool = False
    # Gemma: token embeddings times sqrt(hidden_size)
    embed_scale: float = 1.0
    # mixture of experts (0 experts = dense MLP everywhere)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Mixtral weighs expert outputs with fp32 routing weights; Qwen3-MoE casts them to the activation dtype
    router_weights_fp32: bool = False
    # per layer, whether its MLP is the sparse MoE block; () = every layer when num_experts > 0
    moe_layers: tuple[bool, ...] = ()
    # the language model of this vision-language checkpoint (its architecture, e.g.
    # "LlavaForConditionalGeneration"); its tensor names carry the wrapper's prefixes. None: a text model
    vision_language: str | None = None

    @property
    def max_context_len(self) -> int:
        """Longest sequence the model serves: RoPE scalings that stretch the
        trained context (linear, dynamic NTK, YaRN) multiply it by their factor,
        as vLLM does; llama3 and LongRoPE configs already state the long length."""
        rope = self.rope
        if rope.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * rope.factor)
        if rope.rope_type == "yarn":
            return int(rope.original_max_position_embeddings * rope.factor)
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def layer_is_moe(self, layer: int) -> bool:
        if self.num_experts == 0:
            return False
        return self.moe_layers[layer] if self.moe_layers else True

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(read_config_json(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        wrapped = language_model_config(raw)
        if wrapped is not None:
            wrapper, text = wrapped
            return replace(cls.from_dict(text), vision_language=wrapper)
        architectures = raw.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES), None)
        if family is None:
            supported = ", ".join(ARCHITECTURES)
            raise UnsupportedArchitectureError(
                f"config.json architectures={architectures!r} is not supported; supported: {supported}"
            )
        _refuse_unsupported(raw, family)
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        num_layers = raw["num_hidden_layers"]
        gemma = family in _GEMMA
        # transformers' Gemma configs default to 256-wide heads, not hidden / heads
        head_dim = raw.get("head_dim") or (256 if gemma else hidden // num_heads)
        attention_bias = bool(raw.get("attention_bias", False))
        windows = _layer_windows(raw, family, num_layers)
        uniform = set(windows)
        rope, sliding_rope = _ropes(raw, family, head_dim)
        return cls(
            family=family,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rope=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
            # Qwen2 always carries q/k/v biases (its config has no attention_bias key).
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            sliding_window=uniform.pop() if len(uniform) == 1 else None,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            hidden_act=_activation(raw, family),
            layer_windows=windows if len(set(windows)) > 1 else (),
            sliding_rope=sliding_rope,
            attn_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
            # transformers' Gemma 3 never applies attn_logit_softcapping (its attention call omits it)
            attn_logit_softcap=_positive(raw, "attn_logit_softcapping", 50.0) if family == "gemma2" else None,
            final_logit_softcap=_positive(raw, "final_logit_softcapping", 30.0 if family == "gemma2" else None)
            if gemma
            else None,
            norm_unit_offset=gemma,
            sandwich_norms=gemma,
            embed_scale=math.sqrt(hidden) if gemma else 1.0,
            **_moe_fields(raw, family, num_layers),
        )


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A model directory's config.json (ModelLoadError when it has none)."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{config_path} not found: a model directory needs config.json")
    raw: dict[str, Any] = json.loads(config_path.read_text())
    return raw


def language_model_config(raw: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(wrapper architecture, the text model's config.json) of a vision-language config; None for any
    other. The text config inherits the checkpoint's dtype and word-embedding tying as transformers
    resolves them (LLaVA ties when either level says so; Gemma 3's top level decides, default tied)."""
    architectures = raw.get("architectures") or []
    wrapper = next((a for a in architectures if a in VISION_LANGUAGE_ARCHITECTURES), None)
    if wrapper is None:
        return None
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"{wrapper} config.json needs a text_config object")
    llava = wrapper == "LlavaForConditionalGeneration"
    model_type = text.get("model_type", "llama" if llava else "gemma3_text")
    text_architectures = VISION_LANGUAGE_ARCHITECTURES[wrapper]
    if model_type not in text_architectures:
        raise UnsupportedArchitectureError(
            f"{wrapper} with text_config model_type={model_type!r} is not supported "
            f"(supported: {', '.join(text_architectures)})")
    merged = {**_TEXT_CONFIG_DEFAULTS.get(model_type, {}), **text, "architectures": [text_architectures[model_type]]}
    dtype = text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype") or raw.get("dtype")
    if dtype:
        merged["torch_dtype"] = dtype
    tied = bool(raw.get("tie_word_embeddings", not llava))
    merged["tie_word_embeddings"] = tied or (llava and bool(text.get("tie_word_embeddings", False)))
    return wrapper, merged


def _refuse_unsupported(raw: dict[str, Any], family: str) -> None:
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise UnsupportedArchitectureError(f"quantization_config (quant_method={method!r}) is not supported")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedArchitectureError("use_bidirectional_attention=true is not supported (causal models only)")
    if family in ("qwen2", "qwen3") and raw.get("use_sliding_window", False):
        # Qwen's per-layer window (max_window_layers) is off in every released checkpoint.
        raise UnsupportedArchitectureError(f"{family} with use_sliding_window=true is not supported")


def _activation(raw: dict[str, Any], family: str) -> str:
    # Gemma's configs name it hidden_activation (their modeling code ignores hidden_act)
    key, default = ("hidden_activation", "gelu_pytorch_tanh") if family in _GEMMA else ("hidden_act", "silu")
    act = raw.get(key) or default
    if act not in ACTIVATIONS:
        raise UnsupportedArchitectureError(f"{key}={act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return act


def _positive(raw: dict[str, Any], key: str, default: float | None) -> float | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or value <= 0:
        raise ModelLoadError(f"{key}={value!r} must be a positive number or null")
    return float(value)


def _layer_windows(raw: dict[str, Any], family: str, num_layers: int) -> tuple[int | None, ...]:
    """The attention window of each layer (None = global), as each family's
    transformers code decides it."""
    window = raw.get("sliding_window", 4096 if family in _GEMMA else None)
    if family in ("llama", "qwen2", "qwen3"):
        return (None,) * num_layers
    if family == "qwen3_moe" and not raw.get("use_sliding_window", False):
        return (None,) * num_layers
    if family not in _GEMMA:
        return (window,) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types is None:
        # Gemma 2 alternates (sliding first); Gemma 3 makes every sliding_window_pattern-th layer global
        pattern = 2 if family == "gemma2" else int(raw.get("sliding_window_pattern", 6))
        layer_types = [_SLIDING if (i + 1) % pattern else _FULL for i in range(num_layers)]
    if len(layer_types) != num_layers or not set(layer_types) <= {_SLIDING, _FULL}:
        raise UnsupportedArchitectureError(
            f"layer_types={layer_types!r} is not supported: need {num_layers} entries of {_SLIDING!r} or {_FULL!r}"
        )
    if window is None and _SLIDING in layer_types:
        raise ModelLoadError(f"sliding_window=null but layer_types has {_SLIDING!r} layers")
    return tuple(window if t == _SLIDING else None for t in layer_types)


def _moe_fields(raw: dict[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    if family not in ("mixtral", "qwen3_moe"):
        return {}
    num_experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    top_k = int(raw.get("num_experts_per_tok", 2))
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ModelLoadError(f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({num_experts})")
    if family == "mixtral":
        return {
            "num_experts": num_experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": raw["intermediate_size"],
            "norm_topk_prob": True,
            "router_weights_fp32": True,
        }
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    if step < 1:
        raise ModelLoadError(f"decoder_sparse_step={step} must be at least 1")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": raw["moe_intermediate_size"],
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "moe_layers": tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
    }


def _ropes(raw: dict[str, Any], family: str, head_dim: int) -> tuple[RopeConfig, RopeConfig | None]:
    """(the RoPE of global layers, the RoPE of sliding layers if it differs), from
    the classic (rope_theta + rope_scaling) or the transformers-5
    (rope_parameters, nested by layer type for Gemma 3) spellings."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    if family != "gemma3":
        return _rope_config(raw, family, {**scaling, **params}, float(raw.get("rope_theta", 10000.0)), head_dim), None
    if _FULL in params or _SLIDING in params:
        full, local = dict(params.get(_FULL) or {}), dict(params.get(_SLIDING) or {})
    else:
        full, local = {**scaling, **params}, {}
    global_theta = float(raw.get("rope_theta", 1_000_000.0))
    local_theta = float(raw.get("rope_local_base_freq", 10_000.0))
    return (
        _rope_config(raw, family, full, global_theta, head_dim),
        _rope_config(raw, family, local, local_theta, head_dim),
    )


def _rope_config(
    raw: dict[str, Any], family: str, params: dict[str, Any], default_theta: float, head_dim: int
) -> RopeConfig:
    theta = float(params.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if family == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi-3's early configs, renamed as transformers does
    if rope_type not in ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"rope_scaling rope_type={rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if partial != 1.0 and family != "phi3":
        raise UnsupportedArchitectureError(f"partial_rotary_factor={partial} is not supported for {family}")
    if not 0.0 < partial <= 1.0:
        raise ModelLoadError(f"partial_rotary_factor={partial} must be in (0, 1]")
    max_pos = int(raw.get("max_position_embeddings", 4096))
    base = RopeConfig(theta=theta, partial_rotary_factor=partial, max_position_embeddings=max_pos)
    if rope_type == "default":
        return base
    # transformers lets a top-level original_max_position_embeddings (Phi-3 always has one) win
    original = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    if original is None:
        original = 4096 if family == "phi3" else max_pos
    original = int(original)
    if rope_type == "longrope":
        return _longrope(base, params, original, head_dim)
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ModelLoadError(f"rope_scaling factor={factor!r} must be a positive number for rope_type={rope_type!r}")
    scaled = replace(base, rope_type=rope_type, factor=float(factor), original_max_position_embeddings=original)
    if rope_type == "llama3":
        return replace(
            scaled,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        )
    if rope_type == "yarn":
        return replace(
            scaled,
            attention_factor=_yarn_attention_factor(params, float(factor)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
        )
    return scaled


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    """YaRN's cos/sin scale: explicit, or 0.1 ln(factor) + 1 (DeepSeek's mscale ratio when both are given)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, m) / mscale(factor, m_all)
    return mscale(factor)


def _longrope(base: RopeConfig, params: dict[str, Any], original: int, head_dim: int) -> RopeConfig:
    pairs = base.rotary_dim(head_dim) // 2

    def factors(key: str) -> tuple[float, ...]:
        values = params.get(key)
        if not isinstance(values, list) or len(values) != pairs:
            raise ModelLoadError(
                f"rope_scaling {key} must be a list of {pairs} numbers (rotary dim / 2), got {values!r}")
        return tuple(float(v) for v in values)

    short_factor = factors("short_factor")
    long_factor = factors("long_factor")
    factor = float(params.get("factor") or base.max_position_embeddings / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return replace(
        base,
        rope_type="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
        short_factor=short_factor,
        long_factor=long_factor,
    )
