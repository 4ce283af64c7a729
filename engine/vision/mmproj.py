"""A llama.cpp mmproj GGUF (general.architecture "clip"): the vision tower and projector that go with a
text-model GGUF, read into the same VisionTower an HF LLaVA directory loads into.

Keys and tensor names are the `gguf` package's (Keys.ClipVision, MODEL_TENSOR.V_* / V_MMPROJ). Projector
type "mlp" is LLaVA-1.5's, as llama.cpp's LLaVA converter writes it: a CLIP tower whose layers past the
one LLaVA reads (vision_feature_layer -2) are already dropped (block_count = the kept layers), so the
feature is the last stored layer's output; the projector's Linear-GELU-Linear under `mm.0` / `mm.2`
(LLaVA's mm_projector Sequential indices). `v.post_ln`, which the converter keeps, is never read: HF's
LLaVA feeds the projector the un-normed layer output. Other projector types are refused by name.

The image processor is rebuilt from clip.vision.image_size / image_mean / image_std as the HF processor
of the model the file came from (LLaVA-1.5's CLIPImageProcessor): shortest edge resized to image_size
(bicubic), centre crop, rescale, normalise. llama.cpp's own preprocessing differs (it pads to a square
with the mean colour, then resizes); genq matches transformers. The text model has no image token the
file names: LLaVA's is the vocabulary's `<image>` token, as llava-hf checkpoints have it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from gguf.constants import MODEL_TENSOR, TENSOR_NAMES, Keys

from engine.errors import ModelLoadError
from engine.gguf_file import GGUFFile, open_gguf
from engine.tokenizer import Tokenizer
from engine.vision.config import VisionLanguageConfig
from engine.vision.loading import empty_tower, fill_tower
from engine.vision.processing import ImageProcessor, image_processor_from_config
from engine.vision.tower import VisionTower

LLAVA_IMAGE_TOKEN = "<image>"
SUPPORTED_PROJECTORS = ("mlp",)
_VISION = Keys.ClipVision
# the file's tensors -> VisionTower's parameters ({bid}: the encoder layer)
_TENSORS = {
    MODEL_TENSOR.V_ENC_EMBD_PATCH: "vision.embeddings.patch_embedding",
    MODEL_TENSOR.V_ENC_EMBD_CLS: "vision.embeddings.class_embedding",
    MODEL_TENSOR.V_ENC_EMBD_POS: "vision.embeddings.position_embedding",
    MODEL_TENSOR.V_PRE_NORM: "vision.pre_layrnorm",
    MODEL_TENSOR.V_POST_NORM: None,
    MODEL_TENSOR.V_ENC_ATTN_Q: "vision.encoder.layers.{bid}.self_attn.q_proj",
    MODEL_TENSOR.V_ENC_ATTN_K: "vision.encoder.layers.{bid}.self_attn.k_proj",
    MODEL_TENSOR.V_ENC_ATTN_V: "vision.encoder.layers.{bid}.self_attn.v_proj",
    MODEL_TENSOR.V_ENC_ATTN_O: "vision.encoder.layers.{bid}.self_attn.out_proj",
    MODEL_TENSOR.V_ENC_INPUT_NORM: "vision.encoder.layers.{bid}.layer_norm1",
    MODEL_TENSOR.V_ENC_POST_ATTN_NORM: "vision.encoder.layers.{bid}.layer_norm2",
    MODEL_TENSOR.V_ENC_FFN_UP: "vision.encoder.layers.{bid}.mlp.fc1",
    MODEL_TENSOR.V_ENC_FFN_DOWN: "vision.encoder.layers.{bid}.mlp.fc2",
}
_MLP_PROJECTOR = {0: "projector.linear_1", 2: "projector.linear_2"}  # mm.{i}: LLaVA's mm_projector.{i}


def load_mmproj(path: str | Path, text_hidden_size: int, tokenizer: Tokenizer, device: torch.device | str,
                dtype: torch.dtype) -> tuple[VisionTower, ImageProcessor]:
    """The mmproj file's tower (on device, in dtype) and its image processor, for a text model of width
    text_hidden_size whose tokenizer marks images; ModelLoadError naming what does not fit."""
    file = open_gguf(path)
    where = str(file.path)
    if file.architecture != "clip" or not file.value(Keys.Clip.HAS_VISION_ENCODER, False):
        raise ModelLoadError(f"{where} is not an mmproj file with a vision encoder (general.architecture "
                             f"{file.architecture!r}, {Keys.Clip.HAS_VISION_ENCODER} unset)")
    projector = file.value(_VISION.PROJECTOR_TYPE, None) or file.value(Keys.Clip.PROJECTOR_TYPE, None)
    if projector not in SUPPORTED_PROJECTORS:
        raise ModelLoadError(f"{where}: projector type {projector!r} is not supported (supported: "
                             f"{', '.join(SUPPORTED_PROJECTORS)}: LLaVA-1.5's MLP)")
    if file.value("clip.vision.feature_layer", None) is not None:
        raise ModelLoadError(f"{where}: clip.vision.feature_layer (LLaVA-NeXT's several feature layers) is not "
                             "supported")
    image_token = tokenizer.token_to_id(LLAVA_IMAGE_TOKEN)
    if image_token is None:
        raise ModelLoadError(f"{where}: the text model's vocabulary has no {LLAVA_IMAGE_TOKEN} token to mark images")
    bias = any(tensor.name == "mm.0.bias" for tensor in file.reader.tensors)
    config = VisionLanguageConfig.from_dict(_llava_config(file, text_hidden_size, image_token, bias))
    projected = _projector_width(file)
    if projected != text_hidden_size:
        raise ModelLoadError(f"{where}: the projector writes {projected}-wide embeddings, the text model's "
                             f"embedding width is {text_hidden_size}")
    tower = fill_tower(empty_tower(config, device, dtype), _named(file, config.encoder.num_layers), where)
    processor = image_processor_from_config({
        "image_processor_type": "CLIPImageProcessor",
        "size": {"shortest_edge": config.encoder.image_size},
        "crop_size": {"height": config.encoder.image_size, "width": config.encoder.image_size},
        "image_mean": file.value(_VISION.IMAGE_MEAN), "image_std": file.value(_VISION.IMAGE_STD)})
    return tower, processor


def _llava_config(file: GGUFFile, text_hidden_size: int, image_token: int, bias: bool) -> dict[str, Any]:
    """The config.json of the LLaVA this file holds the vision side of (see the module docstring)."""
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": int(file.value(_VISION.EMBEDDING_LENGTH)),
            "intermediate_size": int(file.value(_VISION.FEED_FORWARD_LENGTH)),
            "num_hidden_layers": int(file.value(_VISION.BLOCK_COUNT)),
            "num_attention_heads": int(file.value(_VISION.Attention.HEAD_COUNT)),
            "image_size": int(file.value(_VISION.IMAGE_SIZE)),
            "patch_size": int(file.value(_VISION.PATCH_SIZE)),
            "layer_norm_eps": float(file.value(_VISION.Attention.LAYERNORM_EPS)),
            # llama.cpp's converter writes use_gelu = (hidden_act == "gelu"); CLIP's own is quick_gelu
            "hidden_act": "gelu" if file.value(_VISION.USE_GELU, False) else "quick_gelu",
        },
        "text_config": {"hidden_size": text_hidden_size},
        "image_token_index": image_token,
        "vision_feature_layer": -1,  # the layers past LLaVA's feature layer are not in the file
        "vision_feature_select_strategy": "default",
        "multimodal_projector_bias": bias,
    }


def _projector_width(file: GGUFFile) -> int:
    """The embedding width the projector's last layer writes (mm.2's output rows)."""
    for tensor in file.reader.tensors:
        if tensor.name == "mm.2.weight":
            return int(tensor.shape.tolist()[-1])
    raise ModelLoadError(f"{file.path}: the MLP projector's mm.2.weight is missing")


def _named(file: GGUFFile, layers: int) -> Iterator[tuple[str | None, str, Callable[[], torch.Tensor]]]:
    """(VisionTower's name or None for a tensor HF's LLaVA never reads, the file's name, its reader)."""
    ours: dict[str, str | None] = {}
    for kind, name in _TENSORS.items():
        for bid in range(layers) if "{bid}" in TENSOR_NAMES[kind] else [0]:
            ours[TENSOR_NAMES[kind].format(bid=bid)] = None if name is None else name.format(bid=bid)
    for index, name in _MLP_PROJECTOR.items():
        ours[TENSOR_NAMES[MODEL_TENSOR.V_MMPROJ].format(bid=index)] = name
    for gguf_name, read in file.float_tensors():
        stem, _, suffix = gguf_name.rpartition(".")
        if gguf_name in ours:  # v.class_embd: a bare parameter
            yield ours[gguf_name], gguf_name, read
        elif stem in ours and suffix in ("weight", "bias"):
            name = ours[stem]
            yield None if name is None else f"{name}.{suffix}", gguf_name, read
        else:
            raise ModelLoadError(f"{file.path}: unexpected tensor {gguf_name!r} in an mmproj file")
