"""A vision-language checkpoint's vision side, read from its config.json: the ViT encoder (CLIP or SigLIP),
the projector (LLaVA's MLP or Gemma 3's pooled projection) and which encoder states feed it.

Keys that released configs leave out take the defaults of transformers' config classes (llava-1.5's
vision_config omits hidden_act and layer_norm_eps); anything the modules would silently get wrong is
refused here, naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import read_config_json
from engine.errors import ModelLoadError, UnsupportedArchitectureError
from engine.vision.activations import ACTIVATIONS

# vision_config model_type -> transformers' config-class defaults for the keys a config may omit
_ENCODER_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                          "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 32,
                          "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
    "siglip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                            "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16,
                            "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
}
# LlavaConfig's vision_config when the checkpoint gives none of a field (llava-1.5's CLIP ViT-L/14-336)
_LLAVA_VISION_DEFAULTS: dict[str, Any] = {"intermediate_size": 4096, "hidden_size": 1024, "patch_size": 14,
                                          "image_size": 336, "num_hidden_layers": 24, "num_attention_heads": 16}
ARCHITECTURES = ("LlavaForConditionalGeneration", "Gemma3ForConditionalGeneration")


@dataclass(frozen=True)
class EncoderConfig:
    """One ViT: CLIP has a class token and a layernorm before the layers; SigLIP has neither and a bias on
    its patch convolution."""

    kind: str  # "clip" or "siglip"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_positions(self) -> int:
        """Tokens out of the embeddings: the patches, plus CLIP's class token."""
        return self.patches_per_side**2 + (1 if self.kind == "clip" else 0)


