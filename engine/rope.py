"""Rotary position embedding frequencies, including Llama 3 frequency scaling."""

from __future__ import annotations

import math

import torch

from engine.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim / 2] in fp32, computed the way
    the reference implementation does so positions rotate identically."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept,
    and a smooth blend in between."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, head_dim] for the given positions, in fp32."""
    freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()
