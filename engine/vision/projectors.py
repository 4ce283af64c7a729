"""Projectors: vision-encoder states [B, tokens, vision_hidden] -> the text model's width.

LLaVA: a two-layer MLP per token. Gemma 3: average-pools the patch grid down to mm_tokens_per_image,
RMS-norms (Gemma's (1 + weight) norm, in fp32) and multiplies by one [vision_hidden, text_hidden] matrix.
Parameter names are the checkpoints' (`multi_modal_projector.` dropped).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import RMSNorm
from engine.vision.activations import ACTIVATIONS
from engine.vision.config import VisionLanguageConfig


class LlavaProjector(nn.Module):
    """linear_2(act(linear_1(x))); its input is the selected encoder layers concatenated on the last axis."""

    def __init__(self, config: VisionLanguageConfig) -> None:
        super().__init__()
        width = config.encoder.hidden_size * len(config.feature_layers)
        self.linear_1 = nn.Linear(width, config.text_hidden_size, bias=config.projector_bias)
        self.act = ACTIVATIONS[config.projector_act]
        self.linear_2 = nn.Linear(config.text_hidden_size, config.text_hidden_size, bias=config.projector_bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class Gemma3Projector(nn.Module):
    """Pools each image's patch grid (row-major, as the encoder emits it) to a tokens_per_side square."""

    def __init__(self, config: VisionLanguageConfig) -> None:
        super().__init__()
        vision = config.encoder
        self.patches_per_side = vision.patches_per_side
        self.kernel = vision.patches_per_side // math.isqrt(config.mm_tokens_per_image)
        self.mm_soft_emb_norm = RMSNorm(vision.hidden_size, vision.layer_norm_eps, unit_offset=True)
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, config.text_hidden_size))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        batch, _, hidden = features.shape
        side = self.patches_per_side
        grid = features.transpose(1, 2).reshape(batch, hidden, side, side)
        pooled = F.avg_pool2d(grid, kernel_size=self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        # the norm kernel takes rows [T, hidden]
        normed, _ = self.mm_soft_emb_norm(pooled.reshape(-1, hidden).contiguous())
        projected = torch.matmul(normed.view(batch, -1, hidden), self.mm_input_projection_weight)
        return projected.type_as(features)
