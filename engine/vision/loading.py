"""Load a VisionTower from a LLaVA or Gemma 3 HF directory (config.json + safetensors).

Only the vision tower's and projector's tensors are read from the shards (the language model's are
skipped by name, never materialised). Tensors the tower never uses are skipped too, by rule: SigLIP's
attention-pooling head, CLIP's post-layernorm (it only norms the pooled class token), and the layers past
the one LLaVA reads. Anything else unexpected, a wrong shape or a missing tensor is a ModelLoadError. A llama.cpp mmproj
file (engine/vision/mmproj.py) fills its tower through the same empty_tower / fill_tower.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError
from engine.vision.checkpoint import vision_name
from engine.vision.config import VisionLanguageConfig
from engine.vision.tower import VisionTower
from engine.weights import checkpoint_files

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER = re.compile(r"vision\.encoder\.layers\.(\d+)\.")


def load_vision_tower(path: str | Path, device: torch.device | str = "cpu",
                      dtype: torch.dtype | str | None = None) -> VisionTower:
    """The directory's vision tower and projector, in eval mode on `device`; dtype None means the
    checkpoint's (config.json `dtype` / `torch_dtype`)."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{config_path} not found: a model directory needs config.json")
    raw = json.loads(config_path.read_text())
    config = VisionLanguageConfig.from_dict(raw)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ModelLoadError(f"dtype {dtype!r} is not supported; use one of {', '.join(_DTYPES)}")
        dtype = _DTYPES[dtype]
    dtype = dtype or _DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype")), torch.float32)
    tower = empty_tower(config, device, dtype)
    return fill_tower(tower, _safetensors(path), str(path))


def _safetensors(path: Path) -> Iterator[tuple[str | None, str, Callable[[], torch.Tensor]]]:
    """(our name, the checkpoint's name, its reader) for every tensor of the directory's shards."""
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                yield vision_name(hf_name), hf_name, partial(f.get_tensor, hf_name)


def empty_tower(config: VisionLanguageConfig, device: torch.device | str, dtype: torch.dtype) -> VisionTower:
    """A VisionTower for config with uninitialised parameters on device (never materialised on the CPU first)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            tower = VisionTower(config)
    finally:
        torch.set_default_dtype(previous)
    return tower.to_empty(device=device)


def fill_tower(tower: VisionTower, tensors: Iterable[tuple[str | None, str, Callable[[], torch.Tensor]]],
               where: str) -> VisionTower:
    """Copy (our name or None to skip, the file's name, its tensor read on demand) into the tower; an
    unexpected tensor, a wrong shape or a missing one is a ModelLoadError naming the file's tensor."""
    params = dict(tower.named_parameters())
    loaded: set[str] = set()
    for name, source_name, read in tensors:
        if name is None or _unused(name, tower):
            continue
        if name not in params:
            raise ModelLoadError(f"{where}: unexpected vision tensor {source_name!r} for "
                                 f"{tower.config.architecture}")
        tensor = read()
        if tensor.shape != params[name].shape:
            raise ModelLoadError(f"{where}: {source_name} has shape {tuple(tensor.shape)}, the config implies "
                                 f"{tuple(params[name].shape)}")
        params[name].data.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"{where}: checkpoint lacks {len(missing)} vision tensors (our names): {shown}")
    return tower.eval()


def _unused(name: str, tower: VisionTower) -> bool:
    """A tower tensor this VLM never reads (see the module docstring)."""
    if name.startswith("vision.head."):
        return True
    if name.startswith("vision.post_layernorm.") and tower.vision.post_layernorm is None:
        return True
    layer = _LAYER.match(name)
    return layer is not None and int(layer.group(1)) >= len(tower.vision.encoder.layers)