@dataclass(frozen=True)
class VisionLanguageConfig:
    """The vision side of a LLaVA or Gemma 3 checkpoint, and how many text positions an image fills."""

    architecture: str
    encoder: EncoderConfig
    text_hidden_size: int
    image_token_id: int
    # LLaVA: the encoder hidden states fed to the projector (index into [embeddings, layer 1, ..., layer L],
    # negative from the end), concatenated when several; whether the first token (CLIP's class token) is dropped
    feature_layers: tuple[int, ...] = ()
    drop_first_token: bool = False
    projector_act: str = "gelu"
    projector_bias: bool = True
    # Gemma 3: patches are average-pooled to this many tokens per image
    mm_tokens_per_image: int = 0
    # Gemma 3: the token a prompt marks an image with (<start_of_image>); the processor expands it
    boi_token_id: int = 255_999
    # Gemma 3: the token after an image's soft tokens (<end_of_image>)
    eoi_token_id: int = 256_000

    @property
    def placeholder_token_id(self) -> int:
        """The token whose text marks an image in a prompt: LLaVA's image token (<image>), Gemma 3's
        <start_of_image> (its processor expands it into the image's soft tokens)."""
        return self.boi_token_id if self.projector == "gemma3" else self.image_token_id

    @property
    def bidirectional_images(self) -> bool:
        """An image's tokens attend to each other both ways in prefill (Gemma 3's token_type_ids mask)."""
        return self.projector == "gemma3"

    @property
    def projector(self) -> str:
        return "gemma3" if self.architecture == "Gemma3ForConditionalGeneration" else "llava"

    @property
    def tokens_per_image(self) -> int:
        """The embedding rows one image becomes (the image tokens a prompt holds for it)."""
        if self.projector == "gemma3":
            return self.mm_tokens_per_image
        return self.encoder.num_positions - (1 if self.drop_first_token else 0)

    @property
    def layers_needed(self) -> int:
        """Encoder layers that must run: LLaVA's default -2 never needs the last one."""
        if self.projector == "gemma3":
            return self.encoder.num_layers
        total = self.encoder.num_layers + 1  # hidden states: the embeddings, then each layer's output
        return max(layer % total for layer in self.feature_layers)

    @classmethod
    def from_dir(cls, path: str | Path) -> VisionLanguageConfig:
        return cls.from_dict(read_config_json(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VisionLanguageConfig:
        architectures = raw.get("architectures") or []
        architecture = next((a for a in architectures if a in ARCHITECTURES), None)
        if architecture is None:
            raise UnsupportedArchitectureError(
                f"config.json architectures={architectures!r} has no vision tower the engine runs; "
                f"supported: {', '.join(ARCHITECTURES)}")
        vision, text = raw.get("vision_config"), raw.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ModelLoadError(f"{architecture} config.json needs vision_config and text_config objects")
        llava = architecture == "LlavaForConditionalGeneration"
        encoder = _encoder(vision, _LLAVA_VISION_DEFAULTS if llava else {})
        # the text model's width; transformers' LlamaConfig / Gemma3TextConfig defaults when left out
        text_hidden = int(text.get("hidden_size", 4096 if llava else 2304))
        if not llava:
            return cls(architecture, encoder, text_hidden, int(raw.get("image_token_index", 262_144)),
                       mm_tokens_per_image=_gemma3_tokens(raw, encoder),
                       boi_token_id=int(raw.get("boi_token_index", 255_999)),
                       eoi_token_id=int(raw.get("eoi_token_index", 256_000)))
        layers = raw.get("vision_feature_layer", -2)
        layers = (layers,) if isinstance(layers, int) else tuple(layers)
        total = encoder.num_layers + 1
        if not layers or not all(isinstance(i, int) and -total <= i < total for i in layers):
            raise ModelLoadError(f"vision_feature_layer={raw.get('vision_feature_layer')!r} must be an index "
                                 f"(or list of indices) into the {total} hidden states of the vision tower")
        strategy = raw.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ModelLoadError(f"vision_feature_select_strategy={strategy!r} must be 'default' or 'full'")
        act = raw.get("projector_hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise UnsupportedArchitectureError(
                f"projector_hidden_act={act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        return cls(architecture, encoder, text_hidden, int(raw.get("image_token_index", 32000)),
                   feature_layers=layers, drop_first_token=strategy == "default", projector_act=act,
                   projector_bias=bool(raw.get("multimodal_projector_bias", True)))


def _encoder(raw: dict[str, Any], wrapper_defaults: dict[str, Any]) -> EncoderConfig:
    model_type = raw.get("model_type", "clip_vision_model")
    if model_type not in _ENCODER_DEFAULTS:
        raise UnsupportedArchitectureError(
            f"vision_config model_type={model_type!r} is not supported (supported: {', '.join(_ENCODER_DEFAULTS)})")
    values = {**_ENCODER_DEFAULTS[model_type], **wrapper_defaults, **raw}
    for key in ("image_size", "patch_size"):
        if not isinstance(values[key], int) or isinstance(values[key], bool) or values[key] <= 0:
            raise UnsupportedArchitectureError(f"vision_config {key}={values[key]!r} must be one positive integer")
    if values["image_size"] % values["patch_size"]:
        raise ModelLoadError(f"vision_config image_size={values['image_size']} is not a multiple of "
                             f"patch_size={values['patch_size']}")
    if values["hidden_size"] % values["num_attention_heads"]:
        raise ModelLoadError(f"vision_config hidden_size={values['hidden_size']} is not a multiple of "
                             f"num_attention_heads={values['num_attention_heads']}")
    if values["hidden_act"] not in ACTIVATIONS:
        raise UnsupportedArchitectureError(f"vision_config hidden_act={values['hidden_act']!r} is not supported "
                                           f"(supported: {', '.join(ACTIVATIONS)})")
    return EncoderConfig(
        kind="clip" if model_type == "clip_vision_model" else "siglip",
        hidden_size=int(values["hidden_size"]), intermediate_size=int(values["intermediate_size"]),
        num_layers=int(values["num_hidden_layers"]), num_heads=int(values["num_attention_heads"]),
        num_channels=int(values["num_channels"]), image_size=values["image_size"],
        patch_size=values["patch_size"], hidden_act=str(values["hidden_act"]),
        layer_norm_eps=float(values["layer_norm_eps"]))


def _gemma3_tokens(raw: dict[str, Any], encoder: EncoderConfig) -> int:
    """mm_tokens_per_image, checked against the square average pool it implies."""
    if encoder.kind != "siglip":
        raise UnsupportedArchitectureError("Gemma3ForConditionalGeneration needs a siglip_vision_model tower")
    tokens = raw.get("mm_tokens_per_image", 256)
    side = math.isqrt(tokens) if isinstance(tokens, int) and tokens > 0 else 0
    if side * side != tokens or encoder.patches_per_side % side:
        raise ModelLoadError(f"mm_tokens_per_image={tokens!r} must be a square whose side divides the "
                             f"{encoder.patches_per_side} patches per side")
    return int(tokens)
