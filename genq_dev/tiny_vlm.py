"""Random-weight vision-language model directories (LLaVA over Llama with a CLIP tower; Gemma 3 with
SigLIP), laid out as transformers saves them, for the vision tower's tests.

Unlike tiny_model.py, this one builds the model with transformers itself (a dev dependency, imported
here only): the checkpoint's tensor names, config.json and initialisation are then exactly the
reference's, which is what the tower is checked against. Sizes are tiny (32x32 images, 2-layer towers,
the "test" text preset) so a CPU test runs in a second.

transformers' init leaves every bias at 0, every LayerNorm at (1, 0), Gemma's norms at 0 and Gemma 3's
projection matrix at 0; such a checkpoint would hide a dropped bias, a wrong norm or a missing
projector, so every constant tensor of the tower and projector gets seeded noise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from genq_dev.tiny_model import PRESETS, SPECIAL_TOKENS, write_tokenizer_files

VLM_FAMILIES = ("llava", "gemma3")
IMAGE_SIZE = 32
_OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
_NOISE = 0.1


def _text_config(family: str, overrides: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        **PRESETS["test"],
        # peaked attention and clear greedy margins, as tests/conftest.py's HF_SMALL
        "initializer_range": 0.2,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": SPECIAL_TOKENS.index("<|pad|>"),
        # tied, transformers' random init makes Gemma predict each token itself (tests/test_engine_vs_transformers)
        "tie_word_embeddings": False,
    }
    if family == "gemma3":
        config.update({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 12,
                       "query_pre_attn_scalar": 24})
    return {**config, **overrides}


def _vision_config(family: str, overrides: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "image_size": IMAGE_SIZE}
    if family == "llava":
        config["patch_size"] = 8  # 16 patches + the class token
    else:
        config.update({"patch_size": 4, "vision_use_head": False})  # 64 patches, pooled to 16 tokens
    return {**config, **overrides}


def preprocessor_config(family: str, image_size: int = IMAGE_SIZE) -> dict[str, Any]:
    """preprocessor_config.json as the released checkpoints have it, scaled to the tiny image size."""
    common = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
              "rescale_factor": 1 / 255}
    if family == "llava":
        return {**common, "image_processor_type": "CLIPImageProcessor", "do_center_crop": True,
                "crop_size": {"height": image_size, "width": image_size}, "size": {"shortest_edge": image_size},
                "resample": 3, "image_mean": _OPENAI_CLIP_MEAN, "image_std": _OPENAI_CLIP_STD}
    return {**common, "image_processor_type": "Gemma3ImageProcessor", "do_pan_and_scan": None,
            "size": {"height": image_size, "width": image_size}, "resample": 2,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def _perturb_constants(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Seeded noise on every constant tensor (see the module docstring); a zero matrix gets a 1/sqrt(in) init."""
    with torch.no_grad():
        for param in module.parameters():
            if param.numel() > 1 and bool((param == param.flatten()[0]).all()):
                noise = torch.randn(param.shape, generator=gen)
                if param.dim() >= 2 and not param.any():
                    param.copy_(noise / math.sqrt(param.shape[0]))
                else:
                    param.add_(_NOISE * noise)


def make_tiny_vlm(
    out_dir: str | Path,
    family: str = "llava",
    *,
    seed: int = 0,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a random-weight LlavaForConditionalGeneration ("llava") or Gemma3ForConditionalGeneration
    ("gemma3") directory: save_pretrained's config.json and safetensors, preprocessor_config.json and the
    tiny model maker's tokenizer files. text / vision override text_config / vision_config keys;
    config_overrides the top-level ones (e.g. vision_feature_select_strategy="full").
    The image token is the vocabulary's last id (the tiny tokenizer has no "<image>" token)."""
    import transformers

    if family not in VLM_FAMILIES:
        raise ValueError(f"unknown vision-language family {family!r}; expected one of {VLM_FAMILIES}")
    text_config = _text_config(family, text or {})
    vision_config = _vision_config(family, vision or {})
    vocab = text_config["vocab_size"]
    torch.manual_seed(seed)
    config: Any
    if family == "llava":
        patches = (vision_config["image_size"] // vision_config["patch_size"]) ** 2
        config = transformers.LlavaConfig(
            vision_config=transformers.CLIPVisionConfig(**vision_config),
            text_config=transformers.LlamaConfig(**text_config),
            **{"image_token_index": vocab - 1, "image_seq_length": patches, "tie_word_embeddings": False,
               **config_overrides})
        model: Any = transformers.LlavaForConditionalGeneration(config)
    else:
        config = transformers.Gemma3Config(
            vision_config=transformers.SiglipVisionConfig(**vision_config),
            text_config=transformers.Gemma3TextConfig(**text_config),
            **{"mm_tokens_per_image": 16, "image_token_index": vocab - 1, "boi_token_index": vocab - 3,
               "eoi_token_index": vocab - 2, "tie_word_embeddings": False, **config_overrides})
        model = transformers.Gemma3ForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(seed)
    _perturb_constants(model.model.vision_tower, gen)
    _perturb_constants(model.model.multi_modal_projector, gen)
    out = Path(out_dir)
    model.to(torch.float32).save_pretrained(out)
    write_tokenizer_files(out, vocab, "llama", text_config["max_position_embeddings"])
    (out / "preprocessor_config.json").write_text(
        json.dumps(preprocessor_config(family, vision_config["image_size"]), indent=2) + "\n")
    return out
