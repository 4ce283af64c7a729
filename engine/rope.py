"""Rotary position embeddings: the frequencies of every supported RoPE scaling
(linear, dynamic NTK, YaRN, LongRoPE, Llama 3) and the per-token cos/sin tables.

Frequencies are computed the way transformers computes them, in fp32, so
positions rotate identically. Two scalings depend on the sequence length in
transformers, which recomputes them from the longest position of each forward:

- dynamic NTK raises the base once a sequence outgrows max_position_embeddings;
- LongRoPE switches from short to long factors once it outgrows
  original_max_position_embeddings.

A paged engine cannot follow "the longest position of this forward": a forward
mixes many sequences, a prompt may be prefilled in chunks or come from the
prefix cache, and keys already in the cache are never rotated again. Here each
token's rotation is a function of its own position only: position p uses the
frequencies transformers uses for a sequence of length p + 1. That equals
transformers exactly for every sequence within the trained length (where the
scaling leaves the frequencies alone or uses the short factors), equals
transformers fed one token per forward beyond it (each step then sees length
p + 1, and cached keys keep the rotation they were written with, as here),
and keeps a token's keys independent of batching, chunking and caching. vLLM
instead fixes one scaling for every position (dynamic NTK at its maximum
length; LongRoPE by whether any token of the batch is long), which differs
from transformers on ordinary short prompts.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.config import RopeConfig


def _exponents(rotary_dim: int) -> torch.Tensor:
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies [rotary_dim / 2] in fp32 for short
    sequences (within the trained length, for the length-dependent scalings)."""
    dim = rope.rotary_dim(head_dim)
    inv_freq = 1.0 / (rope.theta ** _exponents(dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn(rope, dim)
    elif rope.rope_type == "longrope":
        inv_freq = 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32) * rope.theta ** _exponents(dim))
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


def _yarn(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: frequencies that rotate fewer than beta_slow times over the
    original context are interpolated (divided by factor), those rotating more
    than beta_fast times are kept, with a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        wavelengths = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, rotary_dim] in fp32. inv_freq is [rotary_dim / 2]
    (shared by every token) or [T, rotary_dim / 2] (one row per token)."""
    inv = inv_freq if inv_freq.dim() == 2 else inv_freq.unsqueeze(0)
    freqs = positions.float().unsqueeze(1) * inv
    angles = torch.cat((freqs, freqs), dim=-1)
    if attention_factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


class RotaryEmbedding(nn.Module):
    """cos/sin for a batch's positions under one RopeConfig (see the module
    docstring for the length-dependent scalings)."""

    # buffers (register_buffer in __init__)
    inv_freq: torch.Tensor
    long_inv_freq: torch.Tensor

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.rotary_dim = rope.rotary_dim(head_dim)
        self.register_buffer("inv_freq", torch.empty(self.rotary_dim // 2), persistent=False)
        self.register_buffer("long_inv_freq", torch.empty(self.rotary_dim // 2), persistent=False)
        self.reset_buffers()

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the frequency buffers, e.g. after building on the meta device."""
        device = torch.device(device) if device is not None else self.inv_freq.device
        if device.type == "meta":
            return
        with torch.device("cpu"):
            inv_freq = inverse_frequencies(self.rope, self.head_dim)
            long_inv_freq = inv_freq
            if self.rope.rope_type == "longrope":
                long = torch.tensor(self.rope.long_factor, dtype=torch.float32)
                long_inv_freq = 1.0 / (long * self.rope.theta ** _exponents(self.rotary_dim))
        self.inv_freq = inv_freq.to(device)
        self.long_inv_freq = long_inv_freq.to(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rope = self.rope
        inv_freq = self.inv_freq
        if rope.rope_type == "longrope":
            is_long = (positions >= rope.original_max_position_embeddings).unsqueeze(1)
            inv_freq = torch.where(is_long, self.long_inv_freq, self.inv_freq)
        elif rope.rope_type == "dynamic":
            inv_freq = self._dynamic_inv_freq(positions)
        return rope_cos_sin(positions, inv_freq, rope.attention_factor)

    def _dynamic_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, rotary_dim / 2]: the trained frequencies up to max_position_embeddings,
        then the NTK base for a sequence of length position + 1 (fp32, as transformers)."""
        rope = self.rope
        max_len = rope.max_position_embeddings
        dim = self.rotary_dim
        seq_len = (positions + 1).clamp(min=max_len).float().unsqueeze(1)
        base = rope.theta * ((rope.factor * seq_len / max_len) - (rope.factor - 1)) ** (dim / (dim - 2))
        scaled = 1.0 / (base ** _exponents(dim).to(positions.device))
        within = (positions < max_len).unsqueeze(1)
        return torch.where(within, self.inv_freq, scaled)
