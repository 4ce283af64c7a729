"""The ViT encoder of CLIP and SigLIP towers: patch embedding, position embeddings, pre-norm transformer
layers with full (bidirectional) attention over one image's tokens.

The two differ only where EncoderConfig.kind says: CLIP prepends a learned class token and layer-norms the
embeddings before the first layer (its checkpoints spell it `pre_layrnorm`); SigLIP's patch convolution
has a bias, and its VLMs read the final layer-normed output. Module names follow transformers' so a
checkpoint's tensor names map onto parameters by dropping the tower's prefix (engine/vision/checkpoint.py).
Layers, norms and convolutions are torch's own modules, so the arithmetic is the reference's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.vision.activations import ACTIVATIONS
from engine.vision.config import EncoderConfig


class VisionEmbeddings(nn.Module):
    """pixels [B, C, H, W] -> tokens [B, positions, hidden]: one token per patch (plus CLIP's class token),
    each with its learned position embedding."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        clip = config.kind == "clip"
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size,
                                         stride=config.patch_size, bias=not clip)
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size)) if clip else None
        self.position_embedding = nn.Embedding(config.num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        size = self.config.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (self.config.num_channels, size, size):
            raise ValueError(f"pixel values must be [B, {self.config.num_channels}, {size}, {size}] for this "
                             f"tower, got {tuple(pixel_values.shape)}")
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            cls = self.class_embedding.expand(patches.shape[0], 1, -1)
            patches = torch.cat([cls, patches], dim=1)
        return patches + self.position_embedding.weight.unsqueeze(0)


class EncoderAttention(nn.Module):
    """Multi-head self-attention without a mask: every token of an image sees every other."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = hidden // config.num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape
        shape = (batch, tokens, self.num_heads, self.head_dim)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(batch, tokens, hidden))


class EncoderMLP(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.act = ACTIVATIONS[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    """Pre-norm: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = EncoderAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = EncoderMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class LayerStack(nn.Module):
    """Holds the layers under `encoder.layers`, the checkpoints' name for them."""

    def __init__(self, config: EncoderConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(num_layers))


class VisionEncoder(nn.Module):
    """The first `num_layers` layers of the tower (a VLM that reads an earlier layer never runs the rest);
    post_layernorm when its VLM reads the normed last layer (Gemma 3's SigLIP)."""

    def __init__(self, config: EncoderConfig, num_layers: int, post_layernorm: bool) -> None:
        super().__init__()
        if not 0 <= num_layers <= config.num_layers:
            raise ValueError(f"num_layers={num_layers} must be between 0 and the tower's {config.num_layers}")
        self.config = config
        eps = config.layer_norm_eps
        self.embeddings = VisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=eps) if config.kind == "clip" else None
        self.encoder = LayerStack(config, num_layers)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=eps) if post_layernorm else None

    def forward(self, pixel_values: torch.Tensor, keep: Sequence[int]) -> list[torch.Tensor]:
        """The hidden states at the indices `keep` of [embeddings, layer 1 output, ..., layer n output]
        (transformers' `hidden_states`), in that order; the last layer's is post-layer-normed when the
        encoder has that norm."""
        layers = self.encoder.layers
        if any(not 0 <= i <= len(layers) for i in keep):
            raise ValueError(f"hidden state indices {list(keep)} outside 0..{len(layers)}")
        x = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = {0: x} if 0 in keep else {}
        for i, layer in enumerate(layers, start=1):
            x = layer(x)
            if i in keep:
                states[i] = x
        if self.post_layernorm is not None and len(layers) in states:
            states[len(layers)] = self.post_layernorm(states[len(layers)])
        return [states[i] for i in keep]
