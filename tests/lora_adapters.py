"""PEFT adapter directories for tests (engine, kernels and worker alike): random A and B that PEFT
itself initialises and saves, and a damaged copy."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM


def save_peft_adapter(base_dir: Path, out: Path, seed: int, **options: object) -> Path:
    """A PEFT adapter with random A and B (init_lora_weights=False), saved with save_pretrained."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **options))
    model.save_pretrained(out)
    return out


def truncate_adapter(path: Path) -> Path:
    """The adapter directory with its tensor file cut in half (a copy interrupted mid-way)."""
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return path
