"""A PEFT adapter_config.json read and checked: what the engine supports of LoRA, and the scaling
PEFT gives each module (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA; rank_pattern and
alpha_pattern override r and lora_alpha per module, matched as PEFT matches them)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import AdapterLoadError
from engine.lora.targets import TARGETS

MAX_LORA_RANK = 64
"""The largest rank an adapter may have (vLLM's max_lora_rank tops out at this order for serving)."""

# Options whose non-default value changes what the adapter computes beyond x @ A^T @ B^T * scaling.
_UNSUPPORTED: dict[str, str] = {
    "use_dora": "DoRA (use_dora)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)",
    "lora_bias": "lora_bias",
    "modules_to_save": "modules_to_save",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters",
}


@dataclass(frozen=True)
class LoraSettings:
    """The parts of adapter_config.json that decide what the adapter computes."""

    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    def rank_of(self, module: str) -> int:
        """The rank PEFT builds `module` (its full name, e.g. model.layers.0.self_attn.q_proj) with."""
        return int(_pattern_value(self.rank_pattern, module, self.r))

    def scaling(self, module: str) -> float:
        """PEFT's LoraLayer.update_layer: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
        alpha = float(_pattern_value(self.alpha_pattern, module, self.lora_alpha))
        rank = self.rank_of(module)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def read_adapter_config(path: Path) -> LoraSettings:
    """adapter_config.json of an adapter directory, refused (AdapterLoadError) where the engine
    cannot compute it exactly."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterLoadError(f"{path}: missing (an adapter directory holds adapter_config.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterLoadError(f"{path}: unreadable: {error}") from None
    if not isinstance(raw, dict):
        raise AdapterLoadError(f"{path}: not a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterLoadError(f"{path}: peft_type {peft_type!r} is not supported (only LORA)")
    for key, label in _UNSUPPORTED.items():
        if raw.get(key):
            raise AdapterLoadError(f"{path}: {label} is not supported")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise AdapterLoadError(f"{path}: bias={bias!r} is not supported (only 'none')")
    _check_targets(raw.get("target_modules"), path)
    r = raw.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterLoadError(f"{path}: r must be a positive integer, got {r!r}")
    rank_pattern = _pattern(raw, "rank_pattern", path)
    for rank in (r, *rank_pattern.values()):
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise AdapterLoadError(f"{path}: rank {rank!r} is not a positive integer")
        if rank > MAX_LORA_RANK:
            raise AdapterLoadError(f"{path}: rank {rank} exceeds the maximum LoRA rank {MAX_LORA_RANK}")
    alpha = raw.get("lora_alpha", 8)
    alpha_pattern = _pattern(raw, "alpha_pattern", path)
    for value in (alpha, *alpha_pattern.values()):
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise AdapterLoadError(f"{path}: lora_alpha {value!r} is not a finite number")
    return LoraSettings(r, float(alpha), bool(raw.get("use_rslora", False)), rank_pattern, alpha_pattern)


def _check_targets(targets: Any, path: Path) -> None:
    """A list of module names must name only supported linears; a regex string (or all-linear)
    is checked against the tensors the file holds instead."""
    if isinstance(targets, list):
        unknown = sorted(str(t) for t in targets if t not in TARGETS)
        if unknown:
            raise AdapterLoadError(f"{path}: unknown target module(s) {', '.join(unknown)}; supported: "
                                   f"{', '.join(TARGETS)}")
    elif not isinstance(targets, str):
        raise AdapterLoadError(f"{path}: target_modules must be a list of module names or a string")


def _pattern(raw: dict[str, Any], key: str, path: Path) -> dict[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise AdapterLoadError(f"{path}: {key} must be an object")
    return value


def _pattern_value(patterns: dict[str, Any], module: str, default: float) -> float:
    """PEFT's get_pattern_key: the value of the first pattern matching the end of the module's name."""
    return next((patterns[key] for key in patterns if re.match(rf"(.*\.)?({key})$", module)), default)
