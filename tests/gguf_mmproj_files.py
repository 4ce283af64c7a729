"""Write a tiny LLaVA directory (genq_dev.tiny_vlm) the way llama.cpp ships a vision-language model: the
language model as a text GGUF (tests/gguf_files.py) and the CLIP tower and MLP projector as an mmproj GGUF.

The mmproj follows llama.cpp's LLaVA-1.5 converter (tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py):
general.architecture "clip", clip.has_vision_encoder / clip.has_llava_projector, projector type "mlp",
block_count = the layers up to vision_feature_layer (the rest are dropped), the tower's tensors under the
`gguf` package's TensorNameMap names and the projector's Linear layers as `mm.0` / `mm.2` (LLaVA's
mm_projector indices; the name map's `mm.1` for linear_1 is Pixtral's layout). Every tensor is F32, so the
files hold exactly the directory's weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from gguf import MODEL_ARCH, GGUFWriter, get_tensor_name_map
from gguf.constants import Keys
from safetensors.numpy import load_file, save_file

from engine.vision.checkpoint import language_model_name, vision_name
from tests.gguf_files import finish, write_gguf

_PROJECTOR = {"projector.linear_1": "mm.0", "projector.linear_2": "mm.2"}


def write_llava_gguf(vlm_dir: Path, out_dir: Path, projector_type: str = "mlp") -> tuple[Path, Path]:
    """(text model GGUF, mmproj GGUF) in out_dir. The text file's vocabulary calls the image token
    `<image>`, as llava-hf's does (the tiny tokenizer has no such token)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((vlm_dir / "config.json").read_text())
    text = _text_model_dir(vlm_dir, config, out_dir / "text-hf")
    text_file = write_gguf(text, out_dir / "text.gguf", control_tokens={config["image_token_index"]: "<image>"})
    return text_file, write_mmproj(vlm_dir, config, out_dir / "mmproj.gguf", projector_type)


def _text_model_dir(vlm_dir: Path, config: dict[str, Any], out: Path) -> Path:
    """The LLaVA's language model as a Llama HF directory."""
    out.mkdir()
    text = config["text_config"]
    rope_theta = text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    (out / "config.json").write_text(json.dumps({**text, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                 "rope_theta": rope_theta, "rope_scaling": None}))
    weights = load_file(str(vlm_dir / "model.safetensors"))
    renamed = {language_model_name(name): values for name, values in weights.items()}
    save_file({name: values for name, values in renamed.items() if name is not None}, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(vlm_dir / name, out / name)
    return out


def write_mmproj(vlm_dir: Path, config: dict[str, Any], out: Path, projector_type: str = "mlp") -> Path:
    """The directory's CLIP tower (up to its feature layer) and MLP projector as llama.cpp's mmproj file."""
    vision = config["vision_config"]
    layers = vision["num_hidden_layers"]
    feature_layer = config.get("vision_feature_layer", -2)
    kept = feature_layer % (layers + 1)
    processor = json.loads((vlm_dir / "preprocessor_config.json").read_text())
    writer = GGUFWriter(str(out), "clip")
    writer.add_bool(Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_bool(Keys.Clip.HAS_LLAVA_PROJECTOR, True)
    writer.add_string(Keys.Clip.PROJECTOR_TYPE, projector_type)
    writer.add_vision_image_size(vision["image_size"])
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(kept)
    writer.add_vision_head_count(vision["num_attention_heads"])
    writer.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-5))
    writer.add_vision_image_mean(processor["image_mean"])
    writer.add_vision_image_std(processor["image_std"])
    writer.add_vision_use_gelu(vision.get("hidden_act", "quick_gelu") == "gelu")
    names = get_tensor_name_map(MODEL_ARCH.MMPROJ, layers)
    for hf_name, values in load_file(str(vlm_dir / "model.safetensors")).items():
        ours = vision_name(hf_name)
        if ours is None or _past(ours, kept):
            continue
        stem, _, suffix = ours.rpartition(".")
        if stem in _PROJECTOR:
            name = f"{_PROJECTOR[stem]}.{suffix}"
        else:
            name = names.get_name("vision_tower.vision_model." + ours.removeprefix("vision."),
                                  try_suffixes=(".weight", ".bias"))
        assert name is not None, f"the gguf package has no mmproj name for {hf_name}"
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
    finish(writer)
    return out


def _past(name: str, kept: int) -> bool:
    """Whether the tensor belongs to an encoder layer past the ones the mmproj keeps."""
    parts = name.split(".")
    return name.startswith("vision.encoder.layers.") and int(parts[3]) >= kept
