"""Loading a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) for a base
model: every tensor named, shaped and ranked as the base model needs, or the adapter is refused
(AdapterLoadError) with the problem named, before any of it reaches a forward."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from engine.config import ModelConfig
from engine.errors import AdapterLoadError
from engine.lora.adapter import LinearKey, LoraAdapter, LoraSlice
from engine.lora.adapter_config import LoraSettings, read_adapter_config
from engine.lora.targets import MLP_TARGETS, TARGETS, FusedShape, fused_shapes

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight -> module name, layer, kind, A/B
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
                  r"(?P<kind>\w+))\.lora_(?P<ab>[AB])\.weight$")
_Pair = tuple[str, int, str, torch.Tensor, torch.Tensor]  # module name, layer, kind, A, B


def load_adapter(path: str | Path, config: ModelConfig, name: str, dtype: torch.dtype,
                 device: torch.device | str) -> LoraAdapter:
    """The adapter in directory `path`, checked against the base model's config, on `device` in `dtype`."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterLoadError(f"{directory}: not an adapter directory")
    settings = read_adapter_config(directory / CONFIG_FILE)
    weights_path = directory / WEIGHTS_FILE
    try:
        data = weights_path.read_bytes()
    except OSError as error:
        raise AdapterLoadError(f"{weights_path}: unreadable: {error.strerror or error}") from None
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise AdapterLoadError(f"{weights_path}: truncated or not a safetensors file ({error})") from None
    pairs = _pairs(tensors, config, weights_path)
    digest = hashlib.blake2b((directory / CONFIG_FILE).read_bytes() + data, digest_size=16).digest()
    return _fuse(name, digest, pairs, settings, config, dtype, torch.device(device), weights_path)


def _pairs(tensors: dict[str, torch.Tensor], config: ModelConfig, where: Path) -> list[_Pair]:
    """Every targeted module's (A, B), with its name, layer and kind checked."""
    halves: dict[tuple[str, int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterLoadError(f"{where}: tensor {key!r} is not a LoRA A/B weight of a decoder layer's "
                                   f"projection (unknown target module, or an unsupported option)")
        kind, layer = match["kind"], int(match["layer"])
        if kind not in TARGETS:
            raise AdapterLoadError(f"{where}: unknown target module {kind!r} ({key}); supported: {', '.join(TARGETS)}")
        if layer >= config.num_layers:
            raise AdapterLoadError(f"{where}: {key} names layer {layer}; the base model has {config.num_layers}")
        if kind in MLP_TARGETS and config.layer_is_moe(layer):
            raise AdapterLoadError(f"{where}: {key} targets the MLP of a mixture-of-experts layer (not supported)")
        halves.setdefault((match["module"], layer, kind), {})[match["ab"]] = tensor
    if not halves:
        raise AdapterLoadError(f"{where}: holds no LoRA weights")
    pairs = []
    for (module, layer, kind), found in sorted(halves.items(), key=lambda item: (item[0][1], item[0][0])):
        if set(found) != {"A", "B"}:
            missing = "B" if "A" in found else "A"
            raise AdapterLoadError(f"{where}: {module} has no lora_{missing} weight")
        pairs.append((module, layer, kind, found["A"], found["B"]))
    return pairs


def _fuse(name: str, digest: bytes, pairs: list[_Pair], settings: LoraSettings, config: ModelConfig,
          dtype: torch.dtype, device: torch.device, where: Path) -> LoraAdapter:
    """Stack each fused linear's A matrices and place its scaled B matrices at their output slices."""
    shapes = fused_shapes(config)
    grouped: dict[LinearKey, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    scalings: dict[str, float] = {}
    for module, layer, kind, a, b in pairs:
        linear, index = TARGETS[kind]
        shape = shapes[linear]
        rank = settings.rank_of(module)
        _check_shape(module, a, (rank, shape.in_features), "lora_A", where)
        _check_shape(module, b, (shape.slices[index], rank), "lora_B", where)
        scalings[module] = settings.scaling(module)
        grouped.setdefault((layer, linear), []).append((index, a, b * scalings[module]))
    weights = {key: _stack(parts, shapes[key[1]], dtype, device) for key, parts in grouped.items()}
    slices = {key: tuple(LoraSlice(index, shapes[key[1]].offset(index), shapes[key[1]].slices[index], a.shape[0])
                         for index, a, _ in parts) for key, parts in grouped.items()}
    return LoraAdapter(name, digest, max(settings.rank_of(p[0]) for p in pairs), weights, scalings, slices)


def _check_shape(module: str, tensor: torch.Tensor, expected: tuple[int, int], half: str, where: Path) -> None:
    if tuple(tensor.shape) != expected:
        raise AdapterLoadError(f"{where}: {module}.{half} has shape {tuple(tensor.shape)}; the base model "
                               f"and the adapter's rank need {expected}")
    if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
        raise AdapterLoadError(f"{where}: {module}.{half} holds non-finite or non-float values")


def _stack(parts: list[tuple[int, torch.Tensor, torch.Tensor]], shape: FusedShape, dtype: torch.dtype,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    total = sum(a.shape[0] for _, a, _ in parts)
    a_stacked = torch.cat([a.float() for _, a, _ in parts])
    b_placed = torch.zeros(shape.out_features, total)
    column = 0
    for index, a, b in parts:
        start = shape.offset(index)
        b_placed[start : start + shape.slices[index], column : column + a.shape[0]] = b.float()
        column += a.shape[0]
    return a_stacked.to(device, dtype).contiguous(), b_placed.to(device, dtype).contiguous()
